"""The collector's directive is taken once: a poll that lands right after ``take()`` lets go of
the lock finds it already taken, so the job never obeys one directive twice (a second rollback,
an abort after the rollback it ordered). Offline: the collector's answers are canned."""

from __future__ import annotations

from typing import Any

from torchvitals.agent.recover.directives import DirectivePoller
from torchvitals.protocol import ACTIONS

ROLLBACK = {"id": "d-1", "action": "rollback"}


class CannedCollector(DirectivePoller):
    """A poller whose collector always lists one directive (as a collector does until the ack
    reaches it); its own thread sleeps for the whole test."""

    def __init__(self) -> None:
        self.acks: list[str] = []
        super().__init__("http://collector.invalid", "job", poll_seconds=3600.0, token="t", run="r")

    def _request(self, method: str, path: str) -> dict[str, Any]:
        if method == "POST":
            self.acks.append(path)
            return {}
        return {"directives": [ROLLBACK]}


class PollAfterRelease:
    """The poller's lock, with the poll thread taking its turn right after each release (the
    interleaving a busy machine produces now and then), once per release."""

    def __init__(self, poller: DirectivePoller, lock: Any) -> None:
        self.poller, self.lock, self.polling, self.polls = poller, lock, False, 0

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if not self.polling:
            self.polling = True
            self.poller.poll()
            self.polls += 1
            self.polling = False


def test_a_poll_between_take_and_its_record_does_not_install_the_directive_again():
    poller = CannedCollector()
    try:
        poller.poll()
        assert poller.code() == ACTIONS["rollback"]
        interleaved = PollAfterRelease(poller, poller._lock)
        poller._lock = interleaved  # type: ignore[assignment]
        taken = poller.take()
        assert taken == ROLLBACK and interleaved.polls >= 1
        assert poller.code() == 0.0, "the directive just taken is pending again"
        assert poller.take() is None
        poller.poll()  # the collector still lists it until the ack lands: still taken
        assert poller.code() == 0.0
    finally:
        poller.close()


def test_a_new_directive_after_the_taken_one_is_still_delivered():
    poller = CannedCollector()
    try:
        poller.poll()
        assert poller.take() == ROLLBACK
        abort = {"id": "d-2", "action": "abort"}
        poller._request = lambda method, path: {"directives": [ROLLBACK, abort]}  # type: ignore[method-assign]
        poller.poll()
        assert poller.code() == ACTIONS["abort"] and poller.take() == abort
    finally:
        poller.close()
