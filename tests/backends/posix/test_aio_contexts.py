"""AIO contexts are bounded (``aio_contexts``): each takes ``aio_depth`` of fs.aio-max-nr, a budget every process of
the machine shares. Callers holding contexts are stopped at a known point (their batch's start) while others post."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix.aio import AioContext, aio_available
from datamover.errors import InvalidParameter

OK, REASON = aio_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"native AIO unavailable: {REASON}")
B, ROWS, HELD, MORE = 4096, 4, 2, 4


def test_batches_past_the_context_cap_run_synchronously(tmp_path, monkeypatch) -> None:
    """Two batches hold the two contexts allowed; four more, posted meanwhile, make no context of their own (before:
    one each, kept until close: twelve callers at once kept twelve, 3072 of the machine's 65536) and are DONE."""
    real, entered, release = AioContext.start, threading.Semaphore(0), threading.Event()

    def held_start(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            entered.release()
            assert release.wait(30), "never released"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AioContext, "start", held_start)
    n = HELD + MORE
    with Agent("p", {"backends": {"posix": {"aio_contexts": HELD}}}) as agent:
        mem = aligned_empty(n * ROWS * B)
        mem[:] = np.frombuffer(np.random.default_rng(5).bytes(mem.nbytes), np.uint8)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        reg = agent.register_file(path, size=2 * n * ROWS * B)

        def write(k: int) -> XferState:
            rows = k * ROWS + np.arange(ROWS)
            local = DescList.blocks(mem[k * ROWS * B : (k + 1) * ROWS * B], B)
            return agent.transfer("WRITE", local, DescList.file(reg, 2 * rows * B, B)).wait()  # rows apart: AIO

        states: dict[int, XferState] = {}
        threads = [threading.Thread(target=lambda k=k: states.__setitem__(k, write(k))) for k in range(HELD)]
        for t in threads:
            t.start()
        try:
            for _ in range(HELD):
                assert entered.acquire(timeout=30), "a held batch never started"
            for k in range(HELD, n):  # on this thread: not held; past the cap it must not need a context
                assert write(k) == XferState.DONE
            assert len(agent.backend("posix")._aio_all) == HELD
        finally:
            release.set()
            for t in threads:
                t.join(30)
        assert states == {k: XferState.DONE for k in range(HELD)}
        disk = np.frombuffer(path.read_bytes(), np.uint8).reshape(-1, B)[::2]
        assert np.array_equal(disk[: n * ROWS], mem.reshape(-1, B))


def test_aio_contexts_below_one_is_refused() -> None:
    with pytest.raises(InvalidParameter, match="aio_contexts"):
        Agent("p", {"backends": {"posix": {"aio_contexts": 0}}}).backend("posix")
