"""Waiting in tests for a condition another thread or process makes true, with a bound and a message."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(cond: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``cond`` every 10 ms until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.01)
