"""An owner-served transfer the owner fails or refuses while rows of it are still posted: ERR comes only once none
of its UCX operations can touch the caller's memory.

The owner is an agent in this process whose serving is patched at a known point: it posts the request's sends
(READ) or receives (WRITE) as usual, then answers ``fail`` (as it does when one row of a served request fails while
the others still run) or ``refuse`` (which only a hostile owner sends after posting). This agent's native progress
thread is held from before the post until the answer was handled, so the rows cannot have ended first; the caller
refills its buffer as soon as it hears of ERR.
"""

from __future__ import annotations

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.backends.ucx import outbound
from datamover.backends.ucx.messages import Fail, Refuse
from datamover.errors import RemoteDisconnected, RemoteRefused
from datamover.testing import HostBuffer
from datamover.testing.waiting import BOUND_S, until

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

SERVED = {"backends": {"ucx": {"one_sided": False}}}
SIZE, BS = 8 << 20, 1 << 20
ANSWERS = {"fail": (Fail, RemoteDisconnected), "refuse": (Refuse, RemoteRefused)}


def _answer_after_posting(backend, kind):
    """Make ``backend`` answer its next request with ``kind`` right after posting that request's rows."""
    real, armed = backend.tagged._serve, [True]

    def serve(inbound, msg):
        real(inbound, msg)
        if armed and msg.id in inbound.ops:
            armed.clear()
            reason = "injected: a row failed"
            inbound.conn.send(Fail(msg.id, reason) if kind is Fail else Refuse(msg.id, reason, None))
            # let go of it as a failed one is: its rows still posted run out on their own (no done follows)
            backend._active_in.pop((inbound.conn_id, msg.id), None)
            inbound.ops.pop(msg.id)

    backend.tagged._serve = serve


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_an_answer_that_ends_a_served_transfer_with_rows_posted_lands_nothing_after_err(op, answer, monkeypatch):
    kind, error = ANSWERS[answer]
    with Agent("owner", SERVED) as owner, Agent("caller", SERVED) as caller:
        backend = caller.backend("ucx")
        progress = backend._progress
        if progress is None:
            pytest.skip("no native progress thread (the extension is not built): nothing to hold")
        theirs = HostBuffer(owner, SIZE)
        theirs.write(0, b"\xaa" * SIZE)
        caller.add_remote(owner.metadata())
        mine, other = HostBuffer(caller, SIZE), HostBuffer(caller, 4096)
        mine.write(0, b"\x11" * SIZE)
        assert caller.transfer("READ", other.descs([0], [4096]), theirs.descs([0], [4096]), "owner").wait()
        theirs.write(0, b"\xaa" * SIZE)
        handled = []
        real_handler = outbound._FROM_TARGET[kind]
        monkeypatch.setitem(
            outbound._FROM_TARGET, kind, lambda self, *a: (real_handler(self, *a), handled.append(True))
        )
        _answer_after_posting(owner.backend("ucx"), kind)
        n = SIZE // BS
        refill = b"\x00" if op == "READ" else b"\x55"
        progress.hold()
        try:
            # the owner's rows in reverse order: nothing coalesces, every row is its own send or receive
            xfer = caller.transfer(
                op, mine.descs(np.arange(n) * BS, BS), theirs.descs((n - 1 - np.arange(n)) * BS, BS), "owner",
                timeout=BOUND_S,
            )  # fmt: skip
            until(lambda: handled, what="the owner's answer being handled")
            refilled_at_err = xfer.state == XferState.ERR
            if refilled_at_err:
                mine.write(0, refill * SIZE)  # the caller reuses its buffer at once
        finally:
            progress.release()
        with pytest.raises(error, match="injected"):
            xfer.wait()
        if not refilled_at_err:
            mine.write(0, refill * SIZE)
        # a transfer after it on the same connection: what UCX still had of the failed one went first
        assert caller.transfer("READ", other.descs([0], [4096]), theirs.descs([0], [4096]), "owner").wait()
        if op == "READ":
            landed = int(np.count_nonzero(np.frombuffer(mine.read(0, SIZE), np.uint8)))
            assert landed == 0, f"{landed} bytes of the failed READ landed after ERR"
        else:
            reached = int(np.count_nonzero(np.frombuffer(theirs.read(0, SIZE), np.uint8) == 0x55))
            assert reached == 0, f"{reached} bytes written into the caller's buffer after ERR reached the owner"
