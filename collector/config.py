"""The collector's configuration: one keyword-only dataclass, set by flags and the environment.

    torchvitals-collector --state-dir /var/lib/torchvitals --webhook-token-file /run/secrets/token

Precedence: a command-line flag > an environment variable > the default. The variable of a
field is ``TORCHVITALS_COLLECTOR_<FIELD>`` (e.g. ``TORCHVITALS_COLLECTOR_PORT=9500``), so it
cannot be mistaken for an agent setting in a shared environment; the token's are
``TORCHVITALS_WEBHOOK_TOKEN_FILE`` and ``TORCHVITALS_WEBHOOK_TOKEN``, which a job's agent can
share. The token itself is never a flag (a flag shows in ``ps``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..protocol import ENV_PREFIX, TOKEN_ENV, TOKEN_FILE_ENV, TokenError, read_token
from ..settings import add_flags, settings

_SECRET_FIELDS = ("webhook_token",)
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
    """TCP port of the HTTP service (the agents' /metrics use 9400 + LOCAL_RANK); 0 picks a
    free one."""

    state_dir: str = "torchvitals_collector"
    """Folder of the directive store (``directives.json``); a collector restarted on the same
    folder still knows every directive it issued or saw acknowledged."""

    webhook_token_file: str | None = None
    """File holding the Bearer token Alertmanager sends (``http_config.authorization``);
    surrounding whitespace is ignored."""

    webhook_token: str | None = field(default=None, repr=False)
    """The Bearer token itself, from ``TORCHVITALS_WEBHOOK_TOKEN`` only. Set this or
    ``webhook_token_file``, not both: the collector refuses to start without a token."""

    max_body_bytes: int = 1 << 20
    """Largest webhook body accepted; a larger Content-Length is answered 413 before the body is
    read. 1 MiB holds hundreds of alerts (Alertmanager's ``max_alerts`` bounds a notification)."""

    access_log: bool = True
    """Log one line per request (method, path, status; never headers, so never the token)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not self.state_dir:
            raise ValueError("state_dir must not be empty")
        if self.webhook_token is not None and self.webhook_token_file is not None:
            raise ValueError("set either webhook_token_file or TORCHVITALS_WEBHOOK_TOKEN, not both")

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
            raise TokenError(f"no webhook token: set --webhook-token-file, {TOKEN_FILE_ENV} "
                             f"or {TOKEN_ENV}")
        if not token:
            raise TokenError("the webhook token is empty")
        return token

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> "CollectorConfig":
        """Build a config from defaults, then the variables of ``env_name``, then ``overrides``.

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: field values given by flags or code; they win over the environment.

        Returns:
            The validated config.
        """
        return cls(**settings(cls, environ, overrides, env_name, "collector"))

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> "CollectorConfig":
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
                        "The token: TORCHVITALS_WEBHOOK_TOKEN or --webhook-token-file.")
        add_flags(parser, cls, env_name, skip=_SECRET_FIELDS)
        args = parser.parse_args(argv)
        given = {k: v for k, v in vars(args).items() if v is not None}
        if "webhook_token_file" in given:
            given["webhook_token"] = None   # the flag wins over a token in the environment
        try:
            return cls.from_env(environ, **given)
        except ValueError as exc:
            parser.error(str(exc))
