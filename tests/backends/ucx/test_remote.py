"""Remote agents over ucx, each peer a real process: side channel, refresh, notifications, refusals, SIGKILL."""

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.agents.metadata import decode_metadata, encode_metadata
from datamover.backends import backend_status
from datamover.errors import (
    AuthenticationError,
    InvalidMetadata,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
)
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.pause import MidTransferPause
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.waiting import until

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}


@pytest.fixture(scope="module")
def target():
    with RemotePeer("decode-0", {**UCX, "listen_port": 0}) as peer:
        yield peer


@pytest.fixture(scope="module")
def agent(target):
    with Agent("prefill-0", UCX, listen_port=0) as agent:
        host, port = target.call("attr", "listen_address")
        assert agent.fetch_remote(host, port) == "decode-0"
        target.call("fetch_remote", *agent.listen_address)  # so the target can notify back
        yield agent


def test_side_channel_serves_current_metadata(agent, target):
    host, port = target.call("attr", "listen_address")
    assert host == "127.0.0.1" and port > 0
    before = agent.remote_metadata("decode-0")
    buf = RemoteBuffer(target, 4096)
    try:
        assert agent.refresh_remote("decode-0") == "decode-0"
        after = agent.remote_metadata("decode-0")
        assert len(after.regions) == len(before.regions) + 1
        assert any(r[2] == buf.addr and r[3] == 4096 for r in after.regions)
    finally:
        buf.free()
        agent.refresh_remote("decode-0")


def test_fetch_from_nothing_listening_is_remote_disconnected(agent):
    with pytest.raises(RemoteDisconnected):
        agent.fetch_remote("127.0.0.1", 1, timeout=2)


def test_incremental_metadata_needs_refresh(agent, target):
    local = HostBuffer(agent, 8192)
    buf = RemoteBuffer(target, 8192)  # registered after the initiator loaded the target's metadata
    try:
        with pytest.raises(NotRegistered, match="refresh"):
            agent.transfer("WRITE", local.descs([0], [8192]), buf.descs([0], [8192]), agent="decode-0")
        agent.refresh_remote("decode-0")
        data = random_bytes(8192, 3)
        local.write(0, data)
        xfer = agent.transfer("WRITE", local.descs([0], [8192]), buf.descs([0], [8192]), agent="decode-0")
        assert xfer.wait() == XferState.DONE
        assert buf.read(0, 8192) == data
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_notify_arrives_after_every_descriptor_landed(agent, target):
    n, bs = 512, 8192
    local = HostBuffer(agent, n * bs)
    buf = RemoteBuffer(target, n * bs)
    agent.refresh_remote("decode-0")
    try:
        data = random_bytes(n * bs, 5)
        local.write(0, data)
        perm = np.random.default_rng(0).permutation(n)
        xfer = agent.transfer(
            "WRITE", local.descs(np.arange(n) * bs, bs), buf.descs(perm * bs, bs), agent="decode-0", notify=b"req-42"
        )
        (sender, msg), seen = target.call("notified_then_read", b"req-", 10.0, buf.handle, 0, n * bs)
        assert (sender, msg) == ("prefill-0", b"req-42")
        want = np.frombuffer(data, np.uint8).reshape(n, bs)
        got = np.frombuffer(seen, np.uint8).reshape(n, bs)
        assert np.array_equal(got[perm], want), "notification came before all descriptors landed"
        assert xfer.wait() == XferState.DONE
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_notify_on_read_goes_to_the_target(agent, target):
    local = HostBuffer(agent, 4096)
    buf = RemoteBuffer(target, 4096)
    agent.refresh_remote("decode-0")
    try:
        data = random_bytes(4096, 6)
        buf.write(0, data)
        xfer = agent.transfer("READ", local.descs([0], [4096]), buf.descs([0], [4096]), agent="decode-0", notify=b"r1")
        assert xfer.wait() == XferState.DONE and local.read(0, 4096) == data
        assert target.call("wait_notification", b"r1", 10.0) == ("prefill-0", b"r1")
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_send_notification_both_ways(agent, target):
    agent.send_notification("decode-0", b"hello decode")
    assert target.call("wait_notification", b"hello", 10.0) == ("prefill-0", b"hello decode")
    target.call("send_notification", "prefill-0", b"layer-3 ready")
    target.call("send_notification", "prefill-0", b"other")
    assert agent.wait_notification(b"layer-", timeout=10) == ("decode-0", b"layer-3 ready")
    deadline = time.monotonic() + 10
    drained: dict = {}
    while not drained and time.monotonic() < deadline:
        drained = agent.get_notifications()
        time.sleep(0.01)
    assert drained == {"decode-0": [b"other"]}
    assert agent.get_notifications() == {}


def test_target_refuses_memory_it_never_registered(agent, target):
    """A peer with forged metadata asks for more than was registered: refused by the owner, memory untouched."""
    local = HostBuffer(agent, 3 * 4096)
    buf = RemoteBuffer(target, 2 * 4096)
    agent.refresh_remote("decode-0")
    real = agent.remote_metadata("decode-0")
    try:
        before = buf.read(0, 2 * 4096)
        regions = [(m, d, s, (n + 4096 if s == buf.addr else n), r) for m, d, s, n, r in real.regions]
        forged = encode_metadata("decode-0", real.backends, regions)
        agent.add_remote(forged)
        local.write(0, random_bytes(3 * 4096, 9))
        xfer = agent.transfer(
            "WRITE", local.descs([0, 4096], [100, 8000]), buf.descs([0, 200], [100, 8000]), agent="decode-0"
        )
        with pytest.raises(RemoteRefused) as info:
            xfer.wait()
        assert info.value.index == 1 and "descriptor 1" in str(info.value)
        assert "outside every region" in str(info.value)
        assert buf.read(0, 2 * 4096) == before, "a refused transfer touched the owner's memory"
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_bad_connection_info_changes_nothing(agent):
    meta = agent.remote_metadata("decode-0")
    good = {"address": b"a", "host": "h", "port": 1}
    bad_infos = (
        {**good, "address": "x"}, {**good, "port": 70000}, {**good, "incarnation": "x"},
        {**good, "incarnation": b""}, {**good, "incarnation": b"i" * 65},
    )  # fmt: skip
    for bad in bad_infos:
        blob = encode_metadata("decode-0", {"ucx": bad}, meta.regions)
        with pytest.raises(InvalidMetadata):
            agent.add_remote(blob)
        assert agent.remote_metadata("decode-0") is meta


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_initiator_killed_mid_transfer_leaves_this_agent_alive(agent, target, op):
    """A peer posting into our memory dies: we must not die with it (UCX reads a dead process's memory).

    The peer's data movement is parked halfway (its first cma chunk copied, or its UCX rows posted) when it is
    killed: in flight by construction, however loaded the machine.
    """
    size, bs = 64 << 20, 1 << 20
    n = size // bs
    mine = HostBuffer(agent, size)
    killer = RemotePeer("killer", UCX)
    try:
        theirs = RemoteBuffer(killer, size)
        killer.call("fetch_remote", *agent.listen_address)
        addrs = mine.array.ctypes.data + np.arange(n) * bs
        killer.call("pause_mid_transfer")
        parked = killer.call("start_transfer_paused", op, theirs.handle, "prefill-0", addrs, np.full(n, bs))
        assert parked, "the killer's transfer never reached its pause"
        backend = agent.backend("ucx")
        assert "killer" in {i.name for i in list(backend._inbound.values())}
        killer.kill()
        # the known point: this agent has seen the dead peer's control connection close and dropped it
        until(lambda: "killer" not in {i.name for i in list(backend._inbound.values())}, what="dropping the dead peer")
    finally:
        killer.close()
    agent.deregister_memory(mine.registration)
    test_agent_still_serves_its_other_peer_after_a_kill(agent, target)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_sigkill_mid_transfer_then_peer_comes_back(agent, op):
    """The target dies while our transfer is parked halfway (a chunk copied or the rows posted); the transfer
    ends in ERR (RemoteDisconnected) once it goes on, and the target comes back under its name."""
    size, bs = 64 << 20, 1 << 20
    local = HostBuffer(agent, size)
    local.array[:] = 7
    victim = RemotePeer("victim", UCX)
    try:
        rbuf = RemoteBuffer(victim, size)
        agent.add_remote(victim.metadata())
        descs_l = local.descs(np.arange(size // bs) * bs, bs)
        descs_r = rbuf.descs(np.arange(size // bs)[::-1] * bs, bs)
        box = {}
        with MidTransferPause() as pause:
            poster = threading.Thread(
                target=lambda: box.setdefault("x", agent.transfer(op, descs_l, descs_r, agent="victim", timeout=30))
            )
            poster.start()
            assert pause.reached.wait(30), "the transfer never reached its pause"
            victim.kill()
            t0 = time.monotonic()
        poster.join(30)
        xfer = box["x"]
        with pytest.raises(RemoteDisconnected) as info:
            xfer.wait()
        elapsed = time.monotonic() - t0
        assert xfer.state == XferState.ERR and elapsed < 25, elapsed  # well before its 30 s timeout
        assert info.value.backend == "ucx" and "victim" in str(info.value)
        xfer.release()
    finally:
        victim.close()
    # the victim comes back under the same name with new metadata: transfers to it work again
    with RemotePeer("victim", UCX) as again:
        rbuf = RemoteBuffer(again, 1 << 20)
        agent.add_remote(again.metadata())
        data = random_bytes(1 << 20, 12)
        local.write(0, data)
        xfer = agent.transfer("WRITE", local.descs([0], [1 << 20]), rbuf.descs([0], [1 << 20]), agent="victim")
        assert xfer.wait() == XferState.DONE
        assert rbuf.read(0, 1 << 20) == data
        agent.remove_remote("victim")
    agent.deregister_memory(local.registration)


def test_agent_still_serves_its_other_peer_after_a_kill(agent, target):
    local = HostBuffer(agent, 1 << 16)
    buf = RemoteBuffer(target, 1 << 16)
    agent.refresh_remote("decode-0")
    try:
        data = random_bytes(1 << 16, 13)
        local.write(0, data)
        assert agent.transfer("WRITE", local.descs([0], [1 << 16]), buf.descs([0], [1 << 16]), "decode-0").wait()
        assert buf.read(0, 1 << 16) == data
    finally:
        agent.deregister_memory(local.registration)
        buf.free()


class TestSecret:
    def test_same_secret_works_and_blobs_are_signed(self):
        cfg = {**UCX, "secret": b"s3cret"}
        with RemotePeer("sec-target", cfg) as peer, Agent("sec-init", cfg) as agent:
            blob = peer.metadata()
            assert blob.startswith(b"DMS1")
            agent.add_remote(blob)
            buf = RemoteBuffer(peer, 4096)
            agent.add_remote(peer.metadata())
            local = HostBuffer(agent, 4096)
            local.write(0, random_bytes(4096, 1))
            assert agent.transfer("WRITE", local.descs([0], [4096]), buf.descs([0], [4096]), "sec-target").wait()
            assert buf.read(0, 4096) == local.read(0, 4096)
            agent.send_notification("sec-target", b"authenticated")
            assert peer.call("wait_notification", b"auth", 10.0) == ("sec-init", b"authenticated")

    def test_peer_without_the_secret_is_refused(self):
        with RemotePeer("sec-target2", {**UCX, "secret": b"s3cret"}) as peer:
            buf = RemoteBuffer(peer, 4096)
            blob = peer.metadata()
            with Agent("wrong", {**UCX, "secret": b"guess"}) as agent:
                with pytest.raises(AuthenticationError):
                    agent.add_remote(blob)
                assert agent.remotes == []
            with Agent("none", UCX) as agent:
                with pytest.raises(AuthenticationError):
                    agent.add_remote(blob)
                # strip the signature to get past metadata checks: the control handshake still refuses
                agent.add_remote(blob[36:])
                local = HostBuffer(agent, 4096)
                local.write(0, random_bytes(4096, 2))
                before = buf.read(0, 4096)
                xfer = agent.transfer("WRITE", local.descs([0], [4096]), buf.descs([0], [4096]), "sec-target2")
                with pytest.raises(AuthenticationError):
                    xfer.wait()
                assert buf.read(0, 4096) == before
            tampered = bytearray(blob)
            tampered[-1] ^= 1
            with Agent("right", {**UCX, "secret": b"s3cret"}) as agent:
                with pytest.raises(AuthenticationError):
                    agent.add_remote(bytes(tampered))


def test_unsigned_blob_refused_by_agent_with_secret():
    with (
        Agent("a", {"backends": {"memcpy": {}}}) as plain,
        Agent("b", {"backends": {"memcpy": {}}, "secret": "k"}) as b,
    ):
        with pytest.raises(AuthenticationError):
            b.add_remote(plain.metadata())
        assert decode_metadata(plain.metadata()).name == "a"


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x05hello",  # not msgpack
        b"\xff\xff\xff\xff",  # a 4 GiB frame announced
        b"\x00\x00\x00\x0b" + b"\x82\xa1t\xa3req\xa2id\x01",  # a request before the handshake
        b"\x00\x00\x00\x06" + b"\x81\xa1t\xa5hello",  # a hello without its fields
    ],
)
def test_hostile_control_frames_are_dropped(agent, target, garbage):
    import socket

    info = agent.remote_metadata("decode-0").backends["ucx"]
    with socket.create_connection((info["host"], info["port"]), timeout=5) as sock:
        sock.sendall(garbage)
        sock.settimeout(5)
        got = b""
        while True:  # the target answers the challenge, then hangs up on the garbage
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        assert b"challenge" in got
    test_agent_still_serves_its_other_peer_after_a_kill(agent, target)


def test_refused_read_leaves_both_sides_usable(agent, target):
    """A refused READ: our receives were posted first and are completed locally; nothing lands."""
    local = HostBuffer(agent, 3 * 4096)
    buf = RemoteBuffer(target, 2 * 4096)
    agent.refresh_remote("decode-0")
    real = agent.remote_metadata("decode-0")
    try:
        regions = [(m, d, s, (n + 4096 if s == buf.addr else n), r) for m, d, s, n, r in real.regions]
        agent.add_remote(encode_metadata("decode-0", real.backends, regions))
        local.write(0, bytes(3 * 4096))
        xfer = agent.transfer("READ", local.descs([0], [3 * 4096]), buf.descs([0], [3 * 4096]), agent="decode-0")
        with pytest.raises(RemoteRefused) as info:
            xfer.wait()
        assert info.value.index == 0
        assert local.read(0, 3 * 4096) == bytes(3 * 4096), "a refused READ wrote into local memory"
        agent.add_remote(target.metadata())
        data = random_bytes(2 * 4096, 21)
        buf.write(0, data)
        xfer = agent.transfer("READ", local.descs([0], [2 * 4096]), buf.descs([0], [2 * 4096]), agent="decode-0")
        assert xfer.wait() == XferState.DONE and local.read(0, 2 * 4096) == data
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_many_concurrent_transfers_and_notifications(agent, target):
    """Threads post WRITEs and READs with notifications at once; every byte and notification arrives."""
    import threading

    k, part = 8, 64 << 10
    local = HostBuffer(agent, 2 * k * part)
    buf = RemoteBuffer(target, k * part)
    agent.refresh_remote("decode-0")
    try:
        data = random_bytes(k * part, 31)
        local.write(0, data)
        errors = []

        def one(i):
            try:
                for rep in range(5):
                    x = agent.transfer(
                        "WRITE", local.descs([i * part], [part]), buf.descs([i * part], [part]), "decode-0",
                        notify=f"w{i}-{rep}".encode(),
                    )  # fmt: skip
                    x.wait()
                    y = agent.transfer(
                        "READ", local.descs([(k + i) * part], [part]), buf.descs([i * part], [part]), "decode-0"
                    )
                    y.wait()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert local.read(k * part, k * part) == data
        got = set()
        for _ in range(5 * k):
            got.add(target.call("wait_notification", b"w", 10.0)[1])
        assert got == {f"w{i}-{rep}".encode() for i in range(k) for rep in range(5)}
    finally:
        agent.deregister_memory(local.registration)
        buf.free()
        agent.refresh_remote("decode-0")


def test_deregister_waits_for_posted_operations(agent, target):
    """The peer reads our memory directly (cma): deregistering must wait until it has finished."""
    size, bs = 256 << 20, 1 << 20
    local = HostBuffer(agent, size)
    data = random_bytes(size, 41)
    local.write(0, data)
    buf = RemoteBuffer(target, size)
    agent.refresh_remote("decode-0")
    try:
        n = size // bs
        xfer = agent.transfer(
            "WRITE", local.descs(np.arange(n) * bs, bs), buf.descs(np.arange(n)[::-1] * bs, bs), "decode-0"
        )
        agent.deregister_memory(local.registration)
        local.array[:] = 0  # had the peer still been reading, it would now read zeros
        assert xfer.wait() == XferState.DONE
        got = np.frombuffer(buf.read(0, size), np.uint8).reshape(n, bs)
        assert np.array_equal(got[::-1], np.frombuffer(data, np.uint8).reshape(n, bs))
    finally:
        buf.free()
        agent.refresh_remote("decode-0")


@pytest.mark.parametrize(
    "params, present, absent",
    [
        ({"error_handling": True}, "tcp", None),  # UCX's own peer-failure handling (tcp only)
        ({"cma": True}, "cma", None),  # opt back into cma: fastest, but a dying peer aborts the survivor
        ({}, "sysv", "cma"),  # the default
        ({"ucx_config": {"TLS": "tcp"}}, "tcp", "sysv"),
    ],
)
def test_transport_settings_pass_through(params, present, absent):
    cfg = {"backends": {"ucx": params}}
    with RemotePeer("t-" + present, cfg) as peer, Agent("i-" + present, cfg) as agent:
        buf = RemoteBuffer(peer, 1 << 20)
        agent.add_remote(peer.metadata())
        local = HostBuffer(agent, 1 << 20)
        for op, seed in (("WRITE", 1), ("READ", 2)):
            data = random_bytes(1 << 20, seed)
            (local if op == "WRITE" else buf).write(0, data)
            xfer = agent.transfer(op, local.descs([0], [1 << 20]), buf.descs([0], [1 << 20]), peer.name)
            assert xfer.wait() == XferState.DONE
            assert (buf if op == "WRITE" else local).read(0, 1 << 20) == data
        desc = agent.backend("ucx").describe()
        assert present in desc["transports"] and (absent is None or absent not in desc["transports"]), desc
        assert desc["error_handling"] == bool(params.get("error_handling"))


def test_ucx_config_defaults_yield_to_the_user_and_the_environment(monkeypatch):
    from datamover.backends.ucx import ucx_config

    for var in (
        "UCX_TLS", "UCX_TCP_PUT_ENABLE", "UCX_CMA_TX_QUOTA", "UCX_USE_MT_MUTEX", "UCX_TCP_TX_SEG_SIZE",
        "UCX_TCP_RX_SEG_SIZE",
    ):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    mutex = {"USE_MT_MUTEX": "y"}  # threads share the worker: a mutex, not UCX's default spinlock
    segs = {"TCP_TX_SEG_SIZE": "64k", "TCP_RX_SEG_SIZE": "64k"}  # emulated gets come back in 64 KiB messages
    want = {"TLS": "^cma", "TCP_PUT_ENABLE": "n", **segs, **mutex, "CMA_TX_QUOTA": "64"}
    assert ucx_config({}, cma=False) == want
    assert "TLS" not in ucx_config({}, cma=True)
    mine = ucx_config({"CMA_TX_QUOTA": 4, "TCP_PUT_ENABLE": "y"}, cma=True)
    assert mine == {"CMA_TX_QUOTA": "4", "TCP_PUT_ENABLE": "y", **segs, **mutex}
    # the segments: only where tcp is in use, and either one set by the user or the environment keeps UCX's
    for tls in ("sm,self", "^tcp", "rc,sm"):
        assert "TCP_TX_SEG_SIZE" not in ucx_config({"TLS": tls}, cma=False), tls
    kept = ucx_config({"TLS": "tcp", "TCP_RX_SEG_SIZE": "16k"}, cma=False)
    assert kept["TCP_RX_SEG_SIZE"] == "16k" and "TCP_TX_SEG_SIZE" not in kept
    # tcp's own put stays on where no shared memory transport is left to emulate puts over
    for tls in ("tcp,self", "^sm", "^mm,cma", "rc,tcp"):
        assert "TCP_PUT_ENABLE" not in ucx_config({"TLS": tls}, cma=False), tls
    for tls in ("^cma", "sysv,tcp", "self,sm,tcp", "all"):
        assert ucx_config({"TLS": tls}, cma=False)["TCP_PUT_ENABLE"] == "n", tls
    monkeypatch.setenv("UCX_CMA_TX_QUOTA", "2")
    monkeypatch.setenv("UCX_TLS", "posix,tcp")
    assert ucx_config({}, cma=False) == {"TCP_PUT_ENABLE": "n", **segs, **mutex}  # UCX reads the environment's values
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert ucx_config({}, cma=False) == {**segs, **mutex}
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")
    assert ucx_config({}, cma=False) == mutex
    monkeypatch.setenv("UCX_USE_MT_MUTEX", "n")
    assert ucx_config({}, cma=False) == {}
    assert ucx_config({"USE_MT_MUTEX": "n"}, cma=False) == {"USE_MT_MUTEX": "n"}


def test_tcp_segments_read_what_ucx_will_use_its_own_defaults_for_what_nobody_set(monkeypatch):
    """What the handshake tells a peer this agent receives: UCX's receive default is 64 KiB (its send default
    8 KiB), so a user who sets only the send segment still receives 64 KiB messages, and says so."""
    from datamover.backends.ucx.config import tcp_segments

    for var in ("UCX_TLS", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert tcp_segments({"TLS": "tcp"}) == (8192, 65536)
    assert tcp_segments({"TLS": "tcp", "TCP_TX_SEG_SIZE": "16k"}) == (16384, 65536)
    assert tcp_segments({"TLS": "tcp", "TCP_RX_SEG_SIZE": "16k"}) == (8192, 16384)
    assert tcp_segments({"TLS": "sm,self"}) == (0, 0)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "32k")
    assert tcp_segments({"TLS": "tcp,self"}) == (8192, 32768)


def test_tls_includes_reads_ucx_tls_as_ucx_does():
    from datamover.backends.ucx import tls_includes

    sm = frozenset({"sm", "shm"})
    assert tls_includes(None, "cma", sm) and tls_includes("", "cma", sm) and tls_includes("all", "cma", sm)
    assert tls_includes("self,sm,tcp", "cma", sm) and tls_includes("^tcp", "cma", sm)
    assert not tls_includes("^cma", "cma", sm) and not tls_includes("^sm", "cma", sm)
    assert not tls_includes("tcp,self", "cma", sm) and tls_includes(" cma , tcp", "cma", sm)


@contextlib.contextmanager
def _connected(name: str):
    """(target peer, agent, 1 MiB buffer on the peer, 1 MiB local buffer) after one READ went through."""
    with RemotePeer(f"{name}-target", UCX) as peer, Agent(f"{name}-me", UCX) as agent:
        buf = RemoteBuffer(peer, 1 << 20)
        agent.add_remote(peer.metadata())
        local = HostBuffer(agent, 1 << 20)
        assert agent.transfer("READ", local.descs([0], [4096]), buf.descs([0], [4096]), peer.name).wait()
        yield peer, agent, buf, local


def test_a_failing_periodic_step_leaves_the_service_loop_serving(monkeypatch):
    """A bug in a periodic step (here _bury) is logged; the loop goes on, and the next transfer completes at once."""
    from datamover.backends.ucx.backend import UcxBackend

    with _connected("step") as (peer, agent, buf, local):
        backend, real, fired = agent.backend("ucx"), UcxBackend._bury, threading.Event()

        def bury(self):
            if not fired.is_set():
                fired.set()
                raise RuntimeError("injected: a bug in a periodic step")
            return real(self)

        monkeypatch.setattr(UcxBackend, "_bury", bury)
        assert fired.wait(10)
        backend.remove_remote(peer.name)  # a command run after the fault: the loop still runs them
        agent.add_remote(peer.metadata())
        xfer = agent.transfer("READ", local.descs([0], [4096]), buf.descs([0], [4096]), peer.name, timeout=30)
        assert xfer.wait() == XferState.DONE
        assert backend._thread.is_alive()


def test_a_dead_service_thread_fails_transfers_at_once(monkeypatch):
    """If the service thread dies anyway, the backend refuses new work with RemoteDisconnected (it sat in PROC)."""
    from datamover.backends.ucx.backend import UcxBackend

    with _connected("dead") as (peer, agent, buf, local):
        backend = agent.backend("ucx")

        def in_flight(self):
            raise RuntimeError("injected: a bug outside every guarded step")

        monkeypatch.setattr(UcxBackend, "_in_flight", in_flight)
        backend._wake()
        backend._thread.join(10)
        assert not backend._thread.is_alive()
        with pytest.raises(RemoteDisconnected, match="service thread ended"):
            xfer = agent.transfer("READ", local.descs([0], [4096]), buf.descs([0], [4096]), peer.name, timeout=30)
            xfer.wait()


def test_a_notification_reported_unsent_is_never_delivered():
    """A target frozen before the handshake: send_notification raises, and once thawed the message does not arrive."""
    from datamover.errors import NotificationTimeout

    cfg = {"backends": {"ucx": {"connect_timeout_s": 1.0}}}
    with RemotePeer("notif-peer", cfg) as peer, Agent("notif-me", cfg) as agent:
        agent.add_remote(peer.metadata())
        peer.freeze()
        try:
            with pytest.raises(RemoteDisconnected, match=r"handshake|not sent"):
                agent.send_notification("notif-peer", b"hello-1")
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        with pytest.raises(NotificationTimeout):
            peer.call("wait_notification", b"hello", 3.0)
        agent.send_notification("notif-peer", b"hello-2")  # a fresh handshake once it answers
        assert peer.call("wait_notification", b"hello", 10.0) == ("notif-me", b"hello-2")


def test_deregister_cuts_off_receives_still_served_into_the_region(monkeypatch):
    """The target's wait for a served WRITE runs out: its receives are cut off (the writer hears Fail), and the
    writer's late sends land nowhere in the memory the target's caller got back."""
    from datamover.backends.ucx.tagged import Tagged
    from datamover.testing.waiting import HeldOnce

    size, served = 4 << 20, {"backends": {"ucx": {"one_sided": False}}}
    with Agent("dereg-t", {**served, "timeout_s": 1.0}) as target, Agent("dereg-w", served) as writer:
        tbuf = HostBuffer(target, size)
        tbuf.write(0, b"\x00" * size)
        writer.add_remote(target.metadata())
        src = HostBuffer(writer, size)
        src.write(0, b"\x5a" * size)
        assert writer.transfer("WRITE", src.descs([0], [4096]), tbuf.descs([0], [4096]), "dereg-t").wait()
        tbuf.write(0, b"\x00" * size)
        hold, real = HeldOnce("the writer posting its sends"), Tagged._post_local
        # the writer's request leaves, then its sends wait: the target has its receives posted meanwhile
        monkeypatch.setattr(Tagged, "_post_local", lambda self, peer, op: hold.wrap(real)(self, peer, op))
        xfer = writer.transfer("WRITE", src.descs([0], [size]), tbuf.descs([0], [size]), "dereg-t", timeout=60)
        assert hold.reached.wait(10)
        tb = target.backend("ucx")
        until(lambda: tb._active_in, what="the target serving the WRITE")
        target.deregister_memory(tbuf.registration)
        assert not tb._active_in and tb.describe()["quarantined workers"]["held"] == 1
        tbuf.write(0, b"\x00" * size)  # the target's caller reuses its memory
        hold.go.set()
        with pytest.raises(RemoteDisconnected, match="deregistered"):
            xfer.wait(30)
        assert hold.returned.wait(10)
        landed = int(np.count_nonzero(np.frombuffer(tbuf.read(0, size), np.uint8)))
        assert landed == 0, f"{landed} bytes of the cut-off WRITE landed after deregister_memory returned"
