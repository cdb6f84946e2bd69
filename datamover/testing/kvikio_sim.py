"""A simulated kvikio, for testing the gds backend's control flow on machines without a GPU.

``SimKvikio`` stands in for the kvikio module: ``CuFile`` opens the file
once and serves ``pread``/``pwrite`` with ``os.preadv``/``os.pwritev`` on a
thread pool, returning futures with ``get()``/``done()`` like kvikio's
``IOFuture``; device buffers are read through their
``__cuda_array_interface__`` pointer. ``HostAsVram`` registers host memory
as VRAM rows for it. ``install`` swaps it in.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, aligned_empty
from .buffers import HostBuffer


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


class HostAsVram(HostBuffer):
    """Host memory registered as VRAM rows: gds hands it to (simulated) kvikio as a device buffer."""

    def __init__(self, agent: Agent, nbytes: int, *, shift: int = 0) -> None:
        self.array = aligned_empty(nbytes + shift)[shift:]
        self.nbytes = nbytes
        self.registration = agent.register_memory(DescList.from_columns(self.array.ctypes.data, nbytes, 0, "VRAM"))

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.array.ctypes.data + np.asarray(offsets), lengths, 0, "VRAM")


def install(monkeypatch: Any) -> type[SimKvikio]:
    """Make the gds backend use SimKvikio and report itself available; forgets files opened before."""
    from ..backends.gds import backend as gds_backend

    monkeypatch.setattr(gds_backend, "_kvikio", lambda: SimKvikio)
    monkeypatch.setattr(gds_backend.GdsBackend, "available", classmethod(lambda cls: (True, "simulated kvikio")))
    SimCuFile.opened.clear()
    return SimKvikio
