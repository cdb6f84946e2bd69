"""An inline post (``post()`` runs the transfer's syscalls itself, on the caller's thread) stuck on a hung device.
It holds the transfer's lock while it runs, so ``release``, deregistration (``settle``) and ``Agent.close`` must not
wait on that lock for ever: past the post's deadline and the fence's bound they give up on it, the transfer is ERR
(``TransferTimeout``, saying the call under way may still move bytes), and the post, once its syscall returns,
starts nothing more: no more of the caller's bytes reach the file after ERR.

The device is the file's pwritev (or the AIO reaper's io_getevents) at a known call: it moves part of what it was
asked for, then waits until the test lets it go. The post runs on a thread of the test, joined with a bound, and
every call under test runs through ``bounded``, so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends import fence
from datamover.backends.base import clock
from datamover.backends.posix import aio, rows
from datamover.backends.posix.aio import aio_available
from datamover.errors import TransferTimeout
from datamover.testing.waiting import BOUND_S, bounded, until

from .stuck import head

B, N = 4096, 8
GRACE_S = 0.2  # FENCE_S in these tests
TIMEOUT_S = 0.3
#: how long a call under test may take before the test calls it blocked (the code's own bound is TIMEOUT_S + GRACE_S)
CALL_BOUND_S = 10.0


class _StuckPwritev:
    """``os.pwritev``: its first call on the file writes the first ``part`` bytes asked for (all when None), then
    waits for ``go`` and returns that count. Every call made once ``ended`` is set is recorded in ``after``."""

    def __init__(self, real, path, part: int | None) -> None:
        self.real, self.part = real, part
        self.ino = os.stat(path).st_ino
        self.calls = 0
        self.after: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, fd: int, views: list, offset: int) -> int:
        with self.lock:
            if self.ended.is_set():
                self.after.append((fd, offset))
            try:
                mine = os.fstat(fd).st_ino == self.ino
            except OSError:  # a closed fd: the call fails as it would
                mine = False
            self.calls += mine
            held = mine and self.calls == 1
        if not held:
            return self.real(fd, views, offset)
        first = head(views, self.part)
        moved = self.real(fd, first, offset)  # in the kernel, before the device hung
        self.reached.set()
        assert self.go.wait(BOUND_S), "the test never let the stuck pwritev go"
        return moved


@pytest.mark.parametrize("end", ["release", "deregister", "close"])
@pytest.mark.parametrize("shape", ["one syscall", "several"])
def test_a_stuck_inline_pwritev_blocks_no_caller_and_writes_nothing_after_err(tmp_path, monkeypatch, shape, end):
    """``one syscall``: the fast path's pwritev writes half and comes back short (post() then redid it all);
    ``several``: the first of eight inline syscalls writes its row and comes back (post() then wrote the others).
    Before, ``release``, deregistering the file and ``Agent.close`` waited for the post's lock until the syscall
    returned, and the post then wrote the caller's buffer, reused since ERR, into the file."""
    monkeypatch.setattr(fence, "FENCE_S", GRACE_S)
    agent = Agent("p", {"backends": {"posix": {"aio": False}}})
    stuck = poster = None
    try:
        agent.backend("posix")
        src = aligned_empty(N * B)
        data = np.random.default_rng(9).integers(0, 256, N * B, dtype=np.uint8)
        src[:] = data
        agent.register_memory(src)
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(2 * N * B))
        reg = agent.register_file(path, size=2 * N * B, direct=False)
        stride = B if shape == "one syscall" else 2 * B  # gaps between rows: one syscall each
        local = agent.prepare(DescList.blocks(src, B))
        remote = agent.prepare(DescList.file(reg, np.arange(N) * stride, B))
        xfer = agent.make_transfer("WRITE", local, np.arange(N), remote, np.arange(N), timeout=TIMEOUT_S)
        plan = xfer.request.plan
        assert plan.inline and (plan.single is not None) == (shape == "one syscall")
        stuck = _StuckPwritev(os.pwritev, path, N * B // 2 if shape == "one syscall" else None)
        monkeypatch.setattr(rows.os, "pwritev", stuck)
        poster = threading.Thread(target=xfer.post, name="inline post")
        poster.start()
        assert stuck.reached.wait(BOUND_S), "the post never reached pwritev"
        if end == "release":
            bounded(xfer.release, "Transfer.release", CALL_BOUND_S)
            assert xfer.state == XferState.RELEASED
        elif end == "deregister":
            bounded(lambda: agent.deregister_memory(reg), "deregistering the file", CALL_BOUND_S)
            assert xfer.state == XferState.ERR
        else:
            bounded(agent.close, "Agent.close", CALL_BOUND_S)
            assert xfer.state == XferState.ERR
        assert isinstance(xfer.error, TransferTimeout) and "may still" in str(xfer.error), xfer.error
        stuck.ended.set()
        at_err = path.read_bytes()
        src[:] = 0xBB  # the caller's next use of its buffer, once the WRITE reported ERR
        stuck.go.set()
        poster.join(BOUND_S)
        assert not poster.is_alive(), "the stuck post never returned once its syscall did"
        assert stuck.after == [], f"pwritev calls (fd, offset) after ERR: {stuck.after}"
        assert path.read_bytes() == at_err, "the caller's bytes reached the file after the WRITE reported ERR"
        assert xfer.state in (XferState.ERR, XferState.RELEASED)
        assert isinstance(xfer.error, TransferTimeout), xfer.error
    finally:
        if stuck is not None:
            stuck.go.set()
        if poster is not None:
            poster.join(BOUND_S)
        agent.close()


def test_a_stuck_inline_write_is_not_synced_after_err(tmp_path, monkeypatch):
    """An inline WRITE with ``fsync``: its one pwritev is stuck while the file is deregistered (its settle gives the
    post up, then the file is closed: its fd number is free for any open). Once the pwritev comes back, the post
    must not fdatasync that number. Before, it did (the loop of groups was done; only the sync was left)."""
    monkeypatch.setattr(fence, "FENCE_S", GRACE_S)
    with Agent("p", {"backends": {"posix": {"aio": False, "fsync": True}}}) as agent:
        agent.backend("posix")
        src = aligned_empty(N * B)
        src[:] = 0x5A
        agent.register_memory(src)
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(N * B))
        reg = agent.register_file(path, size=N * B, direct=False)
        local = agent.prepare(DescList.blocks(src, B))
        remote = agent.prepare(DescList.file(reg, np.arange(N) * B, B))
        xfer = agent.make_transfer("WRITE", local, np.arange(N), remote, np.arange(N), timeout=TIMEOUT_S)
        plan = xfer.request.plan
        assert plan.inline and len(plan.groups) == 1
        stuck = _StuckPwritev(os.pwritev, path, None)
        monkeypatch.setattr(rows.os, "pwritev", stuck)
        synced: list[int] = []
        real_sync = os.fdatasync
        monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_sync(fd))[1])
        poster = threading.Thread(target=xfer.post, name="inline post")
        poster.start()
        try:
            assert stuck.reached.wait(BOUND_S), "the post never reached pwritev"
            bounded(lambda: agent.deregister_memory(reg), "deregistering the file", CALL_BOUND_S)
            assert isinstance(xfer.error, TransferTimeout), xfer.error
        finally:
            stuck.go.set()
            poster.join(BOUND_S)
        assert not poster.is_alive(), "the stuck post never returned once its syscall did"
        assert synced == [], f"fdatasync of fd {synced} after the post was given up on and its file closed"


class _WatchedLock:
    """A transfer's lock that says when a caller waits on it (a known point: ``release`` waiting for the post)."""

    def __init__(self, real) -> None:
        self.real = real
        self.waiting = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.real.acquire(False):
            return True
        if not blocking:
            return False
        self.waiting.set()
        return self.real.acquire(True, timeout)

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return self.real.locked()


def test_release_waits_for_an_inline_post_that_returns_within_its_bound(tmp_path, monkeypatch):
    """The fast path's pwritev comes back short while ``release`` waits for the post, well within the deadline:
    ``release`` takes the lock once the post is done (which redid the write) and gives nothing up: no error, and
    the file holds the caller's bytes."""
    monkeypatch.setattr(fence, "FENCE_S", GRACE_S)
    with Agent("p", {"backends": {"posix": {"aio": False}}}) as agent:
        src = aligned_empty(N * B)
        data = np.random.default_rng(10).integers(0, 256, N * B, dtype=np.uint8)
        src[:] = data
        agent.register_memory(src)
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(N * B))
        reg = agent.register_file(path, size=N * B, direct=False)
        local = agent.prepare(DescList.blocks(src, B))
        remote = agent.prepare(DescList.file(reg, np.arange(N) * B, B))
        xfer = agent.make_transfer("WRITE", local, np.arange(N), remote, np.arange(N), timeout=60)
        assert xfer.request.plan.single is not None
        stuck = _StuckPwritev(os.pwritev, path, N * B // 2)
        monkeypatch.setattr(rows.os, "pwritev", stuck)
        lock = xfer._lock = _WatchedLock(xfer._lock)
        poster = threading.Thread(target=xfer.post, name="inline post")
        poster.start()
        releaser = None
        try:
            assert stuck.reached.wait(BOUND_S), "the post never reached pwritev"
            out: dict = {}
            releaser = threading.Thread(target=lambda: out.update(err=xfer.release()), name="release")
            releaser.start()
            assert lock.waiting.wait(BOUND_S), "release never waited for the post"
            stuck.go.set()
            releaser.join(BOUND_S)
            assert not releaser.is_alive(), "release still waits once the post returned"
        finally:
            stuck.go.set()
            poster.join(BOUND_S)
            if releaser is not None:
                releaser.join(BOUND_S)
        assert out["err"] is None and xfer.error is None, xfer.error
        assert xfer.state == XferState.RELEASED
        assert path.read_bytes() == data.tobytes()


class _SlowAio:
    """libc for ``aio``: the first io_getevents waits, before the kernel sees it, until the test lets it go; every
    io_submit that gets I/Os in once ``ended`` is set is counted in ``late``."""

    def __init__(self, real) -> None:
        self.real = real
        self.getevents = 0
        self.late = 0
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.reached, self.go = threading.Event(), threading.Event()

    def syscall(self, nr, *args):
        if nr == aio._NR_GETEVENTS:
            with self.lock:
                self.getevents += 1
                held = self.getevents == 1
            if held:
                self.reached.set()
                assert self.go.wait(BOUND_S), "the test never let io_getevents go"
        ret = self.real.syscall(nr, *args)
        if nr == aio._NR_SUBMIT and ret > 0 and self.ended.is_set():
            with self.lock:
                self.late += ret
        return ret


@pytest.mark.skipif(not aio_available()[0], reason="native AIO unavailable here")
def test_an_inline_aio_batch_submits_nothing_past_its_deadline(tmp_path, monkeypatch):
    """Eight I/Os two at a time, inline: the first reap is held until the deadline passed. Nothing more goes to the
    kernel then (a post given up on past its deadline must start nothing), and the WRITE is ERR. Before, the
    remaining six I/Os were submitted past the deadline, up to FENCE_S past it and later, and it came back DONE."""
    with Agent("p", {"backends": {"posix": {"aio_depth": 2}}}) as agent:
        src = aligned_empty(N * B)
        src[:] = 0x5A
        agent.register_memory(src)
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(2 * N * B))
        reg = agent.register_file(path, size=2 * N * B)
        local = agent.prepare(DescList.blocks(src, B))
        remote = agent.prepare(DescList.file(reg, np.arange(N) * 2 * B, B))
        xfer = agent.make_transfer("WRITE", local, np.arange(N), remote, np.arange(N), timeout=TIMEOUT_S)
        assert xfer.request.plan.aio is not None and xfer.request.plan.inline
        libc = _SlowAio(aio._libc)
        monkeypatch.setattr(aio, "_libc", libc)
        poster = threading.Thread(target=xfer.post, name="inline post")
        poster.start()
        try:
            assert libc.reached.wait(BOUND_S), "the post never reaped"
            until(lambda: clock() > xfer.request.deadline, what="the deadline passing")
            libc.ended.set()
        finally:
            libc.go.set()
            poster.join(BOUND_S)
        assert not poster.is_alive(), "the inline post never returned"
        assert libc.late == 0, f"{libc.late} I/O(s) submitted past the deadline"
        assert xfer.state == XferState.ERR and isinstance(xfer.error, TransferTimeout), xfer.error
