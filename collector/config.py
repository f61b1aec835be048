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
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..agent.config import ENV_PREFIX, settings

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
            ValueError: no token is configured, or it is empty (the message never holds it).
        """
        if self.webhook_token_file is not None:
            text = Path(self.webhook_token_file).read_text(encoding="utf-8")
        elif self.webhook_token is not None:
            text = self.webhook_token
        else:
            raise ValueError("no webhook token: set --webhook-token-file, "
                             "TORCHVITALS_WEBHOOK_TOKEN_FILE or TORCHVITALS_WEBHOOK_TOKEN")
        token = text.strip()
        if not token:
            raise ValueError("the webhook token is empty")
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
        for f in dataclasses.fields(cls):
            if f.name in _SECRET_FIELDS:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = str(f.type)
            if kind.startswith("bool"):
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=None, help=env_name(f.name))
            else:
                parser.add_argument(flag, dest=f.name, default=None,
                                    type=int if kind.startswith("int") else str,
                                    help=env_name(f.name))
        args = parser.parse_args(argv)
        given = {k: v for k, v in vars(args).items() if v is not None}
        if "webhook_token_file" in given:
            given["webhook_token"] = None   # the flag wins over a token in the environment
        try:
            return cls.from_env(environ, **given)
        except ValueError as exc:
            parser.error(str(exc))


SUPERVISOR_ENV_PREFIX = ENV_PREFIX + "SUPERVISOR_"
"""``TORCHVITALS_SUPERVISOR_<FIELD>``: the variable of each ``SupervisorConfig`` field."""


@dataclass(kw_only=True)
class SupervisorConfig:
    """How ``torchvitals supervise`` keeps a job alive; flag > environment > default."""

    hang_timeout_s: float | None = None
    """Seconds without a heartbeat advance (outside a checkpoint) that make a hang. None learns
    it: ``hang_factor`` x the median interval between advances, at least ``hang_floor_s``."""

    hang_factor: float = 10.0
    """Safety factor on the median observed interval when the hang timeout is learned."""

    hang_floor_s: float = 30.0
    """Least learned hang timeout: the agents write at most once a second, and a learned
    timeout of a few seconds would turn a slow data-loader stall into a restart."""

    checkpoint_timeout_s: float = 600.0
    """Hang timeout while any rank's phase is "checkpoint" (a save or a load can be long)."""

    startup_timeout_s: float = 600.0
    """Seconds an attempt may take to write its first heartbeat (imports, rendezvous, resume)."""

    grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL when the job's process group is stopped."""

    max_restarts: int = 10
    """Restarts allowed in all; when spent the supervisor exits ``budget_exit_code``."""

    no_progress_restarts: int = 3
    """Consecutive restarts that failed without advancing the last healthy step, after which
    the supervisor exits ``no_progress_exit_code`` (restarting would repeat the same failure)."""

    backoff_s: float = 1.0
    """Wait before a restart; doubled for each consecutive restart without progress."""

    backoff_max_s: float = 60.0
    """Cap of the restart back-off."""

    poll_s: float = 0.2
    """How often the heartbeat files and the job's process are checked."""

    checkpoint_dir: str | None = None
    """The job's checkpoint folder; its ``ledger.json`` gives the last healthy step that
    measures progress. None: the highest heartbeat step of an attempt is used instead."""

    heartbeat_root: str | None = None
    """Folder holding one fresh heartbeat folder per attempt (``attempt-0001`` ...); None makes
    a temporary one."""

    metrics_port: int = 0
    """Port of the supervisor's own /metrics on 127.0.0.1; 0 turns it off."""

    abort_exit_code: int = 75
    """Exit status when the job aborted on purpose (a rank's heartbeat says "aborted": the
    agent's loop guard, or the collector's abort order); such a job is never restarted."""

    no_progress_exit_code: int = 76
    """Exit status when ``no_progress_restarts`` restarts in a row made no progress."""

    budget_exit_code: int = 77
    """Exit status when the job failed again after ``max_restarts`` restarts."""

    def __post_init__(self) -> None:
        for name in ("hang_factor", "hang_floor_s", "checkpoint_timeout_s", "startup_timeout_s",
                     "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hang_timeout_s is not None and not self.hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0 or None, got {self.hang_timeout_s}")
        if self.grace_s < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("need grace_s >= 0 and 0 <= backoff_s <= backoff_max_s")
        if self.max_restarts < 0 or self.no_progress_restarts < 1:
            raise ValueError("need max_restarts >= 0 and no_progress_restarts >= 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        codes = {self.abort_exit_code, self.no_progress_exit_code, self.budget_exit_code}
        if len(codes) != 3 or not all(0 < c < 256 for c in codes):
            raise ValueError("the three exit codes must differ and lie in 1..255")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> "SupervisorConfig":
        """Defaults, then ``TORCHVITALS_SUPERVISOR_<FIELD>``, then ``overrides`` (flags).

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: field values from flags or code; they win over the environment.

        Returns:
            The validated config.
        """
        return cls(**settings(cls, environ, overrides,
                              lambda name: SUPERVISOR_ENV_PREFIX + name.upper(), "supervisor"))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--<field>`` flag per field (default None: not given)."""
        for f in dataclasses.fields(cls):
            kind = str(f.type)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                                type=int if kind.startswith("int") else
                                float if kind.startswith("float") else str,
                                help=SUPERVISOR_ENV_PREFIX + f.name.upper())
