"""A peer in another pid namespace (a container; here a test host) with UCX's default transports: its posix
shared-memory address is 8 bytes longer (the pid namespace follows the segment id, as its flags say) and
UCX reads it by those flags, so it is a well-formed address, not one of unexpected lengths. Every connection
to such a peer was refused unless UCX_TLS left posix out."""

from __future__ import annotations

import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.backends.ucx.address import AddressCheck, parse
from datamover.backends.ucx.segments import POSIX
from datamover.errors import InvalidMetadata
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


def test_a_peer_in_another_pid_namespace_with_default_transports(test_hosts):
    here, there = test_hosts[0], test_hosts[1]
    with (
        RemotePeer("far", {"backends": {"ucx": {"host": there.address}}}, host=there) as peer,
        Agent("near", {"backends": {"ucx": {"host": here.address, "ucx_config": here.ucx_config()}}}) as agent,
    ):
        size = 1 << 16
        local, remote = HostBuffer(agent, 2 * size), RemoteBuffer(peer, size)
        agent.add_remote(peer.metadata())
        data = random_bytes(size, 5)
        local.write(0, data)
        assert agent.transfer("WRITE", local.descs([0], [size]), remote.descs([0], [size]), "far").wait()
        assert remote.read(0, size) == data
        assert agent.transfer("READ", local.descs([size], [size]), remote.descs([0], [size]), "far").wait()
        assert local.read(size, size) == data


def test_a_posix_address_must_be_as_long_as_its_flags_say():
    with Agent("me", {"backends": {"ucx": {}}}) as agent:
        own = agent.backend("ucx").connection_info()["address"]
        check = AddressCheck(own)
        posix = next((t for t in parse(own).transports if t.csum == POSIX), None)
        if posix is None:
            pytest.skip("UCX offers no posix transport here")
        start = posix.at
        seg = bytearray(own[start : start + 8])
        seg[7] |= 0x10  # the pid-namespace flag: 8 bytes of namespace must follow, and do not
        forged = own[:start] + bytes(seg) + own[start + 8 :]
        with pytest.raises(InvalidMetadata, match="unexpected lengths"):
            check.check(forged, "forger")
        assert check.check(own, "self").version == parse(own).version
