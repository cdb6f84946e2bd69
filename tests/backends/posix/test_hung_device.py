"""A hung device: AIO I/Os that never end. No call may block on them for ever (close, release, deregistration, an
inline post), the context they are in is never used again nor destroyed on the caller's thread (io_destroy waits
for them), and the memory they may still move bytes into or out of stays allocated until they end.

The device is a fake libc at a known point: io_submit reaches the kernel as usual, but io_getevents reaps nothing
and io_destroy does not return until the test sets ``back`` (the device came back). Every call under test runs in
a thread joined with a bound, so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends import fence
from datamover.backends.posix import aio
from datamover.backends.posix import backend as posix_backend
from datamover.backends.posix.aio import AioContext, IocbBatch, aio_available
from datamover.errors import TransferTimeout
from datamover.testing.waiting import BOUND_S, HeldOnce, bounded, until

pytestmark = pytest.mark.skipif(not aio_available()[0], reason="native AIO unavailable here")
B, N = 4096, 8
#: how long a call under test may take before the test calls it hung (the code's own bounds are a fraction of it)
CALL_BOUND_S = 15.0
GRACE_S = 0.2  # FENCE_S in these tests: how long a cancel waits for a part, and a reap past the cancel


class _HungDevice:
    """libc for ``aio``: io_submit goes to the kernel; io_getevents reaps nothing until ``back`` is set (it waits for
    that as long as its own timeout, or the test's bound when it has none, then returns no events); io_destroy,
    which waits for every I/O of its context to end, waits for ``back``. ``fail``: the first io_getevents fails with
    that errno instead, before the kernel sees it."""

    def __init__(self, real: Any, fail: int | None = None) -> None:
        self.real, self.fail = real, fail
        self.back = threading.Event()
        self.lock = threading.Lock()
        self.waiting = threading.Event()  # a reaper waits in io_getevents
        self.destroying = 0  # io_destroy calls waiting for the device
        self.destroyed = 0

    def syscall(self, nr: int, *args: Any) -> int:
        if nr == aio._NR_GETEVENTS and not self.back.is_set():
            with self.lock:
                fail, self.fail = self.fail, None
            if fail is not None:
                ctypes.set_errno(fail)
                return -1
            timeout = args[4]
            self.waiting.set()
            wait = BOUND_S if timeout is None else timeout._obj.tv_sec + timeout._obj.tv_nsec * 1e-9
            if not self.back.wait(wait):
                return 0
        if nr == aio._nr["io_destroy"]:
            with self.lock:
                self.destroying += 1
            self.back.wait(BOUND_S)
            ret = self.real.syscall(nr, *args)
            with self.lock:
                self.destroying -= 1
                self.destroyed += 1
            return ret
        return self.real.syscall(nr, *args)


@pytest.fixture
def quick(monkeypatch):
    """Short bounds: the fence's (a cancel's wait and reap) and the backend's close."""
    monkeypatch.setattr(fence, "FENCE_S", GRACE_S)
    monkeypatch.setattr(posix_backend, "CLOSE_S", 0.5)


def _file(tmp_path, agent: Agent, name: str = "direct.bin"):
    path = tmp_path / name
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 2 * N * B, dtype=np.uint8).tobytes())
    return agent.register_file(path, size=2 * N * B)


def test_a_run_that_gives_up_retires_its_context_and_keeps_its_buffers(tmp_path, monkeypatch):
    """``finish(limit_s)`` returns with the I/Os still in flight: the context is no longer ``alive`` (never handed
    out again), ``close`` returns within its timeout (before: io_destroy on the caller's thread, waiting for the
    device for ever), and what the batch keeps (the memory its I/Os move) stays allocated until they end."""
    path = tmp_path / "g.bin"
    path.write_bytes(bytes(4 * B))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    libc = _HungDevice(aio._libc)
    ctx = AioContext(4)
    try:
        buf = aligned_empty(4 * B)
        kept = weakref.ref(buf)
        addrs = buf.ctypes.data + np.arange(4) * B
        batch = IocbBatch(np.full(4, fd), np.arange(4) * B, addrs, np.full(4, B), False, keep=buf)
        monkeypatch.setattr(aio, "_libc", libc)
        run = ctx.start(batch)
        del buf
        run.finish(limit_s=0.05)
        assert run.inflight == 4 and not run.ok
        assert not ctx.alive, "a context with I/Os still to come may be handed out again"
        bounded(lambda: ctx.close(timeout=0.1), "AioContext.close", CALL_BOUND_S)
        del batch, run
        gc.collect()
        assert kept() is not None, "the buffer the kernel may still read into was freed"
    finally:
        libc.back.set()
    until(lambda: ctx.gone, what="the retired context's destroy, once the device is back")
    until(lambda: (gc.collect(), kept() is None)[1], what="the buffer freed once its I/Os ended")
    assert libc.destroyed == 1
    os.close(fd)


def test_agent_close_after_a_cancel_gave_up_reaping_is_bounded(tmp_path, monkeypatch, quick):
    """The pool's one thread is held in another READ's preadv, so the AIO READ's cancel reaps it itself, for at most
    the fence's bound, and gives up (the device is hung). ``Agent.close`` then returns within its bound; before, it
    destroyed that context on the caller's thread, and io_destroy waits for the device for ever."""
    params = {"threads": 1, "inline_bytes": 0, "inline_batch_bytes": 0}
    agent = Agent("p", {"backends": {"posix": params}})
    libc = _HungDevice(aio._libc)
    held = HeldOnce("the preadv")
    try:
        mem = aligned_empty(2 * N * B)
        agent.register_memory(mem)
        (tmp_path / "buffered.bin").write_bytes(bytes(N * B))
        buffered = agent.register_file(tmp_path / "buffered.bin", size=N * B, direct=False)
        direct = _file(tmp_path, agent)
        monkeypatch.setattr(os, "preadv", held.wrap(os.preadv))
        hog = agent.transfer("READ", DescList.blocks(mem[: N * B], B), DescList.file(buffered, np.arange(N) * B, B))
        assert held.reached.wait(BOUND_S), "the first READ never reached preadv on the pool's thread"
        monkeypatch.setattr(aio, "_libc", libc)
        dst = DescList.blocks(mem[N * B :], B)
        xfer = agent.transfer("READ", dst, DescList.file(direct, np.arange(N) * 2 * B, B), timeout=0.3)
        assert xfer.request.plan.aio is not None and not xfer.request.plan.inline
        until(lambda: xfer.error is not None, what="the READ timing out")  # its cancel reaps, then gives up
        assert isinstance(xfer.error, TransferTimeout)
        held.go.set()
        assert hog.wait() == XferState.DONE
        bounded(agent.close, "Agent.close", CALL_BOUND_S)
        assert libc.destroying <= 1 and libc.destroyed == 0, "the hung context was destroyed while the device hung"
    finally:
        held.go.set()
        libc.back.set()
        agent.close()


def test_agent_close_while_a_reaper_waits_on_a_hung_device_is_bounded(tmp_path, monkeypatch, quick):
    """The pool's reaper waits in io_getevents for I/Os that never end; the READ times out. ``Agent.close`` returns
    within its bound (before: it waited for the pool's threads, one of them in that io_getevents for ever), the
    reaper gives up once cancelled, and the context it was in is never used again."""
    agent = Agent("p", {"backends": {"posix": {"inline_bytes": 0, "inline_batch_bytes": 0}}})
    libc = _HungDevice(aio._libc)
    try:
        backend = agent.backend("posix")
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        reg = _file(tmp_path, agent)
        monkeypatch.setattr(aio, "_libc", libc)
        xfer = agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * 2 * B, B), timeout=0.3)
        assert libc.waiting.wait(BOUND_S), "the reaper never waited in io_getevents"
        with pytest.raises(TransferTimeout):
            xfer.wait()
        (ctx,) = backend._aio_all
        bounded(agent.close, "Agent.close", CALL_BOUND_S)
        assert not ctx.alive and backend._aio_free.empty(), "the hung context may be handed out again"
    finally:
        libc.back.set()
        agent.close()


def test_an_inline_batch_on_a_hung_device_returns_err_past_its_deadline(tmp_path, monkeypatch, quick):
    """An inline AIO READ (reaped inside ``post``) on a hung device: ``transfer`` returns ERR (TransferTimeout,
    saying bytes may still land) once the deadline and the fence's bound passed; before, post() waited in
    io_getevents for ever. The context is retired, and once the device is back a new batch gets a fresh one."""
    agent = Agent("p")
    libc = _HungDevice(aio._libc)
    try:
        backend = agent.backend("posix")
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        reg = _file(tmp_path, agent)
        slots = DescList.file(reg, np.arange(N) * 2 * B, B)
        monkeypatch.setattr(aio, "_libc", libc)
        xfer = bounded(
            lambda: agent.transfer("READ", DescList.blocks(mem, B), slots, timeout=0.3), "an inline post", CALL_BOUND_S
        )
        assert xfer.request.plan.aio is not None and xfer.request.plan.inline
        assert xfer.state == XferState.ERR
        assert isinstance(xfer.error, TransferTimeout) and "may still" in str(xfer.error), xfer.error
        (hung,) = backend._aio_all
        assert not hung.alive
        libc.back.set()
        until(lambda: hung.gone, what="the retired context's destroy, once the device is back")
        monkeypatch.undo()
        assert agent.transfer("READ", DescList.blocks(mem, B), slots).wait() == XferState.DONE
        assert hung not in backend._aio_all and all(ctx.alive for ctx in backend._aio_all)
    finally:
        libc.back.set()
        agent.close()


@pytest.mark.parametrize("end", ["wait", "release", "deregister"])
def test_a_failed_reap_on_a_hung_device_blocks_no_caller(tmp_path, monkeypatch, quick, caplog, end):
    """io_getevents fails (EINVAL) while the batch's I/Os hang; the pool's one thread is busy elsewhere, so the
    caller reaps: ``wait`` (its assist), ``release`` or deregistering the file (their cancel). The failed reap
    destroys the context, which waits for the I/Os; before, it did so on the caller's thread, for ever. Now the
    caller gets ERR within its bound, and the log says the I/Os may still land."""
    params = {"threads": 1, "inline_bytes": 0, "inline_batch_bytes": 0}
    agent = Agent("p", {"backends": {"posix": params}})
    libc = _HungDevice(aio._libc, fail=errno.EINVAL)
    held = HeldOnce("the preadv")
    try:
        mem = aligned_empty(2 * N * B)
        agent.register_memory(mem)
        (tmp_path / "buffered.bin").write_bytes(bytes(N * B))
        buffered = agent.register_file(tmp_path / "buffered.bin", size=N * B, direct=False)
        direct = _file(tmp_path, agent)
        monkeypatch.setattr(os, "preadv", held.wrap(os.preadv))
        hog = agent.transfer("READ", DescList.blocks(mem[: N * B], B), DescList.file(buffered, np.arange(N) * B, B))
        assert held.reached.wait(BOUND_S), "the first READ never reached preadv on the pool's thread"
        monkeypatch.setattr(aio, "_libc", libc)
        dst = DescList.blocks(mem[N * B :], B)
        xfer = agent.transfer("READ", dst, DescList.file(direct, np.arange(N) * 2 * B, B), timeout=0.3)
        assert xfer.request.plan.aio is not None and not xfer.request.plan.inline
        with caplog.at_level(logging.WARNING, logger="datamover"):
            if end == "wait":
                with pytest.raises(TransferTimeout):
                    bounded(xfer.wait, "Transfer.wait", CALL_BOUND_S)
            elif end == "release":
                bounded(xfer.release, "Transfer.release", CALL_BOUND_S)
            else:
                bounded(lambda: agent.deregister_memory(direct), "deregistering the file", CALL_BOUND_S)
                assert isinstance(xfer.error, TransferTimeout)
        assert libc.fail is None, "the failing io_getevents was never reached"
        assert any("may still" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        held.go.set()
        assert hog.wait() == XferState.DONE
    finally:
        held.go.set()
        libc.back.set()
        agent.close()


def test_a_file_deregistered_under_a_stuck_syscall_stays_open_until_it_returns(tmp_path, monkeypatch, quick):
    """A WRITE's pwritev (the pool's synchronous path) hangs in the kernel and comes back short, as from a device
    that recovers: ``vectored`` resumes the rest with another pwritev on the same fd. Deregistering the file
    meanwhile (its settle times the WRITE out; the fence gives up on the syscall) must not close that fd: a new open
    takes the lowest free number, and the resumed pwritev would write the caller's bytes into that other file, as it
    did before. Now the fd is closed only once the part returned."""
    agent = Agent("p", {"backends": {"posix": {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}}})
    reused = -1
    held = HeldOnce("the pwritev")
    try:
        agent.backend("posix")  # started now: the file's registration gets its handle
        src = aligned_empty(N * B)
        src[:] = 0x5A
        agent.register_memory(src)
        path, other = tmp_path / "f.bin", tmp_path / "other.bin"
        path.write_bytes(bytes(N * B))
        other.write_bytes(bytes(N * B))
        reg = agent.register_file(path, size=N * B, direct=False)
        handle = reg.handles["posix"]
        fd, real = handle.fd, os.pwritev

        def pwritev(f: int, views: list, offset: int) -> int:
            if f != fd or held.reached.is_set():
                return real(f, views, offset)
            moved = real(f, [views[0][: N * B // 2]], offset)  # in the kernel, on the file it holds
            held.reached.set()
            assert held.go.wait(BOUND_S), "the test never let the pwritev go"
            held.returned.set()
            return moved  # short: the caller resumes from here

        monkeypatch.setattr(os, "pwritev", pwritev)
        xfer = agent.transfer("WRITE", DescList.blocks(src, B), DescList.file(reg, np.arange(N) * B, B), timeout=0.3)
        assert held.reached.wait(BOUND_S), "the WRITE never reached pwritev"
        bounded(lambda: agent.deregister_memory(reg), "deregistering the file", CALL_BOUND_S)
        assert isinstance(xfer.error, TransferTimeout)
        try:
            still_open = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            still_open = False
        if not still_open:  # as any open in the process may: the number now names another file
            reused = os.open(other, os.O_RDWR)
            if reused != fd:
                os.dup2(reused, fd)
                os.close(reused)
                reused = fd
        held.go.set()
        assert xfer._completion.wait(BOUND_S), "the WRITE's part never returned"
        assert other.read_bytes() == bytes(N * B), "the resumed pwritev wrote into a file the fd number names now"
        assert handle.closed, "the file was not closed once the part on it returned"
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        held.go.set()
        if reused >= 0:
            os.close(reused)
        agent.close()
