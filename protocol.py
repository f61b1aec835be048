"""The contracts between a training job's agent and the processes around it, defined once.

    from torchvitals import protocol
    protocol.read_heartbeats("/tmp/job/attempt-0001")      # what the supervisor sees

The agent (inside the job) and the collector and supervisor (outside it) meet only through what
is written here: environment variable names, the heartbeat files and their phases, the directive
actions and the codes they travel as, the bearer token's two sources, and the exit codes. Both
sides import these names; neither spells them itself. Torch-free, like everything the collector
and the supervisor import.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import TorchvitalsError
from .records.durable import replace_json

# ---------------------------------------------------------------- environment

ENV_PREFIX = "TORCHVITALS_"
"""Every setting's variable starts with this (the agent's ``TORCHVITALS_<FIELD>``)."""

HEARTBEAT_DIR_ENV = ENV_PREFIX + "HEARTBEAT_DIR"
"""Set by the supervisor for each attempt; the agent's ``heartbeat_dir`` setting reads it."""

ATTEMPT_ENV = ENV_PREFIX + "SUPERVISOR_ATTEMPT"
"""The supervisor's attempt number (1, 2, ...), for the job's own logs."""

NODE_ENV = ENV_PREFIX + "SUPERVISOR_NODE"
"""The supervisor's node rank, for the job's ranks: the node an agent's incident names (torchrun's
``GROUP_RANK`` is handed out in arrival order by a c10d rendezvous, so it may differ)."""

TOKEN_ENV = ENV_PREFIX + "WEBHOOK_TOKEN"
"""The collector's bearer token itself (agent and collector alike)."""

TOKEN_FILE_ENV = ENV_PREFIX + "WEBHOOK_TOKEN_FILE"
"""A file holding the token (a mounted secret); set this or ``TOKEN_ENV``, not both."""

JOB_ID_ENV = ENV_PREFIX + "JOB_ID"
"""The job's identity, set by a person, the chart, or the supervisor (for every node alike)."""

JOB_ID_ENVS = (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
"""Variables naming the job, first set wins: ours, torchrun's ``--rdzv-id``, Slurm's job id (kept
by a requeue). torchrun's default ``none`` names nothing."""

LEDGER_FILE = "ledger.json"
"""The watchdog's ledger, in the checkpoint folder: the supervisor reads its last healthy step."""

# ---------------------------------------------------------------- exit codes

ABORT_EXIT_CODE = 75
"""The job gave up on purpose (the loop guard, or a collector's abort order): EX_TEMPFAIL."""

NO_PROGRESS_EXIT_CODE = 76
"""The supervisor stopped restarting: restarts in a row made no progress."""

BUDGET_EXIT_CODE = 77
"""The supervisor stopped restarting: its restart budget is spent."""

REFUSED_EXIT_CODE = 78
"""The job refused to resume the checkpoint folder (another job's, or a run it was not told to
continue): EX_CONFIG. Final: a restart would meet the same folder, so it is never retried."""

NODE_LOST_EXIT_CODE = 79
"""A node of a multi-node job was lost and no replacement joined within the deadline."""

# ---------------------------------------------------------------- directives

ACTIONS: dict[str, float] = {"rollback": 1.0, "abort": 2.0}
"""Directive action -> the code it travels as in the step's reduction (0.0: none). The webhook
turns an alert's ``ACTION_LABEL`` with one of these values into a directive."""

CODES: dict[float, str] = {code: action for action, code in ACTIONS.items()}
"""Code -> directive action."""

ACTION_LABEL = "torchvitals_action"
"""The alert label that orders an action of a job."""

JOB_LABEL = "job"
"""The alert label naming the job an order is for (the agent's ``collector_job``)."""

RUN_PARAM = "run"
"""The query parameter of a poll naming the polling run: a directive is delivered only to the
run of its job it was issued for, never to a later run reusing the job name."""

# ---------------------------------------------------------------- heartbeat files

TRAIN, CHECKPOINT, ABORTED, REFUSED = "train", "checkpoint", "aborted", "refused"
PHASES = (TRAIN, CHECKPOINT, ABORTED, REFUSED)
"""A rank's phase: training; writing or loading a checkpoint (may be long, not a hang); gave
up on purpose (the supervisor must not restart it); refused to resume the checkpoint folder
(final too: a restart meets the same folder)."""

HEARTBEAT_GLOB = "heartbeat-rank*.json"

STACK_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
"""The signal on which a rank's agent writes every thread's Python stack into its stack file
(``faulthandler``, registered at ``watch()``: written from the signal handler itself, so a rank
spinning in Python or blocked in a collective answers without the interpreter's cooperation).
A real-time signal: the usual ones are taken (SIGUSR1: Lightning's SLURM requeue). None where
the platform has none. The heartbeat names the one a rank registered."""


def stack_path(folder: str | os.PathLike, rank: int) -> Path:
    """The stack file of ``rank`` in its heartbeat ``folder``."""
    return Path(folder) / f"stack-rank{rank:05d}.txt"


def heartbeat_path(folder: str | os.PathLike, rank: int) -> Path:
    """The heartbeat file of ``rank`` in ``folder``."""
    return Path(folder) / f"heartbeat-rank{rank:05d}.json"


def write_heartbeat(
    path: Path,
    *,
    step: int,
    time: float,
    phase: str,
    pid: int,
    rank: int,
    metrics_url: str | None = None,
    stack_signal: int | None = None,
) -> None:
    """Replace a rank's heartbeat file (a temporary file renamed, so a reader never sees half).

    ``metrics_url`` is where the rank's /metrics really serves (after a port fallback), so
    whoever reads the heartbeats (the supervisor, a person) finds it. ``stack_signal`` is the
    signal on which the rank writes its stacks into ``stack_path(folder, rank)`` (None: it
    registered none).

    No fsync: the reader is on this host, and a crash of the host ends the job anyway.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown heartbeat phase {phase!r}; known: {PHASES}")
    record: dict[str, object] = {
        "step": step,
        "time": time,
        "phase": phase,
        "pid": pid,
        "rank": rank,
    }
    if metrics_url:
        record["metrics_url"] = metrics_url
    if stack_signal is not None:
        record["stack_signal"] = int(stack_signal)
    replace_json(path, record, fsync=False)


@dataclass(frozen=True)
class Beat:
    """What the heartbeat files of one attempt say at one moment."""

    step: int
    """The highest step over the ranks."""
    time: float
    """The newest write (wall clock of the writing rank)."""
    checkpointing: bool
    """Whether any rank is in the CHECKPOINT phase."""
    aborted: bool = False
    """Whether any rank ABORTED on purpose."""
    refused: bool = False
    """Whether any rank REFUSED to resume the checkpoint folder."""
    pids: tuple[int, ...] = ()
    """The ranks' process ids."""


@dataclass(frozen=True)
class RankBeat:
    """One rank's heartbeat file."""

    rank: int
    """The global rank."""
    step: int
    time: float
    """When it was written (wall clock)."""
    phase: str
    pid: int
    stack_signal: int | None = None
    """The signal on which it writes its stacks into ``stack_path`` (None: none registered)."""


def read_rank_beats(folder: str | os.PathLike) -> dict[int, RankBeat]:
    """Every rank's heartbeat in ``folder``, by global rank (files that do not parse skipped)."""
    beats: dict[int, RankBeat] = {}
    for path in Path(folder).glob(HEARTBEAT_GLOB):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            stack = record.get("stack_signal")
            beat = RankBeat(
                rank=int(record["rank"]),
                step=int(record["step"]),
                time=float(record["time"]),
                phase=str(record.get("phase")),
                pid=int(record["pid"]),
                stack_signal=None if stack is None else int(stack),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        beats[beat.rank] = beat
    return beats


def read_heartbeats(folder: str | os.PathLike) -> Beat | None:
    """Every rank's heartbeat in ``folder``, combined (``combine_beats``); None when no file is
    readable yet. A file that does not parse (it cannot be half-written: the writer renames) is
    skipped."""
    return combine_beats(read_rank_beats(folder))


def combine_beats(beats: Mapping[int, RankBeat]) -> Beat | None:
    """The ranks' heartbeats as one: the highest step, the newest write, any rank's phase; the
    pids in rank order. None without any."""
    if not beats:
        return None
    found = beats.values()
    return Beat(
        step=max(b.step for b in found),
        time=max(b.time for b in found),
        checkpointing=any(b.phase == CHECKPOINT for b in found),
        aborted=any(b.phase == ABORTED for b in found),
        refused=any(b.phase == REFUSED for b in found),
        pids=tuple(b.pid for _, b in sorted(beats.items())),
    )


# ---------------------------------------------------------------- the bearer token


class TokenError(TorchvitalsError, ValueError):
    """The token is set twice, unreadable, or missing; the message never holds the token."""


def read_token(token: str | None, path: str | os.PathLike | None) -> str | None:
    """The bearer token from its value or its file (surrounding whitespace stripped, as
    Alertmanager strips its ``credentials_file``); None when neither is given.

    Raises:
        TokenError: both are given, or the file cannot be read.
    """
    if token is not None and path:
        raise TokenError(f"set either {TOKEN_ENV} or {TOKEN_FILE_ENV} (a token file), not both")
    if not path:
        return None if token is None else token.strip()
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenError(f"{TOKEN_FILE_ENV}: cannot read {path}: {exc.strerror or exc}") from None


def token_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The token from ``TOKEN_ENV`` or the file ``TOKEN_FILE_ENV`` names; "" when neither is set."""
    environ = os.environ if environ is None else environ
    return read_token(environ.get(TOKEN_ENV), environ.get(TOKEN_FILE_ENV)) or ""


DEMO_FAULTS = ("lr-spike", "nan", "frozen", "none")
"""The faults ``torchvitals demo --fault`` injects into its ranks (the CLI parses the flag
without loading the agent; the demo's ranks check it)."""
