"""memcpy passes the conformance kit: DRAM <-> DRAM within one agent."""

import pytest

from datamover import Agent
from datamover.testing import BackendConformance, HostBuffer


class TestMemcpy(BackendConformance):
    backend = "memcpy"

    @pytest.fixture
    def agent(self):
        with Agent("memcpy-test", {"backends": {"memcpy": {}}}) as agent:
            yield agent

    @pytest.fixture
    def peer(self):
        return None

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: HostBuffer(agent, n, shift=3)
