"""The supervisor's pure parts: config precedence, heartbeat reading, the hang clock, names.

python -m pytest tests/unit/test_supervisor_unit.py
"""

from __future__ import annotations

import re
from collections import deque

import pytest

from torchvitals.__main__ import parse_args
from torchvitals.agent.recover.heartbeat import Heartbeat
from torchvitals.protocol import CHECKPOINT, TRAIN, Beat, RankBeat, combine_beats, read_heartbeats
from torchvitals.supervisor.hang_clock import HangClock
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.telemetry import SupervisorMetrics


def test_flag_wins_over_environment_wins_over_default(monkeypatch):
    monkeypatch.setenv("TORCHVITALS_SUPERVISOR_MAX_RESTARTS", "4")
    monkeypatch.setenv("TORCHVITALS_SUPERVISOR_HANG_TIMEOUT_S", "7.5")
    args = parse_args(
        ["supervise", "--max-restarts", "2", "--", "torchrun", "--nproc-per-node", "2", "train.py"]
    )
    assert args.job_command == ["torchrun", "--nproc-per-node", "2", "train.py"]
    config = SupervisorConfig.from_env(max_restarts=args.max_restarts)
    assert (config.max_restarts, config.hang_timeout_s, config.grace_s) == (2, 7.5, 10.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"hang_timeout_s": 0},
        {"no_progress_restarts": 0},
        {"backoff_s": 5, "backoff_max_s": 1},
        {"no_progress_exit_code": 77},
    ],
)
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SupervisorConfig(**bad)


def test_heartbeats_combine_the_ranks(tmp_path):
    assert read_heartbeats(tmp_path) is None
    Heartbeat(tmp_path, 0).beat(7)
    Heartbeat(tmp_path, 1).beat(5, "checkpoint")
    beat = read_heartbeats(tmp_path)
    assert (beat.step, beat.checkpointing) == (7, True)


def test_the_ranks_beats_combine_in_one_place():
    assert combine_beats({}) is None
    found = {
        0: RankBeat(rank=0, step=7, time=3.0, phase=TRAIN, pid=11),
        1: RankBeat(rank=1, step=6, time=4.0, phase=CHECKPOINT, pid=12),
    }
    beat = combine_beats(found)
    assert beat is not None
    assert (beat.step, beat.time, beat.checkpointing, beat.pids) == (7, 4.0, True, (11, 12))


def test_hang_clock_startup_checkpoint_and_learned_timeouts():
    config = SupervisorConfig(
        startup_timeout_s=50, checkpoint_timeout_s=90, hang_floor_s=4, hang_factor=10
    )
    clock = HangClock(config, deque(), now=0.0)
    assert clock.timeout() == 50 and not clock.hung(49) and clock.hung(51)
    for t in range(1, 6):  # a step advance every 0.5 s
        clock.observe(Beat(step=t, time=100.0 + t, checkpointing=False), now=t * 0.5)
    assert clock.timeout() == 5.0  # 10 x median 0.5 s, above the floor
    assert not clock.hung(2.5 + 4.9) and clock.hung(2.5 + 5.1)
    clock.observe(Beat(step=5, time=200.0, checkpointing=True), now=3.0)
    assert clock.timeout() == 90 and not clock.hung(80)
    fixed = HangClock(SupervisorConfig(hang_timeout_s=3), deque(), now=0.0)
    fixed.observe(Beat(step=1, time=1.0, checkpointing=False), now=1.0)
    assert fixed.timeout() == 3 and fixed.hung(4.1)


def test_metric_names_follow_the_conventions():
    names = {m.name for m in SupervisorMetrics().registry.collect()}
    assert names == {
        "torchvitals_supervisor_restarts",
        "torchvitals_supervisor_attempt",
        "torchvitals_supervisor_heartbeat_age_seconds",
        # which nodes of a multi-node job are present, and the wait for them
        "torchvitals_supervisor_node_present",
        "torchvitals_supervisor_nodes_present",
        "torchvitals_supervisor_nodes_expected",
        "torchvitals_supervisor_waiting_for_peers",
        # the incidents this node wrote, by kind and culprit
        "torchvitals_supervisor_incidents",
    }
    assert all(re.fullmatch(r"torchvitals_[a-z_]+", n) for n in names)


def test_the_store_password_is_never_a_flag_and_comes_from_a_file_or_the_environment(
    tmp_path, capsys
):
    with pytest.raises(SystemExit):
        parse_args(["supervise", "--store-password", "hunter2", "--", "torchrun", "t.py"])
    error = capsys.readouterr().err
    assert "never put a password on the command line" in error and "hunter2" not in error
    args = parse_args(
        [
            "supervise",
            "--store-user",
            "tv",
            "--store-password-file",
            str(tmp_path / "pw"),
            "--",
            "torchrun",
            "t.py",
        ]
    )
    (tmp_path / "pw").write_text("s3cret\n")
    config = SupervisorConfig.from_env(
        {},
        store_url="https://etcd:2379",
        store_user=args.store_user,
        store_password_file=args.store_password_file,
    )
    assert config.password() == "s3cret"
    config = SupervisorConfig.from_env(
        {
            "TORCHVITALS_SUPERVISOR_STORE_PASSWORD": "s3cret",
            "TORCHVITALS_SUPERVISOR_STORE_USER": "tv",
            "TORCHVITALS_SUPERVISOR_STORE_URL": "http://etcd:2379",
        }
    )
    assert config.password() == "s3cret" and "s3cret" not in repr(config)
    missing = SupervisorConfig(
        store_url="http://etcd:2379", store_user="tv", store_password_file=str(tmp_path / "absent")
    )
    with pytest.raises(ValueError, match=r"store_password_file .*absent"):
        missing.password()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"store_user": "tv"}, "store_user and its password go together"),
        ({"store_password": "x"}, "without store_user"),
        ({"store_user": "tv", "store_password": "x", "store_password_file": "f"}, "not both"),
        ({"store_cafile": "ca.crt"}, "store_cafile need an https:// store_url"),
        ({"store_url": "https://e:2379", "store_certfile": "c.crt"}, "go together"),
        ({"store_url": "etcd:2379"}, "must start with http:// or https://"),
        ({"metrics_certfile": "c.crt"}, "metrics_certfile and metrics_keyfile"),
        ({"metrics_client_cafile": "ca.crt"}, "needs metrics_certfile"),
        ({"job_ttl_s": 0}, "job_ttl_s must be > 0"),
    ],
)
def test_store_and_metrics_settings_that_cannot_work_are_refused(fields, message):
    fields.setdefault("store_url", "http://etcd:2379")
    with pytest.raises(ValueError, match=message):
        SupervisorConfig(**fields)


def test_metrics_bind_loopback_unless_told_otherwise():
    assert SupervisorConfig().metrics_host == "127.0.0.1"
    assert (
        SupervisorConfig.from_env({"TORCHVITALS_SUPERVISOR_METRICS_HOST": "10.0.0.7"}).metrics_host
        == "10.0.0.7"
    )
