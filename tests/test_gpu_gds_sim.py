"""The gds backend's control flow against a simulated kvikio, on machines without a GPU.

``SimKvikio`` stands in for the kvikio module: ``CuFile`` opens the file
once and serves ``pread``/``pwrite`` with ``os.preadv``/``os.pwritev`` on a
thread pool, returning futures with ``get()``/``done()`` like kvikio's
``IOFuture``; device buffers are read through their
``__cuda_array_interface__`` pointer. Bytes really move, so the tests check
planning, file handles, futures, errors naming the descriptor, timeouts and
release. Real cuFile/GDS behaviour and speed are tested by
tests/conformance/test_gds.py on a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from datamover import Agent, DescList
from datamover.backends import gds as gds_mod
from datamover.errors import TransferIOError
from datamover.testing import BackendConformance, FileBuffer, HostBuffer, random_bytes

_names = itertools.count()


def _view(buf: Any, size: int) -> memoryview:
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is not None:
        assert iface["typestr"] == "|u1" and iface["shape"][0] >= size and iface["version"] == 3
        return memoryview((ctypes.c_ubyte * size).from_address(iface["data"][0])).cast("B")
    return memoryview(buf).cast("B")[:size]


class SimFuture:
    def __init__(self, fut) -> None:
        self._fut = fut

    def get(self) -> int:
        return self._fut.result()

    def done(self) -> bool:
        return self._fut.done()


class SimCuFile:
    opened: list[str] = []

    def __init__(self, path: str, flags: str = "r") -> None:
        assert flags == "r+", "registered files are opened for reading and writing, never truncated"
        self.fd = os.open(path, os.O_RDWR)
        self.path = str(path)
        self.pool = SimKvikio.pool
        SimCuFile.opened.append(self.path)

    def pread(self, buf, size=None, file_offset=0, task_size=None) -> SimFuture:
        view = _view(buf, size)
        return SimFuture(self.pool.submit(os.preadv, self.fd, [view], file_offset))

    def pwrite(self, buf, size=None, file_offset=0, task_size=None) -> SimFuture:
        view = _view(buf, size)
        return SimFuture(self.pool.submit(os.pwritev, self.fd, [view], file_offset))

    def close(self) -> None:
        os.close(self.fd)
        SimCuFile.opened.remove(self.path)


class SimKvikio:
    __version__ = "sim"
    pool = ThreadPoolExecutor(4)
    CuFile = SimCuFile

    class CompatMode:
        ON, OFF, AUTO = "ON", "OFF", "AUTO"

    class defaults:
        settings: dict[str, Any] = {"num_threads": 1, "task_size": 4 << 20, "compat_mode": "AUTO"}

        @classmethod
        def set(cls, key, value):
            cls.settings[key] = value

        @classmethod
        def get(cls, key):
            return cls.settings[key]

        @staticmethod
        def is_compat_mode_preferred() -> bool:
            return True


@pytest.fixture
def kv(monkeypatch):
    monkeypatch.setattr(gds_mod, "_kvikio", lambda: SimKvikio)
    monkeypatch.setattr(gds_mod.GdsBackend, "available", classmethod(lambda cls: (True, "simulated kvikio")))
    SimCuFile.opened.clear()
    return SimKvikio


class HostAsVram(HostBuffer):
    """Host memory registered as VRAM rows: gds hands it to (simulated) kvikio as a device buffer."""

    def __init__(self, agent: Agent, nbytes: int, *, shift: int = 0) -> None:
        from datamover.descriptors import aligned_empty

        self.array = aligned_empty(nbytes + shift)[shift:]
        self.nbytes = nbytes
        self.registration = agent.register_memory(DescList.from_columns(self.array.ctypes.data, nbytes, 0, "VRAM"))

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.array.ctypes.data + np.asarray(offsets), lengths, 0, "VRAM")


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
