"""The AIO reaper when io_getevents itself fails (EINVAL, EFAULT) or an exception leaves ``finish`` (Ctrl-C): the
I/Os it submitted are still the kernel's, reading from or writing into the caller's memory, and O_DIRECT AIO cannot
be cancelled. Neither DONE nor ERR may be reported while any is in flight, and the context they are in is never
handed to another transfer (whose reap would count their events as its own).

The fault is injected at a known point: the first io_getevents of a transfer fails before the kernel sees it. A
fake libc counts the I/Os submitted and not yet reaped (io_destroy ends them all: it waits for them).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix import aio
from datamover.backends.posix.aio import AioContext, IocbBatch, aio_available
from datamover.errors import DatamoverError

pytestmark = pytest.mark.skipif(not aio_available()[0], reason="native AIO unavailable here")
B = 4096
N = 8


class _FailingReap:
    """libc for ``aio``: the ``nth`` io_getevents fails with ``fault`` (an errno, or an exception raised) before the
    kernel sees it; counts the I/Os submitted and not reaped, and what was in flight when the test looked."""

    def __init__(self, real, fault: int | type[BaseException], nth: int = 1) -> None:
        self.real, self.fault, self.nth = real, fault, nth
        self.lock = threading.Lock()
        self.getevents = 0
        self.in_flight = 0
        self.destroyed = 0

    def syscall(self, nr, *args):
        if nr == aio._NR_GETEVENTS:
            with self.lock:
                self.getevents += 1
                fail = self.getevents == self.nth
            if fail:
                if isinstance(self.fault, int):
                    ctypes.set_errno(self.fault)
                    return -1
                raise self.fault()
        ret = self.real.syscall(nr, *args)
        with self.lock:
            if nr == aio._NR_SUBMIT and ret > 0:
                self.in_flight += ret
            elif nr == aio._NR_GETEVENTS and ret > 0:
                self.in_flight -= ret
            elif nr == aio._nr["io_destroy"] and ret == 0:
                self.in_flight = 0  # io_destroy returns once every I/O of the context ended
                self.destroyed += 1
        return ret


def _setup(agent: Agent, tmp_path):
    mem = aligned_empty(N * B)
    agent.register_memory(mem)
    path = tmp_path / "f.bin"
    data = np.random.default_rng(7).integers(0, 256, 2 * N * B, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    reg = agent.register_file(path, size=2 * N * B)
    return mem, path, data, DescList.file(reg, np.arange(N) * 2 * B, B)  # gaps: eight I/Os


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "pool"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("fault", [errno.EINVAL, errno.EFAULT], ids=["EINVAL", "EFAULT"])
def test_a_failed_io_getevents_ends_nothing_while_io_is_in_flight(tmp_path, monkeypatch, inline, op, fault):
    params = {} if inline else {"inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        backend = agent.backend("posix")
        mem, path, data, slots = _setup(agent, tmp_path)
        mem[:] = np.random.default_rng(8).integers(0, 256, N * B, dtype=np.uint8)
        want_mem = data.reshape(2 * N, B)[::2].reshape(-1).copy() if op == "READ" else mem.copy()
        libc = _FailingReap(aio._libc, fault)
        monkeypatch.setattr(aio, "_libc", libc)
        xfer = agent.transfer(op, DescList.blocks(mem, B), slots)
        assert xfer.request.plan.aio is not None and xfer.request.plan.inline == inline
        try:
            state = xfer.wait()
        except DatamoverError:
            state = XferState.ERR
        with libc.lock:
            in_flight = libc.in_flight
        assert in_flight == 0, f"the transfer ended {state} with {in_flight} of its I/Os still in flight"
        assert libc.getevents >= 1
        # the I/Os were never reaped, so what they moved is unknown: the transfer is redone on the synchronous path
        assert state == XferState.DONE, xfer.error
        if op == "READ":
            assert np.array_equal(mem, want_mem)
        else:
            disk = np.frombuffer(path.read_bytes(), np.uint8).reshape(2 * N, B)[::2].reshape(-1)
            assert np.array_equal(disk, want_mem)
        # the context those I/Os were in is gone, not handed to the next transfer
        assert libc.destroyed == 1
        assert all(ctx.alive for ctx in backend._aio_all)
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", DescList.blocks(mem, B), slots).wait() == XferState.DONE
        if op == "READ":
            assert np.array_equal(mem, want_mem)


def test_an_exception_out_of_an_inline_reap_leaves_no_io_in_flight(tmp_path, monkeypatch):
    """Ctrl-C while post() reaps an inline batch: it propagates, but only once the batch's I/Os ended, and their
    context is not reused."""
    with Agent("p") as agent:
        backend = agent.backend("posix")
        mem, _, _, slots = _setup(agent, tmp_path)
        libc = _FailingReap(aio._libc, KeyboardInterrupt)
        monkeypatch.setattr(aio, "_libc", libc)
        with pytest.raises(KeyboardInterrupt):
            agent.transfer("READ", DescList.blocks(mem, B), slots)
        assert libc.in_flight == 0, f"Ctrl-C came out of post() with {libc.in_flight} I/Os in flight"
        assert all(ctx.alive for ctx in backend._aio_all)
        monkeypatch.undo()
        assert agent.transfer("READ", DescList.blocks(mem, B), slots).wait() == XferState.DONE


def test_a_failed_io_getevents_on_a_bare_context_names_the_rows_it_lost(tmp_path, monkeypatch):
    """``AioContext.run``: the rows in flight when io_getevents failed read -errno (not -ECANCELED, as if never
    submitted), and the context is gone (io_destroy waited for them)."""
    path = tmp_path / "g.bin"
    path.write_bytes(bytes(4 * B))
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = aligned_empty(4 * B)
    ctx = AioContext(2)
    try:
        libc = _FailingReap(aio._libc, errno.EINVAL)
        monkeypatch.setattr(aio, "_libc", libc)
        batch = IocbBatch(np.full(4, fd), np.arange(4) * B, buf.ctypes.data + np.arange(4) * B, np.full(4, B), False)
        res = ctx.run(batch)
        assert libc.in_flight == 0
        assert list(res) == [-errno.EINVAL] * 2 + [-errno.ECANCELED] * 2
        assert not ctx.alive and libc.destroyed == 1
    finally:
        monkeypatch.undo()
        ctx.close()
        os.close(fd)


class _ShortEvent:
    """libc for ``aio``: the first event io_getevents reaps comes back with ``res`` replaced by ``res(expected)``
    (short by 512 bytes, or -EIO), as the kernel reports a short or failed O_DIRECT I/O."""

    def __init__(self, real, res) -> None:
        self.real, self.res, self.done = real, res, False

    def syscall(self, nr, *args):
        ret = self.real.syscall(nr, *args)
        if nr == aio._NR_GETEVENTS and ret > 0 and not self.done:
            self.done = True
            events = np.frombuffer((ctypes.c_char * (32 * ret)).from_address(args[3].value), dtype=aio.IO_EVENT)
            events["res"][0] = self.res(int(events["res"][0]))
        return ret


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "pool"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("res", [lambda n: n - 512, lambda n: -errno.EIO], ids=["short", "EIO"])
def test_a_short_or_failed_event_is_never_done_unnoticed(tmp_path, monkeypatch, inline, op, res):
    """A short or failed completion makes the batch redo itself on the synchronous path: DONE only with every
    byte moved (the synchronous path reports what it cannot move)."""
    params = {} if inline else {"inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        backend = agent.backend("posix")
        mem, path, data, slots = _setup(agent, tmp_path)
        mem[:] = np.random.default_rng(9).integers(0, 256, N * B, dtype=np.uint8)
        want = data.reshape(2 * N, B)[::2].reshape(-1).copy() if op == "READ" else mem.copy()
        redone = []
        real_groups = type(backend)._run_groups
        monkeypatch.setattr(type(backend), "_run_groups", lambda *a: redone.append(1) or real_groups(*a))
        libc = _ShortEvent(aio._libc, res)
        monkeypatch.setattr(aio, "_libc", libc)
        assert agent.transfer(op, DescList.blocks(mem, B), slots).wait() == XferState.DONE
        assert libc.done and redone == [1]
        got = mem if op == "READ" else np.frombuffer(path.read_bytes(), np.uint8).reshape(2 * N, B)[::2].reshape(-1)
        assert np.array_equal(got, want)
