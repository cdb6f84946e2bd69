"""Freezing a process at a known point: SIGSTOP, then wait until every one of its threads has stopped.

``kill(SIGSTOP)`` only queues the signal: a thread of the target may run on for a while after it returned, e.g.
answering a request the test posted right after, and stop halfway through writing it into a shared-memory fifo
(which then blocks every other sender to that fifo until the target resumes). A test that means "frozen idle"
freezes with ``freeze`` and posts only once it returned.
"""

from __future__ import annotations

import os
import signal

from .waiting import BOUND_S, until


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T or t in ``/proc/<pid>/task/*/stat``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":  # the state follows "(comm) "
            return False
    return True


def freeze(pid: int, timeout: float = BOUND_S) -> None:
    """SIGSTOP ``pid`` and return once all its threads stopped (AssertionError after ``timeout`` s)."""
    os.kill(pid, signal.SIGSTOP)
    until(lambda: all_stopped(pid), timeout, what=f"every thread of process {pid} stopped")
