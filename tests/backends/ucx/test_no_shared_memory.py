"""With posix and sysv shared memory left out of UCX's transports (what the README advises where untrusted
processes share the host), this worker's address names no shared-memory segment, and READs and WRITEs with a
peer in another process still move every byte."""

from __future__ import annotations

import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.backends.ucx.address import parse
from datamover.backends.ucx.segments import POSIX, SYSV
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


def test_no_posix_or_sysv_transport_and_transfers_still_work():
    cfg = {"backends": {"ucx": {"ucx_config": {"TLS": "^posix,sysv,cma"}}}}
    size = 4 << 20
    with RemotePeer("peer", cfg) as peer, Agent("me", cfg) as agent:
        transports = {t.csum for t in parse(agent.backend("ucx").connection_info()["address"]).transports}
        assert not transports & {POSIX, SYSV}, "a shared-memory transport is still in the worker's address"
        remote, local = RemoteBuffer(peer, size), HostBuffer(agent, size)
        agent.add_remote(peer.metadata())
        data = random_bytes(size, 12)
        local.write(0, data)
        assert agent.transfer("WRITE", local.descs([0], [size]), remote.descs([0], [size]), "peer").wait() == (
            XferState.DONE
        )
        assert remote.read(0, size) == data
        back = HostBuffer(agent, size)
        assert agent.transfer("READ", back.descs([0], [size]), remote.descs([0], [size]), "peer").wait() == (
            XferState.DONE
        )
        assert back.read(0, size) == data
