"""``datamover.testing.waiting``: ``until`` returns once its condition holds and fails naming it; ``bounded`` returns
what its call gave and fails naming a call still blocked; ``HeldOnce`` holds the first call only; ``cut_short`` ends a
held transfer and counts what changed after ERR."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.testing.waiting import HeldOnce, bounded, cut_short, until


def test_until_returns_once_the_condition_holds() -> None:
    calls = []
    until(lambda: calls.append(1) or len(calls) >= 3, timeout=5)
    assert len(calls) == 3


def test_until_names_what_never_held() -> None:
    with pytest.raises(AssertionError, match=r"the flag did not hold within 0\.05 s"):
        until(lambda: False, timeout=0.05, what="the flag")


def test_bounded_returns_what_the_call_returned_and_raises_what_it_raised() -> None:
    assert bounded(lambda: 7, "seven", timeout=10) == 7
    with pytest.raises(ZeroDivisionError):
        bounded(lambda: 1 // 0, "a division", timeout=10)


def test_bounded_names_a_call_still_blocked() -> None:
    go = threading.Event()
    try:
        with pytest.raises(AssertionError, match=r"the blocked call still blocked 0\.05 s in"):
            bounded(lambda: go.wait(10), "the blocked call", timeout=0.05)
    finally:
        go.set()


def test_held_once_holds_only_the_first_call_until_go() -> None:
    held = HeldOnce("the call")
    calls = []
    fn = held.wrap(lambda x: calls.append(x) or x)
    first = threading.Thread(target=fn, args=(1,))
    first.start()
    assert held.reached.wait(10)
    assert fn(2) == 2 and calls == [2], "a second call waited behind the hold"
    assert not held.returned.is_set() and first.is_alive()
    held.go.set()
    first.join(10)
    assert held.returned.is_set() and calls == [2, 1]


def test_held_once_binds_as_a_method_and_shares_one_hold() -> None:
    held = HeldOnce()

    class A:
        def f(self) -> str:
            return "a"

    class B:
        def f(self) -> str:
            return "b"

    A.f, B.f = held.wrap(A.f), held.wrap(B.f)  # type: ignore[method-assign]
    t = threading.Thread(target=A().f)
    t.start()
    assert held.reached.wait(10)
    assert B().f() == "b", "the second wrapped function was held too"
    held.go.set()
    t.join(10)
    assert held.returned.is_set()


def test_held_once_fails_naming_what_nobody_let_go() -> None:
    held = HeldOnce("the preadv", timeout=0.05)
    with pytest.raises(AssertionError, match="the test never let the preadv go"):
        held.wrap(lambda: None)()


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_cut_short_ends_a_held_copy_and_counts_what_changed_after_err(monkeypatch, end) -> None:
    """A real memcpy copy held at its first memmove: ERR (or release) while held, then let go and settled. The
    count compares the two snapshots: here the snapshot callable gives 2 differing bytes the second time."""
    from datamover.backends.memcpy import backend as memcpy_mod

    snaps = iter([b"abcd", b"abXY"])
    with Agent("w", {"backends": {"memcpy": {"threads": 1, "inline_bytes": 0}}}) as agent:
        src, dst = aligned_empty(8 << 20), aligned_empty(8 << 20)
        agent.register_memory(src)
        agent.register_memory(dst)
        held = HeldOnce("the copy")
        monkeypatch.setattr(memcpy_mod, "_memmove", held.wrap(memcpy_mod._memmove))
        frm = DescList.blocks(src, 1 << 20)
        to = DescList.from_columns(dst.ctypes.data + np.arange(4) * (2 << 20), 1 << 20)
        xfer = agent.transfer("WRITE", frm[:4], to, timeout=0.5)
        assert held.reached.wait(60)
        assert cut_short(xfer, xfer._completion, end, lambda: next(snaps), held) == 2
        assert held.returned.is_set()
        assert xfer.state == (XferState.ERR if end == "timeout" else XferState.RELEASED)


def test_cut_short_refuses_an_unknown_end() -> None:
    with pytest.raises(ValueError, match="'timeout' or 'release'"):
        cut_short(None, None, "later", bytes, HeldOnce())
