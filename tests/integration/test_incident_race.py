"""Two processes recording the same incidents at once: each key is written once, whole, by
whichever process got there first (the exclusive hard link of ``IncidentLog.record``).

    python -m pytest tests/integration/test_incident_race.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

from torchvitals.records.incidents import IncidentLog

RACER = """
import json, sys, time
from torchvitals.records.incidents import Culprit, Incident, IncidentLog
from pathlib import Path
folder, me = sys.argv[1], int(sys.argv[2])
log = IncidentLog(folder, limit=100_000)
Path(folder, f"ready-{me}").touch()  # both start together: the race is on every key
while not Path(folder, f"ready-{1 - me}").exists():
    time.sleep(0.001)
won = [
    k for k in range(300)
    if log.record(Incident(kind="crash", key=f"crash-a{k:04d}", step=k, culprit=Culprit(node=me),
                           cause=f"seen by node {me}", detected_at=time.time(),
                           writer=f"node {me}"))
]
print(json.dumps(won))
"""


def test_two_processes_racing_on_the_same_keys_write_each_once(tmp_path):
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), str(me)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for me in (0, 1)
    ]
    won = [set(json.loads(p.communicate(timeout=60)[0])) for p in racers]
    assert [p.returncode for p in racers] == [0, 0]
    assert won[0].isdisjoint(won[1]) and won[0] | won[1] == set(range(300))
    found, problems = IncidentLog(tmp_path).read()
    assert problems == [] and len(found) == 300
    for i in found:  # each file is whole, and is its winner's
        assert i.writer == f"node {0 if i.step in won[0] else 1}", i
    assert not [p for p in (tmp_path / "incidents").iterdir() if p.name.startswith(".")]
