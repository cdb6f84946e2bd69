"""posix passes the conformance kit: DRAM <-> FILE, O_DIRECT and buffered."""

import itertools

import pytest

from datamover import Agent
from datamover.testing import BackendConformance, FileBuffer, HostBuffer

_names = itertools.count()


class TestPosixDirect(BackendConformance):
    backend = "posix"
    direct = True

    @pytest.fixture
    def agent(self):
        with Agent("posix-test", {"backends": {"posix": {}}}) as agent:
            yield agent

    @pytest.fixture
    def peer(self):
        return None

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent, tmp_path):
        return lambda n: FileBuffer(agent, tmp_path / f"f{next(_names)}.bin", n, direct=self.direct)


class TestPosixBuffered(TestPosixDirect):
    direct = False
    sizes = (1, 4096, 12345, 1 << 20)
