"""Test buffers for the conformance kit: memory a test can read and write without the backend."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, Registration, aligned_empty


class TestBuffer(Protocol):
    """A region the backend under test moves bytes to or from.

    ``read``/``write`` reach the bytes directly (numpy, plain file I/O, boto3,
    a peer process), never through the backend under test.
    """

    nbytes: int

    def descs(self, offsets: Any, lengths: Any) -> DescList: ...

    def read(self, offset: int, nbytes: int) -> bytes: ...

    def write(self, offset: int, data: bytes) -> None: ...


class HostBuffer:
    """Registered host memory (page-aligned, so O_DIRECT paths are exercised)."""

    def __init__(self, agent: Agent, nbytes: int, *, shift: int = 0) -> None:
        self.array = aligned_empty(nbytes + shift)[shift:]
        self.nbytes = nbytes
        self.registration: Registration = agent.register_memory(self.array)  # type: ignore[assignment]

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.array.ctypes.data + np.asarray(offsets), lengths, 0, "DRAM")

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.array[offset : offset + nbytes].tobytes()

    def write(self, offset: int, data: bytes) -> None:
        self.array[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)


class VramBuffer:
    """Registered GPU memory (a torch CUDA tensor), read and written by the test with torch copies."""

    def __init__(self, agent: Agent, nbytes: int, *, device: int = 0, shift: int = 0) -> None:
        import torch

        self.device = device
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes + shift, dtype=torch.uint8, device=f"cuda:{device}")[shift:]
        self.registration = agent.register_memory(self.tensor)

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.tensor.data_ptr() + np.asarray(offsets), lengths, self.device, "VRAM")

    def read(self, offset: int, nbytes: int) -> bytes:
        import torch

        torch.cuda.synchronize(self.device)
        return self.tensor[offset : offset + nbytes].cpu().numpy().tobytes()

    def write(self, offset: int, data: bytes) -> None:
        import torch

        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.tensor[offset : offset + len(data)].copy_(src)
        torch.cuda.synchronize(self.device)


class FileBuffer:
    """A registered file, read and written with plain buffered I/O by the test."""

    def __init__(self, agent: Agent, path: str | os.PathLike, nbytes: int, **register_kw: Any) -> None:
        self.path = os.fspath(path)
        self.nbytes = nbytes
        self.registration = agent.register_file(self.path, size=nbytes, **register_kw)

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.file(self.registration, offsets, lengths)

    def read(self, offset: int, nbytes: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    def write(self, offset: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(offset)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


_object_prefixes = itertools.count()


class ObjectBuffer:
    """A region of ``nbytes`` held as objects of a store, one per remote descriptor, each written whole (as a KV
    tier uses an object store): the remote side of ``ObjectStoreConformance``.

    Descriptor (offset, length) is object ``bufN/offset+length`` of the registered prefix; a range outside the
    region names a key outside it. A subclass says how one object is put and got without the backend under
    test (``put_object``, ``get_object``: the payload, None when absent); ``threads`` of them run at once.
    """

    threads = 1

    def __init__(self, agent: Agent, bucket: str, nbytes: int) -> None:
        self.bucket = bucket
        self.nbytes = nbytes
        self.prefix = f"buf{next(_object_prefixes)}/"
        self.registration = agent.register_objects(bucket, prefix=self.prefix)
        self.segments: dict[tuple[int, int], str] = {}

    def put_object(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get_object(self, key: str) -> bytes | None:
        raise NotImplementedError

    def key(self, offset: int, length: int) -> str:
        if offset < 0 or offset + length > self.nbytes:
            return f"unregistered/{self.prefix}{offset}+{length}"
        name = self.segments.get((offset, length))
        if name is None:
            name = self.segments[(offset, length)] = f"{self.prefix}{offset:012d}+{length}"
        return name

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        off = np.atleast_1d(np.asarray(offsets, dtype=np.int64))
        ln = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
        off, ln = np.broadcast_arrays(off, ln)
        keys = [self.key(o, n) for o, n in zip(off.tolist(), ln.tolist())]
        return DescList.objects(self.registration, ln, 0, keys=keys)

    def _map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        if self.threads <= 1:
            return [fn(i) for i in items]
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(fn, items))

    def _covering(self, offset: int, nbytes: int) -> list[tuple[int, int, str]]:
        """Known segments inside [offset, offset + nbytes), the exact one if there is one, else non-overlapping."""
        if (offset, nbytes) in self.segments:
            return [(offset, nbytes, self.segments[(offset, nbytes)])]
        inside = sorted((o, n, k) for (o, n), k in self.segments.items() if o >= offset and o + n <= offset + nbytes)
        out, reach = [], offset
        for o, n, k in inside:
            if o >= reach:
                out.append((o, n, k))
                reach = o + n
        return out

    def read(self, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)  # never-written bytes read as zeros, like fresh memory
        segs = self._covering(offset, nbytes)
        for (o, n, _), blob in zip(segs, self._map(lambda s: self.get_object(s[2]), segs)):
            if blob is not None:
                assert len(blob) == n, f"object for [{o}, +{n}) holds {len(blob)} bytes"
                buf[o - offset : o - offset + n] = blob
        return bytes(buf)

    def write(self, offset: int, data: bytes) -> None:
        self.key(offset, len(data))
        end = offset + len(data)
        jobs = []
        for (o, n), k in list(self.segments.items()):
            if o >= end or o + n <= offset:
                continue
            if o >= offset and o + n <= end:
                jobs.append((k, data[o - offset : o - offset + n]))
            else:  # a segment straddling the written range keeps its other bytes
                old = bytearray(self.get_object(k) or bytes(n))
                lo, hi = max(o, offset), min(o + n, end)
                old[lo - o : hi - o] = data[lo - offset : hi - offset]
                jobs.append((k, bytes(old)))
        self._map(lambda j: self.put_object(*j), jobs)


def gpu_skip_reason(backend: str) -> str | None:
    """Why ``backend`` cannot be tested with torch CUDA buffers here, or None when it can."""
    from ..backends import backend_status

    ok, reason = backend_status(backend)
    if not ok:
        return f"{backend} backend unavailable here: {reason}"
    try:
        import torch
    except ImportError:
        return "the VRAM test buffers need torch with CUDA; torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (torch.cuda.is_available() is False)"
    return None
