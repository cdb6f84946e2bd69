"""A simulated CUDA runtime, for testing the cuda backend's control flow on machines without a GPU.

``SimRuntime`` stands in for ``cuda.bindings.runtime``: streams are threads
that run their copies in order with ``ctypes.memmove``, events are set when
their stream reaches them, "device memory" is host memory the simulator
hands out with a device id, and ``cudaHostRegister`` only records ranges.
The enums, the ``cudaMemcpyAttributes`` struct and error strings are the
real cuda-python ones (cuda-python must be installed; no driver is needed),
and where no driver is present every batch call is also passed to the real
binding to check that it accepts the arguments. ``install`` swaps it in.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..agents import Agent
from ..descriptors import DescList


def _rt() -> Any:
    import cuda.bindings.runtime as rt

    return rt


def _OK() -> Any:
    return _rt().cudaError_t.cudaSuccess


def _E() -> Any:
    return _rt().cudaError_t


class SimEvent:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()  # a never-recorded event counts as complete, as in CUDA


class SimStream:
    """Runs queued operations in order on its own thread."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.ops: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            op = self.ops.get()
            if op is None:
                return
            kind, *args = op
            if kind == "copy":
                self.copy(*args)
            elif kind == "wait":
                args[0].wait()
            else:
                args[0].set()

    def copy(self, dst: int, src: int, n: int) -> None:
        """One copy, run by the stream's thread when the stream reaches it (a known point a test may hold)."""
        ctypes.memmove(dst, src, n)


class SimRuntime:
    """The parts of cuda.bindings.runtime the cuda backend calls, simulated on host memory."""

    def __init__(self, devices: int = 2, batch: bool = True) -> None:
        rt = _rt()
        for name in (
            "cudaError_t",
            "cudaMemcpyKind",
            "cudaMemoryType",
            "cudaMemcpySrcAccessOrder",
            "cudaMemcpyFlags",
            "cudaMemcpyAttributes",
            "cudaStreamNonBlocking",
            "cudaEventDisableTiming",
            "cudaEventBlockingSync",
            "cudaHostRegisterPortable",
            "cudaGetErrorString",
        ):
            setattr(self, name, getattr(rt, name))
        if batch:
            self.cudaMemcpyBatchAsync = self._batch
        self.devices = devices
        self.local = threading.local()
        self.lock = threading.Lock()
        self.device_allocs: list[tuple[int, int, int, np.ndarray]] = []
        self.pinned: dict[int, int] = {}
        self.streams: list[SimStream] = []
        self.calls = {"batch": 0, "memcpy": 0, "register": 0, "unregister": 0}
        self.fail_batch: Any = None  # an error code the next batch calls return
        self.fail_copy_at: int | None = None  # memcpy call number that fails
        from ..backends.cuda.backend import driver_missing

        self.real_driver_missing = driver_missing() is not None

    # -- memory the test hands out as "device memory" -------------------------
    def device_buffer(self, nbytes: int, device: int) -> np.ndarray:
        arr = np.zeros(nbytes + 64, dtype=np.uint8)[64:]
        with self.lock:
            self.device_allocs.append((arr.ctypes.data, arr.ctypes.data + nbytes, device, arr))
        return arr

    # -- runtime calls -----------------------------------------------------------
    def cudaGetLastError(self):
        return (_OK(),)

    def cudaGetDevice(self):
        return (_OK(), getattr(self.local, "dev", 0))

    def cudaSetDevice(self, dev: int):
        if not 0 <= dev < self.devices:
            return (_E().cudaErrorInvalidDevice,)
        self.local.dev = dev
        return (_OK(),)

    def cudaRuntimeGetVersion(self):
        return (_OK(), 12090)

    def cudaDriverGetVersion(self):
        return (_OK(), 12090)

    def cudaStreamCreateWithFlags(self, flags: int):
        assert flags == _rt().cudaStreamNonBlocking, "the copy stream must not sync with the legacy stream"
        s = SimStream(self.local.__dict__.get("dev", 0))
        self.streams.append(s)
        return (_OK(), s)

    def cudaStreamSynchronize(self, stream: SimStream):
        done = threading.Event()
        stream.ops.put(("signal", done))
        done.wait()
        return (_OK(),)

    def cudaStreamDestroy(self, stream: SimStream):
        stream.ops.put(None)
        stream.thread.join()
        return (_OK(),)

    def cudaEventCreateWithFlags(self, flags: int):
        assert flags & _rt().cudaEventDisableTiming
        return (_OK(), SimEvent())

    def cudaEventRecord(self, event: SimEvent, stream: SimStream):
        event.done.clear()
        stream.ops.put(("signal", event.done))
        return (_OK(),)

    def cudaEventSynchronize(self, event: SimEvent):
        event.done.wait()
        return (_OK(),)

    def cudaEventDestroy(self, event: SimEvent):
        return (_OK(),)

    def cudaDeviceCanAccessPeer(self, a: int, b: int):
        return (_OK(), 1)

    def cudaDeviceEnablePeerAccess(self, peer: int, flags: int):
        return (_OK(),)

    def cudaPointerGetAttributes(self, ptr: int):
        with self.lock:
            for start, end, dev, _ in self.device_allocs:
                if start <= ptr < end:
                    return (_OK(), SimpleNamespace(type=_rt().cudaMemoryType.cudaMemoryTypeDevice, device=dev))
            for start, n in self.pinned.items():
                if start <= ptr < start + n:
                    return (_OK(), SimpleNamespace(type=_rt().cudaMemoryType.cudaMemoryTypeHost, device=0))
        return (_OK(), SimpleNamespace(type=_rt().cudaMemoryType.cudaMemoryTypeUnregistered, device=-2))

    def cudaHostRegister(self, ptr: int, size: int, flags: int):
        with self.lock:
            self.calls["register"] += 1
            for start, n in self.pinned.items():
                if start < ptr + size and ptr < start + n:
                    return (_E().cudaErrorHostMemoryAlreadyRegistered,)
            self.pinned[ptr] = size
        return (_OK(),)

    def cudaHostUnregister(self, ptr: int):
        with self.lock:
            self.calls["unregister"] += 1
            if self.pinned.pop(ptr, None) is None:
                return (_E().cudaErrorHostMemoryNotRegistered,)
        return (_OK(),)

    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind, stream: SimStream):
        assert kind == _rt().cudaMemcpyKind.cudaMemcpyDefault
        with self.lock:
            self.calls["memcpy"] += 1
            k = self.calls["memcpy"]
        if self.fail_copy_at is not None and k == self.fail_copy_at:
            return (_E().cudaErrorInvalidValue,)
        stream.ops.put(("copy", dst, src, n))
        return (_OK(),)

    def _batch(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream: SimStream):
        if self.real_driver_missing:
            # the real binding must accept these argument types (it then fails for want of a driver)
            res = _rt().cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, None)
            assert res[0] != _OK()
        self.calls["batch"] += 1
        if self.fail_batch is not None:
            return (self.fail_batch, None)
        ok_args = (
            len(dsts) == len(srcs) == len(sizes) == count > 0
            and 1 <= num_attrs <= count
            and list(attrs_idxs)[:1] == [0]
            and all(isinstance(a, _rt().cudaMemcpyAttributes) for a in attrs)
            and all(a.srcAccessOrder != _rt().cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderInvalid for a in attrs)
            and all(isinstance(z, int) and z > 0 for z in sizes)
        )
        if not ok_args:
            return (_E().cudaErrorInvalidValue, 2**64 - 1)
        for d, s, z in zip(dsts, srcs, sizes):
            stream.ops.put(("copy", d, s, z))
        return (_OK(), 0)


class SimVram:
    """Simulated device memory, registered as VRAM with its device id; the test reads it directly."""

    def __init__(self, sim: SimRuntime, agent: Agent, nbytes: int, device: int = 0, shift: int = 0) -> None:
        self.array = sim.device_buffer(nbytes + shift, device)[shift:]
        self.nbytes = nbytes
        self.device = device
        rows = DescList.from_columns(self.array.ctypes.data, nbytes, device, "VRAM")
        self.registration = agent.register_memory(rows)

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.array.ctypes.data + np.asarray(offsets), lengths, self.device, "VRAM")

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.array[offset : offset + nbytes].tobytes()

    def write(self, offset: int, data: bytes) -> None:
        self.array[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


def install(monkeypatch: Any, runtime: SimRuntime | None = None) -> SimRuntime:
    """Make the cuda backend use ``runtime`` (a new SimRuntime by default) and report itself available."""
    from ..backends.cuda import backend as cuda_backend

    runtime = runtime or SimRuntime()
    monkeypatch.setattr(cuda_backend, "_runtime", lambda: runtime)
    monkeypatch.setattr(cuda_backend.CudaBackend, "available", classmethod(lambda cls: (True, "simulated runtime")))
    return runtime


def stop(runtime: SimRuntime) -> None:
    """End the threads of every stream ``runtime`` created."""
    for s in runtime.streams:
        s.ops.put(None)
