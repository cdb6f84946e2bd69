"""Test buffers for the conformance kit: memory a test can read and write without the backend."""

from __future__ import annotations

import os
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
