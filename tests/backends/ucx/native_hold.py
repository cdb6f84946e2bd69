"""Known points for tests that hold the native progress thread off a worker (tests only)."""

from __future__ import annotations

import select
import time


def held_and_idle(progress, worker, timeout: float = 60.0) -> None:
    """Return once the held native thread sleeps on its hold and the worker is armed with no event pending.

    ``hold()`` does not wait for a burst of progress the thread is in; a kick makes it look at the hold once
    that burst ends (``kicks`` counts the wake-up; it then sleeps on the hold and progresses nothing). Events
    from before are progressed here, on the caller's thread, before whatever the test then starts.
    """
    kicks = progress.stats["kicks"]
    progress.kick()
    deadline = time.monotonic() + timeout
    while progress.stats["kicks"] == kicks:
        assert time.monotonic() < deadline, "the native thread never woke for a kick"
        time.sleep(0.001)
    while not worker.arm():
        worker.progress()


def event_arrives(worker, timeout: float = 60.0) -> None:
    """Wait for UCX's event fd (armed by ``held_and_idle``) to say something arrived for the worker."""
    assert select.select([worker.epoll_file_descriptor], [], [], timeout)[0], "no UCX event came"
