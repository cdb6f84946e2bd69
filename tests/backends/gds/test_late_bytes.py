"""gds READs (simulated kvikio) that time out or are released while a kvikio read is in flight: what the
destination holds when ERR is seen (or ``release`` returned) is what it holds after; no byte lands later.

The fault is the first read on kvikio's (simulated) thread pool held before it copies anything, until the test
lets it go; a watcher thread polls the transfer's state until its deadline has turned it ERR. Nothing waits for a
fixed time. On a GPU the same fence holds around real ``IOFuture`` objects; this checks the control flow.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import TransferTimeout
from datamover.testing import HostBuffer, kvikio_sim
from datamover.testing.waiting import HeldOnce, cut_short

B = 4096
N = 8


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_a_gds_read_cut_short_lands_nothing_after_err(tmp_path, monkeypatch, end):
    kvikio_sim.install(monkeypatch)
    with Agent("g", {"backends": {"gds": {"inflight": 3, "workers": 1}}}) as agent:
        path = tmp_path / "f.bin"
        data = np.random.default_rng(7).integers(0, 256, 2 * N * B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=2 * N * B)
        mem = HostBuffer(agent, N * B)
        mem.array[:] = 0xAA
        local = mem.descs(np.arange(N) * B, np.full(N, B))
        slots = DescList.file(reg, np.arange(N) * 2 * B, B)  # gaps: N kvikio reads, not one
        real = os.preadv
        held = HeldOnce("the read")
        monkeypatch.setattr(os, "preadv", held.wrap(real))
        xfer = agent.transfer("READ", local, slots, timeout=0.5)
        assert held.reached.wait(60), "the READ never reached kvikio"
        changed = cut_short(xfer, xfer._completion, end, mem.array.tobytes, held)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"
        monkeypatch.setattr(os, "preadv", real)
        assert agent.transfer("READ", local, slots).wait() == XferState.DONE
        assert np.array_equal(mem.array.reshape(N, B), data.reshape(N, 2, B)[:, 0])


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_a_gds_write_cut_short_writes_nothing_after_err(tmp_path, monkeypatch, end):
    """kvikio's first write held while the deadline passes or ``release`` runs; at ERR the caller refills its
    buffer. Before, ERR came at once and the held write then put the refilled bytes in the file."""
    kvikio_sim.install(monkeypatch)
    with Agent("g", {"backends": {"gds": {"inflight": 3, "workers": 1}}}) as agent:
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(2 * N * B))
        reg = agent.register_file(path, size=2 * N * B)
        mem = HostBuffer(agent, N * B)
        data = np.random.default_rng(8).integers(0, 256, N * B, dtype=np.uint8)
        mem.array[:] = data
        local = mem.descs(np.arange(N) * B, np.full(N, B))
        slots = DescList.file(reg, np.arange(N) * 2 * B, B)
        real = os.pwritev
        held = HeldOnce("the write")
        monkeypatch.setattr(os, "pwritev", held.wrap(real))
        xfer = agent.transfer("WRITE", local, slots, timeout=0.5)
        assert held.reached.wait(60), "the WRITE never reached kvikio"

        def reuse() -> None:
            mem.array[:] = 0xBB

        changed = cut_short(xfer, xfer._completion, end, path.read_bytes, held, reuse)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes reached the file from the caller's buffer after the WRITE reported ERR"
        mem.array[:] = data
        monkeypatch.setattr(os, "pwritev", real)
        assert agent.transfer("WRITE", local, slots).wait() == XferState.DONE
        assert np.frombuffer(path.read_bytes(), np.uint8).reshape(N, 2, B)[:, 0].tobytes() == data.tobytes()
