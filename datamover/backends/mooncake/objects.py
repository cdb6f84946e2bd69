"""datamover's objects in a Mooncake pool: the payload, then a 16-byte trailer (magic ``DMv2``, the CRC32C of the
object's key then its payload, and the payload's length, little-endian u32, u32, u64), and the batched puts and
gets that write and check them. The key is in the CRC so that an object read under another key than the one it
was written for (a misplaced or copied object) fails its check instead of serving another chunk's bytes.

Two ways to move them, both batched calls on registered memory:

- staged (the default): each object is one contiguous buffer in a registered arena: a put copies the payload
  there beside its trailer and sends it with ``batch_put_from``; a get lands the object there with
  ``batch_get_into``, checks it, and only then copies the payload to the caller. One transfer slice per
  object (Mooncake's TCP transport pays about a round trip per buffer of an object), and the caller's memory
  never holds bytes that failed their check.
- zero-copy: the payload moves straight from/to the caller's registered memory and the trailer from/to an
  arena row, as two buffers of one object (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``):
  no local copy, one more slice per object; a row that fails its check is zeroed. Fenced (a READ's
  ``ReadFence``), nothing is verified or zeroed once the fence was shut while the store call ran; but Mooncake's
  own writes into the destination cannot be stopped once the call is under way, so a get stuck past the fence's
  bound (``FENCE_S``, a stalled master) may still land its bytes after the transfer was released. Staged mode
  (``transfer_mode="staged"``) never writes the caller's memory after a cancel.

A get is accepted only when the store answered exactly payload + trailer bytes, the trailer's magic and length
are the ones expected and the CRC32C of the key and payload matches; anything else is a miss for that key.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...descriptors import aligned_empty
from . import codes

try:
    from crc32c import crc32c as _crc
except ImportError:  # MooncakeBackend.available() says what to install
    _crc = None

MAGIC = 0x32764D44  # b"DMv2" little-endian (DMv1 had the payload's CRC32C alone)
TRAILER = 16
_TRAILER = struct.Struct("<IIQ")
_MIN_BLOCK = 4 << 20
_PAGE = 4096
#: the most arena bytes a staged object takes beyond its payload (its trailer, and padding to its page offset)
SLOT = TRAILER + _PAGE
_memmove = ctypes.memmove
_pack_into = _TRAILER.pack_into
_unpack_from = _TRAILER.unpack_from
#: an arena block: the uint8 array, its address, a memoryview of it (each asked for once per block, not per call)
Block = tuple[np.ndarray, int, memoryview]


class Arena:
    """Registered host blocks handed out per call and kept for the next (up to ``keep_bytes`` in all).

    Blocks are at least two huge pages and start on a huge-page boundary, so transparent huge pages back them
    as they back the callers' large buffers (``aligned_empty``): small pages made every copy and every
    transfer through the arena slower.
    """

    def __init__(self, register: Callable[[int, int], None], unregister: Callable[[int], None], keep_bytes: int):
        self._register, self._unregister = register, unregister
        self.keep_bytes = int(keep_bytes)
        self._free: list[np.ndarray] = []
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Block:
        """A registered block of at least ``nbytes``: (the uint8 array, its address, a memoryview of it)."""
        with self._lock:
            best = -1
            for i, b in enumerate(self._free):
                if b[0].nbytes >= nbytes and (best < 0 or b[0].nbytes < self._free[best][0].nbytes):
                    best = i
            if best >= 0:
                return self._free.pop(best)
        size = -(-max(nbytes, _MIN_BLOCK) // _MIN_BLOCK) * _MIN_BLOCK
        arr = aligned_empty(size)
        arr.fill(1)  # written now: no page faults on the first transfer through it
        block = (arr, int(arr.ctypes.data), memoryview(arr))
        self._register(block[1], arr.nbytes)
        with self._lock:
            self._kept += arr.nbytes
        return block

    def give(self, block: Block) -> None:
        with self._lock:
            if self._kept <= self.keep_bytes:
                self._free.append(block)
                return
            self._kept -= block[0].nbytes
        self._unregister(block[1])

    def close(self) -> None:
        with self._lock:
            blocks, self._free, self._kept = self._free, [], 0
        for b in blocks:
            self._unregister(b[1])


def staged_bytes(sizes: Sequence[int]) -> int:
    """The arena bytes a staged call of objects with these payload sizes takes (each slot is padded so that it
    sits at its caller buffer's offset in a page)."""
    return sum(sizes) + SLOT * len(sizes)


def put_objects(
    store: Any,
    config: Any,
    arena: Arena,
    keys: list[str],
    addrs: Sequence[int],
    sizes: Sequence[int],
    staged: bool,
    upsert: bool = False,
) -> list[int]:
    """Write ``sizes[i]`` bytes at ``addrs[i]`` as object ``keys[i]`` with its trailer; the store's status per key.
    ``upsert`` (staged only) replaces what the keys held; otherwise Mooncake keeps an existing object."""
    n = len(keys)
    block = arena.take(staged_bytes(sizes) if staged else TRAILER * n)
    try:
        _, base, mv = block
        ptrs: list[Any] = []
        lens: list[Any] = []
        off = 0
        if staged:
            for k, a, s in zip(keys, addrs, sizes):
                # the slot starts at a's offset in its page: a copy between buffers a few bytes apart modulo a
                # page takes several times as long (the CPU sees false store-to-load dependencies)
                off += (a - base - off) % _PAGE
                _memmove(base + off, a, s)
                _pack_into(mv, off + s, MAGIC, _crc(mv[off : off + s], _crc(k.encode())), s)
                ptrs.append(base + off)
                lens.append(s + TRAILER)
                off += s + TRAILER
            res = (store.batch_upsert_from if upsert else store.batch_put_from)(keys, ptrs, lens, config)
        else:
            for k, a, s in zip(keys, addrs, sizes):
                crc = _crc(k.encode())
                if s:
                    crc = _crc((ctypes.c_char * s).from_address(a), crc)
                _pack_into(mv, off, MAGIC, crc, s)
                ptrs.append([a, base + off] if s else [base + off])
                lens.append([s, TRAILER] if s else [TRAILER])
                off += TRAILER
            res = store.batch_put_from_multi_buffers(keys, ptrs, lens, config)
    finally:
        arena.give(block)
    return res if type(res) is list and len(res) == n else answers(res, n)


def get_objects(
    store: Any,
    arena: Arena,
    keys: list[str],
    addrs: Sequence[int],
    sizes: Sequence[int],
    staged: bool,
    fence: Any = None,
) -> list[int]:
    """Read whole objects ``keys[i]`` of payload ``sizes[i]`` into ``addrs[i]``, each checked; a status per key
    (0: delivered and verified). Staged, a failed row's memory is untouched; zero-copy, it is zeroed. With a
    ``fence`` (``backends.fence.ReadFence``) the caller's memory is touched only inside its ``enter``/``leave``:
    once it was cancelled, every key is CANCELLED and nothing is written there."""
    n = len(keys)
    if fence is not None and not staged and not fence.enter():
        return [codes.CANCELLED] * n
    entered = fence is not None and not staged
    try:
        block = arena.take(staged_bytes(sizes) if staged else TRAILER * n)
    except BaseException:
        if entered:
            fence.leave()
        raise
    try:
        arr, base, mv = block
        offs: list[int] = []
        ptrs: list[Any] = []
        lens: list[Any] = []
        off = 0
        if staged:
            for a, s in zip(addrs, sizes):
                off += (a - base - off) % _PAGE  # as in put_objects: the copy out runs at full speed
                offs.append(off)
                ptrs.append(base + off)
                lens.append(s + TRAILER)
                off += s + TRAILER
            got = store.batch_get_into(keys, ptrs, lens)
        else:
            for a, s in zip(addrs, sizes):
                offs.append(off)
                ptrs.append([a, base + off] if s else [base + off])
                lens.append([s, TRAILER] if s else [TRAILER])
                off += TRAILER
            arr[: TRAILER * n] = 0
            got = store.batch_get_into_multi_buffers(keys, ptrs, lens)
            # the call may have outlasted the fence (cancel gave up waiting, the caller released the memory): then
            # touch nothing more, neither verify nor zero (what Mooncake itself wrote there cannot be taken back)
            if fence is not None and fence.shut():
                return [codes.CANCELLED] * n
        if type(got) is not list or len(got) != n:
            got = answers(got, n)
        if fence is not None and staged:
            if not fence.enter():
                return [codes.CANCELLED] * n
            entered = True
        out = []
        for k, a, s, o, r in zip(keys, addrs, sizes, offs, got):
            if r != s + TRAILER:
                st = r if r < 0 else codes.SIZE_MISMATCH
            else:
                magic, crc, length = _unpack_from(mv, o + s if staged else o)
                if magic != MAGIC or length != s:
                    st = codes.NOT_DATAMOVER
                elif staged:
                    if _crc(mv[o : o + s], _crc(k.encode())) == crc:
                        if s:
                            _memmove(a, base + o, s)
                        out.append(0)
                        continue
                    st = codes.CHECKSUM_MISMATCH
                else:
                    payload = (ctypes.c_char * s).from_address(a) if s else b""
                    st = 0 if _crc(payload, _crc(k.encode())) == crc else codes.CHECKSUM_MISMATCH
            if st != 0 and not staged and s:
                ctypes.memset(a, 0, s)
            out.append(st)
    finally:
        if entered:
            fence.leave()
        arena.give(block)
    return out


def answers(res: Sequence[int] | None, n: int) -> list[int]:
    """The store's per-key answers; a short or missing answer is NO_ANSWER for every key."""
    if res is None or len(res) != n:
        return [codes.NO_ANSWER] * n
    return [int(r) for r in res]
