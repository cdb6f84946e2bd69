"""RegionTable: vectorized lookup of descriptors in a set of registered regions."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..errors import InvalidDescriptor, NotRegistered
from .desclist import DescList
from .memtype import MemType


class RegionTable:
    """Regions of one owner, sorted per (memory type, device) for ``np.searchsorted``.

    ``lookup`` maps a whole DescList to region ids in O(N log R) numpy work and
    names the first descriptor that falls outside every region.
    """

    def __init__(self, entries: Iterable[tuple[MemType, int, int, int, int]] = ()) -> None:
        groups: dict[tuple[MemType, int], list[tuple[int, int, int]]] = {}
        for mem_type, dev, start, length, rid in entries:
            groups.setdefault((MemType.parse(mem_type), int(dev)), []).append((int(start), int(length), int(rid)))
        self._groups: dict[tuple[MemType, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for key, rows in groups.items():
            arr = np.array(sorted(rows), dtype=np.int64).reshape(-1, 3)
            starts, lengths, ids = arr[:, 0], arr[:, 1], arr[:, 2]
            ends = starts + lengths
            if arr.shape[0] > 1 and (starts[1:] < ends[:-1]).any():
                i = int(np.flatnonzero(starts[1:] < ends[:-1])[0])
                raise InvalidDescriptor(
                    f"regions {int(ids[i])} and {int(ids[i + 1])} overlap on {key[0]} device {key[1]}"
                )
            self._groups[key] = (starts, ends, ids)

    @classmethod
    def from_columns(
        cls,
        types: tuple[MemType, ...],
        codes: np.ndarray,
        dev: np.ndarray,
        start: np.ndarray,
        length: np.ndarray,
        ids: np.ndarray,
    ) -> RegionTable:
        """The table of rows given as columns (``types[codes[i]]`` is row i's memory type): O(N log N) numpy."""
        self = cls()
        if codes.shape[0] == 0:
            return self
        order = np.lexsort((start, dev, codes))
        c, d, st, ln, ids = codes[order], dev[order], start[order], length[order], ids[order]
        cut = np.flatnonzero((c[1:] != c[:-1]) | (d[1:] != d[:-1])) + 1
        bounds = [0, *cut.tolist(), c.shape[0]]
        for a, b in zip(bounds[:-1], bounds[1:]):
            key = (types[int(c[a])], int(d[a]))
            starts, ends, gids = st[a:b].copy(), st[a:b] + ln[a:b], ids[a:b].copy()
            if b - a > 1 and (starts[1:] < ends[:-1]).any():
                i = int(np.flatnonzero(starts[1:] < ends[:-1])[0])
                raise InvalidDescriptor(
                    f"regions {int(gids[i])} and {int(gids[i + 1])} overlap on {key[0]} device {key[1]}"
                )
            self._groups[key] = (starts, ends, gids)
        return self

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in self._groups.values())

    def __len__(self) -> int:
        return sum(g[0].shape[0] for g in self._groups.values())

    def overlapping(self, mem_type: MemType, dev: int, start: int, length: int) -> int | None:
        """The id of a region overlapping [start, start+length), or None."""
        group = self._groups.get((mem_type, dev))
        if group is None:
            return None
        starts, ends, ids = group
        hit = (starts < start + max(length, 1)) & (ends > start)
        return int(ids[np.flatnonzero(hit)[0]]) if hit.any() else None

    def lookup_one(self, descs: DescList) -> int | None:
        """The id of the one region holding every descriptor, or None (then ``lookup`` says which and where).

        The usual case, a KV pool registered as one region, from the list's own facts (``device``,
        ``bounds``: worked out once per list) and one search.
        """
        d0 = descs.device  # None for an empty list too
        if d0 is None:
            return None
        group = self._groups.get((descs.mem_type, d0))
        if group is None:
            return None
        starts, ends, ids = group
        lo, hi = descs.bounds  # type: ignore[misc]
        k = starts.searchsorted(lo, side="right").item() - 1
        if k < 0:
            return None
        end = ends.item(k)
        # (a region starting right at ``end`` would own an empty descriptor there: left to ``lookup``)
        if hi < end or (hi == end and (k + 1 == starts.shape[0] or starts.item(k + 1) > end)):
            return ids.item(k)
        return None

    def lookup(self, descs: DescList, *, owner: str, backend: str | None = None) -> np.ndarray:
        """Region id of every descriptor; raises NotRegistered for the first outside all regions."""
        n = len(descs)
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        rid = self.lookup_one(descs)
        if rid is not None:
            out[:] = rid
            return out
        addr, length, dev = descs.addr, descs.length, descs.dev
        d0 = int(dev[0])
        if (dev == d0).all():
            parts = [(d0, None)]
        else:
            parts = [(int(d), np.flatnonzero(dev == d)) for d in np.unique(dev)]
        for d, sel in parts:
            a = addr if sel is None else addr[sel]
            ln = length if sel is None else length[sel]
            group = self._groups.get((descs.mem_type, d))
            if group is None:
                first = 0 if sel is None else int(sel[0])
                raise NotRegistered(
                    f"{owner} has no {descs.mem_type} memory registered on device {d}", index=first, backend=backend
                )
            starts, ends, ids = group
            pos = np.searchsorted(starts, a, side="right") - 1
            ok = pos >= 0
            posc = np.maximum(pos, 0)
            ok &= a + ln <= ends[posc]
            if not ok.all():
                k = int(np.flatnonzero(~ok)[0])
                i = k if sel is None else int(sel[k])
                raise NotRegistered(
                    f"{descs.mem_type} range [{int(a[k]):#x}, +{int(ln[k])}) on device {d} "
                    f"is outside every region {owner} registered",
                    index=i,
                    backend=backend,
                )
            if sel is None:
                out[:] = ids[posc]
            else:
                out[sel] = ids[posc]
        return out
