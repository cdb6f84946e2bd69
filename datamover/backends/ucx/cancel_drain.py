"""A cut-off request's drain: ``cancel_drain_s`` for its UCX operations to end, checked by the service loop.

The service thread registers one when it cuts off a cancelled request whose operations still run (``Fencing._cut``)
and looks at it on every turn of its loop, serving every other peer and transfer meanwhile; the caller's cancel
waits for it to be settled (``CancelDrain.wait``) before the caller hears of ERR.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import RemoteDisconnected
from .config import log

#: what a look at a drain found: its operations still run / all ended / can no longer be seen to end (their
#: completion was let go, e.g. the peer's connection dropped without a worker reset)
PENDING, ENDED, STUCK = "pending", "ended", "stuck"
#: how a drain is settled besides ENDED and STUCK: its time ran out / the worker its operations are on was replaced
#: (and kept: a reset with drains pending quarantines the worker, see ``ServiceLoop._reset_worker``)
EXPIRED, REPLACED = "expired", "replaced"


class CancelDrain:
    """One cancelled request whose UCX operations still run on ``worker``: ``look`` says whether they ended,
    ``settle(outcome)`` finishes the cut (on the service thread), then ``over`` is set."""

    __slots__ = ("deadline", "look", "over", "peer", "settle", "worker")

    def __init__(
        self, peer: str, worker: Any, look: Callable[[], str], settle: Callable[[str], None], deadline: float
    ) -> None:
        self.peer, self.worker, self.look, self.settle, self.deadline = peer, worker, look, settle, deadline
        self.over = threading.Event()

    def wait(self, timeout: float, alive: Callable[[], bool]) -> bool:
        """On the caller's thread: whether the cut was settled within ``timeout`` s (False once ``alive()`` is not)."""
        end = time.monotonic() + timeout
        while not self.over.wait(max(0.0, min(1.0, end - time.monotonic()))):
            if not alive() or time.monotonic() >= end:
                return self.over.is_set()
        return True


class CancelDrains:
    """The drains pending in one backend; only its service thread adds, checks and settles them."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[CancelDrain] = []

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, drain: CancelDrain) -> CancelDrain | None:
        """Settle ``drain`` at once when its operations already ended (None), else keep it pending (``drain``)."""
        seen = _look(drain)
        if seen == PENDING:
            self.pending.append(drain)
            return drain
        _settle(drain, seen)
        return None

    def on(self, worker: Any) -> list[CancelDrain]:
        """The drains whose operations run on ``worker``."""
        return [d for d in self.pending if d.worker is worker]

    def check(self, now: float, worker: Callable[[], Any]) -> None:
        """One turn of the service loop: settle every drain that ended, ran out of time or lost its worker."""
        for drain in list(self.pending):
            if drain.worker is not worker():
                outcome = REPLACED
            else:
                outcome = _look(drain)
                if outcome == PENDING:
                    if now <= drain.deadline:
                        continue
                    outcome = EXPIRED
            self.pending.remove(drain)
            _settle(drain, outcome)

    def release(self) -> None:
        """The service thread is ending (its workers are freed): nobody waits for a drain any more."""
        pending, self.pending = self.pending, []
        for drain in pending:
            drain.over.set()


def _look(drain: CancelDrain) -> str:
    try:
        return drain.look()
    except Exception as exc:  # cannot tell whether they ended: cut them off as if they had not
        log.error("checking a cancelled request to agent %r failed: %s", drain.peer, exc)
        return STUCK


def _settle(drain: CancelDrain, outcome: str) -> None:
    try:
        drain.settle(outcome)
    except RemoteDisconnected:
        pass  # the backend is closing: its workers go with it
    except Exception as exc:  # a bug here must not stop the service thread, nor leave the caller waiting
        log.error("settling a cancelled request to agent %r (%s) failed: %s", drain.peer, outcome, exc)
    finally:
        drain.over.set()
