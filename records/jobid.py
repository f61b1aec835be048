"""Which job a process belongs to, and whether it may continue the run a checkpoint folder holds.

    job_identity()                       # "4711" under Slurm, torchrun's --rdzv-id, ...
    resume_decision(ledger.job_id, job_identity()).refuse

A run belongs to a job: the id its launcher or scheduler gives it (``TORCHVITALS_JOB_ID``, set by
a person, the chart or the supervisor for every node alike; torchrun's ``--rdzv-id``; Slurm's job
id, which a requeue keeps). The ledger records it, so a folder is continued by the job that wrote
it on any node and after any kind of restart (the supervisor's, torchrun's elastic restart, which
leaves ``TORCHELASTIC_RESTART_COUNT`` at 0 on a surviving node, a Slurm requeue, a replaced pod),
and refused to another job. Torch-free: the supervisor reads the same identity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..protocol import JOB_ID_ENV, JOB_ID_ENVS

RDZV_ID_FLAGS = ("--rdzv-id", "--rdzv_id")
"""torchrun's flag naming the rendezvous (and so the job), in both of its spellings."""


def job_identity(environ: Mapping[str, str] | None = None) -> str | None:
    """The job this process belongs to, as its launcher or scheduler names it.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The first of ``JOB_ID_ENVS`` that is set (torchrun's ``none``, the id of a rendezvous
        nobody named, names nothing), else None.
    """
    environ = os.environ if environ is None else environ
    for name in JOB_ID_ENVS:
        value = environ.get(name, "").strip()
        if value and value.lower() != "none":
            return value
    return None


def launcher_job_id(command: Sequence[str]) -> str | None:
    """The ``--rdzv-id`` a torchrun command line names (``none``: not named), else None.

    The supervisor reads it because torchrun sets ``TORCHELASTIC_RUN_ID`` only for its workers.
    """
    for i, arg in enumerate(command):
        for flag in RDZV_ID_FLAGS:
            value = None
            if arg == flag and i + 1 < len(command):
                value = command[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if value is not None and value.strip() and value.strip().lower() != "none":
                return value.strip()
    return None


@dataclass(frozen=True)
class ResumeDecision:
    """Whether the job may continue the folder, from the ids alone."""

    same_job: bool
    """The ledger names this job: continue, whatever restarted it."""
    refuse: bool
    """The ledger names another job: a final refusal (a restart meets the same folder)."""
    message: str = ""
    """For a refusal: both ids and the fix."""


def resume_decision(
    recorded: str | None, current: str | None, *, folder: str = "the checkpoint folder"
) -> ResumeDecision:
    """Decide from the job id the ledger recorded and this process's.

    Args:
        recorded: the ledger's ``job_id`` (None: an older ledger, or a job without an id).
        current: ``job_identity()`` of this process.
        folder: the folder, for the message.

    Returns:
        same_job when both ids are known and equal; refuse when both are known and differ;
        neither when one is unknown (the caller falls back to the restart counters).
    """
    if recorded is None or current is None:
        return ResumeDecision(same_job=False, refuse=False)
    if recorded == current:
        return ResumeDecision(same_job=True, refuse=False)
    return ResumeDecision(
        same_job=False,
        refuse=True,
        message=(
            f"{folder} belongs to job {recorded!r}, not to this job {current!r}: a new job would "
            f"silently inherit another job's weights. Use a new checkpoint_dir for this job, or, "
            f'to continue job {recorded!r}, run it with {JOB_ID_ENV}={recorded} (or resume="auto", '
            f"TORCHVITALS_RESUME=auto, to take the folder over)."
        ),
    )
