import dataclasses
import inspect

import pytest

from torchvitals.agent.config import Config


def test_argument_beats_environment_beats_default():
    env = {"TORCHVITALS_SAMPLE_EVERY": "25", "TORCHVITALS_METRICS_PORT": "0",
           "TORCHVITALS_SPLIT_DDP_WORK": "false", "TORCHVITALS_CLIP_GRAD_NORM": "1.5",
           "TORCHVITALS_BLOCKS": '["encoder", "decoder"]'}
    cfg = Config.from_env(env, sample_every=5)
    assert cfg.sample_every == 5
    assert cfg.metrics_port == 0 and cfg.split_ddp_work is False and cfg.clip_grad_norm == 1.5
    assert cfg.blocks == ["encoder", "decoder"]
    assert Config.from_env({}).sample_every == Config().sample_every == 10


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="TORCHVITALS_SAMPLE_EVERY='often'"):
        Config.from_env({"TORCHVITALS_SAMPLE_EVERY": "often"})
    with pytest.raises(ValueError, match="TORCHVITALS_ACTIVATIONS"):
        Config.from_env({"TORCHVITALS_ACTIVATIONS": "maybe"})


def test_unknown_setting_lists_the_known_ones():
    with pytest.raises(TypeError, match="sample_evry.*known: .*sample_every"):
        Config.from_env({}, sample_evry=3)


@pytest.mark.parametrize("field,value", [("sample_every", 0), ("metrics_port", 70000),
                                         ("log_every", 0), ("clip_grad_norm", -1.0)])
def test_invalid_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_every_field_is_documented():
    source = inspect.getsource(Config)
    for f in dataclasses.fields(Config):
        after = source.split(f"    {f.name}:", 1)[1].split("\n", 2)
        assert after[1].strip().startswith('"""'), f"{f.name} has no docstring"
