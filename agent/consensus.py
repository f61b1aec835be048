"""Agreement at ``watch()``: every rank built its part, and every rank will run the same step.

    fence = Fence(global_rank, world_size)                  # agent.py, once per watch()
    with fence.section("binding /metrics") as agreed:       # this rank's own work, no collective
        ...
        agreed.update(settings)                             # what must be equal on every rank
    # leaving the block is one small MAX all-reduce over the job's world: every rank, or none,
    # goes on to the next collective

Every rank decides each step alone, from the same reduced numbers, with the same code; that
holds only when every rank runs the same collectives with the same settings. One node whose
environment sets another sampling rate makes the step's reductions differ in size (gloo aborts,
NCCL hangs or sums the wrong slots), and one rank that fails inside ``watch()`` (a port taken on
its node alone, a folder it cannot read) would leave the others waiting in the next collective
until the process group times out. So ``watch()`` runs in sections of work each rank does alone,
and each section ends at a fence: one all-reduce of ``[failed, digest, -digest]`` (three floats)
over the job's world. Its maximum tells every rank alike whether any rank failed and whether the
settings differ (the maximum of the digests equals minus the maximum of their negations only
when all are equal), so every rank raises the same error in the same place, or none does. Only
then, on that rare path, a second round finds which setting differs and one gather names the
ranks, hosts, values and where each value came from.

An error raised alike on every rank (a refused checkpoint folder every rank sees) is re-raised
as it is; otherwise every rank raises ``RankFailedError`` naming the failed ranks and their
errors (on a failed rank, chained to its own), or ``SettingsDifferError`` naming the setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..errors import ConfigError, TorchvitalsError
from ..records.incidents import hostname
from .config import Config
from .detect.thresholds import Thresholds

F64 = torch.float64

ERROR_CHARS = 600
"""An error's text as the other ranks read it, cut to this many characters."""

SHOWN_ERRORS = 5
"""Distinct errors named in one message; the rest are counted."""


class Setting(NamedTuple):
    """One value that must be equal on every rank, as a fence agrees on it."""

    key: str
    """What is compared (a setting's value as text, or only whether it is set)."""
    shown: str
    """What a person reads in a mismatch (the value itself)."""
    source: str
    """Where the value came from: ``TORCHVITALS_SAMPLE_EVERY=3``, ``an argument``, ``the
    default``."""


class RankFailedError(TorchvitalsError, RuntimeError):
    """``watch()`` failed on some rank; raised on every rank, naming the failed ranks, their hosts
    and their errors (on a failed rank, chained to its own error)."""


class SettingsDifferError(ConfigError):
    """The ranks were given different values of a setting that shapes every step's collectives or
    decisions; raised on every rank, naming the setting, each value with its ranks and hosts, and
    where each came from.

    Attributes:
        field: the (first) setting that differs.
        values: per differing setting, each value as shown -> the ranks that hold it.
    """

    def __init__(self, message: str, values: dict[str, dict[str, list[int]]]) -> None:
        self.values = values
        self.field = next(iter(values), "")
        self.value, self.allowed, self.source = values.get(self.field), message, None
        Exception.__init__(self, message)


AGREED = (
    # measure: what each rank packs, and when (the step's reductions' sizes and slots)
    "blocks",
    "sample_every",
    "activations",
    "update_ratio",
    "update_ratio_max_bytes",
    "saturation_level",
    "split_ddp_work",
    "clip_grad_norm",
    # recover: what every rank decides, and the checkpoints' collectives
    "skip_nonfinite",
    "skip_outliers",
    "rerun_outliers",
    "checkpoint_every",
    "resume",
    "checkpoint_keep",
    "trust_unsigned_checkpoints",
    "snapshot_max_bytes",
    "healthy_window",
    "trust_steps",
    "verify_steps",
    "lr_ramp_steps",
    "lr_backoff",
    "skip_margin",
    "max_rollbacks",
    "rollback_window",
    "abort_exit_code",
)
"""The settings whose values every rank must share: each shapes a step's collectives (the packed
vectors' layout, a save's phases) or a decision every rank takes alone (a rollback, an abort)."""

SET_OR_NOT = ("checkpoint_dir", "log_dir", "collector_url")
"""Settings of which only being set must agree: each turns a part on (the watchdog's
collectives, the ranks' gather for the job's records, the collector directive's slot), while
its value may be a node's own path (a shared folder is proven otherwise: ``CheckpointStore.probe``)
or rank 0's alone."""


def shaping(config: Config) -> dict[str, Setting]:
    """What every rank must agree on from ``config``, with where each value came from: the
    ``AGREED`` settings, whether each of ``SET_OR_NOT`` is set, every detection threshold, and
    the torchvitals and torch versions (another release may pack or decide otherwise)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Setting] = {}
    for name in AGREED:
        value = repr(getattr(config, name))
        out[name] = Setting(value, value, config.source(name))
    for name in SET_OR_NOT:
        value = getattr(config, name)
        out[name] = Setting(str(bool(value)), repr(value), config.source(name))
    overrides = dict(config.detect)
    for name, value in dataclasses.asdict(Thresholds.from_overrides(overrides)).items():
        source = config.source("detect") if name in overrides else "the default"
        out[f"detect.{name}"] = Setting(repr(value), repr(value), source)
    try:
        mine = version("torchvitals")
    except PackageNotFoundError:  # a checkout on the path, not installed
        mine = "not installed"
    where = f"installed on {hostname()}"
    out["torchvitals_version"] = Setting(mine, mine, where)
    out["torch_version"] = Setting(torch.__version__, torch.__version__, where)
    return out


def digest(text: str) -> float:
    """48 bits of ``text``'s SHA-256 as a float (exact: float64 holds integers to 2**53)."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big"))


def settings_digest(settings: dict[str, Setting]) -> float:
    return digest("\n".join(f"{name}={s.key}" for name, s in sorted(settings.items())))


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-7, 9, 12-15``: consecutive ranks as ranges."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' * (len(ordered) != 1)} {text}"


def _some(items: list[str], most: int = 4) -> str:
    unique = list(dict.fromkeys(items))
    more = f" and {len(unique) - most} more" if len(unique) > most else ""
    return ", ".join(unique[:most]) + more


class Fence:
    """The ranks of one ``watch()``, meeting between sections of their own work.

    Args:
        global_rank: this process's rank in the job's world.
        world_size: the job's world size; 1: nothing to agree with, errors pass through.
        host: this machine's name, for the messages (default: the host name).
    """

    def __init__(self, global_rank: int, world_size: int, host: str | None = None) -> None:
        self.rank, self.world = global_rank, world_size
        self.host = host if host is not None else hostname()
        self._device: torch.device | None = None

    @contextlib.contextmanager
    def section(self, doing: str) -> Iterator[dict[str, Setting]]:
        """Run this rank's part of ``watch()``, then meet every rank (collective on leaving).

        Args:
            doing: what the section does, for the message ("binding /metrics").

        Yields:
            A dict the section fills with the settings every rank must agree on (name ->
            ``Setting``); leave it empty when nothing is compared.

        Raises:
            RankFailedError: on every rank, when the section raised on some rank (not alike
                everywhere); an error every rank raised alike passes through unchanged.
            SettingsDifferError: on every rank, when the ranks' settings differ.
        """
        agreed: dict[str, Setting] = {}
        try:
            yield agreed
        except Exception as exc:
            self._meet(doing, agreed, exc)
            raise  # _meet raised; this keeps the type checker and a world of one honest
        self._meet(doing, agreed, None)

    # ------------------------------------------------------------------ the collectives

    def _meet(self, doing: str, agreed: dict[str, Setting], error: BaseException | None) -> None:
        if self.world == 1:
            if error is not None:
                raise error
            return
        mine = settings_digest(agreed) if agreed else 0.0
        names = digest("\n".join(sorted(agreed))) if agreed else 0.0
        failed, _, same, same_names = self._round(
            doing, error, [1.0 if error is not None else 0.0, mine, names]
        )
        if failed:
            self._raise_failures(doing, error)
        if same:
            return
        if same_names:  # the same names everywhere: a second round finds the ones that differ
            per = [digest(f"{n}={agreed[n].key}") for n in sorted(agreed)]
            _, *flags = self._round(doing, None, per)
            agreed = {n: agreed[n] for n, alike in zip(sorted(agreed), flags) if not alike}
        self._raise_differences(agreed)

    def _round(
        self, doing: str, error: BaseException | None, values: list[float]
    ) -> tuple[bool, ...]:
        """One MAX all-reduce of ``[v, -v]`` per value: per value, whether it was the same on
        every rank (the first value is a flag: whether any rank set it)."""
        tensor = torch.tensor([x for v in values for x in (v, -v)], dtype=F64)
        try:
            tensor = tensor.to(self._collective_device())
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        except Exception as exc:  # a peer that died (gloo: connection reset), a bad device
            raise RankFailedError(
                f"torchvitals: the ranks could not meet after {doing} on rank {self.rank} "
                f"(host {self.host}): {type(exc).__name__}: {str(exc).strip()[:ERROR_CHARS]}. "
                "Another rank left watch() or died: its own log says why"
            ) from (error or exc)
        out = tensor.tolist()
        pairs = [(out[i], out[i + 1]) for i in range(0, len(out), 2)]
        first = pairs[0][0] > 0
        return (first, *(high == -neg_low for high, neg_low in pairs))

    def _collective_device(self) -> torch.device:
        if self._device is None:
            backend = str(dist.get_backend())
            self._device = (
                torch.device("cuda", torch.cuda.current_device())
                if "nccl" in backend and torch.cuda.is_available()
                else torch.device("cpu")
            )
        return self._device

    def _gather(self, mine: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        return everyone

    def _raise_failures(self, doing: str, error: BaseException | None) -> None:
        text = f"{type(error).__name__}: {error}"[:ERROR_CHARS] if error is not None else None
        everyone = self._gather(Failure(self.rank, self.host, os.getpid(), doing, text))
        failed = [entry for entry in everyone if entry.error is not None]
        if error is not None and len(failed) == self.world and len({e.error for e in failed}) == 1:
            raise error  # every rank raised the same error: it is already every rank's
        raise RankFailedError(failure_message(everyone)) from error

    def _raise_differences(self, differing: dict[str, Setting]) -> None:
        message, values = difference_message(self._gather((self.rank, self.host, differing)))
        raise SettingsDifferError(message, values)


class Failure(NamedTuple):
    """What one rank says at a fence where some rank failed."""

    rank: int
    host: str
    pid: int
    doing: str
    """The section it was in."""
    error: str | None
    """Its error, one line (None: it did not fail)."""


def failure_message(everyone: list[Failure]) -> str:
    """One message naming the failed ranks, their hosts and errors, grouped by error (the same
    on every rank: it is built from the gathered list alone)."""
    failed = [entry for entry in everyone if entry.error is not None]
    by_error: dict[tuple[str, str], list[Failure]] = {}
    for entry in failed:
        by_error.setdefault((entry.doing, entry.error or ""), []).append(entry)
    parts = []
    for (where, why), who in list(by_error.items())[:SHOWN_ERRORS]:
        place = (
            f"host {who[0].host}, pid {who[0].pid}"
            if len(who) == 1
            else f"hosts {_some([w.host for w in who])}"
        )
        parts.append(f"{ranks_text(w.rank for w in who)} ({place}) while {where}: {why}")
    if len(by_error) > SHOWN_ERRORS:
        parts.append(f"and {len(by_error) - SHOWN_ERRORS} other errors")
    return (
        f"torchvitals: watch() failed on {'; on '.join(parts)}. Every rank stops here "
        f"({len(failed)} of {len(everyone)} failed), so none is left waiting in a collective"
    )


def difference_message(
    everyone: list[tuple[int, str, dict[str, Setting]]],
) -> tuple[str, dict[str, dict[str, list[int]]]]:
    """The message naming each setting that differs: each value with its ranks, where it came
    from, and the hosts of the odd ones out; and per setting, value -> ranks.

    Args:
        everyone: per rank, ``(rank, host, its differing settings)``.
    """
    values: dict[str, dict[str, list[int]]] = {}
    lines = []
    for name in sorted({n for _, _, theirs in everyone for n in theirs}):
        held: dict[str, list[tuple[int, str, str]]] = {}
        for rank, host, theirs in everyone:
            setting = theirs.get(name)
            shown = setting.shown if setting is not None else "(none)"
            source = setting.source if setting is not None else "another torchvitals"
            held.setdefault(shown, []).append((rank, host, source))
        if len(held) == 1:
            continue  # the same everywhere (sent along when the names themselves differ)
        values[name] = {shown: [r for r, _, _ in who] for shown, who in held.items()}
        # The most common value first: the odd ones out are then named with their hosts.
        ordered = sorted(held.items(), key=lambda item: -len(item[1]))
        described = []
        for i, (shown, who) in enumerate(ordered):
            hosts = f" on {_some([h for _, h, _ in who])}" if i else ""
            described.append(
                f"{shown} on {ranks_text(r for r, _, _ in who)}{hosts} "
                f"(from {_some([s for _, _, s in who], 2)})"
            )
        lines.append(f"{name}: {'; '.join(described)}")
    return (
        "torchvitals: the ranks were given different settings that shape every step's "
        "collectives and decisions, so no rank starts: "
        + " | ".join(lines)
        + ". Give every rank the same values (each node's environment, the launcher's "
        "arguments, the same torchvitals and torch installed everywhere)",
        values,
    )
