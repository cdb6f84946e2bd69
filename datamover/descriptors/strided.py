"""StridedDescList: descriptors as runs of equal blocks, (addr, length, dev, stride, count) per row.

A layer-wise KV layout (the same block in every layer, one layer apart) is one
row per run instead of one per layer and block: ``count`` blocks of ``length``
bytes, ``stride`` bytes apart, starting at ``addr``. Blocks are numbered flat,
run after run, as NIXL's Nx5 lists are; ``select`` turns flat indices into a
plain DescList without expanding the runs not asked for.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidDescriptor
from .desclist import DescList
from .memtype import MemType

_INT64_MAX = np.iinfo(np.int64).max


class StridedDescList:
    """Runs of equal blocks of one memory type; ``len()`` is the number of blocks."""

    __slots__ = ("_first", "_runs", "mem_type")

    def __init__(self, runs: Any, mem_type: MemType | str) -> None:
        self.mem_type = MemType.parse(mem_type)
        arr = np.asarray(runs)
        if arr.size == 0:
            arr = np.zeros((0, 5), dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 5:
            raise InvalidDescriptor(
                f"strided rows must have shape (N, 5) of (addr, length, dev, stride, count), got {arr.shape}"
            )
        if arr.dtype.kind not in "iu":
            raise InvalidDescriptor(f"strided rows must be integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
            raise InvalidDescriptor("strided row values exceed int64")
        rows = np.array(arr, dtype=np.int64, copy=True)
        _check_runs(rows)
        rows.setflags(write=False)
        self._runs = rows
        # flat index of each run's first block
        first = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(rows[:, 4], out=first[1:])
        first.setflags(write=False)
        self._first = first

    @classmethod
    def from_columns(
        cls, addr: Any, length: Any, dev: Any, stride: Any, count: Any, mem_type: MemType | str = MemType.DRAM
    ) -> StridedDescList:
        """Build from separate columns; scalars broadcast."""
        cols = [np.atleast_1d(np.asarray(c)) for c in (addr, length, dev, stride, count)]
        n = max(c.shape[0] for c in cols)
        rows = np.empty((n, 5), dtype=np.int64)
        for k, c in enumerate(cols):
            if c.dtype.kind not in "iu":
                raise InvalidDescriptor(f"strided column {k} must be integers, got dtype {c.dtype}")
            if c.ndim != 1 or c.shape[0] not in (1, n):
                raise InvalidDescriptor(f"strided column {k} of shape {c.shape} does not broadcast to {n} rows")
            if c.dtype == np.uint64 and c.size and int(c.max()) > _INT64_MAX:
                raise InvalidDescriptor(f"strided column {k} values exceed int64")
            rows[:, k] = np.broadcast_to(c.astype(np.int64), (n,))
        return cls(rows, mem_type)

    @property
    def runs(self) -> np.ndarray:
        """The (N, 5) int64 rows, read-only."""
        return self._runs

    def __len__(self) -> int:
        return int(self._first[-1])

    @property
    def nbytes(self) -> int:
        return int((self._runs[:, 1] * self._runs[:, 4]).sum())

    def select(self, indices: Any) -> DescList:
        """The blocks at flat ``indices`` as a DescList (vectorized; IndexError names the first bad index)."""
        idx = np.asarray(indices)
        if idx.size and idx.dtype.kind not in "iu":
            raise IndexError(f"block indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        n = len(self)
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise IndexError(f"block index {int(idx[k])} at position {k} is out of range for {n} blocks")
        run = np.searchsorted(self._first, idx, side="right") - 1
        r = self._runs[run]
        rows = np.empty((idx.shape[0], 3), dtype=np.int64, order="F")
        rows[:, 0] = r[:, 0] + (idx - self._first[run]) * r[:, 3]
        rows[:, 1] = r[:, 1]
        rows[:, 2] = r[:, 2]
        return DescList.wrap(rows, self.mem_type, None, ())

    def expand(self) -> DescList:
        """Every block, in flat order."""
        return self.select(np.arange(len(self), dtype=np.int64))

    def spans(self) -> DescList:
        """One descriptor per non-empty run covering all of its blocks (and the gaps between them)."""
        r = self._runs[self._runs[:, 4] > 0]
        rows = np.empty((r.shape[0], 3), dtype=np.int64, order="F")
        rows[:, 0] = r[:, 0]
        rows[:, 1] = r[:, 3] * (r[:, 4] - 1) + r[:, 1]
        rows[:, 2] = r[:, 2]
        return DescList.wrap(rows, self.mem_type, None, ())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StridedDescList):
            return NotImplemented
        return self.mem_type == other.mem_type and np.array_equal(self._runs, other._runs)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(str(tuple(int(v) for v in r)) for r in self._runs[:3])
        more = f", ... ({self._runs.shape[0]} runs)" if self._runs.shape[0] > 3 else ""
        return f"StridedDescList({self.mem_type.value}, [{head}{more}], blocks={len(self)})"


def _check_runs(rows: np.ndarray) -> None:
    """Non-negative fields, and the last block of every run inside int64."""
    if rows.shape[0] == 0:
        return
    neg = (rows < 0).any(axis=1)
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        raise InvalidDescriptor(f"negative field in strided row {tuple(int(v) for v in rows[i])}", index=i)
    with np.errstate(over="ignore"):
        steps = np.maximum(rows[:, 4] - 1, 0)
        safe = (rows[:, 3] == 0) | (steps <= (_INT64_MAX - rows[:, 1]) // np.maximum(rows[:, 3], 1))
        over = ~safe
        if not over.any():
            end = rows[:, 3] * steps + rows[:, 1]
            over = rows[:, 0] > _INT64_MAX - end
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise InvalidDescriptor("addr + stride * (count - 1) + length overflows int64", index=i)
    if int(rows[:, 4].sum(dtype=np.float64)) > _INT64_MAX:
        raise InvalidDescriptor("total block count overflows int64")
