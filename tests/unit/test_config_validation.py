"""Every setting is checked at watch(), before it acts: a wrong type or an out-of-range value,
given as an argument or read from a TORCHVITALS_* variable, is an error naming the setting, the
value, what is allowed and where it came from."""

import typing

import pytest
import torch

import torchvitals
from torchvitals.agent.config import Config, flat_fields
from torchvitals.errors import ConfigError, ConfigTypeError

BAD_TYPE = {int: "10", float: "fast", bool: "yes", str: 5}
"""A value of the wrong type per annotation (as code would pass it, not as a variable)."""

OUT_OF_RANGE = {
    "blocks": None,
    "sample_every": 0,
    "update_ratio_max_bytes": -1,
    "saturation_level": -0.5,
    "clip_grad_norm": 0.0,
    "detect": {"loss_spike_mads": -3},
    "checkpoint_dir": " ",
    "checkpoint_every": 0,
    "resume": "sometimes",
    "checkpoint_keep": 0,
    "snapshot_max_bytes": -1,
    "checkpoint_close_timeout_s": -1.0,
    "healthy_window": -1,
    "trust_steps": 0,
    "verify_steps": 0,
    "lr_ramp_steps": -1,
    "lr_backoff": 1.5,
    "skip_margin": -1,
    "max_rollbacks": -1,
    "rollback_window": 0,
    "abort_exit_code": 0,
    "metrics_port": 70000,
    "metrics_host": "",
    "metrics_keyfile": "key.pem",
    "metrics_client_cafile": "ca.pem",
    "metrics_client_auth_required": True,
    "metrics_max_connections": 0,
    "metrics_idle_timeout_s": 0.0,
    "metrics_scrapes_per_s": -1.0,
    "metrics_scrape_burst": 0,
    "log_every": 0,
    "collector_url": "collector:8080",
    "collector_poll_seconds": -1.0,
    "metrics_file_sd_dir": " ",
}
"""A value of the right type that the setting cannot take (None: no such value exists)."""

NO_RANGE = {
    "activations",
    "update_ratio",
    "split_ddp_work",
    "skip_nonfinite",
    "skip_outliers",
    "rerun_outliers",
    "checkpoint_key_file",
    "trust_unsigned_checkpoints",
    "heartbeat_dir",
    "metrics_certfile",
    "log_dir",
    "run_name",
    "live",
    "collector_job",
    "blocks",
    "metrics_port_strict",
}
"""Settings every value of whose type is meaningful (a name, a folder, a switch)."""

FIELDS = flat_fields()


def base_type(name: str) -> type:
    hint = typing.get_type_hints(type(getattr(Config(), _section(name))))[_field(name)]
    options = [o for o in typing.get_args(hint) or (hint,) if o is not type(None)]
    return typing.get_origin(options[0]) or options[0]


def _section(name: str) -> str:
    from torchvitals.agent.config import FLAT

    return FLAT[name][0]


def _field(name: str) -> str:
    from torchvitals.agent.config import FLAT

    return FLAT[name][1]


def test_the_tables_cover_every_setting():
    assert set(OUT_OF_RANGE) | NO_RANGE == set(FIELDS), set(FIELDS) ^ (set(OUT_OF_RANGE) | NO_RANGE)


@pytest.mark.parametrize("name", sorted(n for n in FIELDS if base_type(n) in BAD_TYPE))
def test_a_wrong_type_from_an_argument_names_the_setting(name):
    value = BAD_TYPE[base_type(name)]
    with pytest.raises(ConfigTypeError) as e:
        Config.from_env({}, **{name: value})
    assert e.value.field == name and "from an argument" in str(e.value), str(e.value)
    assert repr(value) in str(e.value) and "must be" in str(e.value)


@pytest.mark.parametrize("name", sorted(n for n in OUT_OF_RANGE if OUT_OF_RANGE[n] is not None))
def test_an_out_of_range_argument_names_the_setting_and_what_is_allowed(name):
    value = OUT_OF_RANGE[name]
    with pytest.raises(ConfigError) as e:
        Config.from_env({}, **{name: value})
    assert e.value.field.split(".")[0] == name, str(e.value)
    assert "from an argument" in str(e.value) and e.value.allowed, str(e.value)


def _as_variable(value):
    import json

    if isinstance(value, bool):
        return "1" if value else "0"
    return json.dumps(value) if isinstance(value, dict) else str(value)


# A blank TORCHVITALS_CHECKPOINT_DIR (or _METRICS_FILE_SD_DIR) reads as unset (None), as every
# blank optional variable.
@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in OUT_OF_RANGE
        if OUT_OF_RANGE[n] is not None and n not in ("checkpoint_dir", "metrics_file_sd_dir")
    ),
)
def test_an_out_of_range_variable_names_the_variable(name):
    env = {"TORCHVITALS_" + name.upper(): _as_variable(OUT_OF_RANGE[name])}
    with pytest.raises(ConfigError) as e:
        Config.from_env(env)
    assert e.value.field.split(".")[0] == name
    assert f"from the environment variable TORCHVITALS_{name.upper()}" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", sorted(n for n in FIELDS if base_type(n) in (int, float, bool)))
def test_an_unreadable_variable_names_the_variable(name):
    key = "TORCHVITALS_" + name.upper()
    with pytest.raises(ValueError, match=f"{key}='not-a-value'"):
        Config.from_env({key: "not-a-value"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused(value):
    for name in ("saturation_level", "lr_backoff", "collector_poll_seconds"):
        with pytest.raises(ConfigError, match=name):
            Config.from_env({}, **{name: value})
    with pytest.raises(ConfigError, match=r"detect.loss_spike_mads"):
        Config.from_env({}, detect={"loss_spike_mads": value})


def test_thresholds_are_checked_by_name_type_and_range():
    with pytest.raises(ConfigTypeError, match=r"unknown detection threshold.*'loss_spike_madz'"):
        Config.from_env({}, detect={"loss_spike_madz": 8})
    with pytest.raises(ConfigTypeError, match=r"detect.loss_spike_mads='x'.*must be float"):
        Config.from_env({}, detect={"loss_spike_mads": "x"})
    with pytest.raises(ConfigTypeError, match=r"TORCHVITALS_DETECT.*must be Mapping"):
        Config.from_env({"TORCHVITALS_DETECT": "[1, 2]"})
    assert Config.from_env({"TORCHVITALS_DETECT": '{"loss_spike_mads": 8}'}).detect == {
        "loss_spike_mads": 8
    }


def test_unusable_folders_and_hosts_fail_at_watch(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(
        torchvitals.TorchvitalsError, match=f"checkpoint_dir {a_file} is not a folder"
    ):
        torchvitals.watch(model, opt, checkpoint_dir=str(a_file), log_dir="")
    with pytest.raises(ConfigError, match=r"metrics_host='no.such.host.invalid'.*resolves"):
        torchvitals.watch(
            model, opt, metrics_host="no.such.host.invalid", metrics_port=19999, log_dir=""
        )
    assert "step" not in vars(opt)
