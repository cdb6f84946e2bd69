"""The agent's background thread for metadata pushes, fetches and invalidations, as NIXL's listener thread.

NIXL queues ``sendLocalMD``, ``fetchRemoteMD`` and ``invalidateLocalMD`` to a
thread and returns; programs poll ``check_remote_metadata`` and rely on teardown
calls never raising because the peer has already gone. A job that fails is
logged and counted (``failures``, ``last_error``), never raised to the caller.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("datamover.compat.nixl")

#: How long a fetch or push retries a peer's listener that is not up yet (one it reached before is not retried).
#: NIXL tries once; retrying lets peers that start side by side find each other.
FETCH_RETRY_S = 10.0
#: How long ``close`` waits for queued jobs (teardown invalidations) before giving up on them.
DRAIN_S = 2.0


class MetadataWorker:
    """One daemon thread running queued metadata jobs in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], Any]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self.failures = 0
        self.completed = 0
        self.last_error: BaseException | None = None
        self.failed_jobs: dict[str, int] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-md-{name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, job: Callable[[], Any]) -> None:
        """Queue ``job`` (described by ``what`` in the log); dropped with a warning once closed."""
        with self._lock:
            if self._closed:
                log.warning("metadata job %s dropped: the agent is closed", what)
                return
            self._pending += 1
        self._jobs.put((what, job))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            what, job = item
            try:
                job()
                ok = True
            except BaseException as exc:  # a job must never take the thread down
                ok = False
                with self._lock:
                    self.failures += 1
                    self.last_error = exc
                    kind = what.split(" ", 1)[0]
                    self.failed_jobs[kind] = self.failed_jobs.get(kind, 0) + 1
                log.warning("metadata %s failed: %s: %s", what, type(exc).__name__, exc)
            with self._lock:
                self._pending -= 1
                if ok:
                    self.completed += 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued job ran; False if some were still queued after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Run what is queued (up to ``drain_s`` s), then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.wait_idle(drain_s):
            log.warning("metadata jobs still queued after %.1f s at close; dropping them", drain_s)
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(drain_s)


def retry(fn: Callable[[], Any], timeout: float = FETCH_RETRY_S, retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """``fn()``, retried every 50 ms on ``retry_on`` errors until ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except retry_on:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
