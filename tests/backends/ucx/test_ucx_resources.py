"""Worker resets free the worker they replace; Agent.close() gives back every fd and thread the backend took.

A reset is forced at a known point: a peer asks this agent to serve a WRITE
(receives posted into registered memory), proves the request was read (a
notification sent after it arrives), then hangs up without sending the data,
as a peer killed while sending does. Other peers are SIGKILLed while idle and
right after they posted a transfer.
"""

from __future__ import annotations

import gc
import os
import socket
import time

import numpy as np
import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.testing import HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer

from .control import TCP_RX, control_of, recv, send

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}


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
        fds1 = _fds()
        for k in range(1, 10):
            _dying_sender(agent, local, address, k)
        assert _resets(agent) == 10
        fds10 = _fds()
        assert fds10 <= fds1 + 2, f"10 worker resets took fds {fds1} -> {fds10}"
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
