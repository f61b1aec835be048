"""The start barrier asks the store how many nodes came (a count, one small answer however
large the job) and reads every node's record only when the count says all came, or every
``FULL_LOOK_EVERY`` looks to name a node that is gone. Fake keys and clock: no store, no sleep."""

from __future__ import annotations

from torchvitals.supervisor.barrier import FULL_LOOK_EVERY, StartBarrier
from torchvitals.supervisor.job_store import StoreOutage
from torchvitals.supervisor.options import SupervisorConfig
from torchvitals.supervisor.orders import StartAttempt
from torchvitals.supervisor.store_schema import JobAttempt
from torchvitals.supervisor.telemetry import SupervisorMetrics


class Keys:
    view, live = None, False

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.looks = counts, 0

    def final(self, *, cached: bool = False):
        return None

    def attempt(self, *, cached: bool = False) -> JobAttempt:
        return JobAttempt(number=1)

    def ready_count(self, attempt: int) -> int:
        count = self.counts[min(self.looks, len(self.counts) - 1)]
        self.looks += 1
        return count


class Membership:
    def __init__(self, keys: Keys) -> None:
        self.keys, self.members, self.reads = keys, {0, 1, 2}, 0

    def ready(self, attempt: int) -> set[int]:
        self.reads += 1
        came = self.keys.counts[min(self.keys.looks, len(self.keys.counts)) - 1]
        return set(range(came))

    def gone(self, ready: set[int]) -> list[int]:
        return []


def test_the_barrier_reads_every_record_only_when_the_count_says_every_node_came():
    looks = 2 * FULL_LOOK_EVERY + 3
    keys = Keys([1] * (looks - 1) + [3])
    members = Membership(keys)
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    barrier = StartBarrier(
        keys,  # type: ignore[arg-type]
        members,  # type: ignore[arg-type]
        SupervisorConfig(nnodes=3, node_rank=0, store_url="http://127.0.0.1:1", peer_timeout_s=600),
        SupervisorMetrics(),
        announce=lambda attempt: None,
        finish=lambda code, reason: code,
        outage=StoreOutage(),
        clock=lambda: clock[0],
        sleep=sleep,
    )
    assert barrier.wait(1) == StartAttempt(1)
    assert keys.looks == looks
    # The first look, one every FULL_LOOK_EVERY while short, and the one that found all.
    assert members.reads == 1 + 2 + 1
