"""cuda passes the conformance kit on a GPU: VRAM <-> pinned DRAM, DRAM <-> VRAM, VRAM <-> VRAM.

Skipped, with the backend's own reason, where there is no usable GPU.
"""

from __future__ import annotations

import pytest

from datamover.testing import BackendConformance, HostBuffer, VramBuffer, gpu_skip_reason

SKIP = gpu_skip_reason("cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


def last_device() -> int:
    import torch

    return torch.cuda.device_count() - 1


class TestCudaVramToDram(BackendConformance):
    """Local GPU memory, host memory as the other side (WRITE = D2H, READ = H2D)."""

    backend = "cuda"
    cut_timeout = 1e-4  # copies are enqueued inside post(): cut short with them in flight

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: VramBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: HostBuffer(agent, n, shift=3)


class TestCudaDramToVram(TestCudaVramToDram):
    """Local host memory, GPU memory as the other side, inside one agent."""

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: VramBuffer(agent, n, shift=3)


class TestCudaVramToVram(TestCudaVramToDram):
    """GPU to GPU: across devices when there are two or more, else within device 0."""

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: VramBuffer(agent, n, device=last_device(), shift=3)


class TestCudaNoBatchApi(TestCudaVramToDram):
    """The cudaMemcpyAsync-per-row path, as on runtimes or drivers older than 12.8."""

    params = {"batch": False}
