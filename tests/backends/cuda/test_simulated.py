"""The cuda backend's control flow against a simulated CUDA runtime, on machines without a GPU.

``datamover.testing.cuda_sim.SimRuntime`` stands in for
``cuda.bindings.runtime`` (see its docstring). Bytes really move, so these tests check what the backend does with the
API: planning, batching and its fallback, per-device streams, event
completion in stream order, pinning and the pool, errors naming the
descriptor, timeouts, release and concurrency. What only a GPU can show
(real DMA, real pinning, speed) is tested by
tests/backends/cuda/test_conformance.py there.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

rt_real = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python (cuda.bindings) is not installed")

from datamover import Agent, DescList, XferState  # noqa: E402
from datamover.backends.cuda import backend as cuda_mod  # noqa: E402
from datamover.errors import CudaError, DatamoverError, PinnedPoolExhausted, TransferIOError, TransferTimeout  # noqa: E402
from datamover.testing import BackendConformance, HostBuffer, cuda_sim, random_bytes  # noqa: E402
from datamover.testing.cuda_sim import SimRuntime, SimVram  # noqa: E402

OK = rt_real.cudaError_t.cudaSuccess
E = rt_real.cudaError_t


@pytest.fixture
def sim(monkeypatch):
    runtime = cuda_sim.install(monkeypatch)
    yield runtime
    cuda_sim.stop(runtime)


class TestCudaSimulatedVramToDram(BackendConformance):
    backend = "cuda"
    params: dict = {}
    sizes = (1, 4096, 12345, 1 << 20, 16 << 20)
    cut_timeout = 1e-4  # copies are enqueued inside post(): cut short with them in flight

    def hold_in_flight(self, monkeypatch, held):
        """The copies on the simulated streams, held before each: the cancel's fence must wait for them."""
        monkeypatch.setattr(cuda_sim.SimStream, "copy", held.wrap(cuda_sim.SimStream.copy))
        return True

    @pytest.fixture
    def agent(self, sim):
        with Agent("cuda-sim", {"backends": {"cuda": dict(self.params)}}) as agent:
            yield agent

    @pytest.fixture
    def peer(self):
        return None

    @pytest.fixture
    def make_local(self, sim, agent):
        return lambda n: SimVram(sim, agent, n)

    @pytest.fixture
    def make_remote(self, agent):
        return lambda n: HostBuffer(agent, n, shift=3)


class TestCudaSimulatedVramToVram(TestCudaSimulatedVramToDram):
    @pytest.fixture
    def make_remote(self, sim, agent):
        return lambda n: SimVram(sim, agent, n, device=1, shift=3)


class TestCudaSimulatedNoBatch(TestCudaSimulatedVramToDram):
    params = {"batch": False, "batch_chunk": 7}


class TestCudaSimulatedSmallChunks(TestCudaSimulatedVramToDram):
    params = {"batch_chunk": 5}


# -- targeted behaviour -------------------------------------------------------------


def _pair(sim, agent, n=1 << 16):
    vram = SimVram(sim, agent, n)
    host = HostBuffer(agent, n)
    return vram, host


def test_batch_api_used_for_many_rows_and_single_copy_for_one(sim):
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        vram, host = _pair(sim, agent)
        host.write(0, random_bytes(1 << 16, 1))
        perm = np.random.default_rng(0).permutation(16)
        lp = agent.prepare(vram.descs(np.arange(16) * 4096, 4096))
        rp = agent.prepare(host.descs(np.arange(16) * 4096, 4096))
        agent.make_transfer("READ", lp, np.arange(16), rp, perm).post().wait()
        assert sim.calls["batch"] == 1 and sim.calls["memcpy"] == 0
        got = np.frombuffer(vram.read(0, 1 << 16), np.uint8).reshape(16, 4096)
        want = np.frombuffer(host.read(0, 1 << 16), np.uint8).reshape(16, 4096)
        assert np.array_equal(got, want[perm])
        agent.transfer("WRITE", vram.descs([0], [1 << 16]), host.descs([0], [1 << 16])).wait()
        assert sim.calls["memcpy"] == 1, "one coalesced row should be one cudaMemcpyAsync"
        assert "used" in agent.backend("cuda").describe()["cudaMemcpyBatchAsync"]


def test_batch_not_supported_falls_back_and_still_moves(sim):
    sim.fail_batch = E.cudaErrorNotSupported
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        vram, host = _pair(sim, agent)
        data = random_bytes(1 << 16, 2)
        host.write(0, data)
        perm = np.arange(16)[::-1].copy()
        lp = agent.prepare(vram.descs(np.arange(16) * 4096, 4096))
        rp = agent.prepare(host.descs(np.arange(16) * 4096, 4096))
        agent.make_transfer("READ", lp, np.arange(16), rp, perm).post().wait()
        assert sim.calls["memcpy"] == 16
        got = np.frombuffer(vram.read(0, 1 << 16), np.uint8).reshape(16, 4096)
        assert np.array_equal(got, np.frombuffer(data, np.uint8).reshape(16, 4096)[perm])
        assert "cudaErrorNotSupported" in agent.backend("cuda").describe()["cudaMemcpyBatchAsync"]


def test_batch_error_is_typed_with_cuda_name(sim):
    sim.fail_batch = E.cudaErrorInvalidValue
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        vram, host = _pair(sim, agent)
        x = agent.transfer("WRITE", vram.descs([0, 8192], [100, 100]), host.descs([4096, 0], [100, 100]))
        with pytest.raises(CudaError) as info:
            x.wait()
        assert info.value.cuda_error == "cudaErrorInvalidValue" and info.value.backend == "cuda"
        assert isinstance(info.value, TransferIOError)


def test_copy_error_names_the_callers_descriptor(sim):
    with Agent("a", {"backends": {"cuda": {"batch": False}}}) as agent:
        vram, host = _pair(sim, agent)
        sim.fail_copy_at = 3
        lp = agent.prepare(vram.descs([0, 100, 200, 4096], [100, 100, 100, 50]))
        rp = agent.prepare(host.descs([0, 100, 5000, 9000], [100, 100, 100, 50]))
        x = agent.make_transfer("WRITE", lp, None, rp, None).post()
        with pytest.raises(CudaError) as info:
            x.wait()
        # rows 0 and 1 coalesce; the third cudaMemcpyAsync is caller descriptor 3
        assert info.value.index == 3 and "descriptor 3" in str(info.value)


def test_dram_pinned_at_registration_and_unpinned_at_deregistration(sim):
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        backend = agent.backend("cuda")
        buf = np.zeros(1 << 20, dtype=np.uint8)
        reg = agent.register_memory(buf)
        assert sim.pinned == {buf.ctypes.data: 1 << 20}
        assert backend.pool.used == 1 << 20 and reg.handles["cuda"].pinned_by_us
        agent.deregister_memory(reg)
        assert sim.pinned == {} and backend.pool.used == 0


def test_already_pinned_memory_is_left_alone(sim):
    buf = np.zeros(1 << 16, dtype=np.uint8)
    sim.pinned[buf.ctypes.data] = buf.nbytes  # page-locked by someone else (e.g. torch pin_memory)
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        reg = agent.register_memory(buf)
        agent.backend("cuda")
        assert not reg.handles["cuda"].pinned_by_us
        agent.deregister_memory(reg)
    assert sim.pinned == {buf.ctypes.data: buf.nbytes} and sim.calls["unregister"] == 0


def test_pinned_pool_limit_refuses_registration_and_rolls_back(sim):
    with Agent("a", {"backends": {"cuda": {"pinned_pool_bytes": "1M"}}}) as agent:
        agent.backend("cuda")
        a = agent.register_memory(np.zeros(768 << 10, dtype=np.uint8))
        big = np.zeros(512 << 10, dtype=np.uint8)
        with pytest.raises(PinnedPoolExhausted) as info:
            agent.register_memory(big)
        assert "pinned-pool limit of 1048576 bytes" in str(info.value)
        assert len(agent.registrations) == 1 and len(sim.pinned) == 1
        agent.deregister_memory(a)
        agent.register_memory(big)  # fits once the first region is gone
        assert agent.backend("cuda").pool.used == 512 << 10


def test_close_unpins_everything(sim):
    agent = Agent("a", {"backends": {"cuda": {}}})
    agent.register_memory(np.zeros(4096, dtype=np.uint8))
    agent.register_memory(np.zeros(8192, dtype=np.uint8))
    agent.backend("cuda")
    assert len(sim.pinned) == 2
    agent.close()
    assert sim.pinned == {}


def test_vram_region_must_be_device_memory_of_its_device(sim):
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        agent.backend("cuda")
        arr = sim.device_buffer(4096, device=1)
        with pytest.raises(DatamoverError, match="lives on device 1"):
            agent.register_memory(DescList.from_columns(arr.ctypes.data, 4096, 0, "VRAM"))
        host = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(DatamoverError, match="not device memory"):
            agent.register_memory(DescList.from_columns(host.ctypes.data, 4096, 0, "VRAM"))
        assert agent.registrations == {}


def test_rows_on_two_devices_use_two_streams(sim):
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        v0 = SimVram(sim, agent, 8192, device=0)
        v1 = SimVram(sim, agent, 8192, device=1)
        host = HostBuffer(agent, 16384)
        data = random_bytes(16384, 5)
        host.write(0, data)
        local = v0.descs([0], [8192]).concat([v1.descs([0], [8192])])
        agent.transfer("READ", local, host.descs([0, 8192], [8192, 8192])).wait()
        assert v0.read(0, 8192) + v1.read(0, 8192) == data
        assert sorted(s.device for s in sim.streams) == [0, 1]


def test_post_returns_before_the_copy_completes(sim):
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        vram, host = _pair(sim, agent)
        data = random_bytes(4096, 6)
        vram.write(0, data)
        lp, rp = agent.prepare(vram.descs([0], [4096])), agent.prepare(host.descs([0], [4096]))
        x = agent.make_transfer("WRITE", lp, None, rp, None)
        gate = threading.Event()
        sim.streams[0].ops.put(("wait", gate))  # the copy stream is busy until the gate opens
        x.post()
        assert x.state.value == "PROC" and host.read(0, 4096) != data
        gate.set()
        assert x.wait().value == "DONE" and host.read(0, 4096) == data


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_timeout_waits_for_the_copies_on_the_stream(sim, op):
    """A copy on the stream cannot be stopped: ERR (a timeout) is reported once the copies enqueued ended, so none
    lands in the caller's memory (READ: VRAM -> the caller's DRAM here is a WRITE from VRAM) or reads it after ERR.
    Before, ERR came at the deadline while the copy was still queued, and its bytes landed after it."""
    with Agent("a", {"backends": {"cuda": {}}}) as agent:
        vram, host = _pair(sim, agent)
        on_vram, on_host = random_bytes(4096, 7), random_bytes(4096, 8)
        vram.write(0, on_vram)
        host.write(0, on_host)
        lp, rp = agent.prepare(vram.descs([0], [4096])), agent.prepare(host.descs([0], [4096]))
        # WRITE: VRAM -> host (the caller's host buffer is the destination); READ: host -> VRAM (it is the source)
        x = agent.make_transfer(op, lp, None, rp, None, timeout=0.05)
        gate = threading.Event()
        sim.streams[0].ops.put(("wait", gate))  # the copy is held behind the gate
        x.post()
        fencing = getattr(x._completion, "fencing", threading.Event())
        fenced = threading.Thread(target=lambda: fencing.wait(30) and gate.set())
        fenced.start()  # the gate opens once the timeout's cancel waits for the copy: a known point
        try:
            with pytest.raises(TransferTimeout):
                x.wait()
            # the copy ran before ERR was reported, not after
            landed = host.read(0, 4096) == on_vram if op == "WRITE" else vram.read(0, 4096) == on_host
        finally:
            gate.set()
            fenced.join(30)
        assert landed, "ERR reported with the copy still on the stream"
        assert x.state == XferState.ERR and isinstance(x.error, TransferTimeout)
        x.release()
        agent.transfer("WRITE", vram.descs([0], [4096]), host.descs([0], [4096])).wait()  # still usable


def test_backend_and_simulator_use_the_real_api():
    """Every runtime name the backend uses exists in cuda-python, and the simulator takes the same arguments."""
    import inspect
    import re

    source = inspect.getsource(cuda_mod)
    names = set(re.findall(r"\brt\.(cuda\w+)", source))
    assert {"cudaMemcpyAsync", "cudaMemcpyBatchAsync", "cudaEventRecord", "cudaHostRegister"} <= names
    assert sorted(n for n in names if not hasattr(rt_real, n)) == []
    for enum in ("cudaError_t", "cudaMemoryType", "cudaMemcpySrcAccessOrder", "cudaMemcpyFlags", "cudaMemcpyKind"):
        members = set(re.findall(rf"\b{enum}\.(\w+)", source))
        assert sorted(m for m in members if not hasattr(getattr(rt_real, enum), m)) == [], enum
    assert {"type", "device"} <= set(dir(rt_real.cudaPointerAttributes()))
    assert "name" in dir(rt_real.cudaDeviceProp())
    assert {"srcAccessOrder", "flags"} <= set(dir(rt_real.cudaMemcpyAttributes()))
    sim = SimRuntime()
    for name in sorted(names):
        real = getattr(rt_real, name)
        mine = getattr(sim, name, None)
        if not inspect.isroutine(real) or mine is None or not inspect.ismethod(mine):
            continue
        assert len(inspect.signature(mine).parameters) == len(inspect.signature(real).parameters), name
