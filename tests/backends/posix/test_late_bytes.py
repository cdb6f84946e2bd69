"""posix READs that time out or are released while a preadv is in flight: what the destination holds when ERR
is seen (or ``release`` returned) is what it holds after; no byte of the READ lands later.

The fault is the synchronous path's preadv held at a known point (before the kernel copies anything) until the
test lets it go; a watcher thread polls the transfer's state until its deadline has turned it ERR. Nothing
waits for a fixed time.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.errors import TransferTimeout

B = 4096
N = 8


def until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.01)


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_a_read_cut_short_mid_preadv_lands_nothing_after_err(tmp_path, monkeypatch, end):
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}  # the pool's synchronous path
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(3).integers(0, 256, N * B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=N * B, direct=False)
        mem[:] = 0xAA
        reached, go, returned = threading.Event(), threading.Event(), threading.Event()
        real = os.preadv
        armed = [True]

        def held(fd, views, offset):
            hold, armed[0] = armed[0], False
            if hold:
                reached.set()
                assert go.wait(60), "the test never let the preadv go"
            try:
                return real(fd, views, offset)
            finally:
                if hold:
                    returned.set()

        monkeypatch.setattr(os, "preadv", held)
        xfer = agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * B, B), timeout=0.5)
        assert reached.wait(60), "the READ never reached preadv"
        seen: dict[str, bytes] = {}

        def cut() -> None:
            if end == "timeout":
                until(lambda: xfer.state == XferState.ERR, what="the READ timing out")
            else:
                xfer.release()
            seen["at ERR"] = mem.tobytes()

        watcher = threading.Thread(target=cut)
        watcher.start()
        # the watcher's cancel either waits on the fence for the held preadv, or (no fence) is already done
        fencing = getattr(xfer._completion, "fencing", None)
        until(lambda: (fencing is not None and fencing.is_set()) or not watcher.is_alive(), what="ERR or the fence")
        go.set()
        watcher.join(60)
        assert returned.wait(60), "the held preadv never returned"
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        after = mem.tobytes()
        changed = int(np.count_nonzero(np.frombuffer(after, np.uint8) != np.frombuffer(seen["at ERR"], np.uint8)))
        assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * B, B)).wait() == (
            XferState.DONE
        )
        assert np.array_equal(mem, data)
