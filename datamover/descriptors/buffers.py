"""Find the address, size, memory type and device of a user buffer.

Supports numpy arrays, torch tensors (CPU and CUDA, detected without importing
torch), and anything exposing the buffer protocol (bytearray, memoryview,
mmap). Non-contiguous or read-only buffers are refused, never copied.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidDescriptor
from .memtype import MemType


@dataclass(frozen=True)
class BufferInfo:
    addr: int
    nbytes: int
    mem_type: MemType
    dev: int
    owner: Any  # the object that keeps the memory alive


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def buffer_info(x: Any, *, index: int | None = None) -> BufferInfo:
    """Describe one buffer; raises InvalidDescriptor naming ``index`` if unusable."""
    if is_torch_tensor(x):
        if not x.is_contiguous():
            raise InvalidDescriptor("torch tensor is not contiguous; call .contiguous() first", index=index)
        nbytes = x.numel() * x.element_size()
        if x.device.type == "cuda":
            return BufferInfo(x.data_ptr(), nbytes, MemType.VRAM, x.device.index or 0, x)
        if x.device.type != "cpu":
            raise InvalidDescriptor(f"torch tensors on {x.device.type!r} are not supported", index=index)
        return BufferInfo(x.data_ptr(), nbytes, MemType.DRAM, 0, x)
    if isinstance(x, np.ndarray):
        if not (x.flags.c_contiguous or x.flags.f_contiguous):
            raise InvalidDescriptor("numpy array is not contiguous; refusing to copy it", index=index)
        if not x.flags.writeable:
            raise InvalidDescriptor("numpy array is read-only; datamover may write into it", index=index)
        return BufferInfo(int(x.ctypes.data), int(x.nbytes), MemType.DRAM, 0, x)
    if isinstance(x, (bytes, str)):
        raise InvalidDescriptor(f"{type(x).__name__} is immutable; use a bytearray or numpy array", index=index)
    try:
        view = memoryview(x)
    except TypeError:
        raise InvalidDescriptor(
            f"cannot describe a {type(x).__name__}: expected a numpy array, torch tensor, "
            "bytearray, memoryview or mmap",
            index=index,
        ) from None
    if not view.contiguous:
        raise InvalidDescriptor("buffer is not contiguous; refusing to copy it", index=index)
    if view.readonly:
        raise InvalidDescriptor("buffer is read-only; datamover may write into it", index=index)
    if view.nbytes == 0:
        return BufferInfo(0, 0, MemType.DRAM, 0, x)
    arr = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)
    owner = x if isinstance(x, (bytearray, mmap.mmap)) else view
    return BufferInfo(int(arr.ctypes.data), int(view.nbytes), MemType.DRAM, 0, owner)


def host_view(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of host memory at ``addr`` (no copy)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(addr))


def huge_page_size() -> int:
    """The size of a transparent huge page here (2 MiB on x86_64), or 0 where the kernel does not say."""
    global _huge_page
    if _huge_page is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
                _huge_page = int(f.read())
        except (OSError, ValueError):
            _huge_page = 0
    return _huge_page


_huge_page: int | None = None


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """A zero-filled uint8 array whose address is a multiple of ``alignment``.

    O_DIRECT I/O goes straight from such buffers; misaligned ones go through a
    bounce buffer. Buffers of two huge pages or more start on a huge page
    boundary, so that transparent huge pages (numpy asks for them from 4 MiB
    up) back them from the first byte: a head of small pages made rows copied
    there over cma slower (BENCHMARKS.md). The padding is never touched.
    """
    huge = huge_page_size()
    if huge and nbytes >= 2 * huge:
        alignment = max(alignment, huge)
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    shift = (-raw.ctypes.data) % alignment
    return raw[shift : shift + nbytes]
