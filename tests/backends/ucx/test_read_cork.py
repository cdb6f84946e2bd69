"""A READ from a peer on another machine over tcp posts its gets with the worker's tcp sockets to that peer
corked (``far_read_cork_rows``), so its requests leave in full segments, not one segment per row.

What is counted is the kernel's own count of data segments each TCP socket sent (``TCP_INFO``), over the
process's sockets to the peer found independently of the code under test (``/proc/self/fd``, the control
connection left out); bytes are checked after every READ.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import struct
import time

import numpy as np
import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.backends.ucx import rma as ucx_rma
from datamover.backends.ucx import tcp_sockets
from datamover.errors import InvalidParameter
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = [
    pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}"),
    pytest.mark.skipif(ucx_rma.native() is None, reason=ucx_rma.data_path()),
]

TCP = {"UCX_TLS": "tcp,self"}
ROWS, BLOCK = 256, 4096
FEW = 16  # rows of a WRITE whose acknowledgements (9 bytes each) are more than CORK_MIN_SENT
# offsets (and formats) in struct tcp_info (Linux 4.6 on) of tcpi_data_segs_in, _out and tcpi_bytes_acked
_DATA_SEGS_IN, _DATA_SEGS_OUT, _BYTES_ACKED = (152, "I"), (156, "I"), (120, "Q")


def _sockets_to(ip: str, skip_port: int) -> list[socket.socket]:
    """Duplicates of this process's TCP sockets to ``ip``, the one to port ``skip_port`` left out; each socket
    once, however many fds name it."""
    out, seen = [], set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = sock.getpeername() if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM else None
        except OSError:
            peer = None
        if peer is not None and peer[0] == ip and peer[1] != skip_port:
            out.append(sock)
        else:
            sock.close()
    return out


def _tcp_count(ip: str, skip_port: int, field: tuple[int, str] = _DATA_SEGS_OUT) -> int:
    """Data segments sent (or received, or bytes the peer acknowledged: ``field``) so far by this process's TCP
    sockets to ``ip``, the one to port ``skip_port`` left out."""
    total = 0
    for sock in _sockets_to(ip, skip_port):
        with sock:
            try:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            except OSError:
                continue
            total += struct.unpack_from(field[1], info, field[0])[0]
    return total


def _far_read_segments(hosts, cork_rows: int, push: int = 0) -> tuple[int, str]:
    """Data segments this process sent during one READ of ROWS x BLOCK from a peer on host 1; and the
    initiator's READ cork description. Every byte is checked."""
    there, here = hosts[1], hosts[0]
    cfg = {"backends": {"ucx": {"host": there.address}}}
    near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}}
    with (
        RemotePeer(f"cork-peer-{cork_rows}", cfg, env=TCP, host=there) as peer,
        Agent(
            f"cork-init-{cork_rows}",
            {"backends": {"ucx": {**near, "far_read_cork_rows": cork_rows, "far_read_cork_push": push}}},
        ) as agent,
    ):
        n = ROWS * BLOCK
        remote, local = RemoteBuffer(peer, n), HostBuffer(agent, n)
        data = random_bytes(n, seed=cork_rows)
        remote.write(0, data)
        agent.add_remote(peer.metadata())
        offsets = np.arange(ROWS) * BLOCK
        scattered = np.random.default_rng(1).permutation(ROWS) * BLOCK  # no two rows merge into one
        lp, rp = agent.prepare(local.descs(offsets, BLOCK)), agent.prepare(remote.descs(scattered, BLOCK), peer.name)
        xfer = agent.make_transfer("READ", lp, None, rp, None)
        want = np.frombuffer(data, np.uint8).reshape(ROWS, BLOCK)[scattered // BLOCK].tobytes()
        assert xfer.post().wait()  # connects UCX's sockets (it connects on the first send)
        assert local.read(0, n) == want
        control = int(peer.call("describe", "ucx")["control"].rsplit(":", 1)[1])
        local.write(0, bytes(n))
        before = _tcp_count(there.address, control)
        assert xfer.post().wait()
        segments = _tcp_count(there.address, control) - before
        assert local.read(0, n) == want
        text = agent.backend("ucx").describe()["READ cork"]
        xfer.release()
        return segments, text


def test_a_far_read_sends_its_gets_in_full_segments(test_hosts):
    """Corked, the 256 gets of one READ (a request of a few tens of bytes each) leave together in full segments,
    about 8. Uncorked (``far_read_cork_rows=0``) each leaves when posted, unless the kernel's autocorking
    happens to merge it with the one before: 40-255 segments measured, so that count is only shown. Let out
    every 8 rows (``far_read_cork_push``), they leave in one segment per 8 rows."""
    corked, text = _far_read_segments(test_hosts, 32)
    pushed, every = _far_read_segments(test_hosts, 32, push=8)
    plain, off = _far_read_segments(test_hosts, 0)
    assert corked <= ROWS // 16, f"{corked} segments corked, {plain} uncorked"
    assert ROWS // 8 - 2 <= pushed <= ROWS // 4, f"{pushed} segments let out every 8 rows, {corked} corked"
    assert "corked (TCP_CORK), let out once the flush is posted; sockets found {'cork-peer-32': 1}" in text
    assert "let out every 8 rows" in every
    assert off == "off"


def test_sockets_to_finds_the_workers_tcp_connection_and_post_corks_only_sockets_it_still_names():
    """Two workers of this process over tcp on loopback: ``sockets_to`` finds worker 0's connection; a post
    corks it, and skips (fd, inode) pairs that name something else (a pipe, another inode); every READ is
    right."""
    from datamover.backends.ucx.config import import_ucxx, make_context

    u, _ = import_ucxx()
    ctxs = [make_context(u, {"TLS": "tcp,self", "NET_DEVICES": "lo"}, False)[0] for _ in range(2)]
    workers = [u.UCXWorker(c) for c in ctxs]
    ep = workers[0].create_endpoint_from_worker_address(workers[1].address, False)
    n, rows = 4096, 64
    got, src = np.zeros(n * rows, np.uint8), np.frombuffer(random_bytes(n * rows, seed=5), np.uint8).copy()
    memh = ucx_rma.mem_map(ctxs[1].handle, src.ctypes.data, src.nbytes)
    rkey = ucx_rma.rkey_unpack(ep.handle, ucx_rma.rkey_pack(ctxs[1].handle, memh))
    lib = ucx_rma.native()
    r, w = os.pipe()

    def read(cork) -> int:
        got[:] = 0
        offsets = np.arange(rows) * n
        table = ucx_rma.native_rows(
            got.ctypes.data + offsets, np.full(rows, n), src.ctypes.data + offsets, np.full(rows, rkey, np.uint64),
            [None] * rows,
        )  # fmt: skip
        before = lib.post_stats()["corked"]
        flush, status = ucx_rma.post_native(True, ep.handle, table, None, cork)
        assert status == ucx_rma.UCS_OK
        while flush.poll() == ucx_rma.UCS_INPROGRESS:
            workers[0].progress()
            workers[1].progress()
        assert flush.poll() == ucx_rma.UCS_OK and np.array_equal(got, src)
        return lib.post_stats()["corked"] - before

    try:
        assert read(None) == 0
        found = tcp_sockets.sockets_to(lib.worker_efd(workers[0].handle), "127.0.0.1")
        assert found and all(stat.S_ISSOCK(os.fstat(fd).st_mode) and os.fstat(fd).st_ino == ino for fd, ino in found)
        assert read(found) == 1
        assert len(tcp_sockets.names(found)) == len(found)
        assert all(n.startswith("127.0.0.1:") and " -> 127.0.0.1:" in n for n in tcp_sockets.names(found))
        assert tcp_sockets.names(((found[0][0], found[0][1] + 1),)) == []  # the fd names another inode
        assert read(((r, os.fstat(r).st_ino), (found[0][0], found[0][1] + 1))) == 0
        with pytest.raises(TypeError, match="cork"):
            ucx_rma.post_native(True, ep.handle, np.zeros((0, 5), np.uint64), None, ((r, 1),) * 9)
    finally:
        os.close(r)
        os.close(w)
        ucx_rma.rkey_destroy(rkey)
        ucx_rma.mem_unmap(ctxs[1].handle, memh)


@pytest.mark.parametrize("key", ["far_read_cork_rows", "far_read_cork_push"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "32", None])
def test_far_read_cork_rows_must_be_a_whole_number(key, bad):
    with Agent("cork-bad", {"backends": {"ucx": {key: bad}}}) as agent:
        with pytest.raises(InvalidParameter, match=key):
            agent.backend("ucx")  # started on first use


def _handed(peer: RemotePeer, ip: str, control: int) -> bool:
    """Whether the target's progress thread was handed every connection this process holds to it (ucxx's worker's
    and the data worker's): UCX
    may replace the first connection between two workers with another, and a socket handed over before that is
    looked up again only half a second later."""
    handed = peer.call("describe", "ucx")["progress cork"]
    socks = _sockets_to(ip, control)
    try:
        return bool(socks) and all(
            f"{s.getpeername()[0]}:{s.getpeername()[1]} -> {s.getsockname()[0]}:{s.getsockname()[1]}" in handed
            for s in socks
        )
    finally:
        for s in socks:
            s.close()


def _await_handed(peer: RemotePeer, ip: str, control: int) -> None:
    """Wait (up to 10 s) until ``_handed``: the service thread looks the sockets up again every half second while
    it serves."""
    deadline = time.monotonic() + 10
    while not _handed(peer, ip, control) and time.monotonic() < deadline:
        time.sleep(0.05)


def _frozen_write_acks(hosts, cork: bool) -> tuple[int, str, int]:
    """Data segments (the target's put acknowledgements) this initiator received for one WRITE of ROWS x BLOCK
    posted while the target on host 1 was frozen (SIGSTOP) until its kernel had taken every put (a receive
    buffer of 4 MiB holds them), so its first burst finds them all queued; the target's progress cork
    description and bursts corked. Every byte is checked."""
    import signal

    there, here = hosts[1], hosts[0]
    cfg = {"backends": {"ucx": {"host": there.address, "far_progress_cork": cork}}}
    near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}}
    with (
        RemotePeer(f"pcork-target-{cork}", cfg, env={**TCP, "UCX_TCP_RCVBUF": "4M"}, host=there) as peer,
        Agent(f"pcork-init-{cork}", {"backends": {"ucx": near}}) as agent,
    ):
        n = ROWS * BLOCK
        target, src = RemoteBuffer(peer, n), HostBuffer(agent, n)
        data = random_bytes(n, seed=7)
        src.write(0, data)
        agent.add_remote(peer.metadata())
        scattered = np.random.default_rng(2).permutation(ROWS) * BLOCK
        rows = (src.descs(np.arange(ROWS) * BLOCK, BLOCK), target.descs(scattered, BLOCK))
        assert agent.transfer("WRITE", *rows, peer.name).wait()  # connects UCX's sockets
        control = int(peer.call("describe", "ucx")["control"].rsplit(":", 1)[1])
        if cork:
            _await_handed(peer, there.address, control)
        # the thread's byte counts start at its first burst after the hand-over: have that burst come first
        assert agent.transfer("WRITE", *rows, peer.name).wait()
        # then a few rows, whose acknowledgements are what the backlog's burst finds sent since the last burst:
        # weighed against the backlog that came in meanwhile (not read yet), they made it look like large rows
        few = (src.descs(np.arange(FEW) * BLOCK, BLOCK), target.descs(scattered[:FEW], BLOCK))
        assert agent.transfer("WRITE", *few, peer.name).wait()
        corked_before = peer.call("describe", "ucx")["native progress"]["corked"]
        target.write(0, bytes(n))
        before = _tcp_count(there.address, control, _DATA_SEGS_IN)
        acked = _tcp_count(there.address, control, _BYTES_ACKED) + n
        peer.call("ping")  # answered: idle in its command loop
        peer.freeze()
        try:
            xfer = agent.transfer("WRITE", *rows, peer.name)
            deadline = time.monotonic() + 10  # this process's progress thread pushes the puts the kernel holds
            while (taken := _tcp_count(there.address, control, _BYTES_ACKED)) < acked and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert xfer.wait()
        assert taken >= acked, f"the frozen target's kernel took {n - (acked - taken)} of the WRITE's {n} bytes"
        acks = _tcp_count(there.address, control, _DATA_SEGS_IN) - before
        want = np.frombuffer(data, np.uint8).reshape(ROWS, BLOCK)
        got = np.frombuffer(target.read(0, n), np.uint8).reshape(ROWS, BLOCK)
        assert np.array_equal(got[scattered // BLOCK], want)
        info = peer.call("describe", "ucx")
        assert info["native progress"]["events"] >= ROWS // 2  # UCX counts about an event per put it receives
        socks = _sockets_to(there.address, control)
        mine = [f"{s.getsockname()} -> {s.getpeername()}" for s in socks]
        for s in socks:
            s.close()
        text = f"{info['progress cork']}; this process's sockets to it: {mine}; {info['native progress']}"
        return acks, text, info["native progress"]["corked"] - corked_before


def test_a_target_acknowledges_a_far_write_stream_in_full_segments(test_hosts):
    """The target's progress thread corks its tcp sockets while a stream of puts comes in, so the put
    acknowledgements (one per row) of a progress call leave together; uncorked (``far_progress_cork`` off) each
    leaves as it is made, unless the kernel's autocorking merges it (only shown)."""
    corked, text, bursts = _frozen_write_acks(test_hosts, True)
    plain, off, _ = _frozen_write_acks(test_hosts, False)
    # one socket per connection this process holds to the target (ucxx's worker's and the data worker's)
    assert re.search(r"while a stream of small rows comes in on them: [12] handed", text) and off.startswith("off;")
    assert bursts > 0, text
    assert corked <= ROWS // 4, f"{corked} segments corked ({bursts} bursts), {plain} uncorked; {text}"


def _stream_bursts(hosts, blocks: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """For each row size in ``blocks``: (bursts that saw a put stream come in, bursts corked) on the target on
    host 1 over 30 WRITEs of 4 MiB in rows of that size, the target's sockets handed to its progress thread first.
    Every byte is checked."""
    there, here = hosts[1], hosts[0]
    cfg = {"backends": {"ucx": {"host": there.address}}}
    near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}}
    out = {}
    with (
        RemotePeer("pcork-sizes", cfg, env=TCP, host=there) as peer,
        Agent("pcork-sizes-init", {"backends": {"ucx": near}}) as agent,
    ):
        n = 4 << 20
        target, src = RemoteBuffer(peer, n), HostBuffer(agent, n)
        data = random_bytes(n, seed=11)
        src.write(0, data)
        agent.add_remote(peer.metadata())
        for block in blocks:
            rows = n // block
            scattered = np.random.default_rng(block).permutation(rows) * block
            descs = src.descs(np.arange(rows) * block, block), target.descs(scattered, block)
            assert agent.transfer("WRITE", *descs, peer.name).wait()  # connects UCX's sockets
            control = int(peer.call("describe", "ucx")["control"].rsplit(":", 1)[1])
            _await_handed(peer, there.address, control)
            before = peer.call("describe", "ucx")["native progress"]
            for _ in range(30):
                assert agent.transfer("WRITE", *descs, peer.name).wait()
            after = peer.call("describe", "ucx")["native progress"]
            want = np.frombuffer(data, np.uint8).reshape(rows, block)
            assert np.array_equal(
                np.frombuffer(target.read(0, n), np.uint8).reshape(rows, block)[scattered // block], want
            )
            out[block] = (after["streams"] - before["streams"], after["corked"] - before["corked"])
    return out


def test_a_target_corks_a_stream_of_small_rows_only(test_hosts):
    """A put stream of 4 KiB rows is corked (several acknowledgements to a progress call leave together); one of
    64 KiB rows is not: each progress call makes one acknowledgement, and corking would only add system calls."""
    seen = _stream_bursts(test_hosts, (4096, 65536))
    (small, small_corked), (large, large_corked) = seen[4096], seen[65536]
    assert small > 0 and large > 0, seen
    assert small_corked * 2 > small, seen
    assert large_corked * 2 < large, seen
