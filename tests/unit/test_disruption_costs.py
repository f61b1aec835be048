"""What a node's incidents cost once the job trains again: one stall charged once, however many
disruptions it held (a crash, then its restart stuck at startup).

    python -m pytest tests/unit/test_disruption_costs.py -q
"""

from __future__ import annotations

from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from torchvitals.supervisor.disruptions import Disruptions
from torchvitals.supervisor.telemetry import SupervisorMetrics


def incident(kind: str, key: str, detected_at: float) -> Incident:
    return Incident(
        kind=kind,
        key=key,
        step=12,
        culprit=Culprit(rank=3, node=1),
        cause="test",
        detected_at=detected_at,
    )


def test_one_disruption_costs_from_the_last_advance_to_the_first_new_heartbeat(tmp_path):
    book = Disruptions(tmp_path, node=0, host="h", metrics=SupervisorMetrics())
    assert book.record(incident("hang", "hang-a0001", 1010.0), last_advance=1000.0)
    book.recovered(at=1030.5)
    found = IncidentLog(tmp_path).get("hang-a0001")
    assert found is not None
    assert (found.recovered_at, found.lost_seconds) == (1030.5, 30.5)


def test_a_crash_then_a_stuck_restart_share_the_stall_once(tmp_path):
    book = Disruptions(tmp_path, node=0, host="h", metrics=SupervisorMetrics())
    assert book.record(incident("crash", "crash-a0001", 1001.0), last_advance=1000.0)
    assert book.record(incident("hang", "hang-a0001-r1", 1061.0), last_advance=1000.0)
    book.recovered(at=1072.0)
    log = IncidentLog(tmp_path)
    crash, hang = log.get("crash-a0001"), log.get("hang-a0001-r1")
    assert crash is not None and hang is not None
    assert crash.lost_seconds == 61.0  # the last advance to the stuck restart's detection
    assert hang.lost_seconds == 11.0  # from its detection to the job training again
    assert crash.recovered_at == hang.recovered_at == 1072.0
    assert crash.lost_seconds + hang.lost_seconds == 1072.0 - 1000.0
