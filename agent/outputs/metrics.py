"""Every metric an agent exports, defined once: name, type, help, scope and where its value
comes from. ``exporter.py`` serves them; ``tests/integration/test_exporter.py`` checks each name
against the Prometheus conventions.

    curl -s http://127.0.0.1:19400/metrics | grep ^torchvitals_

Durations are histograms (a scrape every 15 s sees every step, not the last one: ``rate(x_sum)
/ rate(x_count)`` is the mean, ``histogram_quantile`` the tail), throughput is a ``_total``
counter read with ``rate()``, and the rest are last-value gauges of the latest step.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..report import Report

RANK, GLOBAL, BLOCK, PATTERN, GROUP = "rank", "global", "block", "pattern", "param_group"
CUSTOM, INCIDENT = "custom", "incident"
"""Scopes: every rank exports RANK series; global rank 0 alone exports GLOBAL, BLOCK, PATTERN,
GROUP, CUSTOM and INCIDENT ones (PATTERN: one series per detectable pattern, labels ``pattern``
and ``severity``; GROUP: one per optimizer param group, label ``param_group``; CUSTOM: one per
name of ``Report.custom``, the user's own signals, label ``name``; INCIDENT: one per incident
kind and culprit recorded, labels ``kind``, ``rank`` (the culprit's global rank, not the
exporter's), ``node`` and ``host``, "" where unknown)."""

INCIDENT_LABELS = ("kind", "rank", "node", "host")
"""The labels of an INCIDENT series, the supervisors' incident counters' too."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _torch_version() -> str:
    """The running torch's own version, local part included (``2.14.1+cu130``, NGC's
    ``2.13.0a0+git...``): the build is what tells two nodes' torch apart, and a source build
    may have no metadata at all."""
    import torch

    return str(torch.__version__)


STEP_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    120.0,
    300.0,
    600.0,
    math.inf,
)
"""Upper bounds of the duration histograms: steps from 10 ms (a small model on a GPU) to 10 min
(a 70B model's step with a pipeline bubble), ~2.5x apart."""

WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, *STEP_BUCKETS)
"""The data wait's bounds: a loader that keeps up waits well under a millisecond."""


@dataclass(frozen=True)
class Buckets:
    """A histogram's counts at one scrape: per-bucket (not cumulative) counts, sum and count."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of observations <= le)`` pairs, as HistogramMetricFamily takes them."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(running)))
        return out


@dataclass(frozen=True)
class _Snapshot:
    """What one scrape reads: references taken under the lock, read outside it."""

    report: Report | None
    steps: int
    skipped: int
    nonfinite: int
    world_size: int
    update_ratio: dict[str, float]
    activations: dict[str, dict[str, float]]
    verdicts: dict[str, int]
    active: dict[str, int]
    recovery: dict[str, float] | None
    replica_checks: int = 0
    host: dict[str, float] = field(default_factory=dict)  # read at scrape time
    histograms: dict[str, Buckets] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    """Counters summed from the reports (samples, tokens); a key only once a report had it."""
    custom: dict[str, float] = field(default_factory=dict)
    """The last value of each name the user's signals wrote to ``Report.custom``."""
    incidents: dict[tuple[str, str, str, str], int] = field(default_factory=dict)
    """Incidents recorded by ``INCIDENT_LABELS`` values (global rank 0's agent)."""
    scrapes_refused: int = 0
    """Requests this rank's /metrics answered 429 (``metrics_scrapes_per_s``)."""


def _last(
    read: Callable[[Report], float], default: float = math.nan
) -> Callable[[_Snapshot], float]:
    """A gauge of the last report's value (``default`` before the first)."""
    return lambda s: default if s.report is None else float(read(s.report))


def _observed(read: Callable[[Report], float]) -> Callable[[Report], float | None]:
    """A histogram's observation of one step: the report's value, None when not finite."""

    def observe(report: Report) -> float | None:
        x = read(report)
        return float(x) if x is not None and math.isfinite(x) and x >= 0 else None

    return observe


def _summed(read: Callable[[Report], int | None]) -> Callable[[Report], float | None]:
    """A counter's increment from one step: the report's count, None when the loop gave none."""

    def increment(report: Report) -> float | None:
        x = read(report)
        return None if x is None else float(x)

    return increment


def _host(key: str) -> Callable[[_Snapshot], float]:
    return lambda s: s.host.get(key, math.nan)


def _accelerator(key: str) -> Callable[[_Snapshot], float | None]:
    """A CUDA allocator counter of the last sample; None (no series) without one."""
    return lambda s: (
        None
        if s.report is None or s.report.local.accelerator_memory is None
        else float(s.report.local.accelerator_memory[key])
    )


def _recovery(s: _Snapshot, key: str) -> float | None:
    """A watchdog value; None (no series) when the watchdog is off."""
    return None if s.recovery is None else float(s.recovery[key])


def _activation(key: str) -> Callable[[_Snapshot, str], float]:
    return lambda s, block: float(s.activations.get(block, {}).get(key, math.nan))


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its name, type, help text, scope and where its value comes from."""

    name: str
    kind: str
    """"gauge", "counter" or "histogram"."""
    doc: str
    scope: str
    """RANK, GLOBAL, BLOCK (one series per block, label ``block``), PATTERN, GROUP or CUSTOM."""
    value: Callable[..., float | None] = field(repr=False)
    """(snapshot) -> value, or (snapshot, key) -> value for the keyed scopes (the block, the
    pattern, the param group, the custom name); None omits the series.
    A histogram's is (report) -> the step's observation (None: nothing observed); a counter
    with ``from_report`` likewise gives the step's increment."""
    labels: tuple[tuple[str, str], ...] = ()
    """Constant labels besides ``rank``."""
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds (the last is +Inf)."""
    from_report: bool = False
    """A counter summed from each step's report (``value`` is the increment)."""


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "torchvitals_build_info",
        "gauge",
        "Versions of this process (always 1).",
        RANK,
        lambda s: 1.0,
        labels=(("version", _version("torchvitals")), ("torch_version", _torch_version())),
    ),
    MetricSpec(
        "torchvitals_world_size", "gauge", "Ranks in the job.", RANK, lambda s: float(s.world_size)
    ),
    MetricSpec(
        "torchvitals_step",
        "gauge",
        "Last completed step (1-based; 0 before the first).",
        RANK,
        _last(lambda r: r.step, 0.0),
    ),
    MetricSpec(
        "torchvitals_steps_total",
        "counter",
        "Steps reported on this rank.",
        RANK,
        lambda s: float(s.steps),
    ),
    MetricSpec(
        "torchvitals_skipped_steps_total",
        "counter",
        "Steps whose optimizer step was skipped.",
        RANK,
        lambda s: float(s.skipped),
    ),
    MetricSpec(
        "torchvitals_nonfinite_steps_total",
        "counter",
        "Steps with a NaN/Inf loss or gradient on any rank.",
        RANK,
        lambda s: float(s.nonfinite),
    ),
    MetricSpec(
        "torchvitals_step_duration_seconds",
        "histogram",
        "This rank's wall time of each step.",
        RANK,
        _observed(lambda r: r.timing.step_seconds),
        buckets=STEP_BUCKETS,
    ),
    # Synchronous ranks all wait for the slowest in the collectives, so their step times agree;
    # the time before the backward's collectives is what tells a straggler.
    MetricSpec(
        "torchvitals_compute_duration_seconds",
        "histogram",
        "This rank's compute time "
        "of each step (from the previous step's end to the end of its forward and loss).",
        RANK,
        _observed(lambda r: r.timing.compute_seconds),
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "torchvitals_local_loss",
        "gauge",
        "This rank's loss at the last step.",
        RANK,
        _last(lambda r: r.local.loss),
    ),
    MetricSpec(
        "torchvitals_samples_total",
        "counter",
        "Samples this rank trained on (only when "
        "the caller passes the sample count; rate(): samples per second).",
        RANK,
        _summed(lambda r: r.local.samples),
        from_report=True,
    ),
    MetricSpec(
        "torchvitals_tokens_total",
        "counter",
        "Tokens this rank trained on (only when "
        "the caller passes the token count; rate(): tokens per second).",
        RANK,
        _summed(lambda r: r.local.tokens),
        from_report=True,
    ),
    MetricSpec(
        "torchvitals_data_wait_seconds",
        "histogram",
        "This rank's wait for its batches in each step.",
        RANK,
        _observed(lambda r: r.timing.data_wait_seconds),
        buckets=WAIT_BUCKETS,
    ),
    MetricSpec(
        "torchvitals_process_resident_memory_bytes",
        "gauge",
        "This rank's resident memory.",
        RANK,
        _host("resident_bytes"),
    ),
    MetricSpec(
        "torchvitals_process_cpu_seconds_total",
        "counter",
        "User and system CPU time of this rank (rate(): cores used).",
        RANK,
        _host("cpu_seconds"),
    ),
    MetricSpec(
        "torchvitals_process_open_fds",
        "gauge",
        "File descriptors this rank holds open.",
        RANK,
        _host("open_fds"),
    ),
    MetricSpec(
        "torchvitals_dataloader_workers",
        "gauge",
        "Live child processes of this rank (its DataLoader workers).",
        RANK,
        _host("children"),
    ),
    MetricSpec(
        "torchvitals_metrics_scrapes_refused_total",
        "counter",
        "Requests to this rank's /metrics answered 429: their address scraped beyond "
        "metrics_scrapes_per_s (a scrape loop; Prometheus never gets there).",
        RANK,
        lambda s: float(s.scrapes_refused),
    ),
    MetricSpec(
        "torchvitals_host_memory_available_bytes",
        "gauge",
        "Memory available on this rank's host.",
        RANK,
        _host("host_available_bytes"),
    ),
    MetricSpec(
        "torchvitals_accelerator_memory_allocated_bytes",
        "gauge",
        "CUDA memory held by tensors (last sample).",
        RANK,
        _accelerator("allocated_bytes"),
    ),
    MetricSpec(
        "torchvitals_accelerator_memory_reserved_bytes",
        "gauge",
        "CUDA memory reserved by the caching allocator (last sample).",
        RANK,
        _accelerator("reserved_bytes"),
    ),
    MetricSpec(
        "torchvitals_accelerator_memory_peak_bytes",
        "gauge",
        "Peak CUDA memory held by tensors since the sample before.",
        RANK,
        _accelerator("peak_bytes"),
    ),
    MetricSpec(
        "torchvitals_accelerator_memory_fragmentation_bytes",
        "gauge",
        "Reserved minus allocated CUDA memory (last sample).",
        RANK,
        _accelerator("fragmentation_bytes"),
    ),
    MetricSpec(
        "torchvitals_data_wait_ratio",
        "gauge",
        "Share of the ranks' step time spent waiting for data (last step).",
        GLOBAL,
        _last(lambda r: r.timing.data_wait_ratio, 0.0),
    ),
    MetricSpec(
        "torchvitals_replica_checks_total",
        "counter",
        "Sampled steps that compared the DDP replicas' fingerprints.",
        GLOBAL,
        lambda s: float(s.replica_checks),
    ),
    MetricSpec(
        "torchvitals_loss",
        "gauge",
        "Mean loss over the ranks at the last step.",
        GLOBAL,
        _last(lambda r: r.loss),
    ),
    # Not "_grad_norm_total": the _total suffix is reserved for counters.
    MetricSpec(
        "torchvitals_grad_norm_global",
        "gauge",
        "L2 norm of all gradients before clipping.",
        GLOBAL,
        _last(lambda r: r.grad_norm_total),
    ),
    MetricSpec(
        "torchvitals_clip_coefficient",
        "gauge",
        "Factor the gradients were scaled by (1 without clipping).",
        GLOBAL,
        _last(lambda r: r.clip_coef),
    ),
    MetricSpec(
        "torchvitals_grad_norm",
        "gauge",
        "L2 norm of the block's gradient.",
        BLOCK,
        lambda s, b: math.nan if s.report is None else float(s.report.grad_norm.get(b, math.nan)),
    ),
    MetricSpec(
        "torchvitals_update_ratio",
        "gauge",
        "||dw|| / ||w|| of the block's last sampled optimizer update.",
        BLOCK,
        lambda s, b: float(s.update_ratio.get(b, math.nan)),
    ),
    MetricSpec(
        "torchvitals_activation_mean",
        "gauge",
        "Mean of the block's output (last sample).",
        BLOCK,
        _activation("mean"),
    ),
    MetricSpec(
        "torchvitals_activation_rms",
        "gauge",
        "RMS of the block's output (last sample).",
        BLOCK,
        _activation("rms"),
    ),
    MetricSpec(
        "torchvitals_activation_abs_max",
        "gauge",
        "Max |x| of the block's output (last sample).",
        BLOCK,
        _activation("abs_max"),
    ),
    MetricSpec(
        "torchvitals_activation_zero_ratio",
        "gauge",
        "Fraction of the block's outputs that are exactly 0 (last sample).",
        BLOCK,
        _activation("zero_fraction"),
    ),
    MetricSpec(
        "torchvitals_activation_saturated_ratio",
        "gauge",
        "Fraction of the block's outputs with |x| >= saturation_level (last sample).",
        BLOCK,
        _activation("saturation_fraction"),
    ),
    MetricSpec(
        "torchvitals_activation_nonfinite",
        "gauge",
        "NaN/Inf elements in the block's output (last sample).",
        BLOCK,
        _activation("nonfinite"),
    ),
    MetricSpec(
        "torchvitals_attention_entropy_min",
        "gauge",
        "Lowest per-head attention entropy "
        "in the block, nats (last sample; NaN without attention).",
        BLOCK,
        _activation("attention_entropy"),
    ),
    MetricSpec(
        "torchvitals_attention_logit_max",
        "gauge",
        "Largest attention logit in the block (last sample; from record_attention(logits=...)).",
        BLOCK,
        _activation("attention_logit_max"),
    ),
    MetricSpec(
        "torchvitals_loss_scale",
        "gauge",
        "GradScaler scale used at the last step (only when a scaler is passed to agent.step).",
        GLOBAL,
        lambda s: (
            None if s.report is None or s.report.loss_scale is None else float(s.report.loss_scale)
        ),
    ),
    MetricSpec(
        "torchvitals_rollbacks_total",
        "counter",
        "Rollbacks to a healthy checkpoint (this process).",
        GLOBAL,
        lambda s: _recovery(s, "rollbacks"),
    ),
    MetricSpec(
        "torchvitals_rollback_repeats_total",
        "counter",
        "Rollbacks that repeated one that did not cure the run (each went to an earlier "
        "checkpoint with a deeper learning-rate cut) (this process).",
        GLOBAL,
        lambda s: _recovery(s, "rollback_repeats"),
    ),
    MetricSpec(
        "torchvitals_last_healthy_step",
        "gauge",
        "Step of the last healthy checkpoint.",
        GLOBAL,
        lambda s: _recovery(s, "last_healthy_step"),
    ),
    MetricSpec(
        "torchvitals_learning_rate",
        "gauge",
        "Learning rate the param group stepped with "
        "at the last step (what its scheduler, framework or loop set, times the back-off).",
        GROUP,
        lambda s, group: float(s.report.lr[group]),
    ),
    MetricSpec(
        "torchvitals_lr_scale",
        "gauge",
        "Factor the rollbacks' back-off left on the learning rate.",
        GLOBAL,
        lambda s: _recovery(s, "lr_scale"),
    ),
    MetricSpec(
        "torchvitals_skipped_batches_total",
        "counter",
        "Batches never trained on after rollbacks (the skip list).",
        GLOBAL,
        lambda s: _recovery(s, "skipped_batches"),
    ),
    MetricSpec(
        "torchvitals_checkpoint_seconds",
        "gauge",
        "Duration of the last healthy checkpoint save (the background write, when staged).",
        GLOBAL,
        lambda s: _recovery(s, "checkpoint_seconds"),
    ),
    MetricSpec(
        "torchvitals_checkpoint_stall_seconds",
        "gauge",
        "How long the last healthy "
        "checkpoint stalled training (the staging copy, or the whole synchronous save).",
        GLOBAL,
        lambda s: _recovery(s, "checkpoint_stall_seconds"),
    ),
    MetricSpec(
        "torchvitals_checkpoint_failures_total",
        "counter",
        "Healthy checkpoints that failed on some rank and were not committed.",
        GLOBAL,
        lambda s: _recovery(s, "checkpoint_failures"),
    ),
    MetricSpec(
        "torchvitals_custom_value",
        "gauge",
        "Last value of a user-defined signal (watch(signals=...)), by its Report.custom name.",
        CUSTOM,
        lambda s, name: float(s.custom[name]),
    ),
    MetricSpec(
        "torchvitals_incidents_total",
        "counter",
        "Incidents (disruptions: non-finite steps, loss spikes, stragglers, diverging replicas, "
        "aborts) this run's agent recorded, by kind and culprit (rank, node, host; empty where "
        "unknown).",
        INCIDENT,
        lambda s, labels: float(s.incidents[labels]),
    ),
    MetricSpec(
        "torchvitals_verdicts_total",
        "counter",
        "Verdicts emitted, by pattern.",
        PATTERN,
        lambda s, p: float(s.verdicts.get(p, 0)),
    ),
    MetricSpec(
        "torchvitals_active_verdicts",
        "gauge",
        "Blocks (or 1 for job-wide patterns) in which the pattern is currently active.",
        PATTERN,
        lambda s, p: float(s.active.get(p, 0)),
    ),
)
