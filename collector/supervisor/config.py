"""How ``torchvitals supervise`` keeps a job alive: one keyword-only dataclass.

    torchvitals supervise --hang-timeout-s 120 --checkpoint-dir ckpt -- torchrun ... train.py

Precedence: a flag > ``TORCHVITALS_SUPERVISOR_<FIELD>`` > the default; ``--help`` lists each
field's meaning, default and variable.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping

from ...protocol import (ABORT_EXIT_CODE, BUDGET_EXIT_CODE, ENV_PREFIX, NODE_LOST_EXIT_CODE,
                         NO_PROGRESS_EXIT_CODE, REFUSED_EXIT_CODE)
from ...settings import add_flags, settings

SUPERVISOR_ENV_PREFIX = ENV_PREFIX + "SUPERVISOR_"
"""``TORCHVITALS_SUPERVISOR_<FIELD>``: the variable of each ``SupervisorConfig`` field."""

NODE_RANK_ENVS = ("SLURM_NODEID", "PET_NODE_RANK")
"""Where a scheduler says which node this is: Slurm, Kubeflow's training operator."""


def node_rank(config: "SupervisorConfig", environ: Mapping[str, str]) -> int:
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

    store_url: str | None = None
    """etcd client URL (``http://host:2379``) through which the supervisors of a job's nodes
    agree: a restart anywhere restarts every node, a lost node is named. None: one node."""

    nnodes: int = 1
    """Nodes of the job, one supervisor each (more than 1 needs ``store_url``)."""

    node_rank: int | None = None
    """This node's rank among the job's nodes (0 .. nnodes-1). None: the scheduler's
    (``SLURM_NODEID``, or ``PET_NODE_RANK`` of Kubeflow's training operator), else 0."""

    min_nodes: int | None = None
    """Fewest nodes the job may go on with when a lost node was not replaced within
    ``peer_timeout_s`` (with torchrun's ``--nnodes MIN:MAX``; the job resumes at the new world
    size). None: every one of ``nnodes`` is needed."""

    node_ttl_s: float = 30.0
    """Seconds a node's supervisor may stay silent in the store before the others report the
    node lost (and stop their launchers); the report comes within this plus ``store_poll_s``."""

    peer_timeout_s: float = 600.0
    """Seconds the nodes wait for each other at the start of an attempt, and so for a lost
    node's replacement, before every node exits ``node_lost_exit_code``."""

    store_poll_s: float = 1.0
    """How often a node asks the store for the job's attempt and the nodes present."""

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
        for name in ("hang_factor", "hang_floor_s", "checkpoint_timeout_s", "startup_timeout_s",
                     "poll_s", "node_ttl_s", "peer_timeout_s", "store_poll_s"):
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
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need 0 <= node_rank < nnodes, got {self.node_rank}, {self.nnodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"need 1 <= min_nodes <= nnodes, got {self.min_nodes}, {self.nnodes}")
        if self.nnodes > 1 and not self.store_url:
            raise ValueError(f"nnodes={self.nnodes} needs store_url: the nodes' supervisors agree "
                             "through the job's etcd")
        codes = {self.abort_exit_code, self.no_progress_exit_code, self.budget_exit_code,
                 self.refused_exit_code, self.node_lost_exit_code}
        if len(codes) != 5 or not all(0 < c < 256 for c in codes):
            raise ValueError("the five exit codes must differ and lie in 1..255")

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
        add_flags(parser, cls, lambda name: SUPERVISOR_ENV_PREFIX + name.upper())
