"""The bounce buffers of unaligned rows (``bounce_bytes`` each, 8 MiB by default): a small unaligned request runs
inline, on the caller's thread, so any number of threads may need one. Those kept between requests stay within
``threads`` buffers, whichever threads posted them.

Every bounce buffer the backend allocates is tracked with a weak reference; the callers are held together inside
their reads by a barrier at a seam (os.preadv), and kept alive (a per-thread buffer lives as long as its thread)
until the buffers are counted.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix import rows as posix_rows

B = 4096
CALLERS = 12
THREADS = 2


@pytest.mark.parametrize("together", [False, True], ids=["one-after-another", "all-at-once"])
def test_bounce_buffers_kept_between_requests_stay_within_threads(tmp_path, monkeypatch, together):
    made: list[weakref.ref] = []
    real_empty = posix_rows.aligned_empty

    def tracked(nbytes: int, alignment: int = 4096) -> np.ndarray:
        buf = real_empty(nbytes, alignment)
        made.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(posix_rows, "aligned_empty", tracked)
    with Agent("p", {"backends": {"posix": {"threads": THREADS}}}) as agent:
        mem = aligned_empty(CALLERS * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(1).integers(0, 256, CALLERS * B + B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=CALLERS * B + B)
        barrier = threading.Barrier(CALLERS if together else 1, timeout=60)
        real_preadv = os.preadv

        def preadv(fd, views, offset):
            barrier.wait()  # every caller is inside its bounce read, holding its bounce buffer
            return real_preadv(fd, views, offset)

        monkeypatch.setattr(os, "preadv", preadv)
        done = [threading.Event() for _ in range(CALLERS)]
        leave = threading.Event()
        states: list = [None] * CALLERS

        def caller(i: int) -> None:
            # 1000 bytes at an odd offset: not O_DIRECT-aligned, one row, so post() runs it inline through a bounce
            x = agent.transfer("READ", DescList.from_columns(mem.ctypes.data + i * B, 1000),
                               DescList.file(reg, [i * B + 7], [1000]))  # fmt: skip
            assert x.request.plan.inline
            states[i] = x.wait()
            done[i].set()
            leave.wait(60)  # stay alive: a thread's own buffer would live as long as it does

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
        try:
            for i, t in enumerate(threads):
                t.start()
                if not together:
                    assert done[i].wait(60), f"caller {i} never finished"
            for i in range(CALLERS):
                assert done[i].wait(60), f"caller {i} never finished"
            gc.collect()
            kept = sum(ref() is not None for ref in made)
        finally:
            leave.set()
            for t in threads:
                t.join(60)
        assert states == [XferState.DONE] * CALLERS
        for i in range(CALLERS):
            assert mem[i * B : i * B + 1000].tobytes() == data[i * B + 7 : i * B + 1007].tobytes()
        assert kept <= THREADS, f"{kept} bounce buffers of {size(agent)} kept after {CALLERS} callers' requests"
        if not together:
            assert len(made) == 1, f"{len(made)} bounce buffers made for {CALLERS} requests one after another"


def size(agent: Agent) -> str:
    return f"{agent.backend('posix').params['bounce_bytes'] >> 20} MiB"
