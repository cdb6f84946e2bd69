"""The gds backend's control flow against a simulated kvikio, on machines without a GPU.

``datamover.testing.kvikio_sim.SimKvikio`` stands in for the kvikio module
(see its docstring). Bytes really move, so the tests check
planning, file handles, futures, errors naming the descriptor, timeouts and
release. Real cuFile/GDS behaviour and speed are tested by
tests/backends/gds/test_conformance.py on a GPU.
"""

from __future__ import annotations

import itertools
import os

import pytest

from datamover import Agent, DescList
from datamover.backends.gds import backend as gds_mod
from datamover.errors import TransferIOError
from datamover.testing import BackendConformance, FileBuffer, HostBuffer, kvikio_sim, random_bytes
from datamover.testing.kvikio_sim import HostAsVram, SimCuFile

_names = itertools.count()


@pytest.fixture
def kv(monkeypatch):
    return kvikio_sim.install(monkeypatch)


class TestGdsSimulatedDram(BackendConformance):
    backend = "gds"
    sizes = (1, 4096, 12345, 1 << 20, 16 << 20)

    @pytest.fixture
    def agent(self, kv):
        with Agent("gds-sim", {"backends": {"gds": {"inflight": 3, "min_part_bytes": 4096}}}) as agent:
            yield agent

    @pytest.fixture
    def peer(self):
        return None

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n, shift=5)

    @pytest.fixture
    def make_remote(self, agent, tmp_path):
        return lambda n: FileBuffer(agent, tmp_path / f"s{next(_names)}.bin", n)


class TestGdsSimulatedVram(TestGdsSimulatedDram):
    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostAsVram(agent, n)


def test_file_opened_once_and_closed_at_deregistration(kv, tmp_path):
    with Agent("a", {"backends": {"gds": {}}}) as agent:
        agent.backend("gds")
        f = agent.register_file(tmp_path / "x.bin", size=8192)
        assert SimCuFile.opened == [str(tmp_path / "x.bin")]
        mem = HostBuffer(agent, 8192)
        for _ in range(3):
            agent.transfer("WRITE", mem.descs([0], [8192]), DescList.file(f, [0], [8192])).wait()
        assert len(SimCuFile.opened) == 1
        agent.deregister_memory(f)
        assert SimCuFile.opened == []


def test_settings_reach_kvikio(kv):
    with Agent("a", {"backends": {"gds": {"threads": 6, "task_size": "2M", "compat_mode": "on"}}}) as agent:
        described = agent.backend("gds").describe()
    assert kv.defaults.settings["num_threads"] == 6 and kv.defaults.settings["compat_mode"] == "ON"
    assert described["threads"] == 6 and described["task_size"] == 2 << 20


def test_short_read_names_the_descriptor(kv, tmp_path):
    path = tmp_path / "short.bin"
    with Agent("a", {"backends": {"gds": {}}}) as agent:
        f = agent.register_file(path, size=3 * 4096)
        mem = HostBuffer(agent, 3 * 4096)
        os.truncate(path, 4096 + 100)  # the file shrank behind the agent's back
        x = agent.transfer("READ", mem.descs([8192, 0], [4096, 4096]), DescList.file(f, [0, 4096], [4096, 4096]))
        with pytest.raises(TransferIOError) as info:
            x.wait()
    assert info.value.index == 1 and "read 100 of 4096 bytes" in str(info.value) and info.value.backend == "gds"


def test_kvikio_failure_is_a_typed_error(kv, tmp_path, monkeypatch):
    with Agent("a", {"backends": {"gds": {}}}) as agent:
        f = agent.register_file(tmp_path / "e.bin", size=8192)
        mem = HostBuffer(agent, 8192)
        data = random_bytes(8192, 1)
        mem.write(0, data)

        def boom(self, buf, size=None, file_offset=0, task_size=None):
            if file_offset == 4096:
                raise RuntimeError("KvikIO failure at cufile.cpp: cuFile error: CU_FILE_IO_ERROR")
            return SimCuFile.pwrite_orig(self, buf, size, file_offset, task_size)

        monkeypatch.setattr(SimCuFile, "pwrite_orig", SimCuFile.pwrite, raising=False)
        monkeypatch.setattr(SimCuFile, "pwrite", boom)
        x = agent.transfer("WRITE", mem.descs([0, 4096], [100, 100]), DescList.file(f, [0, 4096], [100, 100]))
        with pytest.raises(TransferIOError) as info:
            x.wait()
    assert info.value.index == 1 and "CU_FILE_IO_ERROR" in str(info.value)


def test_simulator_matches_real_kvikio():
    """The kvikio calls the backend makes exist with these parameters (kvikio imports without a driver)."""
    import inspect

    try:
        kvikio = gds_mod._kvikio()
    except ImportError as exc:
        pytest.skip(f"kvikio is not installed: {exc}")
    except Exception as exc:
        pytest.skip(f"kvikio cannot load here: {type(exc).__name__}: {exc}")
    from kvikio.cufile import IOFuture

    for method in ("pread", "pwrite"):
        params = list(inspect.signature(getattr(kvikio.CuFile, method)).parameters)
        assert params == ["self", "buf", "size", "file_offset", "task_size"], params
    assert {"get", "done"} <= set(dir(IOFuture))
    d = kvikio.defaults
    if hasattr(d, "set"):
        assert {"ON", "OFF", "AUTO"} <= set(kvikio.CompatMode.__members__)
        assert d.get("task_size") > 0 and d.get("num_threads") >= 1
    else:
        assert callable(d.num_threads_reset) and callable(d.compat_mode_reset)
    assert isinstance(gds_mod._io_mode(kvikio), str)
