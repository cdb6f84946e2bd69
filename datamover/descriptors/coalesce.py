"""Coalescing: merge descriptor pairs that are contiguous on both sides of a transfer."""

from __future__ import annotations

import numpy as np

from .desclist import SMALL_LIST, DescList


def coalesce_runs(
    a: DescList,
    b: DescList,
    a_regions: np.ndarray | None,
    b_regions: np.ndarray | None,
    *,
    one_region: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Start index and byte length of each run of rows contiguous in both ``a`` and ``b``.

    Row i joins row i-1 when it starts where i-1 ends on both sides, on the
    same device and within the same registered region. Vectorized: O(N) numpy.
    ``one_region`` says each side lies in one region on one device (the caller
    checked), so only addresses are compared (and the region ids may be None).
    """
    n = len(a)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ln = a.length
    block = a.block
    if one_region and n > 1 and block is not None and block == b.block:
        # equal blocks on both sides: nothing joins when no row follows its predecessor on both sides
        if not np.count_nonzero(a.adjacent & b.adjacent):
            return _arange(n), ln
    brk = np.ones(n, dtype=bool)
    if n > 1:
        la, lb, head = a.addr, b.addr, ln[:-1]
        cont = (la[1:] == la[:-1] + head) & (lb[1:] == lb[:-1] + head)
        if one_region:
            if not cont.any():
                return np.arange(n, dtype=np.int64), ln
        else:
            cont &= (a.dev[1:] == a.dev[:-1]) & (b.dev[1:] == b.dev[:-1])
            cont &= (a_regions[1:] == a_regions[:-1]) & (b_regions[1:] == b_regions[:-1])
        brk[1:] = ~cont
    starts = np.flatnonzero(brk)
    lengths = np.add.reduceat(ln, starts) if starts.shape[0] < n else ln.copy()
    return starts, lengths


def caller_index_at(first_index: np.ndarray, lengths: np.ndarray | None, row: int, offset: int) -> int:
    """The caller's index of the descriptor holding byte ``offset`` of coalesced row ``row``.

    ``first_index`` are the runs' first rows (``coalesce_runs``), ``lengths``
    the caller's descriptor lengths before merging (None: nothing merged).
    Zero-length descriptors are skipped over (they hold no byte); a run of
    only zero-length ones names its last.
    """
    first = int(first_index[row])
    if lengths is None:
        return first
    stop = int(first_index[row + 1]) if row + 1 < first_index.shape[0] else int(lengths.shape[0])
    ends = np.cumsum(lengths[first:stop])
    return first + min(int(np.searchsorted(ends, offset, side="right")), stop - first - 1)


def take_runs(descs: DescList, starts: np.ndarray, lengths: np.ndarray) -> DescList:
    """The coalesced list: each run's first row with its summed length."""
    if starts.shape[0] == len(descs):
        return descs
    rows = np.empty((starts.shape[0], 3), dtype=np.int64, order="F")
    rows[:, 0] = descs.addr[starts]
    rows[:, 1] = lengths
    rows[:, 2] = descs.dev[starts]
    rows.setflags(write=False)
    return DescList.wrap(rows, descs.mem_type, descs.keys, descs.owners)


def first_overlap(descs: DescList) -> tuple[int, int] | None:
    """Indices of two non-empty descriptors whose byte ranges overlap, or None. O(N log N)."""
    n = len(descs)
    if n < 2:
        return None
    block = descs.block
    if block and descs.device is not None:
        # equal non-empty blocks on one device: they overlap only where two starts are under a block apart
        start = descs.sorted_addr if n <= SMALL_LIST else np.sort(descs.addr)
        if int(np.minimum.reduce(start[1:] - start[:-1])) >= block:
            return None
    addr, length, dev = descs.addr, descs.length, descs.dev
    if int(length.min()) > 0 and (dev == dev[0]).all():
        # the usual case (no empty rows, one device): one sort, and the general path only to name a pair
        order = np.argsort(addr)
        start = addr[order]
        if not (start[1:] < np.maximum.accumulate(start + length[order])[:-1]).any():
            return None
    nonempty = np.flatnonzero(descs.length > 0)
    if nonempty.shape[0] < 2:
        return None
    addr, length, dev = descs.addr[nonempty], descs.length[nonempty], descs.dev[nonempty]
    for d in np.unique(dev):
        sel = np.flatnonzero(dev == d)
        if sel.shape[0] < 2:
            continue
        order = sel[np.argsort(addr[sel], kind="stable")]
        start, end = addr[order], addr[order] + length[order]
        reach = np.maximum.accumulate(end)
        bad = start[1:] < reach[:-1]
        if bad.any():
            k = int(np.flatnonzero(bad)[0]) + 1
            j = int(order[k])
            i = int(order[int(np.flatnonzero(end[:k] > start[k])[0])])
            a, b = sorted((int(nonempty[i]), int(nonempty[j])))
            return a, b
    return None


def first_cross_overlap(src: DescList, dst: DescList) -> tuple[int, int] | None:
    """Indices (source row, destination row) of a non-empty row of ``src`` and one of ``dst`` whose byte ranges
    overlap, or None; the first such source row. Devices are not compared (host addresses). O(N log N)."""
    block = src.block
    if block and block == dst.block:
        # equal blocks (the usual case): a pair overlaps only where a source starts under a block from the
        # nearest destination start on either side; the sorted starts are facts of the lists
        d, s = dst.sorted_addr, src.sorted_addr
        m = d.shape[0]
        nxt = np.searchsorted(d, s, side="right")
        before = (nxt > 0) & (d[np.maximum(nxt - 1, 0)] + block > s)
        after = (nxt < m) & (d[np.minimum(nxt, m - 1)] < s + block)
        if not (before | after).any():
            return None
    s_keep, d_keep = np.flatnonzero(src.length > 0), np.flatnonzero(dst.length > 0)
    if not s_keep.shape[0] or not d_keep.shape[0]:
        return None
    order = d_keep[np.argsort(dst.addr[d_keep], kind="stable")]
    d_start = dst.addr[order]
    d_end = d_start + dst.length[order]
    reach = np.maximum.accumulate(d_end)
    s_start = src.addr[s_keep]
    s_end = s_start + src.length[s_keep]
    last = np.searchsorted(d_start, s_end, side="left") - 1  # the last destination starting before each source ends
    hit = (last >= 0) & (reach[np.maximum(last, 0)] > s_start)
    if not hit.any():
        return None
    i = int(s_keep[int(np.flatnonzero(hit)[0])])
    a, e = int(src.addr[i]), int(src.addr[i]) + int(src.length[i])
    j = int(order[int(np.flatnonzero((d_start < e) & (d_end > a))[0])])
    return i, j


_ARANGES: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """A read-only ``arange(n)`` (int64), made once per ``n`` for small ``n``."""
    out = _ARANGES.get(n)
    if out is None:
        out = np.arange(n, dtype=np.int64)
        out.setflags(write=False)
        if n <= 4096 and len(_ARANGES) < 256:
            _ARANGES[n] = out
    return out
