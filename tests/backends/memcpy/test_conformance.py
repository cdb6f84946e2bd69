"""memcpy passes the conformance kit: DRAM <-> DRAM within one agent."""

import numpy as np
import pytest

from datamover import Agent, DescList
from datamover.testing import BackendConformance, HostBuffer


class TestMemcpy(BackendConformance):
    backend = "memcpy"

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: HostBuffer(agent, n, shift=3)


def test_gather_into_contiguous_destination_from_large_region():
    """A contiguous destination gathered from a few blocks of a big source copies only those blocks."""
    with Agent("gather", {"backends": {"memcpy": {}}}) as agent:
        src = np.frombuffer(np.random.default_rng(0).bytes(64 << 20), np.uint8).copy()
        dst = np.zeros(3 << 12, np.uint8)
        agent.register_memory(src)
        agent.register_memory(dst)
        lp = agent.prepare(DescList.blocks(src, 4096))
        rp = agent.prepare(DescList.blocks(dst, 4096))
        agent.make_transfer("WRITE", lp, [5, 100, 7], rp, [0, 1, 2]).post().wait()
        want = np.concatenate([src[5 * 4096 : 6 * 4096], src[100 * 4096 : 101 * 4096], src[7 * 4096 : 8 * 4096]])
        assert np.array_equal(dst, want)
