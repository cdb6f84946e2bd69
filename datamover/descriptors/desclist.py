"""DescList: an immutable batch of (addr, length, dev) descriptors of one memory type."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidDescriptor
from .buffers import buffer_info
from .memtype import MemType

_INT64_MAX = int(np.iinfo(np.int64).max)
#: values below this (and >= 0) cannot overflow int64 when an addr and a length are added
_SAFE = 1 << 62
_UNSET: Any = object()
#: lists of at most this many rows get small-list shortcuts (e.g. ``bounds`` from one sort)
SMALL_LIST = 1024
_bitwise_or = np.bitwise_or.reduce
_I64 = np.dtype(np.int64)
#: (rows, length, dev) -> a (3, rows) array whose length and dev rows are filled in, for ``from_columns``
_TEMPLATES: dict[tuple[int, int, int], np.ndarray] = {}


class DescList:
    """A batch of descriptors: one memory type and three int64 columns.

    ``addr`` is a pointer (DRAM, VRAM), a file offset (FILE) or an offset in
    an object (OBJ); ``dev`` is the GPU index (VRAM), the registered file's id
    (FILE) or an index into ``keys`` (OBJ). Immutable: indexing returns new
    lists and never copies bytes of the memory described.
    """

    __slots__ = (
        "__weakref__",
        "_adjacent",
        "_block",
        "_bounds",
        "_device",
        "_owners",
        "_rows",
        "_sorted",
        "keys",
        "mem_type",
    )

    def __init__(
        self,
        rows: Any,
        mem_type: MemType | str,
        *,
        keys: Sequence[str] | None = None,
        owners: tuple = (),
    ) -> None:
        self.mem_type = MemType.parse(mem_type)
        try:
            arr = np.asarray(rows)
        except ValueError as exc:  # ragged rows
            raise InvalidDescriptor(f"descriptor rows must have shape (N, 3) of (addr, length, dev): {exc}") from None
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
        self._block = self._device = self._bounds = self._sorted = self._adjacent = _UNSET

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
        out._block = out._device = out._bounds = out._sorted = out._adjacent = _UNSET
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
        if type(addr) is np.ndarray and type(length) is int and type(dev) is int and keys is None:
            out = _from_address_column(addr, length, dev, mem_type, owners)
            if out is not None:
                return out
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
        info = buffer_info(buffer)
        size = block_step(block_size, info.nbytes)
        starts = np.arange(0, info.nbytes, size, dtype=np.int64)
        lengths = np.minimum(size, info.nbytes - starts)
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
        b = self._block
        if b is not _UNSET and b is not None:
            return b * self._rows.shape[0]
        return int(self._rows[:, 1].sum())

    # -- facts, computed once (the list is immutable) ---------------------------
    @property
    def block(self) -> int | None:
        """The length every descriptor has, or None when they differ or the list is empty."""
        if self._block is _UNSET:
            self._block = _one_value(self._rows[:, 1])
        return self._block

    @property
    def device(self) -> int | None:
        """The ``dev`` every descriptor has, or None when they differ or the list is empty."""
        if self._device is _UNSET:
            self._device = _one_value(self._rows[:, 2])
        return self._device

    @property
    def bounds(self) -> tuple[int, int] | None:
        """(lowest ``addr``, highest ``addr + length``) over the descriptors, or None when the list is empty."""
        b = self._bounds
        if b is _UNSET:
            rows = self._rows
            n, block, b = rows.shape[0], self.block, None
            if n and block is not None and n <= SMALL_LIST:
                start = self.sorted_addr
                b = int(start[0]), int(start[n - 1]) + block
            elif n:
                addr = rows[:, 0]
                end = addr + rows[:, 1] if block is None else addr
                b = int(np.minimum.reduce(addr)), int(np.maximum.reduce(end)) + (block or 0)
            self._bounds = b
        return b

    @property
    def sorted_addr(self) -> np.ndarray:
        """The ``addr`` column in increasing order (read-only)."""
        out = self._sorted
        if out is _UNSET:
            out = np.sort(self._rows[:, 0])
            out.setflags(write=False)
            self._sorted = out
        return out

    @property
    def adjacent(self) -> np.ndarray:
        """``adjacent[i]``: row i+1 starts at the byte where row i ends (N-1 booleans, read-only).

        Devices are not compared.
        """
        out = self._adjacent
        if out is _UNSET:
            rows = self._rows
            addr, block = rows[:, 0], self.block
            if block is None:
                out = addr[1:] == addr[:-1] + rows[:-1, 1]
            else:
                out = (addr[1:] - addr[:-1]) == block
            out.setflags(write=False)
            self._adjacent = out
        return out

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


def block_step(block_size: int, nbytes: int) -> int:
    """``block_size`` checked (InvalidDescriptor unless positive) and cut to ``nbytes`` (numpy's arange takes no
    step past int64): the step that cuts ``nbytes`` into blocks of ``block_size``."""
    size = int(block_size)
    if size <= 0:
        raise InvalidDescriptor(f"block_size must be positive, got {block_size}")
    return min(size, max(1, nbytes))


def _one_value(col: np.ndarray) -> int | None:
    """The value every entry of ``col`` has, or None when they differ or ``col`` is empty."""
    if not col.shape[0]:
        return None
    lo = int(col.min())
    return lo if lo == int(col.max()) else None


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


def _from_address_column(addr: np.ndarray, length: int, dev: int, mem_type: Any, owners: tuple) -> DescList | None:
    """``from_columns`` of an int64 address column with one length and one device: a copy and one sort or reduction.

    None when the general path must decide (another dtype or shape, a value that is negative or near the
    int64 limit), so that the errors stay the general path's.
    """
    if addr.ndim != 1 or addr.dtype is not _I64 or not (0 <= length < _SAFE and 0 <= dev < _SAFE):
        return None
    n = addr.shape[0]
    if n == 0:
        return None
    start = None
    if n <= SMALL_LIST:  # one sort checks the range and gives the bounds (and the overlap check its order)
        start = addr.copy()
        start.sort()
        lo, hi = start.item(0), start.item(n - 1)
        if lo < 0 or hi >= _SAFE:
            return None
        key = (n, length, dev)
        base = _TEMPLATES.get(key)
        if base is None:
            if len(_TEMPLATES) >= 64:
                _TEMPLATES.clear()
            base = _TEMPLATES[key] = np.array([np.zeros(n, np.int64), np.full(n, length), np.full(n, dev)], np.int64)
        base = base.copy()  # (3, n): the transpose is the (n, 3) Fortran-ordered rows
    elif int(_bitwise_or(addr)) >> 62:  # a negative value, or one >= 2**62
        return None
    else:
        base = np.empty((3, n), dtype=np.int64)
        base[1] = length
        base[2] = dev
    base[0] = addr
    rows = base.T
    rows.setflags(write=False)
    out = DescList.__new__(DescList)
    out._rows, out.mem_type, out.keys, out._owners = rows, MemType.parse(mem_type), None, owners
    out._block, out._device, out._adjacent = length, dev, _UNSET
    if start is None:
        out._sorted = out._bounds = _UNSET
    else:
        start.setflags(write=False)
        out._sorted, out._bounds = start, (lo, hi + length)
    return out
