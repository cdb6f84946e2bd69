"""UCX requests that bookkeeping let go of while still in flight: kept until they end, or cancelled safely.

Dropping the last reference to an in-flight ucxx request cancels it, and ucxx
cancels under the request's lock and then the worker's, while a completion
(inside another thread's progress of the worker) takes the worker's lock and
then the request's: a cancel racing the request's own completion deadlocks
both threads, and the agent serves nobody again. So a ``state.Requests``
that goes hands what it still has in flight here; the service thread drops
each once it ended, or cancels it with every other progress of the worker
stopped (``Progress.quiesce`` and the waiters' gate): after ``cancel_drain_s``,
or at once when an endpoint is about to close (its requests go first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, contextmanager
from typing import Any


class Retired:
    """In-flight UCX requests nobody tracks any more, each with when it was let go; swept by the service thread."""

    def __init__(self) -> None:
        self._held: list[tuple[float, Any]] = []
        self._lock = threading.Lock()  # a caller's thread may retire too (the service thread sweeps)
        self.cancelled = 0  # still in flight after the grace: cancelled with the worker quiesced

    def __len__(self) -> int:
        return len(self._held)

    def add(self, reqs: Iterable[Any]) -> None:
        """Take ``reqs`` (ucxx requests, or None) off a caller: those still in flight stay referenced here."""
        now = time.monotonic()
        pending = [(now, r) for r in reqs if r is not None and not r.completed]
        if pending:
            with self._lock:
                self._held.extend(pending)

    def sweep(self, grace_s: float, quiesced: Callable[[], AbstractContextManager[None]]) -> None:
        """Drop the requests that ended; cancel those let go more than ``grace_s`` ago inside ``quiesced()``.

        A request's last reference goes on this thread only: an ended one at once (its cancel is a no-op), a
        late one while nothing else progresses the worker.
        """
        if not self._held:
            return
        late = time.monotonic() - grace_s
        with self._lock:
            held, self._held = self._held, []
        keep = [(t, r) for t, r in held if not r.completed]
        del held  # the ended ones go here, outside any lock
        doomed = [r for t, r in keep if t < late]
        keep = [(t, r) for t, r in keep if t >= late]
        if doomed:
            with quiesced():
                self.cancelled += sum(not r.completed for r in doomed)
                doomed.clear()  # each cancelled as it goes (ucxx cancels on dealloc)
        if keep:
            with self._lock:
                self._held.extend(keep)

    def cancel_now(self, quiesced: Callable[[], AbstractContextManager[None]]) -> None:
        """Cancel every request held (an endpoint is about to close: its requests go first), inside
        ``quiesced()`` if any is still in flight."""
        if not self._held:
            return
        with self._lock:
            held, self._held = self._held, []
        if any(not r.completed for _, r in held):
            with quiesced():
                self.cancelled += sum(not r.completed for _, r in held)
                held.clear()

    def clear(self) -> None:
        """Let every request go, cancelling those in flight: only once nothing else can progress their worker
        (its progress thread stopped, the waiters' gate held, or close())."""
        with self._lock:
            held, self._held = self._held, []
        self.cancelled += sum(not r.completed for _, r in held)
        held.clear()


@contextmanager
def quiesced(gate: threading.Lock, progress: Any):
    """Nothing but this thread progresses the worker meanwhile: waiters' drives wait on ``gate``, the native
    progress thread (if any) is held outside UCX's progress."""
    with gate:
        if progress is None:
            yield
            return
        progress.quiesce()
        try:
            yield
        finally:
            progress.resume()
