"""The collector's configuration: precedence, validation, and a token that never shows.

    python -m pytest tests/unit/test_collector_config.py
"""

import pytest

from torchvitals.collector.config import CollectorConfig, env_name


def test_defaults_bind_localhost():
    config = CollectorConfig.from_args([], environ={})
    assert (config.host, config.port, config.max_body_bytes) == ("127.0.0.1", 9500, 1 << 20)


def test_flag_beats_environment_beats_default():
    env = {"TORCHVITALS_COLLECTOR_PORT": "9600", "TORCHVITALS_COLLECTOR_STATE_DIR": "/env",
           "TORCHVITALS_COLLECTOR_ACCESS_LOG": "false", "TORCHVITALS_PORT": "1"}
    config = CollectorConfig.from_args(["--port", "9700"], environ=env)
    assert (config.port, config.state_dir, config.access_log) == (9700, "/env", False)
    assert env_name("port") == "TORCHVITALS_COLLECTOR_PORT"
    assert env_name("webhook_token") == "TORCHVITALS_WEBHOOK_TOKEN"


def test_token_from_environment_or_file_never_in_repr(tmp_path):
    config = CollectorConfig.from_env({"TORCHVITALS_WEBHOOK_TOKEN": " abc \n"})
    assert config.token() == "abc" and "abc" not in repr(config)
    path = tmp_path / "token"
    path.write_text("from-file\n")
    env = {"TORCHVITALS_WEBHOOK_TOKEN": "abc"}
    assert CollectorConfig.from_args(["--webhook-token-file", str(path)],
                                     environ=env).token() == "from-file"
    with pytest.raises(ValueError, match="not both"):
        CollectorConfig.from_env({**env, "TORCHVITALS_WEBHOOK_TOKEN_FILE": str(path)})


@pytest.mark.parametrize("kwargs, words", [({}, "no webhook token"),
                                           ({"webhook_token": "  "}, "empty")])
def test_missing_token_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        CollectorConfig(**kwargs).token()


@pytest.mark.parametrize("kwargs", [{"port": 70000}, {"max_body_bytes": 0}, {"state_dir": ""}])
def test_invalid_values_are_refused(kwargs):
    with pytest.raises(ValueError):
        CollectorConfig(**kwargs)


def test_malformed_flag_exits_2():
    with pytest.raises(SystemExit) as exc:
        CollectorConfig.from_args(["--port", "70000"], environ={})
    assert exc.value.code == 2
