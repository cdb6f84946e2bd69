"""A cancelled transfer's drain (``cancel_drain_s``) runs beside the service loop's other work, and always ends.

The drain of a READ released from a frozen (SIGSTOPped) peer is made long (300 s) so that it is surely pending
while the test goes on: the known point is the backend saying one cancelled request is draining
(``describe()``), with ``release()`` still waiting in another thread. Meanwhile a healthy peer's first READ (its
connection made then) must complete, a peer dying mid-WRITE into this agent resets the worker, or the frozen peer
is removed; each time ``release()`` returns, and no byte of the cancelled READ lands after it did.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.agents.metadata import decode_metadata
from datamover.backends import backend_status
from datamover.errors import TransferAborted
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.waiting import BOUND_S, until

from .test_ucx_cancel import BS, PATHS, SIZE
from .test_ucx_resources import _hang_up

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

LONG_DRAIN_S = 300.0  # far past any test: the drain ends only by its UCX operations ending, or by what the test does


class _Release:
    """``xfer.release()`` run in a thread, as a caller cancelling while the test goes on."""

    def __init__(self, xfer) -> None:
        self.returned: list[BaseException | None] = []
        self.thread = threading.Thread(target=lambda: self.returned.append(xfer.release()), name="releaser")
        self.thread.start()

    def join(self) -> None:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive(), f"release() still waited {BOUND_S:g} s after the drain could end"
        assert len(self.returned) == 1 and isinstance(self.returned[0], TransferAborted), self.returned


def _draining(backend) -> int:
    return backend.describe()["cancelled requests draining"]


def _release_frozen_read(agent, frozen, fbuf, local) -> _Release:
    """Freeze ``frozen`` idle (the data connection up), post a READ of all of ``fbuf`` and release it in a thread;
    return once its drain is pending (release() waits for it)."""
    assert agent.transfer("READ", local.descs([0], [4096]), fbuf.descs([0], [4096]), frozen.name).wait()
    assert frozen.call("ping") == frozen.pid
    frozen.freeze()
    n = SIZE // BS
    # the peer's rows in reverse order: nothing coalesces, so one-sided each 1 MiB row is its own get (a merged
    # 32 MiB row would go through the owner, past emulated_max_bytes)
    remote = fbuf.descs((n - 1 - np.arange(n)) * BS, BS)
    xfer = agent.transfer("READ", local.descs(np.arange(n) * BS, BS), remote, frozen.name, timeout=BOUND_S)
    backend = agent.backend("ucx")
    # posted: its gets (on this thread) or receives (by the service thread, before the request leaves) are in UCX
    until(lambda: backend._directs or backend._active_out, what="the READ's UCX operations being posted")
    release = _Release(xfer)
    until(lambda: _draining(backend) or not release.thread.is_alive(), what="the released READ's drain")
    assert _draining(backend) == 1, f"release() returned {release.returned} with no drain pending"
    return release


def _nothing_lands_after(agent, frozen, fbuf, local) -> None:
    """The caller refills ``local`` once release() returned; the frozen peer is thawed and serves a full READ into
    other memory (what it still had for the cancelled READ came first): ``local`` must not change."""
    local.write(0, b"\x00" * SIZE)
    os.kill(frozen.pid, signal.SIGCONT)
    assert frozen.call("ping") == frozen.pid
    other = HostBuffer(agent, 1 << 20)
    assert agent.transfer("READ", other.descs([0], [1 << 20]), fbuf.descs([0], [1 << 20]), frozen.name).wait()
    assert other.read(0, 1 << 20) == b"\xaa" * (1 << 20)
    changed = int(np.count_nonzero(np.frombuffer(local.read(0, SIZE), np.uint8)))
    assert changed == 0, f"{changed} bytes of the cancelled READ landed after release() returned"


@pytest.mark.parametrize("path", list(PATHS))
def test_a_pending_drain_leaves_the_other_peers_served(path):
    """While release() waits for the drain, a healthy peer's first READ completes (before: the service thread
    drained on its own for cancel_drain_s, so that READ, its handshake included, waited behind it); the thaw ends
    the drain: release() returns without a worker replaced."""
    cfg = {"backends": {"ucx": {**PATHS[path], "cancel_drain_s": LONG_DRAIN_S}}}
    with (
        RemotePeer("frozen", cfg) as frozen,
        RemotePeer("healthy", cfg) as healthy,
        Agent("reader", cfg) as agent,
    ):
        backend = agent.backend("ucx")
        fbuf, hbuf = RemoteBuffer(frozen, SIZE), RemoteBuffer(healthy, SIZE)
        fbuf.write(0, b"\xaa" * SIZE)
        data = random_bytes(SIZE, 7)
        hbuf.write(0, data)
        agent.add_remote(frozen.metadata())
        agent.add_remote(healthy.metadata())
        local, mine = HostBuffer(agent, SIZE), HostBuffer(agent, SIZE)
        try:
            release = _release_frozen_read(agent, frozen, fbuf, local)
            n = SIZE // BS
            first = agent.transfer(
                "READ", mine.descs(np.arange(n) * BS, BS), hbuf.descs(np.arange(n) * BS, BS), "healthy",
                timeout=BOUND_S,
            )  # fmt: skip
            assert first.wait() == XferState.DONE
            assert mine.read(0, SIZE) == data
            assert release.thread.is_alive() and _draining(backend) == 1, "the drain ended before the thaw"
        finally:
            os.kill(frozen.pid, signal.SIGCONT)  # its gets or sends end: so does the drain
        release.join()
        assert _draining(backend) == 0
        assert backend.resets == 0 and backend.describe()["quarantined workers"]["held"] == 0
        _nothing_lands_after(agent, frozen, fbuf, local)


def _cut_during_drain(agent, frozen, fbuf, local, cut) -> None:
    """Release a READ from the frozen peer, run ``cut`` while its drain is pending, and check release() returned
    with the worker reset once and kept against the frozen peer (thawed here if that fails)."""
    backend = agent.backend("ucx")
    try:
        release = _release_frozen_read(agent, frozen, fbuf, local)
        cut()
        release.join()
        assert backend.resets == 1 and _draining(backend) == 0
        assert backend.describe()["quarantined workers"] == {"held": 1, "by peer": {"frozen": 1}}
    except BaseException:
        os.kill(frozen.pid, signal.SIGCONT)
        raise


@pytest.mark.parametrize("path", list(PATHS))
def test_a_worker_reset_while_a_drain_is_pending_ends_it(path):
    """A peer dies mid-WRITE into this agent while the drain is pending (``hangup_probe_s`` 0: the worker is reset
    at once). The worker is kept, as a drain that ran out would have kept it (its gets or receives still point into
    the caller's buffer), counted against the frozen peer; the drain ends with it and release() returns, 300 s
    early; the thawed peer's bytes land nowhere (before: the dying peer's hello was never answered)."""
    cfg = {"backends": {"ucx": {**PATHS[path], "cancel_drain_s": LONG_DRAIN_S, "hangup_probe_s": 0}}}
    with (
        RemotePeer("frozen", cfg) as frozen,
        RemotePeer("lender", cfg) as lender,
        Agent("reader", cfg) as agent,
    ):
        agent.backend("ucx")  # started before the peers connect
        address = decode_metadata(lender.metadata()).backends["ucx"]["address"]
        fbuf = RemoteBuffer(frozen, SIZE)
        fbuf.write(0, b"\xaa" * SIZE)
        agent.add_remote(frozen.metadata())
        local, target = HostBuffer(agent, SIZE), HostBuffer(agent, 4096)
        # its hang-up is read by the service thread: the worker is reset
        _cut_during_drain(agent, frozen, fbuf, local, lambda: _hang_up(agent, target, address, 0))
        _nothing_lands_after(agent, frozen, fbuf, local)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_peer_removed_while_its_drain_is_pending_costs_the_worker(path):
    """The frozen peer is removed while the READ's drain is pending: its flush is let go unseen (one-sided), or
    its receives stay posted with nobody to send for them (owner-served), so nothing can say they ended; the
    worker is replaced and kept at once and release() returns (before: one-sided, the let-go flush was taken for
    ended and the worker went on being progressed, so the thawed peer's bytes could land; owner-served,
    release() waited out the drain)."""
    cfg = {"backends": {"ucx": {**PATHS[path], "cancel_drain_s": LONG_DRAIN_S}}}
    with RemotePeer("frozen", cfg) as frozen, Agent("reader", cfg) as agent:
        agent.backend("ucx")  # started before the peers connect
        fbuf = RemoteBuffer(frozen, SIZE)
        fbuf.write(0, b"\xaa" * SIZE)
        blob = frozen.metadata()
        agent.add_remote(blob)
        local = HostBuffer(agent, SIZE)
        _cut_during_drain(agent, frozen, fbuf, local, lambda: agent.remove_remote("frozen"))
        agent.add_remote(blob)
        _nothing_lands_after(agent, frozen, fbuf, local)
