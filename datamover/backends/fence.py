"""ReadFence: the completion of a transfer run in parts on pool threads, whose ``cancel`` keeps its bytes out of
the caller's memory, and the caller's bytes out of its destination, from then on.

``Transfer`` reports ERR (a timeout) or returns from ``release`` right after ``cancel``, while parts may still be
inside a call that writes into the caller's memory (a syscall, a store call, a copy out of a staging buffer) or,
for a WRITE, reads it (a buffer the caller reuses after ERR must not reach the file under this transfer's name). A
part touches the caller's memory only inside ``enter``/``leave``; ``cancel`` waits until no part is inside (at
most ``FENCE_S`` seconds, then it logs that the fence did not hold), and a part that enters after it touches
nothing. Used by mooncake (a READ's staged copy-out, or its whole zero-copy store call; a WRITE's every batched
call, from its remove or first read of the source until its put returned), posix (each synchronous preadv or
pwritev, whose short return is not resumed once cancelled; an AIO batch from its first io_submit until all it
submitted is reaped), memcpy (each piece of a copy), cuda (a device's group of copies, from its enqueueing on the
stream until the event after it is seen), gds (each worker's kvikio reads and writes) and s3 (each chunk of a GET
body, copied from the worker's own buffer, and the zeroing of unverified bytes: ``join``; a WRITE's copies of its
bodies).

A part whose call into a library writes the caller's memory itself (mooncake's zero-copy get) cannot be stopped
once that call is under way: if it outlasts ``FENCE_S`` the library may still land its bytes after ``cancel``
returned (the warning says so). What the part does itself after the call (zeroing, verifying) it does only while
``shut`` is False.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .base import Completion

log = logging.getLogger("datamover.fence")

#: the longest ``cancel`` waits for a part writing into the caller's memory (a get from a stalled holder, a hung disk)
FENCE_S = 10.0


class ReadFence(Completion):
    """A completion whose parts write into the caller's memory only between ``enter`` and ``leave``."""

    __slots__ = ("_busy", "_closed", "_idle", "drain", "fencing")

    def __init__(self, parts: int = 1) -> None:
        super().__init__(parts)
        self._idle = threading.Condition(threading.Lock())
        self._busy = 0
        self._closed = False  # set by ``cancel``: from then on nothing enters
        #: set when ``cancel`` starts waiting for the parts inside (a known point for tests)
        self.fencing = threading.Event()
        #: work ``cancel`` runs itself (given the seconds it may take) before it waits: a part that no pool
        #: thread has started yet, which would otherwise keep the fence shut until one is free
        self.drain: Callable[[float], None] | None = None

    def enter(self) -> bool:
        """Before touching the caller's memory: False (touch nothing) once the transfer was cancelled."""
        with self._idle:
            if self.cancelled:
                return False
            self._busy += 1
            return True

    def join(self) -> bool:
        """As ``enter``, refused only once ``cancel`` ran (a timeout, a release), not after another part failed: for
        work that must run after a failure too (zeroing bytes left unverified). A part reports its own failure
        with ``Completion.cancel``, which does not wait for the parts inside."""
        with self._idle:
            if self._closed:
                return False
            self._busy += 1
            return True

    def shut(self) -> bool:
        """Whether ``cancel`` ran (a timeout, a release), read under the fence's lock: a part still inside (its
        cancel may have given up waiting for it) checks this before it touches the caller's memory again, e.g. to
        zero bytes a failed call left there."""
        with self._idle:
            return self._closed

    def leave(self) -> None:
        with self._idle:
            self._busy -= 1
            if not self._busy:
                self._idle.notify_all()

    def cancel(self, error: BaseException | None = None) -> None:
        super().cancel(error)
        drain = self.drain
        if drain is not None:
            drain(FENCE_S)
        with self._idle:
            self._closed = True
            if self._busy:
                self.fencing.set()
                if not self._idle.wait_for(lambda: not self._busy, FENCE_S):
                    log.warning(
                        "a transfer was cancelled while one of its parts was still moving its bytes for over %g s:"
                        " they may still land",
                        FENCE_S,
                    )
