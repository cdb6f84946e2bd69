"""A READ from a peer on another machine over tcp posts its gets with the worker's tcp sockets to that peer
corked (``far_read_cork_rows``), so its requests leave in full segments, not one segment per row.

What is counted is the kernel's own count of data segments each TCP socket sent (``TCP_INFO``), over the
process's sockets to the peer found independently of the code under test (``/proc/self/fd``, the control
connection left out); bytes are checked after every READ.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

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
_DATA_SEGS_OUT = 156  # offset of tcpi_data_segs_out in struct tcp_info (Linux 4.6 on)


def _data_segs_out(ip: str, skip_port: int) -> int:
    """Data segments sent so far by this process's TCP sockets to ``ip``, the one to port ``skip_port`` left out."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
                continue
            peer = sock.getpeername()
            if peer[0] != ip or peer[1] == skip_port:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            total += struct.unpack_from("I", info, _DATA_SEGS_OUT)[0]
        except OSError:
            continue
        finally:
            sock.close()
    return total


def _far_read_segments(hosts, cork_rows: int) -> tuple[int, str]:
    """Data segments this process sent during one READ of ROWS x BLOCK from a peer on host 1; and the
    initiator's READ cork description. Every byte is checked."""
    there, here = hosts[1], hosts[0]
    cfg = {"backends": {"ucx": {"host": there.address}}}
    near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}}
    with (
        RemotePeer(f"cork-peer-{cork_rows}", cfg, env=TCP, host=there) as peer,
        Agent(f"cork-init-{cork_rows}", {"backends": {"ucx": {**near, "far_read_cork_rows": cork_rows}}}) as agent,
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
        before = _data_segs_out(there.address, control)
        assert xfer.post().wait()
        segments = _data_segs_out(there.address, control) - before
        assert local.read(0, n) == want
        text = agent.backend("ucx").describe()["READ cork"]
        xfer.release()
        return segments, text


def test_a_far_read_sends_its_gets_in_full_segments(test_hosts):
    """Corked, the 256 gets of one READ (a request of a few tens of bytes each) leave in full segments: about
    256 x 40 / 1448 of them. Uncorked (``far_read_cork_rows=0``) each leaves when posted, unless the kernel's
    autocorking happens to merge it with the one before: 40-255 segments measured, so that count is only shown."""
    corked, text = _far_read_segments(test_hosts, 32)
    plain, off = _far_read_segments(test_hosts, 0)
    assert corked <= 12, f"{corked} segments corked, {plain} uncorked"
    assert "corked (TCP_CORK); sockets found {'cork-peer-32': 1}" in text
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
        assert read(((r, os.fstat(r).st_ino), (found[0][0], found[0][1] + 1))) == 0
        with pytest.raises(TypeError, match="cork"):
            ucx_rma.post_native(True, ep.handle, np.zeros((0, 5), np.uint64), None, ((r, 1),) * 9)
    finally:
        os.close(r)
        os.close(w)
        ucx_rma.rkey_destroy(rkey)
        ucx_rma.mem_unmap(ctxs[1].handle, memh)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "32", None])
def test_far_read_cork_rows_must_be_a_whole_number(bad):
    with Agent("cork-bad", {"backends": {"ucx": {"far_read_cork_rows": bad}}}) as agent:
        with pytest.raises(InvalidParameter, match="far_read_cork_rows"):
            agent.backend("ucx")  # started on first use


def _local_data_segs_out(ip: str, skip_local_port: int) -> int:
    """Data segments sent so far by this process's TCP sockets to ``ip``, those on local port ``skip_local_port``
    (the control connections the peer opened to us) left out."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
                continue
            if sock.getpeername()[0] != ip or sock.getsockname()[1] == skip_local_port:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            total += struct.unpack_from("I", info, _DATA_SEGS_OUT)[0]
        except OSError:
            continue
        finally:
            sock.close()
    return total


def _served_write_segments(hosts, cork: bool) -> tuple[int, str, int]:
    """Data segments this process, the target, sent while an initiator on host 1 wrote ROWS x BLOCK to it; its
    progress cork description and bursts corked. Every byte is checked, and the UCX events its progress thread
    counted (at least one per row)."""
    import time

    there, here = hosts[1], hosts[0]
    near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}, "far_progress_cork": cork}
    cfg = {"backends": {"ucx": {"host": there.address}}}
    with (
        Agent(f"pcork-target-{cork}", {"backends": {"ucx": near}}) as agent,
        RemotePeer(f"pcork-init-{cork}", cfg, env=TCP, host=there) as peer,
    ):
        n = ROWS * BLOCK
        target = HostBuffer(agent, n)
        src = RemoteBuffer(peer, n)
        data = random_bytes(n, seed=7)
        src.write(0, data)
        peer.call("add_remote", agent.metadata())
        base = int(target.array.ctypes.data)
        scattered = np.random.default_rng(2).permutation(ROWS)
        addrs = base + scattered * BLOCK
        xid = peer.call("start_transfer", "WRITE", src.handle, agent.name, addrs.tolist(), [BLOCK] * ROWS)
        assert peer.call("wait_transfer", xid) == "DONE"  # connects UCX's sockets
        backend = agent.backend("ucx")
        deadline = time.monotonic() + 10
        while cork and "0 handed" in backend.describe()["progress cork"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the service thread hands the sockets over every half second while serving
        control = int(backend.describe()["control"].rsplit(":", 1)[1])
        before = _local_data_segs_out(there.address, control)
        progress_before = backend.describe()["native progress"]
        xid = peer.call("start_transfer", "WRITE", src.handle, agent.name, addrs.tolist(), [BLOCK] * ROWS)
        assert peer.call("wait_transfer", xid) == "DONE"
        segments = _local_data_segs_out(there.address, control) - before
        want = np.frombuffer(data, np.uint8).reshape(ROWS, BLOCK)
        got = np.frombuffer(target.read(0, n), np.uint8).reshape(ROWS, BLOCK)
        assert np.array_equal(got[scattered], want)
        info = backend.describe()
        progress = {k: info["native progress"][k] - progress_before[k] for k in ("corked", "events")}
        assert progress["events"] >= ROWS  # UCX counts an event per put (its data, then its acknowledgement)
        return segments, info["progress cork"], progress["corked"]


def test_a_target_acknowledges_a_far_write_stream_in_full_segments(test_hosts):
    """The target's progress thread corks its tcp sockets while a stream of puts comes in, so the put
    acknowledgements (one per row) of a burst leave together; uncorked (``far_progress_cork`` off) each leaves
    as it is made, unless the kernel's autocorking merges it (only shown)."""
    corked, text, bursts = _served_write_segments(test_hosts, True)
    plain, off, _ = _served_write_segments(test_hosts, False)
    assert "corked during bursts while a stream comes in on them: 1 handed" in text and off == "off"
    assert bursts > 0
    assert corked <= ROWS // 2, f"{corked} segments corked ({bursts} bursts), {plain} uncorked"
