"""DescList: an immutable batch of (addr, length, dev) descriptors of one memory type."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidDescriptor
from .buffers import buffer_info
from .memtype import MemType

_INT64_MAX = int(np.iinfo(np.int64).max)


class DescList:
    """A batch of descriptors: one memory type and three int64 columns.

    ``addr`` is a pointer (DRAM, VRAM), a file offset (FILE) or an offset in
    an object (OBJ); ``dev`` is the GPU index (VRAM), the registered file's id
    (FILE) or an index into ``keys`` (OBJ). Immutable: indexing returns new
    lists and never copies bytes of the memory described.
    """

    __slots__ = ("__weakref__", "_owners", "_rows", "keys", "mem_type")

    def __init__(
        self,
        rows: Any,
        mem_type: MemType | str,
        *,
        keys: Sequence[str] | None = None,
        owners: tuple = (),
    ) -> None:
        self.mem_type = MemType.parse(mem_type)
        arr = np.asarray(rows)
        if arr.size == 0:
            arr = np.zeros((0, 3), dtype=np.int64)
        if arr.ndim == 1 and arr.shape[0] == 3:
            arr = arr.reshape(1, 3)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise InvalidDescriptor(f"descriptor rows must have shape (N, 3) of (addr, length, dev), got {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidDescriptor(f"descriptor rows must be integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
            raise InvalidDescriptor("descriptor values exceed int64")
        rows64 = np.array(arr, dtype=np.int64, order="F", copy=True)
        check_rows(rows64)
        rows64.setflags(write=False)
        self._rows = rows64
        self.keys = tuple(keys) if keys is not None else None
        self._owners = owners

    @property
    def owners(self) -> tuple:
        """The Python objects that keep this list's memory alive (buffers it was made from), if any."""
        return self._owners

    @classmethod
    def wrap(cls, rows: np.ndarray, mem_type: MemType, keys, owners) -> DescList:
        """Build from already-checked int64 rows (addr, length, dev columns) without copying or re-checking."""
        out = cls.__new__(cls)
        if rows.flags.writeable:
            rows = rows.copy(order="F")
            rows.setflags(write=False)
        out._rows = rows
        out.mem_type = mem_type
        out.keys = keys
        out._owners = owners
        return out

    @classmethod
    def from_columns(
        cls,
        addr: Any,
        length: Any,
        dev: Any = 0,
        mem_type: MemType | str = MemType.DRAM,
        *,
        keys: Sequence[str] | None = None,
        owners: tuple = (),
    ) -> DescList:
        """Build from separate columns; scalars broadcast. Checked as the constructor checks rows, copied once."""
        cols = [np.asarray(addr), np.asarray(length), np.asarray(dev)]
        n = 1
        for col, name in zip(cols, ("addr", "length", "dev")):
            if col.dtype.kind not in "iu" and col.size:
                raise InvalidDescriptor(f"{name} must be integers, got dtype {col.dtype}")
            if col.ndim > 1:
                raise InvalidDescriptor(f"{name} must be a scalar or a 1-D column, got shape {col.shape}")
            if col.ndim == 1 and col.shape[0] != 1:
                if n != 1 and col.shape[0] != n:
                    raise InvalidDescriptor(f"columns of {n} and {col.shape[0]} rows do not broadcast")
                n = col.shape[0]
        if any(c.ndim == 1 and c.shape[0] == 0 for c in cols):
            n = 0
        for col, name in zip(cols, ("addr", "length", "dev")):
            if col.dtype == np.uint64 and col.size and int(col.max()) > _INT64_MAX:
                raise InvalidDescriptor(f"{name} values exceed int64")
        rows = np.empty((n, 3), dtype=np.int64, order="F")
        if n:
            rows[:, 0], rows[:, 1], rows[:, 2] = cols
        check_rows(rows)
        rows.setflags(write=False)
        return cls.wrap(rows, MemType.parse(mem_type), None if keys is None else tuple(keys), owners)

    @classmethod
    def from_buffers(cls, buffers: Any) -> DescList:
        """One descriptor per buffer: numpy arrays, torch tensors, bytearray, memoryview, mmap."""
        single = not isinstance(buffers, (list, tuple))
        items = [buffers] if single else list(buffers)
        infos = [buffer_info(b, index=i) for i, b in enumerate(items)]
        if not infos:
            return cls(np.zeros((0, 3), dtype=np.int64), MemType.DRAM)
        mem = infos[0].mem_type
        for i, info in enumerate(infos):
            if info.mem_type != mem:
                raise InvalidDescriptor(f"mixes {mem} and {info.mem_type} buffers in one list", index=i)
        rows = np.array([(i.addr, i.nbytes, i.dev) for i in infos], dtype=np.int64)
        return cls(rows, mem, owners=tuple(i.owner for i in infos))

    @classmethod
    def blocks(cls, buffer: Any, block_size: int) -> DescList:
        """A buffer cut into equal blocks of ``block_size`` bytes; the last may be shorter."""
        if int(block_size) <= 0:
            raise InvalidDescriptor(f"block_size must be positive, got {block_size}")
        info = buffer_info(buffer)
        starts = np.arange(0, info.nbytes, int(block_size), dtype=np.int64)
        lengths = np.minimum(int(block_size), info.nbytes - starts)
        rows = np.empty((starts.shape[0], 3), dtype=np.int64, order="F")
        rows[:, 0] = info.addr + starts
        rows[:, 1] = lengths
        rows[:, 2] = info.dev
        return cls(rows, info.mem_type, owners=(info.owner,))

    @classmethod
    def file(cls, registration: Any, offsets: Any, lengths: Any) -> DescList:
        """FILE descriptors: segments of a registered file at ``offsets`` with ``lengths``."""
        if MemType.parse(registration.mem_type) != MemType.FILE:
            raise InvalidDescriptor(f"DescList.file needs a FILE registration, got {registration.mem_type}")
        return cls.from_columns(offsets, lengths, registration.dev, MemType.FILE)

    @classmethod
    def objects(cls, registration: Any, lengths: Any, offsets: Any = 0, keys: Sequence[str] | None = None) -> DescList:
        """OBJ descriptors: ``lengths`` bytes at ``offsets`` of the objects named by ``keys``.

        ``keys`` defaults to the registration's key list; row i names
        ``keys[i]`` (``dev`` indexes this list's key table).
        """
        if MemType.parse(registration.mem_type) != MemType.OBJ:
            raise InvalidDescriptor(f"DescList.objects needs an OBJ registration, got {registration.mem_type}")
        if keys is None:
            keys = registration.extra.get("keys")
            if not keys:
                raise InvalidDescriptor("the registration names no keys; pass keys=")
        # a repeated key gets one table entry, so overlap checks see two rows naming the same object
        table, dev = np.unique(np.array([str(k) for k in keys], dtype=object), return_inverse=True)
        return cls.from_columns(offsets, lengths, dev, MemType.OBJ, keys=table.tolist())

    # -- columns ---------------------------------------------------------
    @property
    def rows(self) -> np.ndarray:
        """The (N, 3) read-only int64 array of (addr, length, dev)."""
        return self._rows

    @property
    def addr(self) -> np.ndarray:
        return self._rows[:, 0]

    @property
    def length(self) -> np.ndarray:
        return self._rows[:, 1]

    @property
    def dev(self) -> np.ndarray:
        return self._rows[:, 2]

    @property
    def nbytes(self) -> int:
        return int(self._rows[:, 1].sum())

    def __len__(self) -> int:
        return self._rows.shape[0]

    def __getitem__(self, index: Any) -> Any:
        """An int gives an (addr, length, dev) tuple; a slice or index array a new DescList."""
        if isinstance(index, (int, np.integer)):
            a, n, d = self._rows[int(index)]
            return int(a), int(n), int(d)
        if isinstance(index, slice):
            rows = self._rows[index]
        else:
            idx = np.asarray(index)
            if idx.dtype == bool:
                if idx.shape != (len(self),):
                    raise IndexError(f"boolean index of shape {idx.shape} for {len(self)} descriptors")
            elif idx.dtype.kind not in "iu":
                raise IndexError(f"descriptor index must be integers, got dtype {idx.dtype}")
            rows = self._rows[idx]
        rows = np.asfortranarray(rows)
        rows.setflags(write=False)
        return DescList.wrap(rows, self.mem_type, self.keys, self._owners)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        yield from map(tuple, self._rows.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DescList):
            return NotImplemented
        return self.mem_type == other.mem_type and self.keys == other.keys and np.array_equal(self._rows, other._rows)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(str(r) for r in list(self)[:3])
        more = f", ... ({len(self)} in all)" if len(self) > 3 else ""
        return f"DescList({self.mem_type.value}, [{head}{more}])"

    def concat(self, others: Iterable[DescList]) -> DescList:
        """This list followed by ``others`` (same memory type, no key tables)."""
        parts = [self, *others]
        for p in parts:
            if p.mem_type != self.mem_type:
                raise InvalidDescriptor(f"cannot concatenate {self.mem_type} with {p.mem_type}")
            if p.keys is not None:
                raise InvalidDescriptor("cannot concatenate lists with object-key tables")
        rows = np.concatenate([p._rows for p in parts])
        owners = tuple(o for p in parts for o in p._owners)
        return DescList.wrap(np.asfortranarray(rows), self.mem_type, None, owners)


def check_rows(rows: np.ndarray) -> None:
    """Vectorized sanity checks: non-negative fields and no address overflow."""
    if rows.shape[0] == 0:
        return
    if int(rows.min()) >= 0:
        bad = None
    else:
        bad = (rows[:, 0] < 0) | (rows[:, 1] < 0) | (rows[:, 2] < 0)
    if bad is not None:
        i = int(np.flatnonzero(bad)[0])
        raise InvalidDescriptor(f"negative field in {tuple(int(v) for v in rows[i])}", index=i)
    limit = _INT64_MAX
    over = rows[:, 0] > limit - rows[:, 1]
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise InvalidDescriptor("addr + length overflows int64", index=i)
