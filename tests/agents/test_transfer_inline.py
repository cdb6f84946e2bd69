"""Inline posts: small one-part requests run inside post() (no thread hop); polling state assists."""

import contextlib
import errno
import os
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, aligned_empty
from datamover.agents import transfer as transfer_mod
from datamover.agents.transfer import XferState
from datamover.backends.base import run_inline, run_parts
from datamover.errors import DatamoverError, TransferIOError, TransferStateError

MiB = 1 << 20


class CountingPool:
    """Wraps a backend's pool: counts submissions so a test can tell whether post() handed work to a thread."""

    def __init__(self, pool):
        self.pool, self.submitted = pool, 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return self.pool.submit(*args, **kwargs)

    def shutdown(self, *args, **kwargs):
        return self.pool.shutdown(*args, **kwargs)


def counting(agent, name):
    backend = agent.backend(name)
    backend._pool = CountingPool(backend._pool)
    return backend._pool


@pytest.fixture
def mem_agent():
    with Agent("inline-m", {"backends": {"memcpy": {"threads": 2}}}) as agent:
        src, dst = aligned_empty(8 * MiB), aligned_empty(8 * MiB)
        src[:] = np.frombuffer(np.random.default_rng(1).bytes(src.shape[0]), dtype=np.uint8)
        dst[:] = 0
        agent.register_memory(src)
        agent.register_memory(dst)
        yield agent, src, dst


@pytest.fixture
def file_agent(tmp_path):
    with Agent("inline-p", {"backends": {"posix": {"threads": 2}}}) as agent:
        mem = aligned_empty(8 * MiB)
        mem[:] = np.frombuffer(np.random.default_rng(2).bytes(mem.shape[0]), dtype=np.uint8)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        reg = agent.register_file(path, size=8 * MiB)
        yield agent, mem, reg, path


def read_file(path, offset, n):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


# -- memcpy ------------------------------------------------------------------
def test_memcpy_one_mib_is_done_when_post_returns_without_a_thread(mem_agent):
    agent, src, dst = mem_agent
    pool = counting(agent, "memcpy")
    x = agent.make_transfer("WRITE", agent.prepare(src[:MiB]), None, agent.prepare(dst[3 * MiB : 4 * MiB]), None)
    x.post()
    assert x.state == XferState.DONE  # before any wait
    assert pool.submitted == 0
    assert np.array_equal(dst[3 * MiB : 4 * MiB], src[:MiB])
    assert x.wait() == XferState.DONE
    t = x.telemetry
    assert t.bytes == MiB and t.descriptors == 1 and t.backend == "memcpy"
    assert t.transfer_duration_s is not None and 0 <= t.transfer_duration_s <= t.post_duration_s


def test_memcpy_small_gather_batch_is_inline_and_exact(mem_agent):
    agent, src, dst = mem_agent
    pool = counting(agent, "memcpy")
    perm = np.random.default_rng(3).permutation(256)
    lp = agent.prepare(DescList.blocks(src[: 256 * 4096], 4096))
    rp = agent.prepare(DescList.blocks(dst[: 256 * 4096], 4096))
    x = agent.make_transfer("WRITE", lp, np.arange(256), rp, perm).post()
    assert x.state == XferState.DONE and pool.submitted == 0
    assert np.array_equal(dst[: 256 * 4096].reshape(256, 4096)[perm], src[: 256 * 4096].reshape(256, 4096))


def test_memcpy_above_inline_bytes_goes_to_the_pool(mem_agent):
    agent, src, dst = mem_agent
    pool = counting(agent, "memcpy")
    x = agent.make_transfer("WRITE", agent.prepare(src), None, agent.prepare(dst), None).post()
    assert pool.submitted >= 1
    assert x.wait() == XferState.DONE
    assert np.array_equal(dst, src)


def test_memcpy_inline_bytes_zero_turns_inline_posts_off():
    with Agent("inline-0", {"backends": {"memcpy": {"inline_bytes": 0}}}) as agent:
        src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
        agent.register_memory(src)
        agent.register_memory(dst)
        pool = counting(agent, "memcpy")
        x = agent.transfer("WRITE", src, dst)
        assert x.wait() == XferState.DONE and pool.submitted == 1
        assert np.array_equal(dst, src)


def test_memcpy_inline_repost_moves_the_new_bytes_and_release_ends_it(mem_agent):
    agent, src, dst = mem_agent
    x = agent.make_transfer("WRITE", agent.prepare(src[:4096]), None, agent.prepare(dst[:4096]), None)
    for value in (7, 9, 11):
        src[:4096] = value
        assert x.post().state == XferState.DONE
        assert (dst[:4096] == value).all()
    x.release()
    assert x.state == XferState.RELEASED
    with pytest.raises(TransferStateError):
        x.post()


def test_memcpy_inline_post_delivers_its_notification(mem_agent):
    agent, src, dst = mem_agent
    x = agent.transfer("WRITE", src[:4096], dst[:4096], notify=b"inline-done")
    assert x.state == XferState.DONE
    assert b"inline-done" in agent.get_notifications().get(agent.name, [])


# -- posix -------------------------------------------------------------------
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_posix_one_mib_single_syscall_is_done_when_post_returns(file_agent, op):
    agent, mem, reg, path = file_agent
    pool = counting(agent, "posix")
    if op == "READ":
        with open(path, "r+b") as f:
            f.seek(2 * MiB)
            f.write(bytes(range(256)) * 4096)
    x = agent.make_transfer(op, agent.prepare(mem[:MiB]), None, agent.prepare(DescList.file(reg, [2 * MiB], MiB)), None)
    x.post()
    assert x.state == XferState.DONE and pool.submitted == 0
    assert read_file(path, 2 * MiB, MiB) == mem[:MiB].tobytes()
    assert x.telemetry.transfer_duration_s <= x.telemetry.post_duration_s


def test_posix_single_syscall_above_inline_bytes_goes_to_the_pool(file_agent):
    agent, mem, reg, path = file_agent
    pool = counting(agent, "posix")
    x = agent.transfer("WRITE", mem[: 2 * MiB], DescList.file(reg, [0], 2 * MiB))
    assert pool.submitted == 1
    assert x.wait() == XferState.DONE
    assert read_file(path, 0, 2 * MiB) == mem[: 2 * MiB].tobytes()


def test_posix_small_aio_batch_is_inline_and_a_large_one_is_not(file_agent):
    agent, mem, reg, path = file_agent
    backend = agent.backend("posix")
    pool = counting(agent, "posix")
    perm = np.random.default_rng(4).permutation(16)
    small = agent.make_transfer(
        "WRITE",
        agent.prepare(DescList.blocks(mem[: 16 * 65536], 65536)),
        None,
        agent.prepare(DescList.file(reg, perm * 65536, 65536)),
        None,
    )
    if small.request.plan.aio is None:
        pytest.skip("native AIO is not usable here")
    small.post()
    assert small.state == XferState.DONE and pool.submitted == 0
    disk = np.frombuffer(read_file(path, 0, 16 * 65536), dtype=np.uint8).reshape(16, 65536)
    assert np.array_equal(disk[perm], mem[: 16 * 65536].reshape(16, 65536))
    perm = np.random.default_rng(5).permutation(64)
    big = agent.transfer("WRITE", DescList.blocks(mem[: 64 * 65536], 65536), DescList.file(reg, perm * 65536, 65536))
    assert big.request.plan.aio is not None and not big.request.plan.inline
    assert pool.submitted == 1 and big.wait() == XferState.DONE
    disk = np.frombuffer(read_file(path, 0, 64 * 65536), dtype=np.uint8).reshape(64, 65536)
    assert np.array_equal(disk[perm], mem[: 64 * 65536].reshape(64, 65536))
    assert backend.params["inline_bytes"] == MiB


def test_posix_several_sync_syscalls_above_inline_batch_bytes_use_the_pool(tmp_path):
    with Agent("inline-b", {"backends": {"posix": {"direct": False, "threads": 2}}}) as agent:
        mem = aligned_empty(MiB)
        mem[:] = 5
        agent.register_memory(mem)
        path = tmp_path / "b.bin"
        reg = agent.register_file(path, size=2 * MiB)
        pool = counting(agent, "posix")
        # 8 rows of 64 KiB, not contiguous in the file: 8 syscalls, 512 KiB > inline_batch_bytes
        x = agent.transfer(
            "WRITE", DescList.blocks(mem[: 8 * 65536], 65536), DescList.file(reg, np.arange(8) * 131072, 65536)
        )
        assert x.wait() == XferState.DONE and pool.submitted == 1
        # 4 such rows (256 KiB) stay inline
        y = agent.transfer(
            "WRITE", DescList.blocks(mem[: 4 * 65536], 65536), DescList.file(reg, np.arange(4) * 131072, 65536)
        )
        assert y.state == XferState.DONE and pool.submitted == 1
        assert read_file(path, 7 * 131072, 65536) == b"\x05" * 65536


def test_posix_inline_error_is_typed_and_post_does_not_raise(file_agent):
    agent, mem, reg, path = file_agent
    x = agent.make_transfer(
        "READ", agent.prepare(mem[:65536]), None, agent.prepare(DescList.file(reg, [MiB], 65536)), None
    )
    os.truncate(path, 0)  # the file shrank behind the agent's back: the read finds no bytes
    x.post()  # an I/O error is reported through the transfer, never raised by post()
    assert x.state == XferState.ERR
    assert isinstance(x.error, TransferIOError) and x.error.index == 0 and x.error.backend == "posix"
    with pytest.raises(TransferIOError):
        x.wait()
    os.truncate(path, 8 * MiB)
    assert x.post().wait() == XferState.DONE  # re-post after the error works
    assert not mem[:65536].any()  # the regrown file reads zeros


# -- polling assists -----------------------------------------------------------
@contextlib.contextmanager
def pool_threads_held(backend, threads: int = 2):
    """Keep every thread of ``backend``'s pool busy until the block ends, so queued parts stay unstarted."""
    gate, started = threading.Event(), threading.Barrier(threads + 1)

    def occupy():
        started.wait()
        gate.wait(30)

    blockers = [backend._pool.submit(occupy) for _ in range(threads)]
    started.wait()
    try:
        yield
    finally:
        gate.set()
        for b in blockers:
            b.result(30)


def test_state_poll_runs_parts_no_pool_thread_started(mem_agent, monkeypatch):
    agent, src, dst = mem_agent
    with pool_threads_held(agent.backend("memcpy")):  # both pool threads busy
        x = agent.make_transfer("WRITE", agent.prepare(src), None, agent.prepare(dst), None).post()
        assert repr(x).endswith("state=PROC)")  # repr only looks
        monkeypatch.setattr(transfer_mod, "POLL_ASSIST_AFTER_S", 1e9)
        assert all(x.state == XferState.PROC for _ in range(100))  # a poll soon after post only looks
        assert not dst.any()
        # with both pool threads held, only a poll running the queued parts itself can finish the transfer
        monkeypatch.setattr(transfer_mod, "POLL_ASSIST_AFTER_S", 0.0)
        assert x.state == XferState.DONE
        assert np.array_equal(dst, src)


def test_wait_with_timeout_does_not_run_queued_parts(mem_agent):
    agent, src, dst = mem_agent
    with pool_threads_held(agent.backend("memcpy")):
        x = agent.make_transfer("WRITE", agent.prepare(src), None, agent.prepare(dst), None).post()
        assert x.wait(0.01) == XferState.PROC and not dst.any()
    assert x.wait() == XferState.DONE and np.array_equal(dst, src)


# -- run_inline --------------------------------------------------------------
def test_run_inline_stops_at_the_first_error_and_types_it():
    seen = []

    def work(tag, a, b, completion):
        seen.append((tag, a))
        if a == 1:
            raise ValueError("boom")

    c = run_inline([(0, 1), (1, 2), (2, 3)], work, "t", backend="mine")
    assert c.done() and seen == [("t", 0), ("t", 1)]
    assert isinstance(c.error, DatamoverError) and c.error.backend == "mine"
    assert isinstance(c.error.__cause__, ValueError)
    c.cancel()  # cancelling a finished completion keeps its error
    assert isinstance(c.error.__cause__, ValueError)
    got = []
    c.add_done_callback(got.append)
    assert got == [c] and c.wait(0) and c.wait(None, assist=True)


def test_run_inline_without_error_is_done():
    c = run_inline([(0, 4)], lambda a, b, completion: None, backend="mine")
    assert c.done() and c.error is None and not c.cancelled


def test_ctrl_c_in_a_part_on_the_callers_thread_is_raised_and_the_part_ends_err():
    """KeyboardInterrupt in inline work, or in a part a waiting caller runs (assist), reaches the caller; the
    completion is finished with an error, never left in flight (it was swallowed into an ERR, the interrupt lost)."""

    def interrupted(a, b, completion):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_inline([(0, 1)], interrupted, backend="mine")

    class NoThreads:  # the parts wait here: only the caller's assist runs them
        def submit(self, fn, *args):
            pass

    c = run_parts(NoThreads(), [(0, 1)], interrupted, backend="mine")
    with pytest.raises(KeyboardInterrupt):
        c.wait(1.0, assist=True)
    assert c.done() and isinstance(c.error, DatamoverError)


def test_posix_inline_syscall_error_is_typed_with_its_errno(file_agent, monkeypatch):
    agent, mem, reg, path = file_agent
    x = agent.make_transfer("WRITE", agent.prepare(mem[:MiB]), None, agent.prepare(DescList.file(reg, [0], MiB)), None)
    assert x.request.plan.single is not None  # the one-syscall fast path

    def failing(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", failing)
    x.post()
    assert x.state == XferState.ERR
    assert isinstance(x.error, TransferIOError) and x.error.errno == errno.EIO and x.error.index == 0
    monkeypatch.undo()
    assert x.post().state == XferState.DONE
    assert read_file(path, 0, MiB) == mem[:MiB].tobytes()


def test_memcpy_single_run_overlapping_its_source_copies_like_memmove(mem_agent):
    agent, src, _ = mem_agent
    before = src[:8192].copy()
    x = agent.transfer("WRITE", src[:8192], src[4096 : 4096 + 8192])  # destination overlaps the source
    assert x.request.plan.mode == "row" and x.state == XferState.DONE
    assert np.array_equal(src[4096 : 4096 + 8192], before)
