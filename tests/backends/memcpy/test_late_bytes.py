"""memcpy copies on the pool that time out or are released mid-copy: what the destination holds when ERR is seen
(or ``release`` returned) is what it holds after; no byte of the copy lands later.

The fault is the first ``ctypes.memmove`` (a copy of many runs) or the first piece of a one-run numpy copy, held
before it copies anything until the test lets it go; a watcher thread polls the transfer's state until its
deadline has turned it ERR. Nothing waits for a fixed time.
"""

from __future__ import annotations

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.memcpy import backend as memcpy_mod
from datamover.errors import TransferTimeout
from datamover.testing.waiting import HeldOnce, cut_short

R = 128 << 10  # a run: above gather_max_block, so runs are memmoved
N = 8


@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("mode", ["memmove", "row"])
def test_a_copy_cut_short_lands_nothing_after_err(monkeypatch, end, mode):
    params = {"threads": 1, "inline_bytes": 0, "row_piece_bytes": R}
    with Agent("m", {"backends": {"memcpy": params}}) as agent:
        src, dst = aligned_empty(2 * N * R), aligned_empty(2 * N * R)
        src[:] = np.random.default_rng(5).integers(0, 256, src.shape[0], dtype=np.uint8)
        agent.register_memory(src)
        agent.register_memory(dst)
        dst[:] = 0xAA
        if mode == "row":  # one run of N pieces
            frm, to = DescList.blocks(src[: N * R], N * R), DescList.blocks(dst[: N * R], N * R)
        else:  # N runs with gaps in the destination: not merged into one
            frm = DescList.blocks(src[: N * R], R)
            to = DescList.from_columns(dst.ctypes.data + np.arange(N) * 2 * R, R)
        name = "_memmove" if mode == "memmove" else "_copyto"
        held = HeldOnce("the copy")
        monkeypatch.setattr(memcpy_mod, name, held.wrap(getattr(memcpy_mod, name)))
        xfer = agent.transfer("WRITE", frm, to, timeout=0.5)
        assert xfer.request.plan.mode == mode and not xfer.request.plan.inline
        assert held.reached.wait(60), "the copy never started"
        changed = cut_short(xfer, xfer._completion, end, dst.tobytes, held)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes of a copy reached the caller after it reported ERR"
        monkeypatch.undo()
        assert agent.transfer("WRITE", frm, to).wait() == XferState.DONE
        got = dst[: N * R] if mode == "row" else dst.reshape(N, 2, R)[:, 0].reshape(-1)
        assert np.array_equal(got, src[: N * R])


@pytest.mark.parametrize("shift", [R + 100, -(R + 100)])
def test_a_one_run_copy_in_pieces_overlapping_its_source_copies_like_memmove(shift):
    """Pieces go back to front when the destination lies after the source, as memmove copies."""
    with Agent("m", {"backends": {"memcpy": {"inline_bytes": 0, "row_piece_bytes": R // 3}}}) as agent:
        buf = aligned_empty(8 * R)
        buf[:] = np.random.default_rng(6).integers(0, 256, buf.shape[0], dtype=np.uint8)
        agent.register_memory(buf)
        a = 2 * R
        before = buf[a : a + 4 * R].copy()
        x = agent.transfer("WRITE", buf[a : a + 4 * R], buf[a + shift : a + shift + 4 * R])
        assert x.request.plan.mode == "row" and not x.request.plan.inline
        assert x.wait() == XferState.DONE
        assert np.array_equal(buf[a + shift : a + shift + 4 * R], before)
