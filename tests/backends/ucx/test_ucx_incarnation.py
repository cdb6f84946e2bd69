"""A peer that restarts under its name: nothing meant for the process that went lands in the one that came.

The new process maps memory at the very address the old one had registered (``alloc_at``), as a restart with the
same layout would, so a transfer aimed at the old process's memory would land in the new one's, unseen. The restart
is a known point: the old process is SIGKILLed and this agent has seen its control connection close.
"""

from __future__ import annotations

import socket

import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.descriptors import DescList
from datamover.errors import NotRegistered, RemoteDisconnected
from datamover.testing import HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.waiting import until

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

PATHS = {
    "direct cma": {},  # where this process may attach to the peer (else one-sided UCX)
    "one-sided": {"direct_cma": False},
    "owner-served": {"one_sided": False},
}
SIZE = 1 << 20
NAME = "restarter"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restart(agent: Agent, cfg: dict, before) -> tuple[RemotePeer, int, int]:
    """Run the peer, register SIZE bytes there, load its metadata and ``before(old peer, buffer)``; SIGKILL it once
    that returned and this agent saw it go; start it again with memory at the old address: (new peer, its
    buffer's handle, the address)."""
    old = RemotePeer(NAME, cfg)
    try:
        buf = RemoteBuffer(old, SIZE)
        agent.add_remote(old.metadata())
        before(old, buf)
        old.kill()
    finally:
        old.close()
    backend = agent.backend("ucx")
    until(lambda: backend._peers[NAME].state == "idle", what="this agent seeing the old process's connection close")
    new = RemotePeer(NAME, cfg)
    handle, addr = new.call("alloc_at", buf.addr, SIZE)
    return new, handle, addr


@pytest.mark.parametrize("path", list(PATHS))
def test_a_peer_restarted_at_its_port_is_refused_until_its_new_metadata_is_loaded(path):
    """The new process listens on the old one's port: the handshake shows another process answers (before: the
    initiator took it for the old one and wrote the old metadata's descriptors into the new process's memory)."""
    cfg = {"backends": {"ucx": {**PATHS[path], "port": _free_port()}}}
    with Agent("initiator", {"backends": {"ucx": PATHS[path]}}) as agent:
        local = HostBuffer(agent, SIZE)
        local.write(0, b"\x11" * SIZE)
        remote: list = []

        def write_once(peer, buf):
            remote.append(buf.descs([0], [SIZE]))
            assert agent.transfer("WRITE", local.descs([0], [SIZE]), remote[0], NAME).wait() == XferState.DONE

        new, handle, _ = _restart(agent, cfg, write_once)
        with new:
            blob = new.metadata()  # its backend runs: it listens on the old port
            local.write(0, b"\x22" * SIZE)
            xfer = agent.transfer("WRITE", local.descs([0], [SIZE]), remote[0], NAME)
            with pytest.raises(RemoteDisconnected, match="not the process its metadata") as info:
                xfer.wait()
            assert info.value.backend == "ucx" and NAME in str(info.value)
            assert new.call("read", handle, 0, SIZE) == bytes(SIZE), "a byte meant for the old process landed"
            # its current metadata loaded (it registered that same address): traffic works again
            agent.add_remote(blob)
            assert agent.transfer("WRITE", local.descs([0], [SIZE]), remote[0], NAME).wait() == XferState.DONE
            assert new.call("read", handle, 0, SIZE) == b"\x22" * SIZE


@pytest.mark.parametrize("made", ["before the restart", "from lists prepared before it"])
@pytest.mark.parametrize("path", list(PATHS))
def test_descriptors_checked_against_the_old_process_are_refused_once_the_new_ones_metadata_is_loaded(path, made):
    """A transfer made before the restart and posted again, or made from lists prepared before it, once the new
    process's metadata is loaded: refused, typed, and nothing lands (before: both wrote into the new process's
    memory at the old address, its rkeys or its registrations taken for the old process's)."""
    cfg = {"backends": {"ucx": PATHS[path]}}
    with Agent("initiator", cfg) as agent:
        local = HostBuffer(agent, SIZE)
        local.write(0, b"\x11" * SIZE)
        kept: dict = {}

        def prepare_and_write(peer, buf):
            kept["local"] = agent.prepare(local.descs([0], [SIZE]))
            kept["remote"] = agent.prepare(buf.descs([0], [SIZE]), NAME)
            kept["xfer"] = agent.make_transfer("WRITE", kept["local"], None, kept["remote"], None)
            assert kept["xfer"].post().wait() == XferState.DONE

        new, handle, addr = _restart(agent, cfg, prepare_and_write)
        with new:
            agent.add_remote(new.metadata())  # it registered memory at the old address: the descriptors still fit
            assert any(r[2] == addr for r in agent.remote_metadata(NAME).regions)
            local.write(0, b"\x22" * SIZE)
            with pytest.raises(NotRegistered, match="earlier process of agent 'restarter'"):
                if made == "before the restart":
                    kept["xfer"].post()
                else:
                    agent.make_transfer("WRITE", kept["local"], None, kept["remote"], None)
            assert new.call("read", handle, 0, SIZE) == bytes(SIZE), "a byte meant for the old process landed"
            # lists prepared anew from its metadata: traffic works again
            remote = agent.prepare(DescList.from_columns([addr], [SIZE], 0, "DRAM"), NAME)
            assert agent.make_transfer("WRITE", kept["local"], None, remote, None).post().wait() == XferState.DONE
            assert new.call("read", handle, 0, SIZE) == b"\x22" * SIZE
