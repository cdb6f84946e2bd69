"""Waiting in tests for a condition another thread or process makes true, or for a call that may block, with a bound
and a message; holding one call of a transfer at a known point while the transfer is cut short (``HeldOnce``,
``cut_short``); and parking every part of one at a known point until the test lets them go (``Parked``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: how long a test waits for another thread to reach a point or let one go, before it fails saying which
BOUND_S = 60.0


def until(cond: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``cond`` every 10 ms until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.01)


def bounded(call: Callable[[], Any], what: str, timeout: float = BOUND_S) -> Any:
    """``call()`` on a thread joined within ``timeout`` s: what it returned (what it raised is raised here), or an
    AssertionError naming ``what`` when it was still blocked then (the thread, a daemon, is left to it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ret"] = call()
        except BaseException as exc:
            out["exc"] = exc

    t = threading.Thread(target=run, name=f"bounded {what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{what} still blocked {timeout:g} s in")
    if "exc" in out:
        raise out["exc"]
    return out["ret"]


class HeldOnce:
    """The first call through any function it ``wrap``s waits, before the real call, until the test lets it go.

    ``reached`` is set once that call waits, ``go`` lets it go, ``returned`` is set once it returned; every other
    call passes straight through. One HeldOnce may wrap several functions (one hold among all of them).
    """

    def __init__(self, what: str = "the held call", timeout: float = BOUND_S) -> None:
        self.what, self.timeout = what, timeout
        self.reached, self.go, self.returned = threading.Event(), threading.Event(), threading.Event()
        self._armed = True
        self._lock = threading.Lock()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``real`` behind the hold; a plain function, so it binds as a method when set on a class."""

        def held(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                hold, self._armed = self._armed, False
            if not hold:
                return real(*args, **kwargs)
            self.reached.set()
            if not self.go.wait(self.timeout):
                raise AssertionError(f"the test never let {self.what} go")
            try:
                return real(*args, **kwargs)
            finally:
                self.returned.set()

        return held


def cut_short(
    xfer: Any,
    completion: Any,
    end: str,
    snapshot: Callable[[], bytes],
    held: Any,
    at_err: Callable[[], None] | None = None,
) -> int:
    """End ``xfer`` while ``held`` holds one of its calls; how many bytes of ``snapshot()`` changed after ERR.

    ``end`` is ``"timeout"`` (a watcher thread polls ``state`` until the deadline turns it ERR) or ``"release"``.
    At ERR the watcher runs ``at_err`` and takes the snapshot. The held call (``held.go``) is let go once the
    watcher is done or the transfer's fence (``completion.fencing``) waits for it; then the call must return
    (``held.returned``) and ``completion`` finish, and the snapshot is taken again. ``held`` is a HeldOnce or
    anything with those two events.
    """
    from .. import XferState

    if end not in ("timeout", "release"):
        raise ValueError(f"end must be 'timeout' or 'release', not {end!r}")
    seen: dict[str, bytes] = {}

    def cut() -> None:
        if end == "timeout":
            until(lambda: xfer.state == XferState.ERR, what="the transfer timing out")
        else:
            xfer.release()
        if at_err is not None:
            at_err()
        seen["at ERR"] = snapshot()

    watcher = threading.Thread(target=cut, name="cut-short")
    watcher.start()
    fencing = getattr(completion, "fencing", None)
    until(lambda: (fencing is not None and fencing.is_set()) or not watcher.is_alive(), what="ERR or the fence")
    held.go.set()
    watcher.join(BOUND_S)
    assert not watcher.is_alive(), "the transfer did not end within the bound after its held call was let go"
    assert "at ERR" in seen, "the watcher failed before it saw ERR"
    assert held.returned.wait(BOUND_S), "the held call never returned"
    assert completion.wait(BOUND_S), "the transfer's workers never finished"
    before, after = seen["at ERR"], snapshot()
    if len(before) != len(after):
        raise AssertionError(f"the snapshot changed size ({len(before)} -> {len(after)} bytes)")
    return int(np.count_nonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8)))


class Parked:
    """Every call through a function it ``wrap``s waits, before the real call, until ``let_go``: the parts of one
    transfer held at a known point while the test cuts it short (times it out, releases it) and looks at memory.

    Only while armed (from construction until ``let_go``; every call after passes straight through), and never on the
    thread that made it: the test's own thread posts, waits and releases, and what a backend runs there (inside
    ``post``, a cancel's drain) must not wait for the test. ``reached`` is set once a call waits; ``parked`` counts
    the calls waiting now. A call never let go within ``timeout`` (twice the test's own bound on its waits, so that a
    test failing meanwhile lets it go first) fails with AssertionError.
    """

    def __init__(self, what: str = "the parked parts", timeout: float = 2 * BOUND_S) -> None:
        self.what, self.timeout = what, timeout
        self.reached, self.go = threading.Event(), threading.Event()
        self.parked = 0
        self._lock = threading.Lock()
        self._test = threading.get_ident()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``real`` behind the park; a plain function, so it binds as a method when set on a class."""

        def parked(*args: Any, **kwargs: Any) -> Any:
            if not self.go.is_set() and threading.get_ident() != self._test:
                with self._lock:
                    self.parked += 1
                self.reached.set()
                try:
                    if not self.go.wait(self.timeout):
                        raise AssertionError(f"the test never let {self.what} go")
                finally:
                    with self._lock:
                        self.parked -= 1
            return real(*args, **kwargs)

        return parked

    def let_go(self) -> None:
        """Let every parked call go on, and every later one pass."""
        self.go.set()
