"""The collector's configuration: one keyword-only dataclass, set by flags and the environment.

    torchvitals-collector --state-dir /var/lib/torchvitals --webhook-token-file /run/secrets/token \
        --job-tokens-file /run/secrets/job-tokens.json

Two kinds of token, each with one power (``auth.py``): the webhook token is Alertmanager's and
may post alerts only; each job's token may poll and acknowledge that job's directives only.

Precedence: a command-line flag > an environment variable > the default. The variable of a
field is ``TORCHVITALS_COLLECTOR_<FIELD>`` (e.g. ``TORCHVITALS_COLLECTOR_PORT=9500``), so it
cannot be mistaken for an agent setting in a shared environment; the token's are
``TORCHVITALS_WEBHOOK_TOKEN_FILE`` and ``TORCHVITALS_WEBHOOK_TOKEN``, which a job's agent can
share. A token itself is never a flag (a flag shows in ``ps``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..protocol import ENV_PREFIX, TOKEN_ENV, TOKEN_FILE_ENV, TokenError, read_token
from ..settings import add_flags, settings

_SECRET_FIELDS = ("webhook_token", "job_tokens")
"""Fields read from the environment only, never from a flag."""


def env_name(field_name: str) -> str:
    """The environment variable of a config field.

    Args:
        field_name: a ``CollectorConfig`` field.

    Returns:
        ``TORCHVITALS_WEBHOOK_*`` for the token's fields, else ``TORCHVITALS_COLLECTOR_<FIELD>``.
    """
    scoped = field_name if field_name.startswith("webhook_") else "collector_" + field_name
    return ENV_PREFIX + scoped.upper()


@dataclass(kw_only=True)
class CollectorConfig:
    host: str = "127.0.0.1"
    """Address the HTTP service binds to. Use 0.0.0.0 to let Alertmanager on another host in."""

    port: int = 9500
    """TCP port of the HTTP service (the agents' /metrics use 19400 + the local rank); 0 picks a
    free one."""

    state_dir: str = "torchvitals_collector"
    """Folder of the directive store (``directives.sqlite3``); a collector restarted on the same
    folder still knows every directive it issued or saw acknowledged (until pruned)."""

    webhook_token_file: str | None = None
    """File holding the Bearer token Alertmanager sends (``http_config.authorization``);
    surrounding whitespace is ignored. It may post alerts only: it cannot read or acknowledge
    any job's directives."""

    webhook_token: str | None = field(default=None, repr=False)
    """The Bearer token itself, from ``TORCHVITALS_WEBHOOK_TOKEN`` only. Set this or
    ``webhook_token_file``, not both: the collector refuses to start without a token."""

    job_tokens_file: str | None = None
    """JSON file mapping each job name to its token, or to ``sha256:<hex digest of the
    token>`` so the file holds nothing a job could use; re-read when it changes. A job's token
    polls and acknowledges that job's directives only. Without any job token no job can poll."""

    job_tokens: str | None = field(default=None, repr=False)
    """The same JSON object, from ``TORCHVITALS_COLLECTOR_JOB_TOKENS`` only. Set this or
    ``job_tokens_file``, not both."""

    max_body_bytes: int = 1 << 20
    """Largest webhook body accepted; a larger Content-Length is answered 413 before the body is
    read. 1 MiB holds hundreds of alerts (Alertmanager's ``max_alerts`` bounds a notification)."""

    max_label_bytes: int = 1024
    """Largest alert label name or value accepted, in UTF-8 bytes; a notification with a larger
    one is answered 400 ``label_too_large`` naming the alert and the label."""

    max_labels: int = 64
    """Most labels one alert may carry (400 ``label_too_large`` beyond)."""

    max_jobs: int = 1000
    """Most jobs the store keeps directives or a run for; a notification ordering a further
    job is answered 507 ``too_many_jobs`` and nothing stored is lost (old jobs leave as their
    directives are pruned)."""

    max_directives_per_job: int = 100
    """Most directives kept per job; the oldest acknowledged or expired ones make room first,
    and with that many still pending a new one is answered 507 ``too_many_directives``."""

    directive_ttl_seconds: float = 3600.0
    """A pending directive not delivered within this time expires: never delivered, kept as
    a record only (so a repeat of its alert orders nothing)."""

    retention_seconds: float = 86400.0
    """How long an acknowledged or expired directive is remembered (so Alertmanager's repeats
    of a still-firing alert order nothing twice); pruned after it, or as soon as its alert is
    reported resolved."""

    access_log: bool = True
    """Log one line per request (method, path, status; never headers, so never the token)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("max_label_bytes", "max_labels", "max_jobs", "max_directives_per_job"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("directive_ttl_seconds", "retention_seconds"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(
                    f"{name} must be a positive number of seconds, got {getattr(self, name)!r}"
                )
        if not self.state_dir:
            raise ValueError("state_dir must not be empty")
        if self.webhook_token is not None and self.webhook_token_file is not None:
            raise ValueError("set either webhook_token_file or TORCHVITALS_WEBHOOK_TOKEN, not both")
        if self.job_tokens is not None and self.job_tokens_file is not None:
            raise ValueError(
                "set either job_tokens_file or TORCHVITALS_COLLECTOR_JOB_TOKENS, not both"
            )

    def token(self) -> str:
        """Read the webhook token.

        Returns:
            The token, stripped of surrounding whitespace.

        Raises:
            TokenError: no token is configured, it is set twice, its file cannot be read, or it
                is empty (a ValueError; the message never holds the token).
        """
        token = read_token(self.webhook_token, self.webhook_token_file)
        if token is None:
            raise TokenError(
                f"no webhook token: set --webhook-token-file, {TOKEN_FILE_ENV} or {TOKEN_ENV}"
            )
        if not token:
            raise TokenError("the webhook token is empty")
        return token

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> CollectorConfig:
        """Build a config from defaults, then the variables of ``env_name``, then ``overrides``.

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: field values given by flags or code; they win over the environment.

        Returns:
            The validated config.
        """
        return cls(**settings(cls, environ, overrides, env_name, "collector"))

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> CollectorConfig:
        """Parse command-line flags over the environment.

        Args:
            argv: the arguments (default ``sys.argv[1:]``).
            environ: the environment to read (default ``os.environ``).

        Returns:
            The validated config; argparse exits with status 2 on a malformed flag.
        """
        parser = argparse.ArgumentParser(
            prog="torchvitals-collector",
            description="Alertmanager webhook -> directives for torchvitals jobs. Every flag "
            "is also read from the variable shown; a flag wins over the variable. "
            "Alertmanager's token: TORCHVITALS_WEBHOOK_TOKEN or "
            "--webhook-token-file; the jobs' tokens: "
            "TORCHVITALS_COLLECTOR_JOB_TOKENS or --job-tokens-file.",
        )
        add_flags(parser, cls, env_name, skip=_SECRET_FIELDS)
        args = parser.parse_args(argv)
        given = {k: v for k, v in vars(args).items() if v is not None}
        if "webhook_token_file" in given:
            given["webhook_token"] = None  # the flag wins over a token in the environment
        if "job_tokens_file" in given:
            given["job_tokens"] = None
        try:
            return cls.from_env(environ, **given)
        except ValueError as exc:
            parser.error(str(exc))
