import ast
import dataclasses
import inspect
import textwrap

import pytest

from torchvitals.agent.config import Config


def test_argument_beats_environment_beats_default():
    env = {
        "TORCHVITALS_SAMPLE_EVERY": "25",
        "TORCHVITALS_METRICS_PORT": "0",
        "TORCHVITALS_SPLIT_DDP_WORK": "false",
        "TORCHVITALS_CLIP_GRAD_NORM": "1.5",
        "TORCHVITALS_BLOCKS": '["encoder", "decoder"]',
    }
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
    with pytest.raises(TypeError, match=r"sample_evry.*known: .*sample_every"):
        Config.from_env({}, sample_evry=3)


@pytest.mark.parametrize(
    "field,value",
    [("sample_every", 0), ("metrics_port", 70000), ("log_every", 0), ("clip_grad_norm", -1.0)],
)
def test_invalid_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


def test_every_field_is_documented():
    source = inspect.getsource(Config)
    for f in dataclasses.fields(Config):
        after = source.split(f"    {f.name}:", 1)[1].split("\n", 2)
        assert after[1].strip().startswith('"""'), f"{f.name} has no docstring"


def test_sections_and_flat_names_are_the_same_settings():
    from torchvitals.agent.config import (
        FLAT,
        CollectorLink,
        DetectConfig,
        MeasureConfig,
        OutputsConfig,
        RecoverConfig,
    )

    cfg = Config(
        measure=MeasureConfig(sample_every=20),
        recover=RecoverConfig(checkpoint_dir="c"),
        collector_url="http://127.0.0.1:9",
        log_every=3,
    )
    assert cfg.sample_every == cfg.measure.sample_every == 20
    assert cfg.checkpoint_dir == cfg.recover.checkpoint_dir == "c"
    assert cfg.collector_url == cfg.collector.url == "http://127.0.0.1:9"
    assert cfg.log_every == cfg.outputs.log_every == 3
    assert (
        Config(sample_every=20, checkpoint_dir="c", collector_url="http://127.0.0.1:9", log_every=3)
        == cfg
    )
    # A flat keyword given with its section wins; every flat name reads and writes its field.
    assert Config(measure=MeasureConfig(sample_every=20), sample_every=5).sample_every == 5
    for flat, (section, name) in FLAT.items():
        if flat != "detect":
            assert getattr(cfg, flat) == getattr(getattr(cfg, section), name), flat
    cfg.sample_every = 7
    assert cfg.measure.sample_every == 7
    assert isinstance(cfg.outputs, OutputsConfig) and isinstance(cfg.collector, CollectorLink)
    assert isinstance(cfg.detect, DetectConfig)
    with pytest.raises(TypeError, match="measure must be a MeasureConfig"):
        Config(measure=RecoverConfig())
    with pytest.raises(TypeError, match="sample_evry"):
        Config(sample_evry=3)


def test_detect_keeps_meaning_the_threshold_overrides():
    from torchvitals.agent.config import DetectConfig
    from torchvitals.agent.detect.thresholds import Thresholds

    cfg = Config(detect={"loss_spike_mads": 8})
    assert cfg.detect == {"loss_spike_mads": 8} and dict(cfg.detect) == {"loss_spike_mads": 8}
    assert (
        cfg.detect["loss_spike_mads"] == 8
        and Thresholds.from_overrides(cfg.detect).loss_spike_mads == 8
    )
    assert Config(detect=DetectConfig(thresholds={"loss_spike_mads": 8})) == cfg
    assert not Config().detect and dict(Config(detect=None).detect) == {}
    env = Config.from_env({"TORCHVITALS_DETECT": '{"loss_spike_mads": 9}'})
    assert env.detect == {"loss_spike_mads": 9}
    with pytest.raises(TypeError, match="unknown detection threshold"):
        Config(detect={"loss_spike_madz": 8})


def test_a_section_given_whole_beats_the_environment_for_its_fields():
    from torchvitals.agent.config import MeasureConfig

    env = {
        "TORCHVITALS_SAMPLE_EVERY": "25",
        "TORCHVITALS_ACTIVATIONS": "false",
        "TORCHVITALS_LOG_EVERY": "4",
        "TORCHVITALS_COLLECTOR_POLL_SECONDS": "0.5",
    }
    cfg = Config.from_env(env, measure=MeasureConfig(sample_every=7))
    assert cfg.sample_every == 7 and cfg.activations is True  # the section's, not env's
    assert cfg.log_every == 4 and cfg.collector.poll_seconds == 0.5  # other sections: env
    assert Config.from_env(env, measure=MeasureConfig(), sample_every=3).sample_every == 3


@pytest.mark.parametrize(
    "section, field, value",
    [
        ("MeasureConfig", "saturation_level", 0.0),
        ("RecoverConfig", "lr_backoff", 0.0),
        ("RecoverConfig", "resume", "sometimes"),
        ("OutputsConfig", "metrics_port", -1),
        ("CollectorLink", "poll_seconds", 0.0),
    ],
)
def test_each_section_validates_its_own_fields(section, field, value):
    import torchvitals.agent.config as config

    with pytest.raises(ValueError, match=field):
        getattr(config, section)(**{field: value})


def test_every_section_field_is_documented():
    from torchvitals.agent.config import SECTIONS
    from torchvitals.settings import field_docs

    for cls in SECTIONS.values():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_the_flat_names_are_declared_with_their_fields_types():
    # Config's flat attributes are properties made at import, so the class declares them for
    # the type checker under TYPE_CHECKING; the declarations must name exactly the flat fields,
    # each with its section field's type, or `config.sample_every` is typed wrong or not at all.
    from torchvitals.agent.config import FLAT, SECTIONS

    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    (block,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    declared = {
        ast.unparse(node.target): ast.unparse(node.annotation)
        for node in block.body
        if isinstance(node, ast.AnnAssign)
    }
    assert len(declared) == len(block.body), "only annotations belong in the block"
    fields = {
        section: {f.name: f for f in dataclasses.fields(cls)} for section, cls in SECTIONS.items()
    }
    expected = {
        flat: ast.unparse(ast.parse(str(fields[section][name].type), mode="eval").body)
        for flat, (section, name) in FLAT.items()
        if flat not in SECTIONS  # ``detect`` is the section itself
    }
    assert declared == expected
    assert all(isinstance(getattr(Config, flat), property) for flat in expected)
