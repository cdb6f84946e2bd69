"""``nixl._utils``: the raw host buffers NIXL's examples and tests use (``malloc_passthru`` and friends)."""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
_libc.free.restype = None
_libc.free.argtypes = (ctypes.c_void_p,)
IO_SIZE = 4096


def malloc_passthru(size: int) -> int:
    """A 4 KiB-aligned host buffer of ``size`` bytes (rounded up to the alignment); free with ``free_passthru``."""
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    nbytes = max(IO_SIZE, (int(size) + IO_SIZE - 1) // IO_SIZE * IO_SIZE)
    addr = _libc.aligned_alloc(IO_SIZE, nbytes)
    if not addr:
        raise MemoryError(f"aligned_alloc({IO_SIZE}, {nbytes}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """Free a buffer from ``malloc_passthru``."""
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fill ``size`` bytes at ``addr`` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Raise AssertionError unless the ``size`` bytes at the two addresses are equal."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    if a != b:
        first = next(i for i in range(len(a)) if a[i] != b[i])
        raise AssertionError(f"buffers differ at byte {first}: {a[first]:#04x} != {b[first]:#04x}")


__all__ = ["ba_buf", "free_passthru", "malloc_passthru", "verify_transfer"]
