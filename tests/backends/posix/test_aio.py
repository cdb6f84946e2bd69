"""Linux native AIO: the engine on its own, and the posix backend's AIO path (short I/O, EOF, errors, cancel)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from datamover import Agent, DescList, aligned_empty
from datamover.backends.posix import aio
from datamover.backends.posix.aio import AioContext, AioRun, IocbBatch, aio_available
from datamover.errors import TransferIOError

OK, REASON = aio_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"native AIO unavailable: {REASON}")
B = 4096


@pytest.fixture
def direct_file(tmp_path):
    path = tmp_path / "a.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, 64 * B)
    yield fd, path
    os.close(fd)


def _random(n: int, seed: int = 0) -> np.ndarray:
    buf = aligned_empty(n)
    buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8)
    return buf


@pytest.mark.parametrize("depth", [1, 3, 128])
def test_scattered_round_trip_deeper_than_the_context(direct_file, depth) -> None:
    fd, path = direct_file
    n = 40
    src = _random(n * B, depth)
    perm = np.random.default_rng(1).permutation(n)
    addrs = src.ctypes.data + np.arange(n) * B
    ctx = AioContext(depth)
    try:
        res = ctx.run(IocbBatch(np.full(n, fd), perm * B, addrs, np.full(n, B), write=True))
        assert (res == B).all()
        disk = np.frombuffer(path.read_bytes(), np.uint8)[: n * B].reshape(n, B)
        assert np.array_equal(disk[perm], src.reshape(n, B))
        dst = aligned_empty(n * B)
        dst[:] = 0
        res = ctx.run(IocbBatch(np.full(n, fd), perm * B, dst.ctypes.data + np.arange(n) * B, np.full(n, B), False))
        assert (res == B).all()
        assert np.array_equal(dst, src)
    finally:
        ctx.close()


def test_vectored_groups_and_a_range_of_them(direct_file) -> None:
    fd, path = direct_file
    src = _random(8 * B, 5)
    # rows 0-2 contiguous in the file (one PWRITEV), row 3 alone, rows 4-7 contiguous
    offs = np.array([10, 11, 12, 0, 20, 21, 22, 23]) * B
    starts = np.array([0, 3, 4])
    batch = IocbBatch(np.full(8, fd), offs, src.ctypes.data + np.arange(8) * B, np.full(8, B), True, starts)
    assert list(batch.expect) == [3 * B, B, 4 * B]
    ctx = AioContext(4)
    try:
        assert list(ctx.run(batch, first=1, last=3)) == [B, 4 * B]  # only groups 1 and 2
        disk = np.frombuffer(path.read_bytes(), np.uint8)
        assert not disk[10 * B : 13 * B].any()
        assert np.array_equal(disk[20 * B : 24 * B], src[4 * B :])
        assert list(ctx.run(batch)) == [3 * B, B, 4 * B]
        disk = np.frombuffer(path.read_bytes(), np.uint8)
        assert np.array_equal(disk[10 * B : 13 * B], src[: 3 * B])
        assert np.array_equal(disk[:B], src[3 * B : 4 * B])
    finally:
        ctx.close()


def test_errors_short_reads_and_cancel_are_reported_per_row(direct_file) -> None:
    fd, _ = direct_file
    buf = aligned_empty(4 * B)
    ctx = AioContext(8)
    try:
        # a read that runs past the end of the file comes back short; one at the end moves 0 bytes
        lengths = np.array([B, 2 * B, B, B])
        offs = np.array([0, 63 * B, 64 * B, 62 * B])
        res = ctx.run(IocbBatch(np.full(4, fd), offs, buf.ctypes.data + np.array([0, 1, 3, 3]) * B, lengths, False))
        assert list(res) == [B, B, 0, B]
        bad = ctx.run(IocbBatch(np.array([987654]), np.array([0]), np.array([buf.ctypes.data]), np.array([B]), False))
        assert list(bad) == [-errno.EBADF]
        never = ctx.run(IocbBatch(np.full(4, fd), offs, buf.ctypes.data + np.arange(4) * B, np.full(4, B), False),
                        cancelled=lambda: True)  # fmt: skip
        assert list(never) == [-errno.ECANCELED] * 4
    finally:
        ctx.close()


@pytest.fixture
def agent_file(tmp_path):
    agent = Agent("aio", {"backends": {"posix": {"threads": 2}}})
    mem = aligned_empty(256 * B)
    agent.register_memory(mem)
    reg = agent.register_file(tmp_path / "f.bin", size=256 * B)
    yield agent, mem, reg, tmp_path / "f.bin"
    agent.close()


def test_posix_uses_aio_for_aligned_direct_batches(agent_file, monkeypatch) -> None:
    agent, mem, reg, path = agent_file
    runs = []
    real = AioContext.start
    monkeypatch.setattr(AioContext, "start", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    n = 200
    mem[: n * B] = _random(n * B, 7)
    perm = np.random.default_rng(2).permutation(n)
    agent.transfer("WRITE", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B)).wait()
    disk = np.frombuffer(path.read_bytes(), np.uint8)[: n * B].reshape(n, B)
    assert np.array_equal(disk[perm], mem[: n * B].reshape(n, B))
    want = mem[: n * B].copy()
    mem[:] = 0
    agent.transfer("READ", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B)).wait()
    assert np.array_equal(mem[: n * B], want)
    assert len(runs) == 2
    # unaligned rows keep the synchronous path
    agent.transfer("READ", DescList.from_columns(mem.ctypes.data + 1, 100), DescList.file(reg, [5], [100])).wait()
    assert len(runs) == 2


@pytest.mark.parametrize("loss", [512, B + errno.EAGAIN])  # one group short by 512 bytes; one failed (-EAGAIN)
def test_short_or_failed_aio_groups_are_redone(agent_file, monkeypatch, loss) -> None:
    agent, mem, reg, _ = agent_file
    backend = agent.backend("posix")
    real, real_groups = AioRun.finish, type(backend)._run_groups
    lossy_runs, redone = [], []

    def lossy(self, *args, **kwargs):
        res = real(self, *args, **kwargs)
        self.moved -= loss  # as if the kernel had reported one group short or failed
        lossy_runs.append(self.ok)
        return res

    def spy(self, req, p, write, first, last, completion):
        redone.append((first, last))
        return real_groups(self, req, p, write, first, last, completion)

    monkeypatch.setattr(AioRun, "finish", lossy)
    monkeypatch.setattr(type(backend), "_run_groups", spy)
    monkeypatch.setitem(backend.params, "inline_bytes", 128 * B)
    for n in (30, 200):  # 30 x 4 KiB is inline (reaped in post), 200 x 4 KiB goes to the pool
        src = _random(n * B, 9)
        mem[: n * B] = src
        perm = np.random.default_rng(4).permutation(n)
        x = agent.transfer("WRITE", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B))
        assert x.request.plan.inline == (n == 30)
        x.wait()
        mem[:] = 0
        agent.transfer("READ", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B)).wait()
        assert np.array_equal(mem[: n * B], src)
    assert lossy_runs == [False] * 4
    assert len(redone) == 4 and all(first == 0 and last >= 1 for first, last in redone)


def test_run_ok_only_when_every_row_moved_all_its_bytes(direct_file) -> None:
    fd, _ = direct_file
    buf = _random(4 * B, 3)
    ctx = AioContext(2)
    try:
        full = IocbBatch(np.full(4, fd), np.arange(4) * B, buf.ctypes.data + np.arange(4) * B, np.full(4, B), True)
        run = ctx.start(full, rows=False)
        assert run.finish() is None and run.ok and run.moved == 4 * B == full.total
        # a read running past the end of the 64-block file moves 1 of its 2 blocks: not ok, by B bytes
        short = IocbBatch(np.full(2, fd), np.array([0, 63 * B]), buf.ctypes.data + np.array([0, B]),
                          np.array([B, 2 * B]), False)  # fmt: skip
        run = ctx.start(short, rows=False)
        run.finish()
        assert not run.ok and run.moved == 2 * B and short.total == 3 * B
        bad = IocbBatch(np.array([987654]), np.array([0]), np.array([buf.ctypes.data]), np.array([B]), False)
        run = ctx.start(bad, rows=False)
        run.finish()
        assert not run.ok and run.refused
        assert not ctx._lock.locked()
    finally:
        ctx.close()


def test_aio_read_past_end_is_an_error(agent_file) -> None:
    agent, mem, reg, path = agent_file
    os.truncate(path, 4 * B)  # behind the agent's back
    with pytest.raises(TransferIOError, match="past the end"):
        agent.transfer("READ", DescList.blocks(mem[: 8 * B], B), DescList.file(reg, np.arange(8) * B * 2, B)).wait()


def test_aio_can_be_turned_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(AioContext, "start", lambda *a, **k: pytest.fail("aio used although turned off"))
    with Agent("noaio", {"backends": {"posix": {"aio": False}}}) as agent:
        mem = _random(8 * B)
        agent.register_memory(mem)
        reg = agent.register_file(tmp_path / "g.bin", size=8 * B)
        agent.transfer("WRITE", DescList.blocks(mem, B), DescList.file(reg, np.arange(8) * B, B)).wait()
        assert (tmp_path / "g.bin").read_bytes() == mem.tobytes()


def test_unavailable_is_explained(monkeypatch) -> None:
    monkeypatch.setattr(aio, "_status", (False, "io_setup failed: Function not implemented"))
    from datamover.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="io_setup failed"):
        AioContext(4)


def test_aio_write_with_fsync_syncs_every_file(agent_file, monkeypatch) -> None:
    _, mem, reg, _ = agent_file
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd) or real(fd))
    with Agent("aio-sync", {"backends": {"posix": {"fsync": True}}}) as sync_agent:
        sync_agent.register_memory(mem)
        r = sync_agent.register_file(reg.path, size=8 * B)
        sync_agent.transfer("WRITE", DescList.blocks(mem[: 8 * B], B), DescList.file(r, np.arange(8) * B, B)).wait()
        assert synced == [r.handles["posix"].fd]


def test_release_while_aio_in_flight_reaps_everything(agent_file) -> None:
    agent, mem, reg, _ = agent_file
    backend = agent.backend("posix")
    n = 256
    lp = agent.prepare(DescList.blocks(mem[: n * B], B))
    rp = agent.prepare(DescList.file(reg, np.random.default_rng(3).permutation(n) * B, B))
    for _ in range(5):
        x = agent.make_transfer("READ", lp, None, rp, None)
        x.post()
        x.release()  # aborts or waits; either way no I/O may still be in flight afterwards
    contexts = backend._aio_all
    assert contexts and all(not c._lock.locked() for c in contexts)
    assert backend._aio_free.qsize() == len(contexts)


@pytest.mark.parametrize("spin_us", [0, 50_000])
def test_spinning_and_sleeping_reap_the_same_bytes(direct_file, spin_us) -> None:
    fd, _ = direct_file
    n = 48
    src = _random(n * B, 11)
    ctx = AioContext(8, spin_us)  # 48 rows through 8 slots: refills, then the last ones polled or slept on
    try:
        perm = np.random.default_rng(6).permutation(n)
        assert (
            ctx.run(IocbBatch(np.full(n, fd), perm * B, src.ctypes.data + np.arange(n) * B, np.full(n, B), True)) == B
        ).all()
        dst = aligned_empty(n * B)
        dst[:] = 0
        res = ctx.run(IocbBatch(np.full(n, fd), perm * B, dst.ctypes.data + np.arange(n) * B, np.full(n, B), False))
        assert (res == B).all() and np.array_equal(dst, src)
    finally:
        ctx.close()


def test_rows_tiling_a_file_range_become_one_vectored_io(agent_file, monkeypatch) -> None:
    agent, mem, reg, path = agent_file
    batches = []
    real = AioContext.start
    monkeypatch.setattr(AioContext, "start", lambda self, b, *a, **k: batches.append(b) or real(self, b, *a, **k))
    n = 64
    src = _random(n * B, 12)
    mem[: n * B] = src
    perm = np.random.default_rng(8).permutation(n)  # memory block i -> file slot perm[i]: slots 0..63 tiled
    agent.transfer("WRITE", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B)).wait()
    assert len(batches[-1]) == 1 and batches[-1].expect.tolist() == [n * B]  # one PWRITEV of 64 iovecs
    disk = np.frombuffer(path.read_bytes(), np.uint8)[: n * B].reshape(n, B)
    assert np.array_equal(disk[perm], src.reshape(n, B))
    mem[:] = 0
    agent.transfer("READ", DescList.blocks(mem[: n * B], B), DescList.file(reg, perm * B, B)).wait()
    assert np.array_equal(mem[: n * B], src)


def test_reads_of_the_same_offsets_twice(agent_file) -> None:
    agent, mem, reg, _ = agent_file
    data = _random(2 * B, 13)
    mem[: 2 * B] = data
    agent.transfer("WRITE", DescList.blocks(mem[: 2 * B], B), DescList.file(reg, [0, B], B)).wait()
    mem[:] = 0
    # rows 0,1 and rows 2,3 read the same two blocks: sorted, the groups differ from descriptor order
    agent.transfer("READ", DescList.blocks(mem[: 4 * B], B), DescList.file(reg, [0, B, 0, B], B)).wait()
    assert np.array_equal(mem[: 2 * B], data) and np.array_equal(mem[2 * B : 4 * B], data)


def test_close_does_not_hang_on_a_run_that_was_never_finished(direct_file, caplog) -> None:
    """A started run whose reaper never came (a bug elsewhere) must not hang the agent's close forever."""
    fd, _ = direct_file
    buf = aligned_empty(B)
    ctx = AioContext(4)
    run = ctx.start(IocbBatch(np.array([fd]), np.array([0]), np.array([buf.ctypes.data]), np.array([B]), False))
    ctx.close(timeout=0.05)
    assert ctx._ctx.value, "a context with I/O possibly in flight was destroyed"
    assert "still busy" in caplog.text
    assert list(run.finish()) == [B]
    ctx.close()
    assert not ctx._ctx.value


def test_a_bounded_finish_returns_with_what_never_completed_still_in_flight(direct_file, monkeypatch) -> None:
    """A cancel's own reap (``limit_s``) must end even if the kernel never completes an I/O: each io_getevents then
    carries a timeout, and the run returns with the I/Os still counted in flight (here io_getevents reports none,
    as for a hung device)."""
    fd, _ = direct_file
    buf = _random(2 * B, 4)
    ctx = AioContext(4)
    real = aio._libc
    timeouts = []

    class Hung:
        def syscall(self, nr, *args):
            if nr == aio._NR_GETEVENTS:
                timeouts.append(args[4])
                return 0  # the wait's timeout ran out with nothing completed
            return real.syscall(nr, *args)

    try:
        run = ctx.start(IocbBatch(np.full(2, fd), np.arange(2) * B, buf.ctypes.data + np.arange(2) * B,
                                  np.full(2, B), False), rows=False)  # fmt: skip
        monkeypatch.setattr(aio, "_libc", Hung())
        run.finish(lambda: True, spin=False, limit_s=0.05)
        assert run.inflight == 2 and not run.ok
        assert timeouts and all(t is not None for t in timeouts), "an io_getevents without a timeout could hang"
        assert not ctx._lock.locked()
    finally:
        monkeypatch.undo()
        ctx.close()  # io_destroy waits for the two reads


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "pool"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_no_aio_context_to_be_had_runs_the_batch_synchronously(tmp_path, monkeypatch, caplog, inline, op) -> None:
    """io_setup refuses a new context (EAGAIN: the machine's fs.aio-max-nr is used up by other processes): the
    batch runs on the synchronous path, DONE with every byte right, instead of an OSError out of post()."""
    params = {} if inline else {"inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        n = 16
        mem = aligned_empty(n * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = _random(2 * n * B, 5)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=2 * n * B)
        real = aio._syscall

        def no_context(name, *args):
            if name == "io_setup":
                raise OSError(errno.EAGAIN, f"{name}: {os.strerror(errno.EAGAIN)}")
            return real(name, *args)

        monkeypatch.setattr(aio, "_syscall", no_context)
        mem[:] = _random(n * B, 6)
        want = mem.copy() if op == "WRITE" else data.reshape(2 * n, B)[::2].reshape(-1).copy()
        xfer = agent.transfer(op, DescList.blocks(mem, B), DescList.file(reg, np.arange(n) * 2 * B, B))
        assert xfer.request.plan.aio is not None
        assert xfer.wait() == "DONE"
        if op == "READ":
            assert np.array_equal(mem, want)
        else:
            assert np.array_equal(np.frombuffer(path.read_bytes(), np.uint8).reshape(2 * n, B)[::2].reshape(-1), want)
        assert "io_setup" in caplog.text, "the fallback is logged"
