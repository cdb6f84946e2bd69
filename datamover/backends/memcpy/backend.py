"""memcpy: DRAM <-> DRAM within one agent, on threads that release the GIL.

Three paths, picked per request: many equal small blocks between two regions
go through one numpy gather/scatter (one call for all blocks); a single
coalesced run is one numpy copy between views of the two regions; everything
else is a ``ctypes.memmove`` per coalesced run (one foreign call per
run). All copy with the GIL released. A one-part request of at most
``inline_bytes`` is copied inside ``post()``, on the caller's thread; larger
requests are split by bytes across threads, and their completion is a
``ReadFence`` (both sides are the caller's memory): each piece of a copy is
fenced, so ERR and ``release`` come only once no copy is writing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...descriptors import DescList, MemType, Registration
from ...descriptors.coalesce import first_cross_overlap
from ...errors import InvalidParameter, OverlappingDestination
from ...units import size_text
from ..base import (
    Backend,
    BackendHost,
    Completion,
    Op,
    TransferRequest,
    finished_completion,
    run_inline,
    run_parts,
    split_by_bytes,
)
from ..fence import ReadFence

_memmove = ctypes.memmove
_copyto = np.copyto


@dataclass(eq=False)
class MemcpyPlan:
    """How one request is copied: ``mode`` is "gather" (equal blocks, one numpy call per chunk), "row" (one run)
    or "memmove" (a call per run); ``ranges`` are the parts over rows (blocks for gather); ``fast`` the two views
    of an inline one-run request."""

    total: int = 0
    mode: str = "memmove"
    ranges: list[tuple[int, int]] | None = None
    inline: bool = False
    fast: tuple[np.ndarray, np.ndarray] | None = None
    # gather
    block: int = 0
    src_reg: Registration | None = None
    dst_reg: Registration | None = None
    src_off: np.ndarray | None = None
    dst_off: np.ndarray | None = None
    src_run: bool = False
    dst_run: bool = False
    views: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    # row
    row: tuple[np.ndarray, np.ndarray] | None = None
    # memmove
    src: list[int] | None = None
    dst: list[int] | None = None
    len: list[int] | None = None


class MemcpyBackend(Backend):
    """Host-memory copies between regions registered with the same agent."""

    name = "memcpy"
    pairs = frozenset({(MemType.DRAM, MemType.DRAM)})
    default_params = {
        "threads": min(4, os.cpu_count() or 1),
        # a request of at most this many bytes is copied inside post(), on the caller's thread: a thread hop
        # and a wake-up cost more than the copy (BENCHMARKS.md)
        "inline_bytes": 1 << 20,
        # each thread gets at least this many bytes
        "min_part_bytes": 4 << 20,
        # equal blocks up to this size use the numpy gather path
        "gather_max_block": 64 << 10,
        # the gather path works in chunks of this many bytes (bounds its temporary memory)
        "gather_chunk_bytes": 8 << 20,
        # a one-run copy on the pool goes in pieces of this many bytes: a cancel stops it at the next piece
        "row_piece_bytes": 64 << 20,
    }

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        if self.params["threads"] < 1:
            raise InvalidParameter(f"threads must be at least 1, got {self.params['threads']!r}", backend=self.name)
        self._pool = ThreadPoolExecutor(int(self.params["threads"]), thread_name_prefix="dm-memcpy")
        self._views: dict[tuple[int, int, bool], np.ndarray] = {}  # (region id, block, writeable) -> strided view

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, "ok"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        limit = size_text(cls.default_params["inline_bytes"])
        return {
            "inline": f"post() copies requests of <= {limit} on the caller's thread (param inline_bytes); "
            "larger ones are split across the pool"
        }

    def plan(self, req: TransferRequest) -> MemcpyPlan:
        _refuse_crossed_rows(req, self.name)
        if req.one_region:
            p = self._plan_one_region(req)
            if p is not None:
                return p
        src, dst = req.src, req.dst
        n = len(src)
        ln = src.length
        total = int(ln.sum()) if n else 0
        p = MemcpyPlan()
        p.total = total
        src_regs, dst_regs = req.src_regions, req.dst_regions
        single_pair = n > 1 and (src_regs == src_regs[0]).all() and (dst_regs == dst_regs[0]).all()
        block = int(ln.min()) if n else 0
        if single_pair and 0 < block <= self.params["gather_max_block"] and not (ln % block).any():
            # coalesced runs of equal blocks are cut back into blocks for one numpy gather
            sreg = req.registrations[int(src_regs[0])]
            dreg = req.registrations[int(dst_regs[0])]
            p.mode = "gather"
            p.block = block
            p.src_reg, p.dst_reg = sreg, dreg
            counts = ln // block
            nblocks = int(counts.sum())
            if nblocks == n:  # nothing was coalesced: one block per row
                p.src_off = src.addr - sreg.addr
                p.dst_off = dst.addr - dreg.addr
            else:
                within = np.arange(nblocks, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
                within *= block
                p.src_off = np.repeat(src.addr - sreg.addr, counts) + within
                p.dst_off = np.repeat(dst.addr - dreg.addr, counts) + within
            p.src_run = bool((p.src_off[1:] - p.src_off[:-1] == block).all())
            p.dst_run = bool((p.dst_off[1:] - p.dst_off[:-1] == block).all())
            p.views = (sreg.array, dreg.array, self._strided(sreg, block, False), self._strided(dreg, block, True))
            if nblocks != n:
                ln = np.full(nblocks, block, dtype=np.int64)
        elif n == 1:
            # one run: a numpy copy between views of the two regions (GIL released, no ctypes call)
            sreg = req.registrations[int(src_regs[0])]
            dreg = req.registrations[int(dst_regs[0])]
            s0, d0 = int(src.addr[0]) - sreg.addr, int(dst.addr[0]) - dreg.addr
            p.mode = "row"
            p.row = (dreg.array[d0 : d0 + total], sreg.array[s0 : s0 + total])
        else:
            p.mode = "memmove"
            p.src, p.dst, p.len = src.addr.tolist(), dst.addr.tolist(), ln.tolist()
        threads = int(self.params["threads"]) if total > self.params["inline_bytes"] else 1
        rows = int(ln.shape[0])
        p.ranges = (
            [(0, rows)] if threads == 1 and rows else split_by_bytes(ln, threads, int(self.params["min_part_bytes"]))
        )
        p.inline = len(p.ranges) <= 1 and total <= self.params["inline_bytes"]
        p.fast = p.row if p.inline and p.mode == "row" else None
        return p

    def _plan_one_region(self, req: TransferRequest) -> MemcpyPlan | None:
        """``plan`` of equal blocks from one region into one region: the gather, from the lists' facts.

        Merged rows are gathered as the caller's blocks. None when the general ``plan`` must decide
        (unequal or large blocks, one row, many bytes).
        """
        src, dst = req.src, req.dst
        local, remote = req.caller_local, req.caller_remote
        if local is not None and remote is not None:
            src, dst = (local, remote) if req.op is Op.WRITE else (remote, local)
        n, block = len(src), src.block
        if n < 2 or not block or block > self.params["gather_max_block"]:
            return None
        total = n * block
        if total > self.params["inline_bytes"]:
            return None
        sreg = req.registrations[int(req.src_regions[0])]
        dreg = req.registrations[int(req.dst_regions[0])]
        p = MemcpyPlan()
        p.total, p.mode, p.block = total, "gather", block
        p.src_reg, p.dst_reg = sreg, dreg
        p.src_off = src.addr - sreg.addr
        p.dst_off = dst.addr - dreg.addr
        p.src_run = _is_run(src)
        p.dst_run = _is_run(dst)
        p.views = (sreg.array, dreg.array, self._strided(sreg, block, False), self._strided(dreg, block, True))
        p.ranges = [(0, n)]
        p.inline = True
        return p

    def _strided(self, reg: Registration, block: int, writeable: bool) -> np.ndarray:
        """``reg`` as overlapping rows of ``block`` bytes, row k starting at byte k (made once per region and size)."""
        key = (reg.id, block, writeable)
        view = self._views.get(key)
        if view is None:
            arr = reg.array
            view = as_strided(arr, shape=(arr.shape[0] - block + 1, block), strides=(1, 1), writeable=writeable)
            self._views[key] = view
        return view

    def deregister(self, reg: Registration, handle: Any) -> None:
        for key in [k for k in list(self._views) if k[0] == reg.id]:
            self._views.pop(key, None)

    def post(self, req: TransferRequest) -> Completion:
        p = req.plan
        fast = p.fast
        if fast is not None:
            # one small run: the copy and nothing else, and post() returns DONE
            try:
                fast[0][...] = fast[1]
                return finished_completion()
            except Exception:
                pass  # run_inline below does it again and turns the failure into a typed error
        mode = p.mode
        work = self._row if mode == "row" else self._gather if mode == "gather" else self._memmove
        if p.inline:
            # one small part: copy it here, and post() returns DONE without waking a thread
            return run_inline(p.ranges, work, p, backend=self.name)
        # the copies write into the caller's memory: once cancelled (timed out, released) the fence waits for
        # the piece being copied, and no later one starts
        return run_parts(self._pool, p.ranges, partial(work, p), backend=self.name, completion_type=ReadFence)

    def _row(self, p: MemcpyPlan, start: int, stop: int, completion: Completion) -> None:
        dst, src = p.row
        enter, leave = _gate(completion)
        step = max(1, int(self.params["row_piece_bytes"]))
        pieces = range(0, max(1, dst.shape[0]), step)
        if dst.ctypes.data > src.ctypes.data:
            pieces = reversed(pieces)  # as memmove: a destination overlapping the source's tail is copied from the back
        for a in pieces:
            if not enter():
                return
            try:
                _copyto(dst[a : a + step], src[a : a + step])
            finally:
                leave()

    def _gather(self, p: MemcpyPlan, start: int, stop: int, completion: Completion) -> None:
        """Equal blocks in one numpy call per chunk; a contiguous side is used in place (no temporary)."""
        block = p.block
        sarr, darr, srows, drows = p.views
        src_off, dst_off = p.src_off, p.dst_off
        step = max(1, int(self.params["gather_chunk_bytes"]) // block)
        enter, leave = _gate(completion)
        for a in range(start, stop, step):
            if not enter():
                return
            b = min(stop, a + step)
            try:
                if p.src_run:
                    s0 = int(src_off[a])
                    drows[dst_off[a:b]] = sarr[s0 : s0 + (b - a) * block].reshape(b - a, block)
                elif p.dst_run:
                    # np.take would first copy the whole overlapping strided source; fancy indexing gathers
                    # only the rows asked for, into a temporary of at most gather_chunk_bytes
                    d0 = int(dst_off[a])
                    darr[d0 : d0 + (b - a) * block].reshape(b - a, block)[...] = srows[src_off[a:b]]
                else:
                    drows[dst_off[a:b]] = srows[src_off[a:b]]
            finally:
                leave()

    @staticmethod
    def _memmove(p: MemcpyPlan, start: int, stop: int, completion: Completion) -> None:
        src, dst, ln = p.src, p.dst, p.len
        step = 64
        enter, leave = _gate(completion)
        for base in range(start, stop, step):
            if not enter():
                return
            try:
                for i in range(base, min(base + step, stop)):
                    _memmove(dst[i], src[i], ln[i])
            finally:
                leave()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _nothing() -> None:
    pass


def _gate(completion: Completion) -> tuple[Callable[[], bool], Callable[[], None]]:
    """``enter``/``leave`` around each piece of a copy: the fence's on the pool, a cancel check inline."""
    if type(completion) is ReadFence:
        return completion.enter, completion.leave
    return (lambda: not completion.cancelled), _nothing


def _refuse_crossed_rows(req: TransferRequest, backend: str) -> None:
    """Refuse rows whose sources overlap destinations: one run is copied as memmove copies, but several are
    copied in no set order (across threads, in blocks, or all gathered first), so what would land depends on it."""
    src, dst = req.src, req.dst
    if len(src) < 2:
        return
    sb, db = src.bounds, dst.bounds
    if sb is None or db is None or sb[0] >= db[1] or db[0] >= sb[1]:
        return
    pair = first_cross_overlap(src, dst)
    if pair is None:
        return
    i, j = pair
    first = max(int(src.addr[i]), int(dst.addr[j]))  # the first byte both rows name
    raise OverlappingDestination(
        f"destination overlaps source descriptor {req.caller_index(i, first - int(src.addr[i]))}: the rows of a"
        " copy of more than one run are copied in no set order, so what would land there depends on it",
        index=req.caller_index(j, first - int(dst.addr[j])),
        backend=backend,
    )


def _is_run(descs: DescList) -> bool:
    """Whether the rows follow each other in order, one contiguous range (the list's ``adjacent`` facts)."""
    return np.count_nonzero(descs.adjacent) == len(descs) - 1
