"""The thread pool backends run request parts on: a queue and up to ``n`` threads, nothing more."""

from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger("datamover.workers")


class Workers:
    """A minimal executor: ``submit(fn, *args)`` hands a call to one of up to ``n`` threads.

    What ``run_parts`` and the AIO reaper need and no more: no Future, no
    semaphore. ``ThreadPoolExecutor.submit`` cost 60-130 us of the caller's
    time per post on the 2-vCPU VM (measured inside a 256 KiB x 16 AIO
    post); this is a SimpleQueue put and one futex wake. Threads start as
    ``ThreadPoolExecutor`` starts them: one more per submit that finds none
    idle, up to ``n``.
    """

    def __init__(self, n: int, name: str) -> None:
        self._n, self._name = max(1, int(n)), name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0
        self._closed = False

    def submit(self, fn, *args) -> None:
        if self._closed:
            raise RuntimeError("cannot schedule new work after shutdown")
        self._q.put((fn, args))
        # read without the lock: at worst one thread more than needed, or the call waits for a busy one
        if self._idle <= 0 and len(self._threads) < self._n:
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            if self._closed or len(self._threads) >= self._n:
                return
            t = threading.Thread(target=self._loop, name=f"{self._name}_{len(self._threads)}", daemon=True)
            self._threads.append(t)
        t.start()

    def _loop(self) -> None:
        get, lock = self._q.get, self._lock
        while True:
            with lock:
                self._idle += 1
            item = get()
            with lock:
                self._idle -= 1
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # the work reports its own errors; this is a last resort
                log.exception("%s: a worker task failed", self._name)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> int:
        """Stop the threads once the work queued is done; with ``wait``, wait for them (``timeout`` s at most in
        all: a thread inside a syscall on a hung device may never return). Returns how many are still running."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        if not wait:
            return 0
        end = None if timeout is None else time.monotonic() + timeout
        others = [t for t in threads if t is not threading.current_thread()]
        for t in others:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        return sum(t.is_alive() for t in others)
