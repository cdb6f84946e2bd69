"""datamover's objects in a Mooncake pool: the payload, then a 16-byte trailer (magic ``DMv1``, the payload's
CRC32C and its length, little-endian u32, u32, u64), and the batched puts and gets that write and check them.

Two ways to move them, both batched calls on registered memory:

- staged (the default): each object is one contiguous buffer in a registered arena: a put copies the payload
  there beside its trailer and sends it with ``batch_put_from``; a get lands the object there with
  ``batch_get_into``, checks it, and only then copies the payload to the caller. One transfer slice per
  object (Mooncake's TCP transport pays about a round trip per buffer of an object), and the caller's memory
  never holds bytes that failed their check.
- zero-copy: the payload moves straight from/to the caller's registered memory and the trailer from/to an
  arena row, as two buffers of one object (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``):
  no local copy, one more slice per object; a row that fails its check is zeroed.

A get is accepted only when the store answered exactly payload + trailer bytes, the trailer's magic and length
are the ones expected and the CRC32C of the payload matches; anything else is a miss for that key.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import codes

MAGIC = 0x31764D44  # b"DMv1" little-endian
TRAILER = 16
_TRAILER = struct.Struct("<IIQ")
_MIN_BLOCK = 1 << 20
_memmove = ctypes.memmove


class Arena:
    """Registered host blocks handed out per call and kept for the next (up to ``keep_bytes`` in all)."""

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None], keep_bytes: int):
        self._register, self._unregister = register, unregister
        self.keep_bytes = int(keep_bytes)
        self._free: list[np.ndarray] = []
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A registered uint8 block of at least ``nbytes``."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        size = -(-max(nbytes, _MIN_BLOCK) // _MIN_BLOCK) * _MIN_BLOCK
        block = np.ones(size, dtype=np.uint8)  # written now: no page faults on the first transfer through it
        self._register(block.ctypes.data, block.nbytes)
        with self._lock:
            self._kept += block.nbytes
        return block

    def give(self, block: np.ndarray) -> None:
        with self._lock:
            if self._kept <= self.keep_bytes:
                self._free.append(block)
                return
            self._kept -= block.nbytes
        self._unregister(block.ctypes.data)

    def close(self) -> None:
        with self._lock:
            blocks, self._free, self._kept = self._free, [], 0
        for b in blocks:
            self._unregister(b.ctypes.data)


def put_objects(
    store: Any, config: Any, arena: Arena, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], staged: bool
) -> list[int]:
    """Write ``sizes[i]`` bytes at ``addrs[i]`` as object ``keys[i]`` with its trailer; the store's status per key."""
    import crc32c

    n = len(keys)
    block = arena.take(sum(sizes) + TRAILER * n if staged else TRAILER * n)
    try:
        base, mv = block.ctypes.data, memoryview(block)
        ptrs: list[Any] = []
        lens: list[Any] = []
        off = 0
        for a, s in zip(addrs, sizes):
            if staged:
                _memmove(base + off, a, s)
                crc = crc32c.crc32c(mv[off : off + s])
                _TRAILER.pack_into(mv, off + s, MAGIC, crc, s)
                ptrs.append(base + off)
                lens.append(s + TRAILER)
                off += s + TRAILER
            else:
                crc = crc32c.crc32c((ctypes.c_char * s).from_address(a)) if s else 0
                _TRAILER.pack_into(mv, off, MAGIC, crc, s)
                ptrs.append([a, base + off] if s else [base + off])
                lens.append([s, TRAILER] if s else [TRAILER])
                off += TRAILER
        if staged:
            res = store.batch_put_from(list(keys), ptrs, lens, config)
        else:
            res = store.batch_put_from_multi_buffers(list(keys), ptrs, lens, config)
    finally:
        arena.give(block)
    return answers(res, n)


def get_objects(
    store: Any, arena: Arena, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], staged: bool
) -> list[int]:
    """Read whole objects ``keys[i]`` of payload ``sizes[i]`` into ``addrs[i]``, each checked; a status per key
    (0: delivered and verified). Staged, a failed row's memory is untouched; zero-copy, it is zeroed."""
    import crc32c

    n = len(keys)
    block = arena.take(sum(sizes) + TRAILER * n if staged else TRAILER * n)
    try:
        base, mv = block.ctypes.data, memoryview(block)
        offs, ptrs, lens = [], [], []
        off = 0
        for a, s in zip(addrs, sizes):
            offs.append(off)
            if staged:
                ptrs.append(base + off)
                lens.append(s + TRAILER)
                off += s + TRAILER
            else:
                ptrs.append([a, base + off] if s else [base + off])
                lens.append([s, TRAILER] if s else [TRAILER])
                off += TRAILER
        if staged:
            got = answers(store.batch_get_into(list(keys), ptrs, lens), n)
        else:
            block[: TRAILER * n] = 0
            got = answers(store.batch_get_into_multi_buffers(list(keys), ptrs, lens), n)
        out = []
        for a, s, o, r in zip(addrs, sizes, offs, got):
            if r != s + TRAILER:
                st = r if r < 0 else codes.SIZE_MISMATCH
            else:
                t = o + s if staged else o
                magic, crc, length = _TRAILER.unpack_from(mv, t)
                if magic != MAGIC or length != s:
                    st = codes.NOT_DATAMOVER
                else:
                    payload = mv[o : o + s] if staged else (ctypes.c_char * s).from_address(a) if s else b""
                    st = 0 if crc32c.crc32c(payload) == crc else codes.CHECKSUM_MISMATCH
            if st == 0 and staged and s:
                _memmove(a, base + o, s)
            elif st != 0 and not staged and s:
                ctypes.memset(a, 0, s)
            out.append(st)
    finally:
        arena.give(block)
    return out


def answers(res: Sequence[int] | None, n: int) -> list[int]:
    """The store's per-key answers; a short or missing answer is NO_ANSWER for every key."""
    if res is None or len(res) != n:
        return [codes.NO_ANSWER] * n
    return [int(r) for r in res]
