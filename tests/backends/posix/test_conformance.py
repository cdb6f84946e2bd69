"""posix passes the conformance kit: DRAM <-> FILE, O_DIRECT (native AIO and thread pool) and buffered."""

import itertools

import pytest

from datamover.testing import BackendConformance, FileBuffer

_names = itertools.count()


class TestPosixDirect(BackendConformance):
    backend = "posix"
    direct = True

    @pytest.fixture
    def make_remote(self, agent, tmp_path):
        return lambda n: FileBuffer(agent, tmp_path / f"f{next(_names)}.bin", n, direct=self.direct)


class TestPosixDirectThreadPool(TestPosixDirect):
    params = {"aio": False}


class TestPosixBuffered(TestPosixDirect):
    direct = False
    sizes = (1, 4096, 12345, 1 << 20)
