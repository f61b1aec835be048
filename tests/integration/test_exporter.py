"""The per-rank Prometheus exporter, scraped over HTTP on 127.0.0.1: every series and its
labels against the Report it came from, counters, histograms, a taken port, concurrent scrapes.

    python -m pytest tests/integration/test_exporter.py
"""

from __future__ import annotations

import errno
import importlib.metadata
import math
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.world import free_port

from torchvitals.agent.detect import PATTERNS
from torchvitals.agent.outputs.exporter import Exporter, MetricsPortError
from torchvitals.agent.outputs.metrics import (
    BLOCK,
    CUSTOM,
    GLOBAL,
    GROUP,
    INCIDENT,
    METRICS,
    PATTERN,
    RANK,
)
from torchvitals.agent.report import Report

RECOVERY = {
    "torchvitals_rollbacks",
    "torchvitals_rollback_repeats",
    "torchvitals_last_healthy_step",
    "torchvitals_lr_scale",
    "torchvitals_skipped_batches",
    "torchvitals_checkpoint_seconds",
    "torchvitals_checkpoint_stall_seconds",
    "torchvitals_checkpoint_failures",
}

ACCELERATOR = {
    f"torchvitals_accelerator_memory_{k}_bytes"
    for k in ("allocated", "reserved", "peak", "fragmentation")
}
BLOCKS = ["embed", "layers.0", "layers.1", "head"]
NAME = re.compile(r"^torchvitals_[a-z][a-z0-9_]*$")
UNIT_SUFFIXES = ("_total", "_seconds", "_bytes", "_ratio", "_info")


def activation(x: float) -> dict[str, float]:
    return {
        "mean": x,
        "rms": 2 * x,
        "abs_max": 3 * x,
        "zero_fraction": 0.25,
        "saturation_fraction": 0.125,
        "nonfinite": 0.0,
    }


def make_report(step: int, *, sampled: bool = False, rank: int = 0, **kw) -> Report:
    fields = dict(
        step=step,
        loss=1.0 / step,
        grad_norm={b: step + i for i, b in enumerate(BLOCKS)},
        grad_norm_total=10.0 * step,
        world_size=2,
        rank=rank,
        local_loss=2.0 / step,
        step_seconds=0.25,
        samples=8,
        clip_coef=0.5,
        tokens=1024,
        local_data_wait_seconds=0.125,
        data_wait_ratio=0.5,
    )
    if sampled:
        fields["update_ratio"] = {b: 1e-3 * step + i for i, b in enumerate(BLOCKS)}
        fields["update_ratio_step"] = step - 1
        fields["activations"] = {b: activation(step + i) for i, b in enumerate(BLOCKS)}
        fields["replicas_checked"] = True
        fields["custom"] = {"my_signal": float(step)}  # a user's signal, measured when sampled
    # What a CUDA rank's steps carry (the last sample's counters; a CPU rank has none: no series).
    fields["local_accelerator_memory"] = {
        "allocated_bytes": 3e9,
        "reserved_bytes": 4e9,
        "peak_bytes": 3.5e9,
        "fragmentation_bytes": 1e9,
    }
    fields.update(kw)
    return Report.from_flat(**fields)


def scrape(url: str) -> dict[str, dict]:
    """name -> {"type", "samples": {(sample name, sorted labels): value}}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        f.name: {
            "type": f.type,
            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples},
        }
        for f in text_string_to_metric_families(text)
    }


def value(families: dict, sample: str, **labels: str) -> float:
    for family in families.values():
        key = (sample, tuple(sorted(labels.items())))
        if key in family["samples"]:
            return family["samples"][key]
    raise KeyError(f"no sample {sample}{labels}")


def series_count(families: dict) -> int:
    return sum(len(f["samples"]) for f in families.values())


@pytest.fixture
def served():
    """A rank-0 exporter on a free port; closed after the test."""
    exporters = []

    def start(rank: int = 0, blocks=BLOCKS) -> Exporter:
        ex = Exporter(
            blocks,
            rank=rank,
            local_rank=rank,
            world_size=2,
            port=free_port(),
            registry=CollectorRegistry(),
        )
        exporters.append(ex)
        return ex

    yield start
    for ex in exporters:
        ex.close()


def test_a_user_signals_values_are_served_by_name_and_kept_between_samples(served):
    """``Report.custom`` (``watch(signals=...)``) is one gauge per name on rank 0; a name a
    step did not measure keeps its last value, as per-block series do, so it has no gaps."""
    ex, other = served(), served(rank=1)
    for step, custom in ((1, {"tokens_seen": 10.0, "my_ratio": 0.5}), (2, {"my_ratio": 0.25})):
        ex.update(make_report(step, custom=custom))
        other.update(make_report(step, rank=1, custom=custom))
    got = scrape(ex.url)
    assert value(got, "torchvitals_custom_value", rank="0", name="tokens_seen") == 10.0
    assert value(got, "torchvitals_custom_value", rank="0", name="my_ratio") == 0.25
    assert "torchvitals_custom_value" not in scrape(other.url), "global: rank 0 alone"


def test_scrape_matches_report(served):
    ex = served()
    assert ex.url == f"http://127.0.0.1:{ex.port}/metrics"
    report = make_report(7, sampled=True)
    ex.update(report)
    got = scrape(ex.url)
    r = {"rank": "0"}
    assert value(got, "torchvitals_step", **r) == 7
    assert value(got, "torchvitals_steps_total", **r) == 1
    assert value(got, "torchvitals_world_size", **r) == 2
    assert value(got, "torchvitals_step_duration_seconds_sum", **r) == 0.25
    assert value(got, "torchvitals_step_duration_seconds_count", **r) == 1
    assert value(got, "torchvitals_step_duration_seconds_bucket", **r, le="0.25") == 1
    assert value(got, "torchvitals_step_duration_seconds_bucket", **r, le="0.1") == 0
    assert got["torchvitals_step_duration_seconds"]["type"] == "histogram"
    assert value(got, "torchvitals_local_loss", **r) == pytest.approx(2.0 / 7)
    assert value(got, "torchvitals_samples_total", **r) == 8
    assert value(got, "torchvitals_loss", **r) == pytest.approx(1.0 / 7)
    assert value(got, "torchvitals_grad_norm_global", **r) == 70.0
    assert value(got, "torchvitals_clip_coefficient", **r) == 0.5
    for block in BLOCKS:
        b = dict(r, block=block)
        assert value(got, "torchvitals_grad_norm", **b) == report.grad_norm[block]
        assert value(got, "torchvitals_update_ratio", **b) == report.update_ratio[block]
        act = report.activations[block]
        assert value(got, "torchvitals_activation_mean", **b) == act["mean"]
        assert value(got, "torchvitals_activation_rms", **b) == act["rms"]
        assert value(got, "torchvitals_activation_abs_max", **b) == act["abs_max"]
        assert value(got, "torchvitals_activation_zero_ratio", **b) == act["zero_fraction"]
        assert (
            value(got, "torchvitals_activation_saturated_ratio", **b) == act["saturation_fraction"]
        )
        assert value(got, "torchvitals_activation_nonfinite", **b) == act["nonfinite"]
    assert got["torchvitals_build_info"]["samples"] == {
        (
            "torchvitals_build_info",
            (
                ("rank", "0"),
                ("torch_version", torch.__version__),
                ("version", importlib.metadata.version("torchvitals")),
            ),
        ): 1.0
    }


def test_counters_count_steps_skips_and_nonfinite(served):
    ex = served()
    ex.update(make_report(1))
    ex.update(make_report(2, action="skip", nonfinite=True, loss=math.nan))
    ex.update(make_report(3, action="skip"))
    ex.update(make_report(4, nonfinite=True))  # skip_nonfinite=False: stepped anyway
    got = scrape(ex.url)
    assert value(got, "torchvitals_steps_total", rank="0") == 4
    assert value(got, "torchvitals_skipped_steps_total", rank="0") == 2
    assert value(got, "torchvitals_nonfinite_steps_total", rank="0") == 2
    assert value(got, "torchvitals_step", rank="0") == 4


def test_before_first_report_every_series_is_present(served):
    got = scrape(served().url)
    assert value(got, "torchvitals_step", rank="0") == 0
    assert value(got, "torchvitals_steps_total", rank="0") == 0
    assert math.isnan(value(got, "torchvitals_loss", rank="0"))
    assert value(got, "torchvitals_step_duration_seconds_count", rank="0") == 0
    assert value(got, "torchvitals_step_duration_seconds_bucket", rank="0", le="+Inf") == 0
    for m in METRICS:
        if m.scope == BLOCK:
            for block in BLOCKS:
                assert math.isnan(value(got, m.name, rank="0", block=block)), m.name
    exported = {n for n in got}
    expected = {m.name.removesuffix("_total") for m in METRICS}
    # Present only when the caller passes the sample (token) count, a GradScaler, runs the
    # watchdog, or trains on CUDA.
    assert expected - exported == (
        {"torchvitals_samples", "torchvitals_loss_scale", "torchvitals_tokens"}
        | RECOVERY
        | ACCELERATOR
    )


def test_samples_total_only_when_samples_known(served):
    ex = served()
    ex.update(make_report(1, samples=None))
    assert "torchvitals_samples" not in scrape(ex.url)
    ex.update(make_report(2, samples=4, step_seconds=0.5))
    ex.update(make_report(3, samples=6, step_seconds=0.5))
    got = scrape(ex.url)
    assert got["torchvitals_samples"]["type"] == "counter"
    assert value(got, "torchvitals_samples_total", rank="0") == 10.0


def test_durations_are_histograms_that_see_every_step(served):
    """A scrape every 15 s sees every step's duration, the slow one too, not the last alone."""
    ex = served()
    times = [0.02, 0.3, 0.3, 7.0, 0.3, math.nan]  # one slow step among fast ones
    for i, t in enumerate(times, 1):
        ex.update(
            make_report(i, step_seconds=t, compute_seconds=t / 2, local_data_wait_seconds=0.0004)
        )
    got = scrape(ex.url)
    r = {"rank": "0"}
    name = "torchvitals_step_duration_seconds"
    assert value(got, f"{name}_count", **r) == 5  # the NaN step is not observed
    assert value(got, f"{name}_sum", **r) == pytest.approx(7.92)
    assert value(got, f"{name}_bucket", **r, le="0.025") == 1
    assert value(got, f"{name}_bucket", **r, le="0.5") == 4
    assert value(got, f"{name}_bucket", **r, le="5.0") == 4
    assert value(got, f"{name}_bucket", **r, le="10.0") == 5  # the slow step is counted
    bounds = [
        float(dict(labels)["le"])
        for sample, labels in got[name]["samples"]
        if sample.endswith("_bucket")
    ]
    assert bounds[0] == 0.01 and bounds[-2] == 600.0 and bounds[-1] == math.inf
    assert value(got, "torchvitals_compute_duration_seconds_sum", **r) == pytest.approx(3.96)
    assert value(got, "torchvitals_data_wait_seconds_bucket", **r, le="0.001") == 6


def test_names_follow_conventions(served):
    table = [m.name for m in METRICS]
    assert len(table) == len(set(table)), "a name defined twice"
    for m in METRICS:
        assert NAME.match(m.name), m.name
        assert m.kind in ("gauge", "counter", "histogram"), m.name
        if m.kind == "histogram":  # base unit seconds, +Inf last, bounds ascending
            assert m.name.endswith("_seconds") and m.buckets[-1] == math.inf, m.name
            assert list(m.buckets) == sorted(set(m.buckets)), m.name
        assert m.scope in (RANK, GLOBAL, BLOCK, PATTERN, GROUP, CUSTOM, INCIDENT), m.name
        # _total means "counter" to Prometheus tooling; a gauge with it misleads rate().
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.doc.strip(), m.name
    assert "torchvitals_build_info" in table

    ex = served()
    report = make_report(1, sampled=True)
    report.loss_scale = 1024.0
    report.lr = [1e-3]
    ex.update(
        report,
        recovery={
            "rollbacks": 1,
            "rollback_repeats": 0,
            "lr_scale": 0.5,
            "last_healthy_step": 50,
            "skipped_batches": 12,
            "checkpoint_seconds": 0.2,
            "checkpoint_stall_seconds": 0.01,
            "checkpoint_failures": 0,
        },
    )
    ex.count_incident("nonfinite", 3, 1, "node-b")
    got = scrape(ex.url)
    kinds = {m.name: m.kind for m in METRICS}
    histograms = {m.name for m in METRICS if m.kind == "histogram"}
    assert {
        name if f["type"] == "histogram" else s for name, f in got.items() for s, _ in f["samples"]
    } == set(table), "rank 0 exports exactly the table once a report with samples arrived"
    gauges, counters = set(), set()
    for name, family in got.items():
        for sample, labels in family["samples"]:
            assert NAME.match(sample), sample
            if family["type"] == "histogram":
                assert name in histograms and kinds[name] == "histogram", sample
                assert sample in (f"{name}_bucket", f"{name}_sum", f"{name}_count"), sample
                assert set(dict(labels)) <= {"rank", "le"}
                continue
            assert kinds[sample] == family["type"], sample
            assert {k for k, _ in labels} <= {
                "rank",
                "block",
                "version",
                "torch_version",
                "pattern",
                "severity",
                "param_group",
                "name",
                "kind",
                "node",
                "host",
            }
            # An incident's rank is its culprit's, not the exporting rank's.
            assert dict(labels)["rank"] == ("3" if name == "torchvitals_incidents" else "0")
            if family["type"] == "counter":
                assert sample.endswith("_total"), sample
                counters.add(name)
            else:
                assert family["type"] == "gauge", sample
                assert not sample.endswith("_total"), sample
                gauges.add(name)
    assert not gauges & counters
    for name in table:  # base units: seconds, not ms; ratios, not percent
        assert not re.search(r"_(milli|micro)?(ms|us|percent|minutes|hours)(_|$)", name), name


def test_rank1_exports_only_its_scalars(served):
    ex = served(rank=1)
    ex.update(make_report(3, sampled=True, rank=1))
    got = scrape(ex.url)
    samples = [(s, dict(labels)) for f in got.values() for s, labels in f["samples"]]
    assert samples
    assert all(labels["rank"] == "1" for _, labels in samples)
    assert not [s for s, labels in samples if "block" in labels]
    rank_names = {m.name for m in METRICS if m.scope == RANK}
    assert {
        name if f["type"] == "histogram" else s for name, f in got.items() for s, _ in f["samples"]
    } == rank_names
    assert value(got, "torchvitals_local_loss", rank="1") == pytest.approx(2.0 / 3)


def test_series_count_constant_as_steps_go_by(served):
    ex = served()
    last_sampled = None
    for step in range(1, 201):
        sampled = step == 1 or step % 10 == 0
        report = make_report(step, sampled=sampled, action="skip" if step % 37 == 0 else "step")
        ex.update(report)
        last_sampled = report if sampled else last_sampled
        if step == 10:
            after_10 = scrape(ex.url)
    after_200 = scrape(ex.url)
    # Rank and global scalars, each histogram's buckets + _sum + _count, per block, per pattern,
    # the one custom name.
    histogram_series = sum(len(m.buckets) + 2 for m in METRICS if m.kind == "histogram")
    assert (
        series_count(after_10)
        == series_count(after_200)
        == 19 + histogram_series + 5 + 10 * len(BLOCKS) + 2 * len(PATTERNS) + 1
    )
    assert set(after_10) == set(after_200)
    # Step 200 was sampled; check an unsampled last step keeps the sampled values.
    ex.update(make_report(201))
    got = scrape(ex.url)
    assert series_count(got) == series_count(after_200)
    for block in BLOCKS:
        assert (
            value(got, "torchvitals_update_ratio", rank="0", block=block)
            == last_sampled.update_ratio[block]
        )
        assert (
            value(got, "torchvitals_activation_rms", rank="0", block=block)
            == last_sampled.activations[block]["rms"]
        )
        assert (
            value(got, "torchvitals_grad_norm", rank="0", block=block)
            == make_report(201).grad_norm[block]
        )


def test_partial_samples_keep_other_blocks_last_value():
    ex = Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=0)
    ex.update(make_report(1, update_ratio={"embed": 0.1, "head": 0.2}))
    ex.update(make_report(2, update_ratio={"head": 0.3, "layers.0": 0.4}))
    got = {
        (s.labels.get("block")): s.value
        for f in ex.registry.collect()
        if f.name == "torchvitals_update_ratio"
        for s in f.samples
    }
    assert got["embed"] == 0.1 and got["head"] == 0.3 and got["layers.0"] == 0.4
    assert math.isnan(got["layers.1"])


def test_unnamed_block_is_exported_too():
    ex = Exporter(["a"], rank=0, local_rank=0, world_size=1, port=0)
    ex.update(Report(step=1, loss=0.0, grad_norm={"a": 1.0, "other": 2.0}, grad_norm_total=3.0))
    got = {
        s.labels["block"]: s.value
        for f in ex.registry.collect()
        if f.name == "torchvitals_grad_norm"
        for s in f.samples
    }
    assert got == {"a": 1.0, "other": 2.0}


def test_taken_port_raises_clear_error_when_strict():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        registry = CollectorRegistry()
        with pytest.raises(MetricsPortError) as info:
            Exporter(
                BLOCKS,
                rank=3,
                local_rank=1,
                world_size=4,
                port=port,
                registry=registry,
                strict=True,
            )
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.EADDRINUSE
    msg = str(err)
    assert f"127.0.0.1:{port}" in msg
    assert "metrics_port" in msg and "TORCHVITALS_METRICS_PORT" in msg
    assert "LOCAL_RANK" in msg and f"{port - 1} + 1" in msg
    assert re.search(r"\b0\b.*turn the endpoint off", msg)
    assert err.__cause__ is None and err.__suppress_context__
    # The failed exporter left nothing registered behind.
    assert generate_latest(registry) == b""


def test_port_zero_serves_nothing_but_collects():
    ex = Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=0)
    assert ex.url is None
    ex.update(make_report(5))
    text = generate_latest(ex.registry).decode()
    assert 'torchvitals_step{rank="0"} 5.0' in text
    ex.close()
    ex.close()


def serving_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("torchvitals-metrics") and t.is_alive()
    }


def test_close_is_idempotent_and_frees_the_port(served):
    before = serving_threads()
    ex = served()
    port, url = ex.port, ex.url
    scrape(url)
    assert serving_threads() - before
    ex.close()
    ex.close()
    assert ex.url is None
    assert not serving_threads() - before, "the server thread outlived close()"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
    again = Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=port)
    try:
        assert value(scrape(again.url), "torchvitals_step", rank="0") == 0
    finally:
        again.close()


def test_two_exporters_in_one_registry_clash_until_closed():
    registry = CollectorRegistry()
    first = Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=0, registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=0, registry=registry)
    first.close()
    Exporter(BLOCKS, rank=0, local_rank=0, world_size=1, port=0, registry=registry).close()


def test_scrapes_during_updates_see_consistent_counters(served):
    ex = served()
    seen, errors, stop = [], [], threading.Event()

    def scraper():
        while not stop.is_set():
            try:
                seen.append(value(scrape(ex.url), "torchvitals_steps_total", rank="0"))
            except Exception as exc:  # surfaced below, not lost in the thread
                errors.append(exc)
                return

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        for step in range(1, 2001):
            ex.update(make_report(step, sampled=step % 10 == 0))
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors and not thread.is_alive()
    assert seen and seen == sorted(seen)
    assert value(scrape(ex.url), "torchvitals_steps_total", rank="0") == 2000


def test_learning_rate_per_param_group_on_rank_0(served):
    ex = served()
    ex.update(make_report(3, lr=[1e-3, 2.5e-4]))
    got = scrape(ex.url)
    assert value(got, "torchvitals_learning_rate", rank="0", param_group="0") == 1e-3
    assert value(got, "torchvitals_learning_rate", rank="0", param_group="1") == 2.5e-4


def test_vitals_are_served_per_rank(served):
    """Process and host vitals come from this process at scrape time; the step's from the report."""
    import psutil

    ex = served(rank=1)
    ex.update(make_report(3, rank=1))
    got = scrape(ex.url)
    r = {"rank": "1"}
    assert value(got, "torchvitals_tokens_total", **r) == 1024
    assert value(got, "torchvitals_data_wait_seconds_sum", **r) == 0.125
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < value(got, "torchvitals_process_resident_memory_bytes", **r) < 2 * rss
    assert value(got, "torchvitals_process_cpu_seconds_total", **r) > 0
    assert value(got, "torchvitals_process_open_fds", **r) >= 3  # stdin, stdout, stderr
    assert value(got, "torchvitals_dataloader_workers", **r) == len(psutil.Process().children())
    assert (
        0
        < value(got, "torchvitals_host_memory_available_bytes", **r)
        <= psutil.virtual_memory().total
    )
    assert value(got, "torchvitals_accelerator_memory_fragmentation_bytes", **r) == 1e9
    # A worker starting shows at the next scrape once the cached text is older than the
    # render interval (a scrape loop reads the cache), without a step in between.
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(ex.cache.min_interval_s)
        assert value(scrape(ex.url), "torchvitals_dataloader_workers", **r) == len(
            psutil.Process().children()
        )
        assert value(scrape(ex.url), "torchvitals_dataloader_workers", **r) >= 1
    finally:
        child.kill()
        child.wait(10)


def test_incidents_are_counted_by_kind_and_culprit_on_rank_0_only(served):
    ex = served()
    ex.count_incident("nonfinite", 1, 0, "node-a")
    ex.count_incident("nonfinite", 1, 0, "node-a")
    ex.count_incident("loss_spike", None, None, None)
    got = scrape(ex.url)
    name = "torchvitals_incidents_total"
    assert value(got, name, kind="nonfinite", rank="1", node="0", host="node-a") == 2
    assert value(got, name, kind="loss_spike", rank="", node="", host="") == 1
    other = served(rank=1)
    other.count_incident("nonfinite", 1, 0, "node-a")
    assert "torchvitals_incidents" not in scrape(other.url)
