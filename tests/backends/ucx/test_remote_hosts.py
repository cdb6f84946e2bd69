"""The remote tests across two test hosts (network namespaces joined by veth pairs, the peer in its own pid
namespace; UCX over tcp as between machines): SIGKILL mid-transfer, reconnect, refused descriptors,
revocation, auth, and a link taken down mid-transfer.

Every fault comes at a known point: "mid-transfer" is made certain by freezing the peer (SIGSTOP) once it
answered on its pipe, posting, then killing it or taking its link down; the peer's CPU is needed to serve
tcp gets, so the transfer cannot have finished first.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.agents.metadata import encode_metadata
from datamover.backends import backend_status
from datamover.backends.ucx import rma as ucx_rma
from datamover.errors import (
    AuthenticationError,
    DatamoverError,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
    TransferTimeout,
)
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

from .native_hold import event_arrives, held_and_idle

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

TCP = {"UCX_TLS": "tcp,self"}
SIZE, BS = 16 << 20, 1 << 20


def _far(hosts, name, secret=None, **params):
    there = hosts[1]
    cfg = {"backends": {"ucx": {"host": there.address, **params}}}
    if secret is not None:
        cfg["secret"] = secret
    return RemotePeer(name, cfg, env=TCP, host=there)


def _near(hosts, name, secret=None, **params):
    here = hosts[0]
    cfg = {
        "backends": {"ucx": {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}, **params}}
    }
    if secret is not None:
        cfg["secret"] = secret
    return Agent(name, cfg)


def _rows(buf_or_local, n=SIZE // BS):
    return buf_or_local.descs(np.arange(n) * BS, BS)


def _roundtrip(agent, peer, nbytes=1 << 16, seed=3):
    """A WRITE then a READ of ``nbytes`` with ``peer``, every byte checked."""
    local, remote = HostBuffer(agent, 2 * nbytes), RemoteBuffer(peer, nbytes)
    agent.add_remote(peer.metadata())  # the buffer was registered after the metadata this agent holds
    try:
        data = random_bytes(nbytes, seed)
        local.write(0, data)
        assert agent.transfer("WRITE", local.descs([0], [nbytes]), remote.descs([0], [nbytes]), peer.name).wait()
        assert remote.read(0, nbytes) == data
        assert agent.transfer("READ", local.descs([nbytes], [nbytes]), remote.descs([0], [nbytes]), peer.name).wait()
        assert local.read(nbytes, nbytes) == data
    finally:
        agent.deregister_memory(local.registration)
        remote.free()


def _frozen_read(agent, peer, remote, local, timeout):
    """Freeze ``peer`` once idle and post a READ from it: in flight for certain."""
    peer.call("ping")  # answered: idle in its command loop
    peer.freeze()
    xfer = agent.transfer("READ", _rows(local), _rows(remote), peer.name, timeout=timeout)
    assert xfer.state == XferState.PROC
    return xfer


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_sigkill_mid_transfer_across_hosts_then_the_peer_comes_back(test_hosts, op):
    with _near(test_hosts, "near-kill") as agent:
        local = HostBuffer(agent, SIZE)
        victim = _far(test_hosts, "victim")
        try:
            remote = RemoteBuffer(victim, SIZE)
            agent.add_remote(victim.metadata())
            _roundtrip(agent, victim)
            victim.call("ping")  # answered: idle in its command loop
            victim.freeze()  # idle, connected: the transfer below cannot finish
            xfer = agent.transfer(op, _rows(local), _rows(remote), "victim", timeout=30)
            assert xfer.state == XferState.PROC
            t0 = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            with pytest.raises(RemoteDisconnected) as info:
                xfer.wait()
            assert time.monotonic() - t0 < 10 and "victim" in str(info.value)
        finally:
            victim.close()
        with _far(test_hosts, "victim") as again:  # same name, new metadata: reconnects
            agent.add_remote(again.metadata())
            _roundtrip(agent, again, seed=4)
        agent.deregister_memory(local.registration)


def test_refused_descriptors_across_hosts(test_hosts):
    with _far(test_hosts, "owner-far") as peer, _near(test_hosts, "forger") as agent:
        buf = RemoteBuffer(peer, 2 * 4096)
        agent.add_remote(peer.metadata())
        real = agent.remote_metadata("owner-far")
        regions = [(m, d, s, (n + 4096 if s == buf.addr else n), r) for m, d, s, n, r in real.regions]
        agent.add_remote(encode_metadata("owner-far", real.backends, regions))
        local = HostBuffer(agent, 3 * 4096)
        local.write(0, random_bytes(3 * 4096, 9))
        before = buf.read(0, 2 * 4096)
        xfer = agent.transfer("WRITE", local.descs([0, 4096], [100, 8000]), buf.descs([0, 200], [100, 8000]),
                              "owner-far")  # fmt: skip
        with pytest.raises(RemoteRefused) as info:
            xfer.wait()
        assert info.value.index == 1 and "outside every region" in str(info.value)
        assert buf.read(0, 2 * 4096) == before


def test_revocation_across_hosts(test_hosts):
    with _far(test_hosts, "revoker") as peer, _near(test_hosts, "stale") as agent:
        local, buf = HostBuffer(agent, 8192), RemoteBuffer(peer, 8192)
        agent.add_remote(peer.metadata())
        local.write(0, random_bytes(8192, 3))
        assert agent.transfer("WRITE", local.descs([0], [8192]), buf.descs([0], [8192]), "revoker").wait()
        stale = buf.descs([0], [8192])
        one_sided = agent.backend("ucx").describe()["requests"]["one-sided"]
        buf.free()  # returns once this agent confirmed dropping the rkey, over the veth
        with pytest.raises((RemoteRefused, NotRegistered)):
            agent.transfer("WRITE", local.descs([0], [8192]), stale, "revoker").wait()
        assert agent.backend("ucx").describe()["requests"]["one-sided"] == one_sided


def test_auth_across_hosts(test_hosts):
    with _far(test_hosts, "sec-far", secret=b"s3cret") as peer:
        buf = RemoteBuffer(peer, 4096)
        with _near(test_hosts, "sec-near", secret=b"s3cret") as agent:
            agent.add_remote(peer.metadata())
            _roundtrip(agent, peer, 4096)
        blob = peer.metadata()
        with _near(test_hosts, "no-secret") as agent:
            agent.add_remote(blob[36:])  # the signature stripped: the control handshake still refuses
            local = HostBuffer(agent, 4096)
            before = buf.read(0, 4096)
            xfer = agent.transfer("WRITE", local.descs([0], [4096]), buf.descs([0], [4096]), "sec-far")
            with pytest.raises(AuthenticationError):
                xfer.wait()
            assert buf.read(0, 4096) == before


def test_link_down_mid_transfer_ends_in_err_within_its_timeout_and_traffic_resumes(test_hosts):
    there = test_hosts[1]
    with _far(test_hosts, "far-link") as peer, _near(test_hosts, "near-link") as agent:
        remote, local = RemoteBuffer(peer, SIZE), HostBuffer(agent, SIZE)
        remote.write(0, b"\x5a" * SIZE)
        agent.add_remote(peer.metadata())
        _roundtrip(agent, peer)
        timeout = 3.0
        xfer = _frozen_read(agent, peer, remote, local, timeout)
        t0 = time.monotonic()
        there.link_down()
        try:
            os.kill(peer.pid, signal.SIGCONT)  # the peer runs again: only the link stops the transfer now
            with pytest.raises((TransferTimeout, RemoteDisconnected)):
                xfer.wait()
            elapsed = time.monotonic() - t0
            # its deadline, then cancel_drain_s (1 s) for the gets to end before the worker is replaced, then 2 s
            assert xfer.state == XferState.ERR and elapsed < timeout + 1.0 + 2.0, elapsed
        finally:
            there.link_up()
        local.array[:] = 0
        # traffic resumes once the link is back (the agent reconnects by itself); nothing of the ERR'd READ lands
        deadline = time.monotonic() + 60
        while True:
            try:
                _roundtrip(agent, peer, seed=8)
                break
            except DatamoverError:
                assert time.monotonic() < deadline, "traffic did not resume after the link came back"
        assert np.count_nonzero(local.array) == 0, "bytes of the READ that ended in ERR landed later"


@pytest.mark.skipif(ucx_rma.native() is None, reason=ucx_rma.data_path())
def test_targets_on_either_host_are_served_by_their_native_progress_thread(test_hosts):
    """Over tcp the target must progress for a put or get to complete; across hosts its native thread does it.

    The far target's counters grow with the transfers it served; the near target, its native thread held off
    its worker, lets no byte of a far WRITE land (nothing else progresses it) until released.
    """
    n, bs = 16, 4096
    with _far(test_hosts, "far-served") as peer, _near(test_hosts, "near-served") as agent:
        remote, local = RemoteBuffer(peer, n * bs), HostBuffer(agent, n * bs)
        agent.add_remote(peer.metadata())
        before = peer.call("describe", "ucx")
        assert before["UCX progress"] == "a native thread on UCX's event fd"
        local.write(0, random_bytes(n * bs, 5))
        rows = local.descs(np.arange(n) * bs, bs), remote.descs(np.arange(n)[::-1] * bs, bs)
        for _ in range(20):
            assert agent.transfer("WRITE", *rows, "far-served").wait() == XferState.DONE
            assert agent.transfer("READ", *rows, "far-served").wait() == XferState.DONE
        after = peer.call("describe", "ucx")["native progress"]
        assert after["progressed"] - before["native progress"]["progressed"] >= 40
        assert remote.read(0, n * bs) == b"".join(local.read(i * bs, bs) for i in reversed(range(n)))

        progress = agent.backend("ucx")._progress
        mine = HostBuffer(agent, n * bs)
        theirs, _ = peer.call("alloc", n * bs)
        peer.call("write", theirs, 0, random_bytes(n * bs, 6))
        peer.call("add_remote", agent.metadata())
        addrs = mine.descs(np.arange(n) * bs, bs).addr
        assert peer.call("wait_transfer", peer.call("start_transfer", "WRITE", theirs, "near-served", addrs, [bs] * n))
        mine.write(0, bytes(n * bs))
        worker = agent.backend("ucx")._worker
        progress.hold()
        try:
            held_and_idle(progress, worker)
            held = progress.stats["progressed"]
            xid = peer.call("start_transfer", "WRITE", theirs, "near-served", addrs, [bs] * n)
            event_arrives(worker)  # known point: the far WRITE's data reached this host, and nobody progressed it
            assert mine.read(0, n * bs) == bytes(n * bs) and progress.stats["progressed"] == held
        finally:
            progress.release()
        assert peer.call("wait_transfer", xid) == "DONE"
        assert mine.read(0, n * bs) == peer.call("read", theirs, 0, n * bs)


@pytest.mark.parametrize("small", ["far", "near"])
def test_peers_whose_tcp_segments_are_smaller_than_ours_are_refused_not_crashed(test_hosts, small):
    """We send tcp segments of 64 KiB (an emulated get comes back in messages of one segment); UCX aborts a
    process that receives a message larger than its own segment (seen: SIGSEGV/SIGABRT in the initiator when a
    target sent 64 KiB get replies to an 8 KiB receiver). So the handshake compares them: an agent on UCX's
    8 KiB default (a user's environment, or a version before this field) is refused with the reason, on
    either side, and both processes live on."""
    eight = {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "8k"}
    there, here = test_hosts[1], test_hosts[0]
    env = {**TCP, **eight} if small == "far" else TCP
    near_ucx = {"TLS": "tcp,self", **here.ucx_config()}
    if small == "near":
        near_ucx.update({k.removeprefix("UCX_"): v for k, v in eight.items()})
    far_cfg = {"backends": {"ucx": {"host": there.address}}}
    near_cfg = {"backends": {"ucx": {"host": here.address, "ucx_config": near_ucx}}}
    with RemotePeer(f"segs-{small}", far_cfg, env=env, host=there) as peer, Agent(f"segs-n-{small}", near_cfg) as agent:
        want = {"send": 8192, "receive": 8192}
        assert (peer.call("describe", "ucx") if small == "far" else agent.backend("ucx").describe())[
            "tcp segments"
        ] == want
        remote, local = RemoteBuffer(peer, 1 << 20), HostBuffer(agent, 1 << 20)
        agent.add_remote(peer.metadata())
        with pytest.raises((RemoteRefused, DatamoverError), match="UCX_TCP_TX_SEG_SIZE"):
            agent.transfer("READ", local.descs([0], [1 << 20]), remote.descs([0], [1 << 20]), peer.name).wait()
        assert peer.call("ping") is not None
        assert local.read(0, 1 << 20) == bytes(1 << 20)


@pytest.mark.skipif(ucx_rma.native() is None, reason=ucx_rma.data_path())
def test_a_peer_on_another_machine_gets_the_far_waiting_settings_on_both_sides(test_hosts):
    """Between machines over tcp the initiator's waiters poll ``far_drive_spin_us`` before sleeping, and a target
    that serves such an initiator switches its native progress thread to ``far_progress_spin_us`` /
    ``far_progress_poll_us``; the near settings stay for everyone else (the far ones are chosen per peer)."""
    far = {"far_drive_spin_us": 1234, "far_progress_spin_us": 55, "far_progress_poll_us": 0}
    with _far(test_hosts, "far-tuned", **far) as peer, _near(test_hosts, "near-tuned", **far) as agent:
        assert peer.call("describe", "ucx")["UCX progress"] == "a native thread on UCX's event fd"
        agent.add_remote(peer.metadata())
        _roundtrip(agent, peer)
        mine, theirs = agent.backend("ucx").describe(), peer.call("describe", "ucx")
        assert mine["peers on other machines"] == {"far-tuned": 1234}
        assert theirs["UCX progress"] == (
            "a native thread on UCX's event fd, spinning 55 us after work, polling every 25 us after work while a"
            " stream of puts comes in (once it brought 2097152 bytes) (for peers on other machines over tcp)"
        )
        assert mine["UCX progress"] == "a native thread on UCX's event fd"  # it served nobody


def _stream_polls(peer, agent, op, rows, times):
    """The far target's timer polls and stream bursts over ``times`` transfers ``op`` of ``rows``."""
    before = peer.call("describe", "ucx")["native progress"]
    for _ in range(times):
        assert agent.transfer(op, *rows, peer.name).wait() == XferState.DONE
    after = peer.call("describe", "ucx")["native progress"]
    return after["polls"] - before["polls"], after["streams"] - before["streams"]


@pytest.mark.skipif(ucx_rma.native() is None, reason=ucx_rma.data_path())
@pytest.mark.parametrize("poll_us", [25, 0])
def test_a_far_target_polls_on_its_timer_after_put_streams_not_after_reads(test_hosts, poll_us):
    """``far_stream_poll_us``: a target serving an initiator on another machine over tcp sleeps on its timer
    after each burst during which a stream of puts came in (a WRITE), once the stream brought
    ``far_stream_poll_bytes`` (2 MiB), instead of waiting to be woken by the next segment; a WRITE of 1 MiB
    after a pause, and a READ's bursts (small get requests in, the rows out), block on the event fd; 0: never."""
    with _far(test_hosts, f"stream-poll-{poll_us}", far_stream_poll_us=poll_us) as peer:
        with _near(test_hosts, f"stream-init-{poll_us}") as agent:
            remote, local = RemoteBuffer(peer, SIZE), HostBuffer(agent, SIZE)
            agent.add_remote(peer.metadata())
            local.write(0, random_bytes(SIZE, 8))
            rows = _rows(local), _rows(remote)
            deadline = time.monotonic() + 10  # its sockets are looked up every half second while it serves
            while _stream_polls(peer, agent, "WRITE", rows, 1)[1] == 0 and time.monotonic() < deadline:
                pass
            polls, streams = _stream_polls(peer, agent, "WRITE", rows, 5)
            assert streams > 0, peer.call("describe", "ucx")
            assert (polls > 0) == (poll_us > 0), (polls, streams)
            assert agent.transfer("READ", *rows, peer.name).wait()  # its first burst still counts the WRITE's tail
            assert _stream_polls(peer, agent, "READ", rows, 5) == (0, 0)
            short = _rows(local, 1), _rows(remote, 1)
            before = peer.call("describe", "ucx")["native progress"]
            for _ in range(5):
                time.sleep(0.005)  # a pause of more than 1 ms: a new stream
                assert agent.transfer("WRITE", *short, peer.name).wait() == XferState.DONE
            after = peer.call("describe", "ucx")["native progress"]
            assert after["streams"] > before["streams"] and after["polls"] == before["polls"], (before, after)
            assert local.read(0, SIZE) == remote.read(0, SIZE)
            mode = peer.call("describe", "ucx")["UCX progress"]
            assert ("polling every 25 us after work while a stream of puts comes in" in mode) == (poll_us > 0), mode
