"""ReadFence: the completion of a mooncake READ run on pool threads, whose ``cancel`` keeps its bytes out of the
caller's memory from then on.

``Transfer`` reports ERR (a timeout) or returns from ``release`` right after ``cancel``, while parts may still be
inside a store call. A part touches the caller's memory only inside ``enter``/``leave``: staged, the copy of
verified objects out of the arena; zero-copy, the whole store call (Mooncake writes into the caller's memory
itself) and the zeroing of rows that failed. ``cancel`` waits until no part is inside (at most ``FENCE_S``
seconds, then it logs that the fence did not hold), and a part that enters after it touches nothing.
"""

from __future__ import annotations

import logging
import threading

from ..base import Completion

log = logging.getLogger("datamover.mooncake")

#: the longest ``cancel`` waits for a part writing into the caller's memory (a zero-copy get from a stalled holder)
FENCE_S = 10.0


class ReadFence(Completion):
    """A completion whose parts write into the caller's memory only between ``enter`` and ``leave``."""

    __slots__ = ("_busy", "_idle", "fencing")

    def __init__(self, parts: int = 1) -> None:
        super().__init__(parts)
        self._idle = threading.Condition(threading.Lock())
        self._busy = 0
        #: set when ``cancel`` starts waiting for the parts inside (a known point for tests)
        self.fencing = threading.Event()

    def enter(self) -> bool:
        """Before touching the caller's memory: False (touch nothing) once the transfer was cancelled."""
        with self._idle:
            if self.cancelled:
                return False
            self._busy += 1
            return True

    def leave(self) -> None:
        with self._idle:
            self._busy -= 1
            if not self._busy:
                self._idle.notify_all()

    def cancel(self, error: BaseException | None = None) -> None:
        super().cancel(error)
        with self._idle:
            if self._busy:
                self.fencing.set()
                if not self._idle.wait_for(lambda: not self._busy, FENCE_S):
                    log.warning(
                        "a mooncake READ was cancelled while a store call wrote into its destination for over %g s:"
                        " its bytes may still land",
                        FENCE_S,
                    )
