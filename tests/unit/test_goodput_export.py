"""The supervisor's goodput series, scraped from a real registry over a folder of records.

python -m pytest tests/unit/test_goodput_export.py -q
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.goodput_jobs import crash_then_rollback

from torchvitals.records.goodput import CAUSES, Accountant, account
from torchvitals.records.timeline import StepTimeline, SupervisorTimeline
from torchvitals.supervisor.goodput_export import GoodputCollector


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scrape(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """(sample name, cause label) -> value, from the exposition text a Prometheus reads."""
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels.get("cause", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("torchvitals_supervisor_")
    }


def served(registry: CollectorRegistry) -> tuple[float, dict[str, float], float | None]:
    values = scrape(registry)
    return (
        values[("torchvitals_supervisor_productive_seconds_total", "")],
        {c: values[("torchvitals_supervisor_badput_seconds_total", c)] for c in CAUSES},
        values.get(("torchvitals_supervisor_goodput_ratio", "")),
    )


def test_the_series_are_the_accountings_figures(tmp_path):
    crash_then_rollback(tmp_path)
    registry = CollectorRegistry()
    registry.register(GoodputCollector(tmp_path))
    productive, badput, ratio = served(registry)
    g = account(tmp_path)
    assert productive == pytest.approx(g.productive_seconds)
    assert badput == pytest.approx(g.badput)
    assert ratio == pytest.approx(g.goodput)


def test_a_scrape_reads_the_folder_at_most_every_refresh_s_and_counters_never_go_back(tmp_path):
    clock = Clock()
    collector = GoodputCollector(tmp_path, refresh_s=15.0, clock=clock)
    registry = CollectorRegistry()
    registry.register(collector)  # registering reads nothing: no records needed yet
    productive, badput, ratio = served(registry)
    assert (productive, set(badput.values()), ratio) == (0.0, {0.0}, None)  # not started
    # Attempt 1 hung before any process started (startup 1 -> 4, restart 4 -> 5 -> 9); attempt
    # 2 is running: its wait ended at 10 and its first process started at 14, so far startup
    # (the attempt's own start is not known before its line lands).
    sup = SupervisorTimeline(tmp_path)
    sup.waited(1, start=0, end=1)
    sup.attempt(1, start=1, end=5, reason="hang", status=-9, detected=4)
    sup.waited(2, start=9, end=10)
    steps = StepTimeline(tmp_path, attempt=2, pid=3)
    steps.start(at=14, resumed=0)
    steps.step(1, end=16, seconds=2)
    clock.now = 14.9
    assert served(registry)[0] == 0.0  # cached: the folder was read at 0
    clock.now = 15.0
    productive, badput, ratio = served(registry)
    assert (productive, badput["startup"], badput["restart"]) == (2.0, 3 + 4, 1 + 4)
    assert ratio == pytest.approx(2 / 16)
    # The attempt's line lands: it started at 12, so 10 -> 12 was no one's (unattributed) and
    # startup shrinks by 2. A counter that went back would read as a reset: it keeps 7.
    steps.step(2, end=18, seconds=2)
    sup.attempt(2, start=12, end=19, reason="exit", status=0)
    assert account(tmp_path).badput["startup"] == 3 + 2
    clock.now = 30.0
    productive, badput, ratio = served(registry)
    assert (productive, badput["startup"], badput["teardown"]) == (4.0, 3 + 4, 1)
    assert ratio == pytest.approx(4 / 19)


def test_a_failing_accounting_is_logged_once_and_the_last_figures_served(
    tmp_path, caplog, monkeypatch
):
    crash_then_rollback(tmp_path)
    clock = Clock()
    registry = CollectorRegistry()
    registry.register(GoodputCollector(tmp_path, refresh_s=1.0, clock=clock))
    before = served(registry)

    def broken(self):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Accountant, "account", broken)
    with caplog.at_level(logging.WARNING, logger="torchvitals.supervisor"):
        for t in (1, 2, 3):
            clock.now = t
            assert served(registry) == before
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "disk on fire" in caplog.records[0].getMessage() and len(caplog.records) == 1


def test_refresh_s_must_not_be_negative(tmp_path):
    with pytest.raises(ValueError, match="refresh_s"):
        GoodputCollector(tmp_path, refresh_s=-1)
