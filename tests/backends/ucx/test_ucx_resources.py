"""Worker resets free the worker they replace; Agent.close() gives back every fd and thread the backend took.

A reset is forced at a known point: a peer asks this agent to serve a WRITE
(receives posted into registered memory), proves the request was read (a
notification sent after it arrives), then hangs up without sending the data,
as a peer killed while sending does. Other peers are SIGKILLed while idle and
right after they posted a transfer.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time

import numpy as np
import pytest

from datamover import Agent
from datamover.agents.metadata import encode_metadata
from datamover.backends import backend_status
from datamover.testing import HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.waiting import until

from .control import TCP_RX, control_of, recv, send

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}
# the worker is not recycled here (test_ucx_recycle.py): a recycle, when this agent is idle between two cycles,
# replaces the worker and its mappings and fds at a moment of its own, between the counts these tests compare
STEADY = {"backends": {"ucx": {"recycle_after_departed": 0}}}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_names() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _resets(agent) -> int:
    return agent.backend("ucx").describe()["worker resets"]


def _hang_up(agent, local, address: bytes, k: int) -> None:
    """A peer that starts a WRITE into ``agent`` (4096 bytes at ``local``) and hangs up before its data."""
    with socket.create_connection(control_of(agent.metadata()), timeout=10) as sock:
        assert recv(sock)["t"] == "challenge"
        send(sock, {"t": "hello", "name": f"dying{k}", "address": address, "nonce": os.urandom(16), "tcp_rx": TCP_RX})
        assert recv(sock)["t"] == "welcome"
        cols = [np.array([v], dtype="<i8").tobytes() for v in (local.array.ctypes.data, 4096, 0)]
        send(sock, {"t": "req", "id": 1, "op": "WRITE", "mem": "DRAM", "addr": cols[0], "len": cols[1],
                     "dev": cols[2], "tag": 7 << 40, "notify": b""})  # fmt: skip
        send(sock, {"t": "notif", "msg": f"posted-{k}".encode()})
        assert agent.wait_notification(f"posted-{k}".encode(), timeout=10) == (f"dying{k}", f"posted-{k}".encode())


def _dying_sender(agent, local, address: bytes, k: int) -> None:
    """A hang-up mid-WRITE into an agent that resets its worker for one (``hangup_probe_s`` 0)."""
    before = _resets(agent)
    _hang_up(agent, local, address, k)
    deadline = time.monotonic() + 30
    while _resets(agent) == before:  # the hang-up is read by the service thread
        assert time.monotonic() < deadline, "the agent never reset its worker"
        time.sleep(0.005)


def test_resets_free_what_they_replace_and_close_frees_everything():
    with Agent("warm-up", UCX):  # what a first Agent sets up once per process (ucxx, UCX's globals)
        pass
    gc.collect()
    with RemotePeer("peer-address", UCX) as other:
        from datamover.agents.metadata import decode_metadata

        address = decode_metadata(other.metadata()).backends["ucx"]["address"]
        fds0, threads0, names0 = _fds(), _threads(), _fd_names()
        agent = Agent("leaky", {"backends": {"ucx": {"hangup_probe_s": 0}}})  # every hang-up resets
        local = HostBuffer(agent, 1 << 20)
        _dying_sender(agent, local, address, 0)
        fds1, names1 = _fds(), _fd_names()
        for k in range(1, 10):
            _dying_sender(agent, local, address, k)
        assert _resets(agent) == 10
        # what the service thread lets go after a reset (the hung-up connection, the old worker) may go a moment
        # after the reset is counted (once failed at load ~8 with a second suite beside: 141 -> 150); a leak never
        # comes back, so wait for the count, bounded
        deadline = time.monotonic() + 30
        while _fds() > fds1 + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        fds10 = _fds()
        extra = [n for n in _fd_names() if n not in names1]
        assert fds10 <= fds1 + 2, f"10 worker resets took fds {fds1} -> {fds10}: {extra}"
        # peers killed at known points: idle after a transfer, and right after posting one into us
        for k, mid in enumerate((False, True)):
            killer = RemotePeer(f"killer{k}", UCX)
            try:
                theirs = RemoteBuffer(killer, 1 << 20)
                killer.call("add_remote", agent.metadata())
                xid = killer.call("start_transfer", "WRITE", theirs.handle, "leaky", [local.array.ctypes.data],
                                  [1 << 20])  # fmt: skip
                if not mid:
                    killer.call("wait_transfer", xid)
                killer.kill()
            finally:
                killer.close()
                killer.process.close()  # its sentinel fd
        del killer, theirs
        agent.deregister_memory(local.registration)
        agent.close()
        del agent, local
        gc.collect()
        extra = [n for n in _fd_names() if n not in names0]
        assert _fds() <= fds0, f"fds {fds0} before the agent, {_fds()} after close(): {extra}"
        assert _threads() <= threads0, f"threads {threads0} before the agent, {_threads()} after close()"


def _live_ucx_objects(before: frozenset[int] = frozenset()) -> list[str]:
    """ucxx's objects alive now that were not among ``before`` (ids): a data worker closed with operations still
    queued on it (an earlier test's quarantine) keeps its context for the life of the process, by design."""
    gc.collect()
    return [
        type(o).__name__
        for o in gc.get_objects()
        if type(o).__name__ in ("UCXWorker", "UCXContext", "UCXEndpoint") and id(o) not in before
    ]


def _ucx_ids() -> frozenset[int]:
    gc.collect()
    return frozenset(id(o) for o in gc.get_objects() if type(o).__name__ in ("UCXWorker", "UCXContext", "UCXEndpoint"))


class _Keep(logging.Handler):
    """Keeps every record, as pytest's log capture does for the length of a test."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_errors_kept_after_close_hold_no_worker():
    """What failed under load ("two UCX workers alive after close()"), set up at known points: an exception raised
    on the service thread and kept past close() (a log record of it, a transfer's error) held the thread's frames
    through its traceback, and the loop's frame held the worker in a local: fds 6 -> 27 after close(), a UCXWorker
    alive. Here a hello the agent refuses (logged), and a notification whose target answers with a malformed
    welcome (its error kept by the test)."""
    with Agent("warm-up", UCX):
        pass
    gc.collect()
    keep = _Keep()
    logger = logging.getLogger("datamover")
    logger.addHandler(keep)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        fds0, names0, ucx0 = _fds(), _fd_names(), _ucx_ids()
        agent = Agent("keeps", UCX)
        address = agent.backend("ucx").connection_info()["address"]
        with socket.create_connection(control_of(agent.metadata()), timeout=10) as sock:
            assert recv(sock)["t"] == "challenge"
            send(sock, {"t": "hello", "name": 5})  # the known point: the service thread raises and logs it
            assert recv(sock) is None
        blob = encode_metadata(
            "fake", {"ucx": {"address": address, "host": "127.0.0.1", "port": listener.getsockname()[1]}}, []
        )
        agent.add_remote(blob)
        noted: list[BaseException] = []
        sender = threading.Thread(target=_notify_into, args=(agent, noted))
        sender.start()
        sock, _ = listener.accept()  # the known point: the agent connects; it gets a malformed welcome
        with sock:
            send(sock, {"t": "challenge", "nonce": os.urandom(16), "tcp_rx": TCP_RX})
            assert recv(sock)["t"] == "hello"
            send(sock, {"t": "welcome", "conn_id": "not an int", "address": address})
            sender.join(30)
        assert noted and "conn_id" in str(noted[0]), noted
        assert any("dropping connection" in r.getMessage() for r in keep.records), "nothing logged: checks nothing"
        agent.close()
        del agent
        gc.collect()
        extra = [n for n in _fd_names() if n not in names0]
        assert _fds() <= fds0, f"fds {fds0} before the agent, {_fds()} after close(): {extra}"
        assert _live_ucx_objects(ucx0) == [], "UCX objects outlived close()"
        assert noted[0].__traceback__ is not None  # still kept: the error itself is not what was freed
    finally:
        logger.removeHandler(keep)
        listener.close()


def _notify_into(agent, noted: list) -> None:
    try:
        agent.send_notification("fake", b"x")
    except Exception as exc:  # kept, with its traceback, past close()
        noted.append(exc)


def test_a_close_that_outlasts_its_timeout_leaves_the_freeing_to_the_service_thread(monkeypatch):
    """The other way two workers could outlive close(): close() used to wait 10 s for the service thread and
    then drop the UCX objects under a ``_shutdown`` still running (their endpoints and mappings still in use).
    ``_shutdown`` is held at a known point past ``close_timeout_s``: close() returns, logs it, takes nothing
    from the thread; released, the thread shuts down cleanly and frees every object itself."""
    from datamover.backends.ucx.service import ServiceLoop

    with Agent("warm-up", UCX):
        pass
    gc.collect()
    entered, release = threading.Event(), threading.Event()
    real = ServiceLoop._shutdown
    failed: list[BaseException] = []

    def held(self) -> None:
        entered.set()
        assert release.wait(60), "never released"
        try:
            real(self)
        except BaseException as exc:
            failed.append(exc)
            raise

    monkeypatch.setattr(ServiceLoop, "_shutdown", held)
    fds0, names0, ucx0 = _fds(), _fd_names(), _ucx_ids()
    agent = Agent("held-close", {"backends": {"ucx": {"close_timeout_s": 0.2}}})
    local = HostBuffer(agent, 1 << 20)  # a mapped region: _shutdown unmaps it with the context
    thread = agent.backend("ucx")._thread
    agent.close()  # returns after close_timeout_s: _shutdown is held
    assert entered.is_set() and thread.is_alive()
    release.set()
    thread.join(30)
    assert not thread.is_alive() and failed == [], failed
    del agent, local
    gc.collect()
    extra = [n for n in _fd_names() if n not in names0]
    assert _fds() <= fds0, f"fds {fds0} before the agent, {_fds()} after its service thread ended: {extra}"
    assert _live_ucx_objects(ucx0) == [], "UCX objects outlived the service thread"


def _shm_mappings() -> int:
    """Shared memory segments mapped into this process (UCX's FIFOs and buffers, ours and those of peers)."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return sum(1 for line in f if "/SYSV" in line or "ucx_shm_posix" in line)


def test_connections_to_a_peer_that_come_and_go_leave_none_of_its_segments_mapped():
    """Each connection's endpoint on the data worker is closed for real when the peer is let go (before, UCX
    refused the forced close of an endpoint without peer error handling and the endpoint stayed open: each
    connection left the peer's FIFO segments mapped here, and kept alive on the host, 20 connections 40 mappings)."""
    with RemotePeer("comes-and-goes", UCX) as peer, Agent("churner", STEADY) as agent:
        blob = peer.metadata()
        for k in range(21):
            agent.add_remote(blob)
            agent.send_notification("comes-and-goes", b"connected")  # the handshake made its endpoints
            agent.remove_remote("comes-and-goes")
            if k == 0:
                before, fds, threads = _shm_mappings(), _fds(), _threads()
        assert _shm_mappings() == before, f"20 connections took shared memory mappings {before} -> {_shm_mappings()}"
        assert (_fds(), _threads()) == (fds, threads)
        desc = agent.backend("ucx").describe()
        assert desc["quarantined workers"]["held"] == 0 and desc["worker resets"] == 0


def test_peers_that_come_and_go_leave_no_fd_thread_or_bookkeeping_behind():
    """60 cycles of a peer (agents in this process, 7 names coming back) connected both ways, a WRITE and a READ
    each way, then removed (every other one) or just closed: this agent's fds, threads and the backend's own
    bookkeeping (``describe()``, its tables of peers, connections and requests) end where they began. (Its shared
    memory mappings are not counted here: one-sided puts and gets emulated over shared memory between agents of one
    process leave UCX's own reply endpoints behind; see test_connections_to_a_peer_that_come_and_go_... for ours.)"""
    with Agent("hub", STEADY) as hub:
        backend = hub.backend("ucx")
        local = HostBuffer(hub, 1 << 16)
        blob = hub.metadata()

        def cycle(k: int) -> None:
            with Agent(f"visitor{k % 7}", UCX) as peer:
                theirs = HostBuffer(peer, 1 << 16)
                hub.add_remote(peer.metadata())
                peer.add_remote(blob)
                for op in ("WRITE", "READ"):
                    assert hub.transfer(op, local.descs([0], [4096]), theirs.descs([0], [4096]), peer.name).wait()
                    assert peer.transfer(op, theirs.descs([4096], [4096]), local.descs([4096], [4096]), "hub").wait()
                if k % 2 == 0:
                    hub.remove_remote(peer.name)
            until(lambda: not backend._inbound, what="the visitor's connection dropped")

        for k in range(7):  # every name once: what stays per name (an idle peer entry) is there from here on
            cycle(k)
        gc.collect()
        fds, threads, before = _fds(), _threads(), _bookkeeping(backend)
        for k in range(7, 67):
            cycle(k)
        gc.collect()
        assert (_fds(), _threads()) == (fds, threads), f"fds {fds} -> {_fds()}, threads {threads} -> {_threads()}"
        assert _bookkeeping(backend) == before
        assert set(backend._peers) <= {f"visitor{k}" for k in range(7)}  # those loaded and not removed, idle


def _bookkeeping(backend) -> dict:
    desc = backend.describe()
    return {
        "inbound": len(backend._inbound), "out": len(backend._active_out),
        "in": len(backend._active_in), "directs": len(backend._directs), "revokes": len(backend._revokes),
        "retired": len(backend._retired), "mapped": len(backend.mapped_regions.mapped),
        "quarantined": desc["quarantined workers"], "draining": desc["cancelled requests draining"],
        "served": desc["rows served for peers"]["now"], "buffered": desc["control bytes buffered"]["held"],
        "resets": desc["worker resets"],
    }  # fmt: skip
