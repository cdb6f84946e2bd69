"""gds passes the conformance kit on a GPU: VRAM <-> FILE and DRAM <-> FILE through kvikio.

Skipped, with the backend's own reason, where kvikio or the GPU is missing.
"""

from __future__ import annotations

import itertools

import pytest

from datamover.testing import BackendConformance, FileBuffer, HostBuffer, VramBuffer, gpu_skip_reason

SKIP = gpu_skip_reason("gds")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

_names = itertools.count()


class TestGdsVram(BackendConformance):
    """GPU memory to and from a registered file."""

    backend = "gds"

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: VramBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent, tmp_path):
        return lambda n: FileBuffer(agent, tmp_path / f"g{next(_names)}.bin", n)


class TestGdsDram(TestGdsVram):
    """Host memory to and from a registered file through kvikio (its host path)."""

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n)
