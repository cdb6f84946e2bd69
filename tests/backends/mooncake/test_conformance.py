"""mooncake passes the conformance kit: DRAM <-> OBJ against a real mooncake_master and store clients.

The agent's client lends the pool its memory; the kit's "remote" is ``ObjectBuffer`` (conftest): one pool
object per remote descriptor, read and written by a second, plain ``MooncakeDistributedStore`` client in
datamover's object format. Two kit tests are overridden with their object-store equivalents, as for s3:
overlapping destinations (two writes of one key) and odd offsets (a WRITE is a whole object; odd offsets
are ranged READs inside one).
"""

from __future__ import annotations

import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import OverlappingDestination
from datamover.testing import BackendConformance, random_bytes

from .conftest import ObjectBuffer

MiB = 1 << 20


@pytest.fixture(scope="module")
def agents(master):
    """One agent per transfer mode (each a store client lending 512 MiB), all alive for the whole module: a
    client that leaves takes the replicas in its memory with it, and a client takes ~1 s to close."""
    made = {}
    try:
        for mode in ("auto", "staged", "zero_copy"):
            params = master.config(global_segment_size=512 * MiB, threads=2, transfer_mode=mode)
            made[mode] = Agent(f"mooncake-{mode}", {"backends": {"mooncake": params}})
            made[mode].backend("mooncake")
        yield made
    finally:
        for agent in made.values():
            agent.close()


@pytest.fixture(params=["auto", "staged", "zero_copy"])
def shared_agent(agents, request):
    return agents[request.param]


class TestMooncake(BackendConformance):
    backend = "mooncake"
    sizes = (1, 4096, 12345, 1 * MiB, 16 * MiB)
    batch_count = 1024
    big = 8 * MiB

    @pytest.fixture
    def agent(self, shared_agent):
        before = set(shared_agent.registrations)
        yield shared_agent
        shared_agent.deregister_memory([r for i, r in shared_agent.registrations.items() if i not in before])

    @pytest.fixture
    def make_remote(self, agent, raw):
        return lambda n: ObjectBuffer(agent, raw, n)

    def test_overlapping_destinations_refused(self, agent, peer, make_local, make_remote):
        """Distinct keys never overlap; two WRITE descriptors for the same key do, and are refused untouched."""
        local, remote = make_local(8192), make_remote(8192)
        local.write(0, random_bytes(8192, 3))
        key, other = remote.key(0, 100), remote.key(100, 100)
        before = remote.read(0, 200)
        dst = DescList.objects(remote.registration, [100, 100, 100], 0, keys=[key, other, key])
        with pytest.raises(OverlappingDestination) as info:
            agent.transfer("WRITE", local.descs([0, 1000, 5000], [100, 100, 100]), dst, backends="mooncake")
        assert info.value.index == 2
        assert remote.read(0, 200) == before, "a refused transfer touched the destination"

    def test_roundtrip_odd_offsets(self, agent, peer, make_local, make_remote):
        """A WRITE is a whole object; odd offsets are ranged READs inside it, landing at odd local offsets."""
        size = 10_007 + max(self.offsets)
        local, remote = make_local(size + 8), make_remote(size)
        data = random_bytes(size, 100)
        remote.write(0, data)
        obj = remote.key(0, size)
        for k, off in enumerate(self.offsets):
            n = size - off - k
            dst = 1 + k
            local.write(0, bytes(size + 8))
            src = DescList.objects(remote.registration, [n], [off], keys=[obj])
            xfer = agent.transfer("READ", local.descs([dst], [n]), src, backends="mooncake")
            assert xfer.wait() == XferState.DONE
            got = local.read(0, size + 8)
            assert got[dst : dst + n] == data[off : off + n], f"ranged READ at offset {off} returned wrong bytes"
            assert got[:dst] == bytes(dst) and got[dst + n :] == bytes(size + 8 - dst - n), "READ wrote outside"
