"""The supervisor's restart policy on its own: how each ending of an attempt is decided.

python -m pytest tests/unit/test_restart_policy.py
"""

from __future__ import annotations

import pytest

from torchvitals.protocol import Beat
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.orders import JobEnded, JobRestarted, NodesLost
from torchvitals.supervisor.outcomes import Exited, Hung, Ordered
from torchvitals.supervisor.restart_policy import (
    Follow,
    GiveUp,
    NoRestart,
    Obey,
    Restart,
    RestartPolicy,
    Succeed,
    failure,
)
from torchvitals.supervisor.store_schema import JobAttempt, NodeState

POLICY = RestartPolicy(
    max_restarts=3, no_progress_restarts=2, backoff_s=1.0, backoff_max_s=3.0, node=1
)
JOB = JobAttempt(number=2, restarts=1, best=10, stalled=0)
LOST = NodeState(node=0, host="h", pid=7, attempt=2, state="running", step=57)


def beat(**flags) -> Beat:
    return Beat(step=12, time=1.0, checkpointing=False, **flags)


def exited(status: int, number: int = 2, **flags) -> Exited:
    return Exited(
        number=number, started=0.0, ended=1.0, status=status, beat=beat(**flags) if flags else None
    )


def hung(number: int = 2, **flags) -> Hung:
    return Hung(
        number=number,
        started=0.0,
        ended=1.0,
        status=-15,
        beat=beat(**flags) if flags else None,
        age_s=31.0,
        timeout_s=30.0,
    )


def ordered(order) -> Ordered:
    return Ordered(number=2, started=0.0, ended=1.0, status=-15, order=order)


@pytest.mark.parametrize(
    "scenario, outcome, decision",
    [
        ("clean exit", exited(0), Succeed()),
        # A clean exit ends the job even when a rank's last beat was an abort's.
        ("clean exit after an abort beat", exited(0, aborted=True), Succeed()),
        ("crash", exited(3), None),
        ("hang", hung(), None),
        (
            "refused ledger",
            exited(1, refused=True),
            NoRestart(
                78,
                "the job refused to resume its checkpoint folder (attempt 2, status 1); see the "
                "job's log for both job ids and the fix",
            ),
        ),
        (
            "aborted on purpose",
            exited(1, aborted=True),
            NoRestart(75, "the job aborted itself (attempt 2, status 1, step 12)"),
        ),
        (
            "aborted, then hung on the way out",
            hung(aborted=True),
            NoRestart(75, "the job aborted itself (attempt 2, status -15, step 12)"),
        ),
        ("the job ended elsewhere", ordered(JobEnded(79, "node 0 lost")), Obey(79)),
        ("a restart elsewhere", ordered(JobRestarted(3, "node 0: crash")), Follow("peer")),
        (
            "a lost node",
            ordered(NodesLost((LOST,), "node 0 (host h, supervisor pid 7) lost at step 57")),
            Restart(
                JobAttempt(
                    number=3,
                    restarts=2,
                    best=10,
                    stalled=0,
                    reason="node 0 (host h, supervisor pid 7) lost at step 57",
                ),
                label="lost",
                backoff_s=None,
            ),
        ),
    ],
)
def test_an_ending_decides_by_itself_or_leaves_it_to_the_limits(scenario, outcome, decision):
    assert POLICY.settle(outcome, JOB) == decision, scenario


@pytest.mark.parametrize(
    "scenario, outcome, job, progress, decision",
    [
        (
            "a crash that made progress waits the base back-off",
            exited(3),
            JOB,
            15,
            Restart(
                JobAttempt(3, 2, best=15, stalled=0, reason="node 1: attempt 2 ended by crash"),
                label="crash",
                backoff_s=1.0,
            ),
        ),
        (
            "a hang without progress backs off twice as long",
            hung(),
            JOB,
            10,
            Restart(
                JobAttempt(3, 2, best=10, stalled=1, reason="node 1: attempt 2 ended by hang"),
                label="hang",
                backoff_s=2.0,
            ),
        ),
        (
            "the first attempt's failure is not a stall",
            exited(3, number=1),
            JobAttempt(number=1),
            None,
            Restart(
                JobAttempt(2, 1, best=None, stalled=0, reason="node 1: attempt 1 ended by crash"),
                label="crash",
                backoff_s=1.0,
            ),
        ),
        (
            "restarts without progress in a row",
            exited(3),
            JobAttempt(number=2, restarts=1, best=10, stalled=1),
            10,
            GiveUp(76, "2 restarts in a row without progress past step 10"),
        ),
        (
            "restarts exhausted",
            exited(3),
            JobAttempt(number=4, restarts=3, best=10, stalled=0),
            20,
            GiveUp(77, "restart budget (3) spent"),
        ),
    ],
)
def test_a_failure_restarts_until_the_limits_are_spent(scenario, outcome, job, progress, decision):
    assert POLICY.after_failure(outcome, job, progress) == decision, scenario


def test_the_back_off_doubles_per_restart_without_progress_up_to_its_cap():
    policy = RestartPolicy(no_progress_restarts=10, backoff_s=0.5, backoff_max_s=3.0)
    waits = [
        policy.after_failure(exited(3), JobAttempt(number=2, best=10, stalled=n), 10).backoff_s
        for n in range(4)
    ]
    assert waits == [1.0, 2.0, 3.0, 3.0]
    # Progress resets it.
    assert policy.after_failure(exited(3), JobAttempt(2, best=10, stalled=3), 11).backoff_s == 0.5


def test_a_failure_is_named_a_hang_or_a_crash():
    assert (failure(hung()), failure(exited(3))) == ("hang", "crash")


def test_the_policy_is_the_one_the_config_sets_out():
    config = SupervisorConfig(
        max_restarts=4, no_progress_restarts=5, backoff_s=2, backoff_max_s=9, node_rank=0
    )
    policy = RestartPolicy.from_config(config)
    assert (policy.max_restarts, policy.no_progress_restarts) == (4, 5)
    assert (policy.backoff_s, policy.backoff_max_s) == (2, 9)
    assert (policy.abort_exit_code, policy.no_progress_exit_code) == (75, 76)
    assert (policy.budget_exit_code, policy.refused_exit_code) == (77, 78)


@pytest.mark.parametrize(
    "bad", [{"max_restarts": -1}, {"no_progress_restarts": 0}, {"backoff_s": 2, "backoff_max_s": 1}]
)
def test_limits_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)
