"""How ``torchvitals supervise`` keeps a job alive: one keyword-only dataclass.

    torchvitals supervise --hang-timeout-s 120 --checkpoint-dir ckpt -- torchrun ... train.py

Precedence: a flag > ``TORCHVITALS_SUPERVISOR_<FIELD>`` > the default; ``--help`` lists each
field's meaning, default and variable.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol import (
    ABORT_EXIT_CODE,
    BUDGET_EXIT_CODE,
    ENV_PREFIX,
    NO_PROGRESS_EXIT_CODE,
    NODE_LOST_EXIT_CODE,
    REFUSED_EXIT_CODE,
)
from ..settings import add_flags, settings

SUPERVISOR_ENV_PREFIX = ENV_PREFIX + "SUPERVISOR_"
"""``TORCHVITALS_SUPERVISOR_<FIELD>``: the variable of each ``SupervisorConfig`` field."""

SECRET_FIELDS = ("store_password",)
"""Fields read from the environment only, never from a flag (a command line is world-readable
in ``/proc``)."""

NODE_RANK_ENVS = ("SLURM_NODEID", "PET_NODE_RANK")
"""Where a scheduler says which node this is: Slurm, Kubeflow's training operator."""


def node_rank(config: SupervisorConfig, environ: Mapping[str, str]) -> int:
    """This node's rank: the config's, else the scheduler's (``NODE_RANK_ENVS``), else 0.

    Raises:
        ValueError: the scheduler's is not a rank of ``config.nnodes`` nodes.
    """
    if config.node_rank is not None:
        return config.node_rank
    for name in NODE_RANK_ENVS:
        value = environ.get(name, "").strip()
        if value:
            rank = int(value) if value.isdigit() else -1
            if not 0 <= rank < config.nnodes:
                raise ValueError(f"{name}={value!r} is not a node rank of nnodes={config.nnodes}")
            return rank
    return 0


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

    restart_floor_s: float = 60.0
    """Least time a re-start may take to write its first heartbeat (torchrun restarting its
    workers, or a new attempt of the job) before it is a hang: the bound is this or
    ``restart_factor`` x the job's first start, whichever is larger. The first start itself has
    ``startup_timeout_s``."""

    restart_factor: float = 3.0
    """A re-start taking longer than this many times the job's first start (attempt start to
    first heartbeat) is stuck (at least ``restart_floor_s``)."""

    probe_wait_s: float = 2.0
    """Seconds the supervisor waits for a hung rank's stack after sending its stack signal,
    and for the launcher's report of a dead worker, before deciding without."""

    findings_wait_s: float = 5.0
    """Seconds a node that saw a hang or a crash waits for every other node's findings (through
    the store) before naming the culprit from what it has."""

    job_dir: str | None = None
    """The job's folder, where incidents (``incidents/``) and the supervisor's goodput timeline
    (``goodput/``) are written. None: ``checkpoint_dir``, else the heartbeat root."""

    tee_stderr: bool = True
    """Pass the launcher's stderr through the supervisor, byte for byte, to read torchrun's
    reports of failed workers (their exit status) from it. False: the launcher writes to the
    supervisor's stderr directly, and a crash is named without torchrun's line."""

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
    """Port of the supervisor's own /metrics; 0 turns it off."""

    metrics_host: str = "127.0.0.1"
    """Address the supervisor's /metrics binds to: loopback unless told otherwise (in a pod,
    the pod's IP, so Prometheus can scrape it)."""

    metrics_certfile: str | None = None
    """PEM certificate: /metrics serves HTTPS (with ``metrics_keyfile``)."""

    metrics_keyfile: str | None = None
    """PEM key of ``metrics_certfile``."""

    metrics_client_cafile: str | None = None
    """PEM CA bundle: /metrics then requires a client certificate it signed."""

    store_url: str | None = None
    """etcd client URL (``http://host:2379``, ``https://`` for TLS) through which the
    supervisors of a job's nodes agree: a restart anywhere restarts every node, a lost node is
    named. None: one node."""

    store_cafile: str | None = None
    """PEM CA bundle that signed the store's certificate (an https store_url; None: the
    system's CAs)."""

    store_certfile: str | None = None
    """PEM client certificate for a store started with ``--client-cert-auth`` (with
    ``store_keyfile``)."""

    store_keyfile: str | None = None
    """PEM key of ``store_certfile``."""

    store_user: str | None = None
    """etcd user the supervisor authenticates as (a store with auth enabled); its password
    comes from ``store_password_file`` or ``TORCHVITALS_SUPERVISOR_STORE_PASSWORD``."""

    store_password_file: str | None = None
    """File holding ``store_user``'s password (a mounted secret; surrounding whitespace is
    ignored)."""

    store_password: str | None = field(default=None, repr=False)
    """``store_user``'s password itself, from ``TORCHVITALS_SUPERVISOR_STORE_PASSWORD`` only
    (never a flag). Set this or ``store_password_file``, not both."""

    job_ttl_s: float = 86400.0
    """Seconds the job's keys in the store (its attempt, its end) outlive the last node that
    renewed them: a requeued or replaced node within this finds the job's attempt, restart
    budget and end; after it the store holds nothing of the job. A job that ends for good
    removes them at once."""

    nnodes: int = 1
    """Nodes of the job, one supervisor each (more than 1 needs ``store_url``)."""

    node_rank: int | None = None
    """This node's rank among the job's nodes (0 .. nnodes-1). None: the scheduler's
    (``SLURM_NODEID``, or ``PET_NODE_RANK`` of Kubeflow's training operator), else 0."""

    min_nodes: int | None = None
    """Fewest nodes the job may go on with when a lost node was not replaced within
    ``peer_timeout_s`` (with torchrun's ``--nnodes MIN:MAX``; the job resumes at the new world
    size). None: every one of ``nnodes`` is needed."""

    node_ttl_s: float = 9.0
    """Seconds a node's supervisor may stay silent in the store before the others report the
    node lost (and stop their launchers): its lease, renewed every third of it, so two renewals
    may fail in a row. The report comes within this plus ``poll_s`` (the others watch the
    store). Shorter names a dead node sooner; it also takes a supervisor that cannot reach the
    store for that long (a stalled host, a network blip longer than etcd's own few-second
    leader election) for a lost node, and restarts the job. 30 until the store was watched:
    a lost node was then named only 1-3 s before the survivors' 30 s hang floor."""

    peer_timeout_s: float = 600.0
    """Seconds the nodes wait for each other at the start of an attempt, and so for a lost
    node's replacement, before every node exits ``node_lost_exit_code``."""

    store_poll_s: float = 1.0
    """How often a node asks the store for the job's attempt and the nodes present while its
    watch of the job's keys is down (while it holds, the node reads the watch's view every
    ``poll_s`` and asks the store nothing)."""

    abort_exit_code: int = ABORT_EXIT_CODE
    """Exit status when the job aborted on purpose (a rank's heartbeat says "aborted": the
    agent's loop guard, or the collector's abort order); such a job is never restarted."""

    no_progress_exit_code: int = NO_PROGRESS_EXIT_CODE
    """Exit status when ``no_progress_restarts`` restarts in a row made no progress."""

    budget_exit_code: int = BUDGET_EXIT_CODE
    """Exit status when the job failed again after ``max_restarts`` restarts."""

    refused_exit_code: int = REFUSED_EXIT_CODE
    """Exit status when the job refused to resume its checkpoint folder (another job's, or a
    run it was not told to continue: a rank's heartbeat says "refused"); never retried."""

    node_lost_exit_code: int = NODE_LOST_EXIT_CODE
    """Exit status when a node was lost and none took its place within ``peer_timeout_s``."""

    def __post_init__(self) -> None:
        for name in (
            "hang_factor",
            "hang_floor_s",
            "checkpoint_timeout_s",
            "startup_timeout_s",
            "restart_floor_s",
            "restart_factor",
            "poll_s",
            "node_ttl_s",
            "peer_timeout_s",
            "store_poll_s",
            "job_ttl_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hang_timeout_s is not None and not self.hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0 or None, got {self.hang_timeout_s}")
        if self.probe_wait_s < 0 or self.findings_wait_s < 0:
            raise ValueError("need probe_wait_s >= 0 and findings_wait_s >= 0")
        if self.grace_s < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("need grace_s >= 0 and 0 <= backoff_s <= backoff_max_s")
        if self.max_restarts < 0 or self.no_progress_restarts < 1:
            raise ValueError("need max_restarts >= 0 and no_progress_restarts >= 1")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if bool(self.metrics_certfile) != bool(self.metrics_keyfile):
            raise ValueError(
                "metrics_certfile and metrics_keyfile go together: set both or neither"
            )
        if self.metrics_client_cafile and not self.metrics_certfile:
            raise ValueError(
                "metrics_client_cafile needs metrics_certfile and metrics_keyfile "
                "(client certificates are checked over HTTPS only)"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need 0 <= node_rank < nnodes, got {self.node_rank}, {self.nnodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"need 1 <= min_nodes <= nnodes, got {self.min_nodes}, {self.nnodes}")
        if self.nnodes > 1 and not self.store_url:
            raise ValueError(
                f"nnodes={self.nnodes} needs store_url: the nodes' supervisors agree "
                "through the job's etcd"
            )
        if self.store_url and not self.store_url.startswith(("http://", "https://")):
            raise ValueError(f"store_url {self.store_url!r} must start with http:// or https://")
        tls = [n for n in ("store_cafile", "store_certfile", "store_keyfile") if getattr(self, n)]
        if tls and not (self.store_url or "").startswith("https://"):
            raise ValueError(f"{', '.join(tls)} need an https:// store_url, got {self.store_url!r}")
        if bool(self.store_certfile) != bool(self.store_keyfile):
            raise ValueError("store_certfile and store_keyfile go together: set both or neither")
        if self.store_password is not None and self.store_password_file:
            raise ValueError(
                f"set either store_password_file or {SUPERVISOR_ENV_PREFIX}STORE_PASSWORD, not both"
            )
        has_password = self.store_password is not None or bool(self.store_password_file)
        if has_password != bool(self.store_user):
            raise ValueError(
                "store_user and its password go together: set store_user and "
                f"store_password_file (or {SUPERVISOR_ENV_PREFIX}STORE_PASSWORD)"
                if self.store_user
                else "a store password without store_user"
            )
        codes = {
            self.abort_exit_code,
            self.no_progress_exit_code,
            self.budget_exit_code,
            self.refused_exit_code,
            self.node_lost_exit_code,
        }
        if len(codes) != 5 or not all(0 < c < 256 for c in codes):
            raise ValueError("the five exit codes must differ and lie in 1..255")

    def password(self) -> str | None:
        """``store_user``'s password, read from its file when it has one.

        Raises:
            ValueError: the file cannot be read (the message names it, never the password).
        """
        if not self.store_password_file:
            return self.store_password
        try:
            return Path(self.store_password_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(
                f"store_password_file {self.store_password_file}: cannot be read "
                f"({exc.strerror or exc})"
            ) from None

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> SupervisorConfig:
        """Defaults, then ``TORCHVITALS_SUPERVISOR_<FIELD>``, then ``overrides`` (flags).

        Args:
            environ: the environment to read (default ``os.environ``).
            **overrides: field values from flags or code; they win over the environment.

        Returns:
            The validated config.
        """
        return cls(
            **settings(
                cls,
                environ,
                overrides,
                lambda name: SUPERVISOR_ENV_PREFIX + name.upper(),
                "supervisor",
            )
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--<field>`` flag per field (default None: not given); ``--store-password``
        only refuses (``SECRET_FIELDS``: a command line is readable by every user of the
        machine), where argparse would otherwise take it for ``--store-password-file``."""
        add_flags(
            parser, cls, lambda name: SUPERVISOR_ENV_PREFIX + name.upper(), skip=SECRET_FIELDS
        )

        class _Refused(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                parser.error(
                    f"{option_string}: never put a password on the command line; use "
                    f"--store-password-file or {SUPERVISOR_ENV_PREFIX}STORE_PASSWORD"
                )

        for name in SECRET_FIELDS:
            parser.add_argument(
                "--" + name.replace("_", "-"), action=_Refused, help=argparse.SUPPRESS
            )
