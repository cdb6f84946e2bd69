"""posix passes the conformance kit: DRAM <-> FILE, O_DIRECT (native AIO and thread pool) and buffered."""

import itertools

import pytest

from datamover.backends.posix import aio
from datamover.testing import BackendConformance, FileBuffer

_names = itertools.count()


class TestPosixDirect(BackendConformance):
    backend = "posix"
    direct = True
    # its rows go through native AIO, submitted inside post(): cut short with those I/Os in flight
    cut_timeout = 1e-4

    @pytest.fixture
    def make_remote(self, agent, tmp_path):
        return lambda n: FileBuffer(agent, tmp_path / f"f{next(_names)}.bin", n, direct=self.direct)

    def hold_in_flight(self, monkeypatch, held):
        """The AIO batch's reaper (on the pool) held before it reaps or submits more, the I/Os submitted inside post()
        in flight: the cancel's fence must wait for them."""
        if not self.params.get("aio", True) or not self.direct:
            return False
        monkeypatch.setattr(aio.AioRun, "finish", held.wrap(aio.AioRun.finish))
        return True


class TestPosixDirectThreadPool(TestPosixDirect):
    params = {"aio": False}
    cut_timeout = BackendConformance.cut_timeout  # parts parked before each preadv/pwritev


class TestPosixBuffered(TestPosixDirect):
    direct = False
    cut_timeout = BackendConformance.cut_timeout
    sizes = (1, 4096, 12345, 1 << 20)
