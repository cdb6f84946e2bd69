"""mooncake passes the conformance kit: DRAM <-> OBJ against a real mooncake_master and store clients.

The agent's client lends the pool its memory; the kit's "remote" is ``PoolObjects`` (conftest): one pool
object per remote descriptor, read and written by a second, plain ``MooncakeDistributedStore`` client in
datamover's object format. As for s3, the kit is ``ObjectStoreConformance``: its overlapping destinations are
two writes of one key, and its odd offsets are ranged READs inside one object (a WRITE is a whole object).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from datamover import Agent
from datamover.backends.mooncake import client as client_mod
from datamover.testing import ObjectStoreConformance

from .conftest import PoolObjects

MiB = 1 << 20


@pytest.fixture(scope="module")
def agents(mooncake_master):
    """One agent per transfer mode (each a store client lending 512 MiB), all alive for the whole module: a
    client that leaves takes the replicas in its memory with it, and a client takes ~1 s to close."""
    made = {}
    try:
        for mode in ("auto", "staged", "zero_copy"):
            params = mooncake_master.config(global_segment_size=512 * MiB, threads=2, transfer_mode=mode)
            made[mode] = Agent(f"mooncake-{mode}", {"backends": {"mooncake": params}})
            made[mode].backend("mooncake")
        yield made
    finally:
        # side by side: each store client's close waits about a second in Mooncake
        with ThreadPoolExecutor(len(made) or 1) as pool:
            list(pool.map(Agent.close, made.values()))  # a close that raises fails the teardown still


@pytest.fixture(params=["auto", "staged", "zero_copy"])
def shared_agent(agents, request):
    return agents[request.param]


class TestMooncake(ObjectStoreConformance):
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
        return lambda n: PoolObjects(agent, raw, n)

    def park_parts(self, monkeypatch, parked):
        """As the kit's, and a WRITE's parts also before each batched put (``objects.put_objects``), where they first
        read the caller's memory (a staged copy, a zero-copy store call)."""
        super().park_parts(monkeypatch, parked)
        monkeypatch.setattr(client_mod, "put_objects", parked.wrap(client_mod.put_objects))
        return True
