"""The agent's configuration: five keyword-only sections, also settable flat and from the
environment.

    Config(measure=MeasureConfig(sample_every=20), recover=RecoverConfig(checkpoint_dir="ckpt"))
    Config(sample_every=20, checkpoint_dir="ckpt")          # the same: every field flat as well
    config.measure.sample_every == config.sample_every == 20

Sections: ``measure`` (what is measured and how often), ``detect`` (the detection thresholds),
``recover`` (skips, healthy checkpoints, rollbacks, resume, the supervisor's heartbeat),
``outputs`` (/metrics, the event log, the live view) and ``collector`` (the directives this job
obeys). Every field is also a flat keyword of ``Config(...)``, ``Config.from_env(...)`` and
``torchvitals.watch(...)``, a flat attribute (``config.sample_every``) and a ``TORCHVITALS_<FIELD>``
variable under its flat name (``TORCHVITALS_SAMPLE_EVERY``, ``TORCHVITALS_COLLECTOR_URL``).
The detect section is also the mapping of its threshold overrides, which is what the flat
``detect`` keyword, ``config.detect`` and ``TORCHVITALS_DETECT`` have always meant.

Precedence: an argument to ``torchvitals.watch(...)`` > a ``TORCHVITALS_<FIELD>`` environment
variable (e.g. ``TORCHVITALS_SAMPLE_EVERY=20``, ``TORCHVITALS_METRICS_PORT=0``) > the default. A
section passed whole is an argument for each of its fields; a flat keyword given with it wins.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..protocol import ABORT_EXIT_CODE, ENV_PREFIX
from ..settings import check_types, settings
from .detect.thresholds import Thresholds


@dataclass(kw_only=True)
class MeasureConfig:
    """What each rank measures, and how often (``agent/measure``)."""

    blocks: Mapping[str, Any] | list[str] | None = None
    """Blocks named by module path: a list of paths, or a mapping name -> path (or list of
    paths). Parameters under no named path form the block "other". None discovers blocks
    automatically (the repeated layers, the embeddings, the head, "other")."""

    sample_every: int = 10
    """Measure activation statistics and the update ratio on step 1 and every this many steps
    (10 keeps the agent under 2% of a step; see benchmarks/overhead.py)."""

    activations: bool = True
    """Record per-block activation statistics on sampled steps (forward hooks)."""

    update_ratio: bool = True
    """Record the per-block update ratio ||dw||/||w|| on sampled steps (a snapshot of the
    parameters is kept across the optimizer step of a sampled step only)."""

    update_ratio_max_bytes: int = 1 << 30
    """Bound on the parameter snapshot the update ratio keeps per rank during a sampled step.
    When the blocks do not fit, the sampled steps take turns over the blocks."""

    saturation_level: float = 0.99
    """An activation with |x| >= this counts as saturated (tanh/sigmoid units pinned at 1)."""

    split_ddp_work: bool = True
    """Under DDP (gradients identical on every rank) rank r measures every world-th block and
    the SUM reduction reassembles them. False makes every rank measure every block, which
    also catches a gradient corrupted on one rank after DDP's all-reduce."""

    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value before the optimizer step, reusing the
    measured norms (no second pass). The report keeps the norms from before clipping."""

    def __post_init__(self) -> None:
        _check(self, "measure")
        _need(self.sample_every >= 1, "sample_every", self.sample_every, "an integer >= 1")
        _need(
            self.saturation_level > 0,
            "saturation_level",
            self.saturation_level,
            "a number > 0 (|x| at or above it counts as saturated)",
        )
        _need(
            self.update_ratio_max_bytes >= 0,
            "update_ratio_max_bytes",
            self.update_ratio_max_bytes,
            "an integer >= 0",
        )
        _need(
            self.clip_grad_norm is None or self.clip_grad_norm > 0,
            "clip_grad_norm",
            self.clip_grad_norm,
            "a number > 0, or None",
        )


@dataclass(kw_only=True, eq=False)
class DetectConfig(Mapping):
    """How verdicts are reached (``agent/detect``); reads as the mapping of its threshold
    overrides, so ``config.detect`` means what it always did."""

    thresholds: Mapping[str, Any] | None = None
    """Overrides of the detection thresholds by name (see ``torchvitals.Thresholds``),
    e.g. ``{"loss_spike_mads": 8}``; flat: ``detect=``, from the environment as JSON
    (``TORCHVITALS_DETECT``)."""

    def __post_init__(self) -> None:
        _check(self, "detect")
        Thresholds.from_overrides(
            self.thresholds
        )  # an unknown threshold fails at watch(), not later

    def __getitem__(self, name: str) -> Any:
        return (self.thresholds or {})[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.thresholds or {})

    def __len__(self) -> int:
        return len(self.thresholds or {})


@dataclass(kw_only=True)
class RecoverConfig:
    """What the agent does about a verdict and what survives a crash (``agent/recover``)."""

    skip_nonfinite: bool = True
    """Skip the optimizer (and scheduler) step on every rank when any rank's loss or gradient
    is NaN or Inf."""

    skip_outliers: bool = True
    """With the watchdog on (``checkpoint_dir``): skip the optimizer (and scheduler) step on
    every rank when the step's loss is a one-step outlier (``loss_outlier``): the batch was
    used, its update is dropped. The cheapest remedy: a bad batch costs one step instead of a
    rollback. False: only warn."""

    rerun_outliers: bool = True
    """With ``skip_outliers`` and a loop that passes ``agent.step(loss, closure=fn)`` on every
    rank: compute a ``loss_outlier`` step once more before skipping it. One that does not
    reproduce is a transient fault (a ``transient_fault`` verdict and a ``transient`` incident
    naming the rank whose loss changed); its update is dropped either way."""

    checkpoint_dir: str | None = None
    """Folder of the watchdog's healthy checkpoints and ledger; None turns the watchdog off. A
    run started again with the same folder resumes from its last healthy checkpoint."""

    checkpoint_every: int = 50
    """Save a healthy checkpoint after every this many steps (when the step is healthy)."""

    resume: str = "restart"
    """What a ``checkpoint_dir`` that already holds checkpoints means at start: "restart"
    continues it only in a restarted process (``torchvitals supervise``'s later attempts,
    torchrun's ``--max-restarts``) and refuses it otherwise; "auto" always continues it;
    "never" always refuses it. A refused folder is an error, never silently another run's."""

    checkpoint_keep: int = 3
    """Healthy checkpoints kept on disk."""

    checkpoint_key_file: str | None = None
    """File holding the job's secret that signs the checkpoints' manifests (HMAC-SHA256); None:
    the secret in TORCHVITALS_CHECKPOINT_KEY, else a key made once per user in
    ~/.config/torchvitals/checkpoint.key. Every node of a job needs the same key."""

    trust_unsigned_checkpoints: bool = False
    """Load checkpoints whose manifest is unsigned or signed under another key (folders written
    before torchvitals signed them, or another job's). Loading still unpickles nothing."""

    snapshot_max_bytes: int = 32 << 30
    """Host memory per rank for two staged copies of its state: the last healthy one, which
    rollbacks restore from RAM, and the one written in the background (its buffers reused by
    the next save). When twice the largest rank's state exceeds it, checkpoints are saved
    synchronously and rollbacks read the disk (logged once); 0 always does so."""

    checkpoint_close_timeout_s: float = 60.0
    """Seconds ``agent.close()`` waits for a background checkpoint write still in flight. A
    peer that died or stopped (a hung host) mid-save never lets it finish: past this, the
    write is left uncommitted (its ``.tmp-*`` folder is never loaded), logged with its step and
    folder, and the last committed checkpoint stays the rollback target. 0 waits for none."""

    healthy_window: int = 20
    """A step is healthy when no warning or critical verdict came in this many steps before it."""

    trust_steps: int = 2
    """A healthy checkpoint becomes a rollback target only once this many steps after it passed
    without a warning or critical verdict: the update that causes a spike is taken a step or
    more before the loss shows it, so the checkpoint just before a spike may hold the damage.
    One that an unhealthy verdict follows sooner is never restored (nor resumed from)."""

    verify_steps: int = 20
    """A rollback cured the run once it gets this many steps past the step that caused it
    without another rollback. One that did not is a repeat: its checkpoint is never restored
    again, and the next rollback goes to an earlier one with the learning rate cut by
    ``lr_backoff`` once more and twice the ``skip_margin`` (again for each repeat in a row)."""

    lr_ramp_steps: int = 0
    """Once a rollback cured the run (``verify_steps`` past it), bring the learning-rate scale
    back to 1 linearly over this many steps; 0 keeps the back-off for the rest of the run (a
    restart keeps it too). Off by default: a learning rate that broke the run once may again."""

    lr_backoff: float = 0.5
    """Each rollback multiplies the learning rate by this, applied at every optimizer step over
    whatever set the LR (a scheduler, a framework, the loop), and kept across restarts."""

    skip_margin: int = 2
    """Batches skipped past the one that broke the run, on top of those since the checkpoint."""

    max_rollbacks: int = 3
    """More rollbacks than this within ``rollback_window`` steps aborts the run."""

    rollback_window: int = 500
    """Steps over which ``max_rollbacks`` is counted."""

    abort_exit_code: int = ABORT_EXIT_CODE
    """Exit code of ``TrainingAborted`` when the loop guard gives up (EX_TEMPFAIL)."""

    heartbeat_dir: str | None = None
    """Folder where each rank keeps a heartbeat file for ``torchvitals supervise`` (which sets
    TORCHVITALS_HEARTBEAT_DIR for the job); None writes none."""

    def __post_init__(self) -> None:
        _check(self, "recover")
        _need(
            self.checkpoint_dir is None or self.checkpoint_dir.strip() != "",
            "checkpoint_dir",
            self.checkpoint_dir,
            "a folder, or None for no watchdog",
        )
        _need(
            self.checkpoint_every >= 1,
            "checkpoint_every",
            self.checkpoint_every,
            "an integer >= 1 (steps between healthy checkpoints)",
        )
        _need(
            self.checkpoint_keep >= 1,
            "checkpoint_keep",
            self.checkpoint_keep,
            "an integer >= 1 (checkpoints kept on disk)",
        )
        _need(self.healthy_window >= 0, "healthy_window", self.healthy_window, "an integer >= 0")
        _need(
            self.resume in ("restart", "auto", "never"),
            "resume",
            self.resume,
            "one of 'restart', 'auto', 'never'",
        )
        _need(self.trust_steps >= 1, "trust_steps", self.trust_steps, "an integer >= 1")
        _need(self.verify_steps >= 1, "verify_steps", self.verify_steps, "an integer >= 1")
        _need(self.lr_ramp_steps >= 0, "lr_ramp_steps", self.lr_ramp_steps, "an integer >= 0")
        _need(0.0 < self.lr_backoff <= 1.0, "lr_backoff", self.lr_backoff, "a number in (0, 1]")
        _need(self.skip_margin >= 0, "skip_margin", self.skip_margin, "an integer >= 0")
        _need(self.max_rollbacks >= 0, "max_rollbacks", self.max_rollbacks, "an integer >= 0")
        _need(self.rollback_window >= 1, "rollback_window", self.rollback_window, "an integer >= 1")
        _need(
            1 <= self.abort_exit_code <= 255,
            "abort_exit_code",
            self.abort_exit_code,
            "an exit status in 1..255",
        )
        _need(
            self.snapshot_max_bytes >= 0,
            "snapshot_max_bytes",
            self.snapshot_max_bytes,
            "an integer >= 0 (0: synchronous saves)",
        )
        _need(
            self.checkpoint_close_timeout_s >= 0,
            "checkpoint_close_timeout_s",
            self.checkpoint_close_timeout_s,
            "seconds >= 0 (how long close() waits for a checkpoint write in flight)",
        )


@dataclass(kw_only=True)
class OutputsConfig:
    """Where the vital signs go (``agent/outputs``)."""

    metrics_port: int = 19400
    """Base port of each rank's Prometheus /metrics endpoint; the rank serves on base + its
    local rank (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK or MPI_LOCALRANKID).
    19400 is outside the exporters' 9100-9999 (dcgm-exporter 9400, node-exporter 9100). A taken
    port falls back (see ``metrics_port_strict``); ``agent.metrics_url`` says where it serves.
    0 turns the endpoint off."""

    metrics_port_strict: bool = False
    """A /metrics port that cannot be bound raises MetricsPortError at watch(). Off (the
    default): one warning, and the rank serves a node-width further up, or on any free port."""

    metrics_file_sd_dir: str | None = None
    """Folder of Prometheus file_sd target files: each rank writes ``<host>-rank<r>.json``
    naming the ``host:port`` it really serves (``file_sd_configs: [{files: [DIR/*.json]}]``),
    labelled ``job`` = ``collector_job`` when a collector is set, removed when the agent
    closes. None writes none."""

    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint binds to. Use 0.0.0.0 to let a scraper on another host in
    (then consider TLS with client certificates, below)."""

    metrics_certfile: str | None = None
    """PEM certificate chain of the /metrics endpoint: set, it serves HTTPS only."""

    metrics_keyfile: str | None = None
    """PEM private key of ``metrics_certfile`` (None: the key is in that file)."""

    metrics_client_cafile: str | None = None
    """PEM CA bundle whose client certificates /metrics accepts (scrapers may present one)."""

    metrics_client_auth_required: bool = False
    """Refuse scrapers without a client certificate signed by ``metrics_client_cafile``."""

    metrics_max_connections: int = 32
    """Connections /metrics holds open at once; beyond it the oldest idle one is dropped."""

    metrics_idle_timeout_s: float = 10.0
    """A /metrics connection that sends no complete request within this is closed."""

    metrics_scrapes_per_s: float = 2.0
    """Scrapes a second each client address may make on /metrics (Prometheus makes one every
    10-60 s); beyond it, and ``metrics_scrape_burst``, it is answered 429 with Retry-After before
    anything is parsed or rendered, so a scrape loop cannot slow the step. 0 turns it off."""

    metrics_scrape_burst: int = 5
    """Scrapes a client address may make back to back before ``metrics_scrapes_per_s`` applies."""

    log_dir: str = "torchvitals_runs"
    """Folder for the run's JSON-lines event log (written by global rank 0). Empty turns it off."""

    run_name: str | None = None
    """Name of the run's folder under log_dir; None uses the start time."""

    log_every: int = 1
    """Write one event-log line every this many steps (steps that skip are always written)."""

    live: bool = False
    """Global rank 0 shows a live view of the vital signs on stdout: a rich panel on a terminal,
    plain lines (one every ``sample_every`` steps, one per verdict or rollback) otherwise."""

    def __post_init__(self) -> None:
        _check(self, "outputs")
        _need(self.log_every >= 1, "log_every", self.log_every, "an integer >= 1")
        _need(
            0 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "a port in 0..65535 (0 turns /metrics off)",
        )
        _need(
            self.metrics_host.strip() != "",
            "metrics_host",
            self.metrics_host,
            "an address or host name to bind",
        )
        _need(
            self.metrics_file_sd_dir is None or self.metrics_file_sd_dir.strip() != "",
            "metrics_file_sd_dir",
            self.metrics_file_sd_dir,
            "a folder Prometheus' file_sd_configs reads, or None for no target files",
        )
        for name in ("metrics_keyfile", "metrics_client_cafile", "metrics_client_auth_required"):
            _need(
                not getattr(self, name) or bool(self.metrics_certfile),
                name,
                getattr(self, name),
                "needs metrics_certfile (HTTPS) as well",
            )
        _need(
            not self.metrics_client_auth_required or bool(self.metrics_client_cafile),
            "metrics_client_auth_required",
            True,
            "needs metrics_client_cafile: the CA whose client certificates are accepted",
        )
        _need(
            self.metrics_max_connections >= 1,
            "metrics_max_connections",
            self.metrics_max_connections,
            "an integer >= 1",
        )
        _need(
            self.metrics_idle_timeout_s > 0,
            "metrics_idle_timeout_s",
            self.metrics_idle_timeout_s,
            "seconds > 0",
        )
        _need(
            0 <= self.metrics_scrapes_per_s < math.inf,
            "metrics_scrapes_per_s",
            self.metrics_scrapes_per_s,
            "a number >= 0 (0 turns the limit off)",
        )
        _need(
            self.metrics_scrape_burst >= 1,
            "metrics_scrape_burst",
            self.metrics_scrape_burst,
            "an integer >= 1",
        )


@dataclass(kw_only=True)
class CollectorLink:
    """The collector whose directives this job obeys (``agent/recover/directives.py``); flat
    names ``collector_url``, ``collector_job``, ``collector_poll_seconds``."""

    url: str | None = None
    """Base URL of the collector whose directives (rollback, abort) this job obeys; global rank
    0 polls it off the training thread. The bearer token comes from TORCHVITALS_WEBHOOK_TOKEN."""

    job: str = "default"
    """The job name the collector addresses directives to (its alerts' ``job`` label)."""

    poll_seconds: float = 2.0
    """Seconds between polls of the collector."""

    def __post_init__(self) -> None:
        _check(self, "collector")
        _need(self.poll_seconds > 0, "collector_poll_seconds", self.poll_seconds, "seconds > 0")
        _need(
            self.url is None or self.url.startswith(("http://", "https://")),
            "collector_url",
            self.url,
            "an http:// or https:// URL, or None",
        )


def _need(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


def _check(section: Any, name: str) -> None:
    """The section's values against their types, named by their flat names."""
    check_types(
        section, {f.name: _RENAMED.get((name, f.name), f.name) for f in dataclasses.fields(section)}
    )


ARGUMENT = "an argument"
"""Where a setting given in code came from (``watch(...)``, ``Config(...)``)."""

SECTIONS: dict[str, type] = {
    "measure": MeasureConfig,
    "detect": DetectConfig,
    "recover": RecoverConfig,
    "outputs": OutputsConfig,
    "collector": CollectorLink,
}
"""Section name -> its dataclass."""

_RENAMED = {
    ("detect", "thresholds"): "detect",
    ("collector", "url"): "collector_url",
    ("collector", "job"): "collector_job",
    ("collector", "poll_seconds"): "collector_poll_seconds",
}

FLAT: dict[str, tuple[str, str]] = {
    _RENAMED.get((section, f.name), f.name): (section, f.name)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}
"""Flat name (keyword, attribute, ``TORCHVITALS_<NAME>``) -> (section, field)."""


@dataclass(kw_only=True, init=False)
class Config:
    """The agent's settings; see the module for the sections and the flat names."""

    measure: MeasureConfig
    """What each rank measures, and how often."""

    detect: DetectConfig
    """The detection thresholds; reads as the mapping of their overrides (flat ``detect=``)."""

    recover: RecoverConfig
    """Skips, healthy checkpoints, rollbacks, resume and the supervisor's heartbeat."""

    outputs: OutputsConfig
    """/metrics, the event log and the live view."""

    collector: CollectorLink
    """The collector whose directives this job obeys."""

    if TYPE_CHECKING:
        # The flat names, as the type checker sees them: at run time each is a property set
        # below the class (``_flat``) that reads and writes its section's field. Each has that
        # field's type; tests/unit/test_config.py holds these equal to the sections' fields.

        # measure
        blocks: Mapping[str, Any] | list[str] | None
        sample_every: int
        activations: bool
        update_ratio: bool
        update_ratio_max_bytes: int
        saturation_level: float
        split_ddp_work: bool
        clip_grad_norm: float | None
        # recover
        skip_nonfinite: bool
        skip_outliers: bool
        rerun_outliers: bool
        checkpoint_dir: str | None
        checkpoint_every: int
        resume: str
        checkpoint_keep: int
        checkpoint_key_file: str | None
        trust_unsigned_checkpoints: bool
        snapshot_max_bytes: int
        checkpoint_close_timeout_s: float
        healthy_window: int
        trust_steps: int
        verify_steps: int
        lr_ramp_steps: int
        lr_backoff: float
        skip_margin: int
        max_rollbacks: int
        rollback_window: int
        abort_exit_code: int
        heartbeat_dir: str | None
        # outputs
        metrics_port: int
        metrics_port_strict: bool
        metrics_file_sd_dir: str | None
        metrics_host: str
        metrics_certfile: str | None
        metrics_keyfile: str | None
        metrics_client_cafile: str | None
        metrics_client_auth_required: bool
        metrics_max_connections: int
        metrics_idle_timeout_s: float
        metrics_scrapes_per_s: float
        metrics_scrape_burst: int
        log_dir: str
        run_name: str | None
        log_every: int
        live: bool
        # collector
        collector_url: str | None
        collector_job: str
        collector_poll_seconds: float

    def __init__(
        self,
        *,
        measure: MeasureConfig | None = None,
        detect: DetectConfig | Mapping[str, Any] | None = None,
        recover: RecoverConfig | None = None,
        outputs: OutputsConfig | None = None,
        collector: CollectorLink | None = None,
        **flat: Any,
    ) -> None:
        """Sections given whole, flat fields on top (each validated by its section).

        Raises:
            TypeError: a keyword names no field, or a section is of the wrong type.
            ValueError: a value out of range (the message names the field).
        """
        if not isinstance(detect, DetectConfig):  # the flat ``detect``: threshold overrides
            if detect is not None:
                flat["detect"] = detect
            detect = None
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"Config got unexpected keyword argument(s) {', '.join(unknown)}")
        self._sources: dict[str, str] = {name: ARGUMENT for name in flat}
        given = {
            "measure": measure,
            "detect": detect,
            "recover": recover,
            "outputs": outputs,
            "collector": collector,
        }
        for section, cls in SECTIONS.items():
            value = given[section]
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{section} must be a {cls.__name__}, got {type(value).__name__}")
            changes = {
                name: flat[key]
                for key, (sec, name) in FLAT.items()
                if sec == section and key in flat
            }
            if value is None:
                value = cls(**changes)
            else:
                self._sources.update(
                    {key: ARGUMENT for key, (sec, _) in FLAT.items() if sec == section}
                )
                if changes:
                    value = dataclasses.replace(value, **changes)
            setattr(self, section, value)

    def source(self, name: str) -> str:
        """Where the flat setting ``name`` came from: ``TORCHVITALS_SAMPLE_EVERY='3'``, ``an
        argument`` or ``the default`` (what a mismatch between ranks names)."""
        return self._sources.get(name, "the default")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build a Config from defaults, then ``TORCHVITALS_*`` variables, then ``overrides``.

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: sections or flat field values given in code; they win over the
                environment (a section given whole wins for each of its fields).

        Returns:
            The validated Config.
        """
        sections = {
            name: value
            for name, value in overrides.items()
            if name in SECTIONS and (name != "detect" or isinstance(value, DetectConfig))
        }
        flat = {name: value for name, value in overrides.items() if name not in sections}
        values = settings(
            cls,
            environ,
            flat,
            lambda name: ENV_PREFIX + name.upper(),
            "torchvitals",
            fields=flat_fields(),
        )
        values = {
            name: value
            for name, value in values.items()
            if name in flat or FLAT[name][0] not in sections
        }
        environ = os.environ if environ is None else environ
        try:
            config = cls(**sections, **values)
        except ConfigError as e:
            root = e.field.split(".")[0]  # detect.loss_spike_mads came from detect
            env = ENV_PREFIX + root.upper()
            from_env = root not in flat and root in values
            raise e.from_source(
                f"the environment variable {env}" if from_env else "an argument"
            ) from None
        for name in values:
            if name not in flat:  # read from the environment (an argument wins over it)
                env = ENV_PREFIX + name.upper()
                config._sources[name] = f"{env}={environ[env]!r}"
        return config


def flat_fields() -> dict[str, dataclasses.Field]:
    """Flat name -> the section's field (its type and default), for settings and docs."""
    fields = {
        section: {f.name: f for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()
    }
    return {flat: fields[section][name] for flat, (section, name) in FLAT.items()}


def _flat(section: str, name: str, flat: str) -> property:
    def get(self: Config) -> Any:
        return getattr(getattr(self, section), name)

    def put(self: Config, value: Any) -> None:
        setattr(getattr(self, section), name, value)

    return property(get, put, doc=f"``config.{section}.{name}``, by its flat name {flat}.")


for _name, (_section, _field) in FLAT.items():
    if _name not in SECTIONS:  # ``detect`` is the section itself (a mapping)
        setattr(Config, _name, _flat(_section, _field, _name))
