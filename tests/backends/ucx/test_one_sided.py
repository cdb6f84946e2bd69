"""The ucx backend's one-sided path: put/get with the target idle, rkey bounds, revocation, hostile offers."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover import Agent, XferState
from datamover.agents.metadata import encode_metadata
from datamover.backends import backend_status
from datamover.errors import InvalidMetadata, NotRegistered, RemoteDisconnected, RemoteRefused
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.pause import MidTransferPause
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}


@pytest.fixture(scope="module")
def target():
    with RemotePeer("owner", UCX) as peer:
        yield peer


@pytest.fixture(scope="module")
def agent(target):
    with Agent("initiator", UCX) as agent:
        agent.add_remote(target.metadata())
        yield agent


def counts(agent_or_peer) -> dict:
    if isinstance(agent_or_peer, RemotePeer):
        return agent_or_peer.call("describe", "ucx")["requests"]
    return agent_or_peer.backend("ucx").describe()["requests"]


def require_direct_cma(agent, target) -> None:
    """Connect (a tiny WRITE), then skip unless the probe let this process attach to the target."""
    mine, theirs = HostBuffer(agent, 8), RemoteBuffer(target, 8)
    agent.add_remote(target.metadata())
    try:
        assert agent.transfer("WRITE", mine.descs([0], [8]), theirs.descs([0], [8]), target.name).wait() == "DONE"
    finally:
        theirs.free()
        agent.deregister_memory(mine.registration)
        agent.add_remote(target.metadata())
    state = agent.backend("ucx").describe()["direct cma"][target.name]
    if not state.startswith("pid "):
        pytest.skip(f"direct cma unavailable here: {state}")


def test_put_and_get_leave_the_owner_idle(agent, target):
    """WRITE and READ (many rows, two registrations) go one-sided: the owner serves no request."""
    n, bs = 64, 4096
    local = HostBuffer(agent, 2 * n * bs)
    bufs = [RemoteBuffer(target, n * bs // 2) for _ in range(2)]
    agent.add_remote(target.metadata())
    try:
        before, owner_before = counts(agent), counts(target)
        data = random_bytes(n * bs, 5)
        local.write(0, data)
        half = n // 2
        perm = np.random.default_rng(1).permutation(half)
        for op in ("WRITE", "READ"):
            offs = perm * bs if op == "WRITE" else perm * bs + n * bs
            for k, buf in enumerate(bufs):
                loc = local.descs(offs + k * half * bs, bs)
                xfer = agent.transfer(op, loc, buf.descs(np.arange(half) * bs, bs), "owner")
                assert xfer.wait() == XferState.DONE
        for k, buf in enumerate(bufs):
            got = np.frombuffer(buf.read(0, half * bs), np.uint8).reshape(half, bs)
            want = np.frombuffer(data, np.uint8).reshape(n, bs)[k * half : (k + 1) * half][perm]
            assert np.array_equal(got, want)
        assert local.read(n * bs, n * bs) == data, "READ brought back other bytes than were written"
        after, owner_after = counts(agent), counts(target)
        assert after["one-sided"] - before["one-sided"] == 4
        assert after["served by the owner"] == before["served by the owner"]
        assert owner_after["served for peers"] == owner_before["served for peers"]
    finally:
        agent.deregister_memory(local.registration)
        for buf in bufs:
            buf.free()
        agent.add_remote(target.metadata())


def test_rows_beyond_what_the_owner_mapped_go_to_the_owner_and_are_refused(agent, target):
    """Metadata claiming a larger region than the owner mapped: the rkey bounds send it the served way."""
    local = HostBuffer(agent, 3 * 4096)
    buf = RemoteBuffer(target, 2 * 4096)
    agent.add_remote(target.metadata())
    real = agent.remote_metadata("owner")
    try:
        before = buf.read(0, 2 * 4096)
        regions = [(m, d, s, (n + 4096 if s == buf.addr else n), r) for m, d, s, n, r in real.regions]
        agent.add_remote(encode_metadata("owner", real.backends, regions))
        local.write(0, random_bytes(3 * 4096, 9))
        served = counts(target)["served for peers"]
        xfer = agent.transfer("WRITE", local.descs([0], [3 * 4096]), buf.descs([0], [3 * 4096]), agent="owner")
        with pytest.raises(RemoteRefused, match="outside every region"):
            xfer.wait()
        assert counts(target)["served for peers"] == served + 1
        assert buf.read(0, 2 * 4096) == before
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.add_remote(target.metadata())


def test_deregistration_revokes_the_rkey(agent, target):
    """Once the owner deregisters, a peer with stale metadata can no longer reach the region one-sided."""
    local = HostBuffer(agent, 8192)
    buf = RemoteBuffer(target, 8192)
    agent.add_remote(target.metadata())
    try:
        local.write(0, random_bytes(8192, 3))
        assert agent.transfer("WRITE", local.descs([0], [8192]), buf.descs([0], [8192]), "owner").wait() == "DONE"
        stale = buf.descs([0], [8192])
        buf.free()  # returns only after the initiator confirmed it dropped the rkey
        one_sided = counts(agent)["one-sided"]
        with pytest.raises((RemoteRefused, NotRegistered)):
            agent.transfer("WRITE", local.descs([0], [8192]), stale, "owner").wait()
        assert counts(agent)["one-sided"] == one_sided, "a revoked region was still written one-sided"
    finally:
        agent.deregister_memory(local.registration)
        agent.add_remote(target.metadata())


def test_served_mode_on_either_side_keeps_the_owner_in_the_path(target):
    """one_sided=False on the initiator: every request is served (and checked) by the owner."""
    with Agent("served-initiator", {"backends": {"ucx": {"one_sided": False}}}) as agent:
        buf = RemoteBuffer(target, 4096)
        agent.add_remote(target.metadata())
        local = HostBuffer(agent, 4096)
        try:
            served = counts(target)["served for peers"]
            local.write(0, random_bytes(4096, 4))
            assert agent.transfer("WRITE", local.descs([0], [4096]), buf.descs([0], [4096]), "owner").wait() == "DONE"
            assert buf.read(0, 4096) == local.read(0, 4096)
            assert counts(target)["served for peers"] == served + 1
            assert counts(agent)["one-sided"] == 0
        finally:
            buf.free()


_row = st.lists(
    st.one_of(st.integers(-5, 1 << 64), st.binary(max_size=8), st.text(max_size=4), st.none()), min_size=0, max_size=7
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(_row, max_size=4), st.integers(), st.binary(max_size=16), st.none()))
def test_hostile_rkey_offers_raise_invalid_metadata(rows):
    from datamover.backends.ucx import parse_rkeys

    try:
        out = parse_rkeys("peer", rows)
    except InvalidMetadata:
        return
    for rid, (mem, dev, addr, length, key) in out.items():
        assert rid >= 0 and dev >= 0 and addr >= 0 and length > 0 and mem in ("DRAM", "VRAM")
        assert isinstance(key, bytes) and 0 < len(key) <= 4096


def test_a_valid_rkey_offer_parses():
    from datamover.backends.ucx import parse_rkeys

    out = parse_rkeys("peer", [[3, "DRAM", 0, 4096, 8192, b"k"], [4, "VRAM", 1, 1 << 40, 1, b"x" * 4096]])
    assert out == {3: ("DRAM", 0, 4096, 8192, b"k"), 4: ("VRAM", 1, 1 << 40, 1, b"x" * 4096)}
    with pytest.raises(InvalidMetadata):
        parse_rkeys("peer", [[3, "FILE", 0, 4096, 8192, b"k"]])
    with pytest.raises(InvalidMetadata):
        parse_rkeys("peer", [[3, "DRAM", 0, (1 << 63) - 10, 20, b"k"]])


def test_large_requests_go_to_the_owner_when_put_is_only_emulated(target):
    """Without cma or RDMA, UCX emulates put/get; requests above emulated_max_bytes use the owner's rendezvous."""
    with Agent("emulated", {"backends": {"ucx": {"emulated_max_bytes": 8192, "direct_cma": False}}}) as agent:
        if agent.backend("ucx")._rma_native:
            pytest.skip("this UCX has native RMA (cma or RDMA) here: nothing is emulated")
        buf = RemoteBuffer(target, 4 * 8192)
        agent.add_remote(target.metadata())
        local = HostBuffer(agent, 4 * 8192)
        try:
            local.write(0, random_bytes(4 * 8192, 8))
            for n, path in ((8192, "one-sided"), (4 * 8192, "served by the owner")):
                before = counts(agent)[path]
                assert agent.transfer("WRITE", local.descs([0], [n]), buf.descs([0], [n]), "owner").wait() == "DONE"
                assert counts(agent)[path] == before + 1, path
            assert buf.read(0, 4 * 8192) == local.read(0, 4 * 8192)
        finally:
            buf.free()


@pytest.mark.parametrize("n", [16, 2048], ids=["inline", "in-parts"])
def test_a_same_host_peer_is_copied_with_direct_cma(agent, target, n):
    """process_vm_writev/readv, IOV_MAX rows per call: small requests inside post(), large ones in parts."""
    require_direct_cma(agent, target)
    bs = 4096
    local, buf = HostBuffer(agent, 2 * n * bs), RemoteBuffer(target, n * bs)
    agent.add_remote(target.metadata())
    try:
        data = random_bytes(n * bs, 11)
        local.write(0, data)
        before, owner_before = counts(agent), counts(target)
        perm = np.random.default_rng(2).permutation(n)
        assert (
            agent.transfer("WRITE", local.descs(np.arange(n) * bs, bs), buf.descs(perm * bs, bs), "owner").wait()
            == "DONE"
        )
        got = np.frombuffer(buf.read(0, n * bs), np.uint8).reshape(n, bs)
        assert np.array_equal(got[perm], np.frombuffer(data, np.uint8).reshape(n, bs))
        back = local.descs(n * bs + np.arange(n) * bs, bs)
        assert agent.transfer("READ", back, buf.descs(perm * bs, bs), "owner").wait() == "DONE"
        assert local.read(n * bs, n * bs) == data
        after = counts(agent)
        assert after["of them direct cma"] - before["of them direct cma"] == 2
        assert after["one-sided"] - before["one-sided"] == 2
        assert counts(target)["served for peers"] == owner_before["served for peers"]
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.add_remote(target.metadata())


def test_direct_cma_off_on_either_side_leaves_ucx_put_get(target):
    """direct_cma: False on the initiator, or on the target (which then offers no token), keeps UCP put/get."""
    with RemotePeer("no-token", {"backends": {"ucx": {"direct_cma": False}}}) as plain:
        for peer, config in ((target, {"direct_cma": False}), (plain, {})):
            with Agent("init-" + peer.name, {"backends": {"ucx": config}}) as init:
                buf = RemoteBuffer(peer, 1 << 16)
                init.add_remote(peer.metadata())
                local = HostBuffer(init, 1 << 16)
                local.write(0, random_bytes(1 << 16, 12))
                assert init.transfer("WRITE", local.descs([0], [1 << 16]), buf.descs([0], [1 << 16]), peer.name).wait()
                assert buf.read(0, 1 << 16) == local.read(0, 1 << 16)
                c = counts(init)
                assert c["one-sided"] == 1 and c["of them direct cma"] == 0
                why = init.backend("ucx").describe()["direct cma"][peer.name]
                assert why == ("direct_cma is off here" if config else "the peer offered no token")
                buf.free()


def test_a_revocation_waits_for_direct_cma_parts_in_flight(agent, target):
    """The owner deregistering a region a large direct cma WRITE is copying into returns only after the copy's parts
    ended; they stop at their next chunk (RemoteDisconnected), not copying the rest into memory being let go."""
    require_direct_cma(agent, target)
    size, bs = 256 << 20, 1 << 20
    local, buf = HostBuffer(agent, size), RemoteBuffer(target, size)
    agent.add_remote(target.metadata())
    try:
        n = size // bs
        with MidTransferPause() as pause:  # the parts stop after their first chunk, until released
            xfer = agent.transfer(
                "WRITE", local.descs(np.arange(n) * bs, bs), buf.descs(np.arange(n)[::-1] * bs, bs), "owner"
            )
            assert pause.reached.wait(30), "the copy never reached its pause"
            freeing = threading.Thread(target=buf.free)  # the owner unmaps only once we confirmed: after the parts
            freeing.start()
            freeing.join(2)
            assert freeing.is_alive(), "the owner unmapped the region while the copy was parked in it"
        freeing.join(30)
        assert not freeing.is_alive()
        with pytest.raises(RemoteDisconnected, match="revoked a region"):
            xfer.wait(30)
    finally:
        agent.deregister_memory(local.registration)
        agent.add_remote(target.metadata())


def test_the_service_thread_leaves_ucx_to_a_driving_waiter_and_takes_it_back(target, monkeypatch):
    """While a waiter progresses UCX, the service thread waits on its sockets only; UCX's fd is back after, and
    it follows a worker reset."""
    # the Python service thread's own handling of UCX's fd (with native progress, UCX's fd is that thread's)
    with Agent("driven", {"backends": {"ucx": {"direct_cma": False, "native_progress": False}}}) as agent:
        backend = agent.backend("ucx")
        mine, theirs = HostBuffer(agent, 1 << 20), RemoteBuffer(target, 1 << 20)
        agent.add_remote(target.metadata())
        seen = []
        real = type(backend.one_sided)._finish_direct

        def spy(self, direct, why=None):
            seen.append(backend._ucx_watched)
            return real(self, direct, why)

        monkeypatch.setattr(type(backend.one_sided), "_finish_direct", spy)
        rows = np.arange(16) * 65536
        try:
            for _ in range(50):  # 1 MiB of emulated gets: the waiter drives UCX for a while each time
                x = agent.transfer("READ", mine.descs(rows, 65536), theirs.descs(rows, 65536), target.name)
                assert x.wait() == "DONE"
                if False in seen:
                    break
            assert False in seen, "the service thread kept UCX's fd in its wait while a waiter drove"

            def watched() -> None:
                assert backend._ucx_watched
                assert backend._worker.epoll_file_descriptor in backend._sel.get_map()

            backend._call(lambda: None)  # a whole turn with no driver, then look
            backend._call(watched)

            old = backend._worker.epoll_file_descriptor

            def reset_unwatched() -> None:
                backend._watch_ucx(False)
                backend._reset_worker("test")
                assert backend._worker.epoll_file_descriptor not in backend._sel.get_map()
                backend._watch_ucx(True)
                assert backend._worker.epoll_file_descriptor != old

            backend._call(reset_unwatched)
            backend._call(watched)
        finally:
            theirs.free()
            agent.deregister_memory(mine.registration)


def test_a_direct_cma_write_stops_when_the_target_deregisters_its_region(monkeypatch):
    """The target deregisters and frees a region mid-WRITE (its wait for us runs out): our cma parts stop at the
    next chunk with RemoteDisconnected, and nothing lands in the memory the target reuses."""
    from datamover.backends.ucx import cma
    from datamover.testing.waiting import HeldOnce

    with RemotePeer("cma-owner", {**UCX, "timeout_s": 1.0}) as peer, Agent("cma-writer", UCX) as agent:
        size = 64 << 20
        buf = RemoteBuffer(peer, size)
        agent.add_remote(peer.metadata())
        local = HostBuffer(agent, size)
        local.write(0, b"\x77" * size)
        assert agent.transfer("WRITE", local.descs([0], [4096]), buf.descs([0], [4096]), peer.name).wait()
        if not str(agent.backend("ucx").describe()["direct cma"].get(peer.name, "")).startswith("pid"):
            pytest.skip("no direct cma with the peer here")
        real, hold = cma.CmaPlan.run, HeldOnce("the copy of a WRITE's second chunk")
        held = hold.wrap(real)

        def run(plan, pid, write, first=0, last=None):
            return (held if first >= 1 else real)(plan, pid, write, first, last)

        monkeypatch.setattr(cma.CmaPlan, "run", run)
        xfer = agent.transfer("WRITE", local.descs([0], [size]), buf.descs([0], [size]), peer.name, timeout=60)
        assert hold.reached.wait(30)
        buf.free()  # the target revokes, waits its 1 s for us, cuts us off and frees the memory
        new = RemoteBuffer(peer, size)  # and reuses it
        hold.go.set()  # the chunk under way (taken as already copying) goes; no later one does
        with pytest.raises(RemoteDisconnected, match="revoked a region"):
            xfer.wait(30)
        landed = int(np.count_nonzero(np.frombuffer(new.read(0, size), np.uint8)))
        # the held chunk counts as a syscall under way at the revocation (the limit of a target's fence): it alone
        # may land; without the per-chunk check every later chunk of every part did too
        chunk = int(agent.backend("ucx").params["cma_chunk_bytes"])
        assert landed <= chunk, f"{landed} bytes landed after the target deregistered the region (one chunk: {chunk})"
