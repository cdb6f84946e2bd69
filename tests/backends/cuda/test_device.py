"""The cuda and gds backends on a real GPU: torch tensors and raw pointers, pinning, the pool, streams.

Skipped, with the backend's own reason, where there is no usable GPU.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from datamover import Agent, DescList
from datamover.backends import backend_status
from datamover.errors import InvalidDescriptor


def _skip_reason() -> str | None:
    ok, reason = backend_status("cuda")
    if not ok:
        return f"cuda backend unavailable here: {reason}"
    try:
        import torch
    except ImportError:
        return "these tests build VRAM buffers with torch; torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (torch.cuda.is_available() is False)"
    return None


SKIP = _skip_reason()
GPUS = __import__("torch").cuda.device_count() if SKIP is None else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


@pytest.fixture
def torch():
    import torch

    return torch


@pytest.fixture
def rt():
    from cuda.bindings import runtime

    return runtime


@pytest.fixture
def agent():
    with Agent("gpu-test", {"backends": {"cuda": {}, "gds": {}}}) as agent:
        yield agent


def _memory_type(rt, addr: int):
    err, attrs = rt.cudaPointerGetAttributes(addr)
    assert err == rt.cudaError_t.cudaSuccess
    return attrs.type


def test_list_of_cuda_tensors_is_one_vram_desclist(torch, agent):
    dev = torch.cuda.device_count() - 1
    tensors = [torch.arange(n, dtype=torch.int32, device=f"cuda:{dev}") for n in (256, 1000, 4096)]
    descs = DescList.from_buffers(tensors)
    assert descs.mem_type.value == "VRAM" and descs.dev.tolist() == [dev] * 3
    hosts = [np.zeros(t.numel() * 4, dtype=np.uint8) for t in tensors]
    agent.register_memory(tensors)
    agent.register_memory(hosts)
    agent.transfer("WRITE", tensors, hosts).wait()
    for t, h in zip(tensors, hosts):
        assert np.array_equal(h.view(np.int32), t.cpu().numpy())


def test_raw_device_pointer_with_device_id(torch, agent):
    t = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    ptr = t.data_ptr()
    agent.register_memory(DescList.from_columns(ptr, t.numel(), 0, "VRAM"))
    host = np.zeros(1 << 20, dtype=np.uint8)
    agent.register_memory(host)
    agent.transfer("WRITE", DescList.from_columns(ptr, 1 << 20, 0, "VRAM"), host).wait()
    assert np.array_equal(host, t.cpu().numpy())


def test_host_pointer_registered_as_vram_is_refused(agent):
    agent.backend("cuda")
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(InvalidDescriptor, match="not device memory"):
        agent.register_memory(DescList.from_columns(host.ctypes.data, 4096, 0, "VRAM"))


def test_dram_is_page_locked_while_registered(rt, agent):
    agent.backend("cuda")
    buf = np.zeros(4 << 20, dtype=np.uint8)
    before = _memory_type(rt, buf.ctypes.data)
    reg = agent.register_memory(buf)
    assert before == rt.cudaMemoryType.cudaMemoryTypeUnregistered
    assert _memory_type(rt, buf.ctypes.data) == rt.cudaMemoryType.cudaMemoryTypeHost
    assert agent.backend("cuda").pool.used == 4 << 20
    agent.deregister_memory(reg)
    assert _memory_type(rt, buf.ctypes.data) == rt.cudaMemoryType.cudaMemoryTypeUnregistered
    assert agent.backend("cuda").pool.used == 0


def test_torch_pinned_memory_is_not_pinned_twice_and_leaves_no_cuda_error(torch, rt, agent):
    agent.backend("cuda")
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    reg = agent.register_memory(pinned)
    assert not reg.handles["cuda"].pinned_by_us and agent.backend("cuda").pool.used == 0
    x = torch.ones(1024, device="cuda:0") * 2  # a kernel launch after our calls sees no stale error
    torch.cuda.synchronize()
    assert float(x.sum()) == 2048.0
    assert rt.cudaGetLastError()[0] == rt.cudaError_t.cudaSuccess


def test_pinned_pool_limit_is_a_clear_error(rt):
    from datamover.errors import PinnedPoolExhausted

    with Agent("pool", {"backends": {"cuda": {"pinned_pool_bytes": "1M"}}}) as agent:
        agent.backend("cuda")
        buf = np.zeros(2 << 20, dtype=np.uint8)
        with pytest.raises(PinnedPoolExhausted, match="pinned-pool limit of 1048576 bytes"):
            agent.register_memory(buf)
        assert _memory_type(rt, buf.ctypes.data) == rt.cudaMemoryType.cudaMemoryTypeUnregistered
        assert agent.registrations == {}


def test_post_does_not_wait_for_the_copy(torch, agent):
    n = 256 << 20
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    host = np.zeros(n, dtype=np.uint8)
    agent.register_memory(gpu)
    agent.register_memory(host)
    lp, rp = agent.prepare(DescList.from_buffers(gpu)), agent.prepare(DescList.from_buffers(host))
    x = agent.make_transfer("READ", lp, None, rp, None)
    x.post().wait()  # warm up
    t0 = time.perf_counter()
    x.post()
    posted = time.perf_counter() - t0
    x.wait()
    total = time.perf_counter() - t0
    assert posted < 0.25 * total, f"post took {posted * 1e6:.0f} us of a {total * 1e6:.0f} us transfer"


def test_copies_run_on_the_backends_own_stream(torch, agent):
    gpu = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    host = np.ones(4096, dtype=np.uint8)
    agent.register_memory(gpu)
    agent.register_memory(host)
    agent.transfer("READ", gpu, host).wait()
    backend = agent.backend("cuda")
    lane = backend._lanes[0]
    assert int(lane.stream) not in (
        0,
        torch.cuda.current_stream(0).cuda_stream,
        torch.cuda.default_stream(0).cuda_stream,
    )
    assert backend.describe()["streams"] == {0: "non-blocking copy stream"}


@pytest.mark.skipif(SKIP is None and GPUS < 2, reason="needs two GPUs")
def test_vram_to_vram_across_devices(torch, agent):
    a = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda:1")
    agent.register_memory([a, b])
    agent.transfer("WRITE", DescList.blocks(a, 1 << 20), DescList.blocks(b, 1 << 20)).wait()
    assert torch.equal(a.cpu(), b.cpu())


def test_gds_vram_to_file_and_back(torch, tmp_path):
    ok, reason = backend_status("gds")
    if not ok:
        pytest.skip(f"gds backend unavailable here: {reason}")
    with Agent("gds", {"backends": {"gds": {"task_size": "1M"}}}) as agent:
        src = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        agent.register_memory([src, dst])
        f = agent.register_file(tmp_path / "kv.bin", size=8 << 20)
        blocks = np.random.default_rng(0).permutation(8) * (1 << 20)
        agent.transfer("WRITE", DescList.blocks(src, 1 << 20), DescList.file(f, blocks, 1 << 20)).wait()
        agent.transfer("READ", DescList.blocks(dst, 1 << 20), DescList.file(f, blocks, 1 << 20)).wait()
        assert torch.equal(src, dst)
        assert agent.backend("gds").describe()["task_size"] == 1 << 20
