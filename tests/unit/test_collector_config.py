"""The collector's configuration: precedence, validation, and a token that never shows.

python -m pytest tests/unit/test_collector_config.py
"""

import pytest

from torchvitals.collector.config import CollectorConfig, env_name


def test_defaults_bind_localhost():
    config = CollectorConfig.from_args([], environ={})
    assert (config.host, config.port, config.max_body_bytes) == ("127.0.0.1", 9500, 1 << 20)


def test_flag_beats_environment_beats_default():
    env = {
        "TORCHVITALS_COLLECTOR_PORT": "9600",
        "TORCHVITALS_COLLECTOR_STATE_DIR": "/env",
        "TORCHVITALS_COLLECTOR_ACCESS_LOG": "false",
        "TORCHVITALS_PORT": "1",
    }
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
    assert (
        CollectorConfig.from_args(["--webhook-token-file", str(path)], environ=env).token()
        == "from-file"
    )
    with pytest.raises(ValueError, match="not both"):
        CollectorConfig.from_env({**env, "TORCHVITALS_WEBHOOK_TOKEN_FILE": str(path)})


@pytest.mark.parametrize(
    "kwargs, words", [({}, "no webhook token"), ({"webhook_token": "  "}, "empty")]
)
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


def test_bounds_are_settings_from_flags_and_the_environment():
    env = {
        "TORCHVITALS_COLLECTOR_MAX_JOBS": "50",
        "TORCHVITALS_COLLECTOR_DIRECTIVE_TTL_SECONDS": "120",
        "TORCHVITALS_COLLECTOR_RETENTION_SECONDS": "600",
    }
    config = CollectorConfig.from_args(
        [
            "--max-label-bytes",
            "256",
            "--directive-ttl-seconds",
            "30",
            "--max-directives-per-job",
            "7",
        ],
        environ=env,
    )
    assert (
        config.max_jobs,
        config.max_label_bytes,
        config.max_directives_per_job,
        config.directive_ttl_seconds,
        config.retention_seconds,
    ) == (50, 256, 7, 30.0, 600.0)
    defaults = CollectorConfig()
    assert (defaults.max_jobs, defaults.max_labels, defaults.directive_ttl_seconds) == (
        1000,
        64,
        3600.0,
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_jobs": 0}, "max_jobs"),
        ({"max_label_bytes": 0}, "max_label_bytes"),
        ({"max_labels": -1}, "max_labels"),
        ({"max_directives_per_job": 0}, "max_directives"),
        ({"directive_ttl_seconds": 0}, "directive_ttl_seconds"),
        ({"retention_seconds": float("inf")}, "retention_seconds"),
        ({"job_tokens": "{}", "job_tokens_file": "/x"}, "not both"),
    ],
)
def test_invalid_bounds_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        CollectorConfig(**kwargs)


def test_job_tokens_come_from_the_environment_or_a_file_never_a_flag(tmp_path):
    config = CollectorConfig.from_env({"TORCHVITALS_COLLECTOR_JOB_TOKENS": '{"a": "tok-a"}'})
    assert config.job_tokens == '{"a": "tok-a"}' and "tok-a" not in repr(config)
    # No flag takes the tokens themselves (argparse reads "--job-tokens" as the file's flag).
    assert CollectorConfig.from_args(["--job-tokens", "x.json"], environ={}).job_tokens is None
    path = tmp_path / "tokens.json"
    config = CollectorConfig.from_args(
        ["--job-tokens-file", str(path)], environ={"TORCHVITALS_COLLECTOR_JOB_TOKENS": "{}"}
    )
    assert (config.job_tokens_file, config.job_tokens) == (str(path), None)
