"""What every rank agrees on at watch(), and how a refusal reads: which settings shape the step,
where each value came from, and messages that name the odd ranks out at 16,384 ranks as at 2
(built from the gathered entries alone, so every rank raises the very same text)."""

from __future__ import annotations

import pytest

from torchvitals.agent.config import Config
from torchvitals.agent.consensus import (
    AGREED,
    Failure,
    Fence,
    Setting,
    difference_message,
    failure_message,
    ranks_text,
    settings_digest,
    shaping,
)
from torchvitals.errors import ConfigError


def test_ranks_read_as_ranges():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert ranks_text(range(16384)) == "ranks 0-16383"


def test_each_setting_says_where_its_value_came_from():
    config = Config.from_env(
        {"TORCHVITALS_SAMPLE_EVERY": "3", "TORCHVITALS_DETECT": '{"loss_spike_mads": 8}'},
        checkpoint_dir="/ckpt",
        lr_backoff=0.25,
    )
    agreed = shaping(config)
    assert agreed["sample_every"] == Setting("3", "3", "TORCHVITALS_SAMPLE_EVERY='3'")
    assert agreed["lr_backoff"].source == "an argument"
    assert agreed["max_rollbacks"].source == "the default"
    assert agreed["detect.loss_spike_mads"].source.startswith("TORCHVITALS_DETECT=")
    assert agreed["detect.window"].source == "the default"
    # A folder's path may be each node's own; only whether it is set must agree.
    assert agreed["checkpoint_dir"].key == "True" and agreed["checkpoint_dir"].shown == "'/ckpt'"
    assert agreed["log_dir"].key == "True" and agreed["collector_url"].key == "False"
    assert {"torchvitals_version", "torch_version"} <= set(agreed)
    assert set(AGREED) <= set(agreed)
    # A setting given in code wins over the environment, and says so.
    assert shaping(Config.from_env({"TORCHVITALS_SAMPLE_EVERY": "3"}, sample_every=5))[
        "sample_every"
    ] == Setting("5", "5", "an argument")


def test_the_digest_compares_values_not_where_they_came_from():
    a = shaping(Config.from_env({}, sample_every=10))
    b = shaping(Config.from_env({"TORCHVITALS_SAMPLE_EVERY": "10"}))
    c = shaping(Config.from_env({"TORCHVITALS_SAMPLE_EVERY": "3"}))
    assert settings_digest(a) == settings_digest(b)
    assert settings_digest(a) != settings_digest(c)
    d = shaping(Config.from_env({}, checkpoint_dir="/node-local/a"))
    e = shaping(Config.from_env({}, checkpoint_dir="/node-local/b"))
    assert settings_digest(d) == settings_digest(e) != settings_digest(a)


def test_one_odd_rank_in_sixteen_thousand_is_named_with_its_host_and_source():
    world, odd = 16384, 9000
    everyone = []
    for rank in range(world):
        value = ("3", "TORCHVITALS_SAMPLE_EVERY='3'") if rank == odd else ("10", "the default")
        everyone.append(
            (rank, f"node{rank // 8}", {"sample_every": Setting(value[0], value[0], value[1])})
        )
    message, values = difference_message(everyone)
    assert (
        "sample_every: 10 on ranks 0-8999, 9001-16383 (from the default); "
        "3 on rank 9000 on node1125 (from TORCHVITALS_SAMPLE_EVERY='3')" in message
    ), message
    assert values == {"sample_every": {"10": [r for r in range(world) if r != odd], "3": [odd]}}
    assert len(message) < 600, "the message lists no rank one by one"


def test_failed_ranks_are_grouped_by_error_with_their_hosts():
    everyone = [
        Failure(r, f"node{r // 8}", 1000 + r, "building this rank's agent", None) for r in range(64)
    ]
    everyone[9] = everyone[9]._replace(error="MetricsPortError: port 19401 is taken")
    for r in range(16, 32):
        everyone[r] = everyone[r]._replace(error="PermissionError: /hb")
    message = failure_message(everyone)
    assert message.startswith(
        "torchvitals: watch() failed on rank 9 (host node1, pid 1009) while building this "
        "rank's agent: MetricsPortError: port 19401 is taken; on ranks 16-31 (hosts node2, "
        "node3) while building this rank's agent: PermissionError: /hb."
    ), message
    assert "(17 of 64 failed)" in message


def test_a_single_process_raises_its_own_error_as_it_is():
    fence = Fence(0, 1, host="here")
    with pytest.raises(ConfigError, match="sample_every"), fence.section("reading the settings"):
        Config.from_env({}, sample_every=0)
    with fence.section("nothing to agree with") as agreed:
        agreed["sample_every"] = Setting("1", "1", "an argument")  # no peer: nothing compared
