"""Making transfers: descriptors validated against their owner's regions, coalesced, routed and planned."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import numpy as np

from ..backends.base import BackendHost, Op, TransferRequest
from ..descriptors import DescList, RegionTable
from ..descriptors.coalesce import coalesce_runs, first_overlap, take_runs
from ..errors import InvalidDescriptor, InvalidParameter, LengthMismatch, OverlappingDestination
from .backend_set import BackendSet
from .config import MAX_TIMEOUT_S, AgentConfig
from .peers import Peers
from .registry import Registry
from .transfer import Transfer


class Prepared:
    """A validated descriptor list: what ``make_transfer`` indexes into.

    ``agent`` is the owner's name (None for this agent); ``regions`` the
    region id of every descriptor, looked up once here; ``ident`` the identity
    of the owner's metadata they were looked up in.
    """

    __slots__ = ("agent", "descs", "ident", "regions")

    def __init__(self, descs: DescList, agent: str | None, regions: np.ndarray, ident: bytes | None = None) -> None:
        self.descs = descs
        self.agent = agent
        self.regions = regions
        self.ident = ident

    def __len__(self) -> int:
        return len(self.descs)

    def __repr__(self) -> str:
        return f"Prepared({self.descs!r}, agent={self.agent!r})"


class TransferMaker:
    """The three ways to a Transfer: ``prepare`` + ``make_transfer``, and the one-shot ``transfer``.

    All three check lengths and overlapping destinations, coalesce contiguous
    rows and let the chosen backend plan, in ``make``. The one-shot form
    remembers its last transfer per (lists, op, peer, ...) and, given the same
    immutable lists against the same regions and peer metadata, reuses it.
    """

    def __init__(
        self, host: BackendHost, config: AgentConfig, registry: Registry, peers: Peers, backends: BackendSet
    ) -> None:
        self._host = host
        self._config = config
        self._registry = registry
        self._peers = peers
        self._backends = backends
        self._oneshot: dict[tuple, _OneShot] = {}  # transfer()'s last transfer per (lists, op, ...), see there
        self._oneshot_lock = threading.Lock()

    def forget(self) -> None:
        """Drop the one-shot memory (regions or peer metadata changed)."""
        self._oneshot.clear()

    def prepare(self, descs: Any, agent: str | None) -> Prepared:
        descs = _as_desclist(descs)
        if agent is None or agent == self._host.name:
            return Prepared(descs, None, self._registry.lookup(descs))
        meta = self._peers.get(agent)
        return Prepared(descs, agent, self._peers.lookup(descs, agent), None if meta is None else meta.ident)

    def make_transfer(
        self,
        op: str,
        local: Prepared,
        local_idx: Any,
        remote: Prepared,
        remote_idx: Any,
        notify: bytes,
        backends: str | list[str] | None,
        timeout: float | None,
    ) -> Transfer:
        op = Op.parse(op)
        if local.agent is not None:
            raise InvalidDescriptor("the local list was prepared for a remote agent")
        if remote.agent is not None:
            self._peers.check_current(remote.agent, remote.ident)
        li = _index_array(local_idx, len(local), "local")
        ri = _index_array(remote_idx, len(remote), "remote")
        if li.shape[0] != ri.shape[0]:
            raise LengthMismatch(f"{li.shape[0]} local descriptor(s) but {ri.shape[0]} remote")
        ldescs = local.descs if li.shape[0] == len(local) and _is_identity(li) else local.descs[li]
        rdescs = remote.descs if ri.shape[0] == len(remote) and _is_identity(ri) else remote.descs[ri]
        return self.make(
            op, ldescs, local.regions[li], rdescs, remote.regions[ri], remote.agent, notify, backends, timeout,
            remote.ident,
        )  # fmt: skip

    def make(
        self,
        op: Op,
        ldescs: DescList,
        lreg: np.ndarray | int,
        rdescs: DescList,
        rreg: np.ndarray | int,
        remote_agent: str | None,
        notify: bytes,
        backends: str | list[str] | None,
        timeout: float | None,
        remote_ident: bytes | None = None,
    ) -> Transfer:
        """The transfer of validated, looked-up descriptors: what ``make_transfer`` and ``transfer`` share.

        ``lreg``/``rreg`` are each descriptor's region id, or one id for a side that lies in one region
        on one device (then coalescing skips those checks, and the request says ``one_region``);
        ``remote_ident`` the identity of the peer's metadata ``rreg`` came from.
        """
        n = len(ldescs)
        if len(rdescs) != n:
            raise LengthMismatch(f"{n} local descriptor(s) but {len(rdescs)} remote")
        block = ldescs.block
        if block is None or block != rdescs.block:
            diff = ldescs.length != rdescs.length
            if diff.any():
                i = int(np.flatnonzero(diff)[0])
                raise LengthMismatch(
                    f"local length {int(ldescs.length[i])} != remote length {int(rdescs.length[i])}", index=i
                )
        backend = self._backends.choose(ldescs.mem_type, rdescs.mem_type, remote_agent is not None, backends)
        pair = first_overlap(rdescs if op is Op.WRITE else ldescs)
        if pair is not None:
            raise OverlappingDestination(
                f"destination overlaps destination descriptor {pair[0]}", index=pair[1], backend=backend.name
            )
        one_region = type(lreg) is int
        if one_region:
            starts, lengths = coalesce_runs(ldescs, rdescs, None, None, one_region=True)  # type: ignore[arg-type]
            runs = starts.shape[0]
            local_regions, remote_regions = _same(runs, lreg), _same(runs, rreg)  # type: ignore[arg-type]
        else:
            starts, lengths = coalesce_runs(ldescs, rdescs, lreg, rreg)  # type: ignore[arg-type]
            local_regions, remote_regions = lreg[starts], rreg[starts]  # type: ignore[index]
        merged = starts.shape[0] < n
        try:
            seconds = float(self._config.timeout_s if timeout is None else timeout)
        except (TypeError, ValueError):
            seconds = math.nan
        if not 0.0 < seconds <= MAX_TIMEOUT_S:
            raise InvalidParameter(
                f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout!r}", backend=backend.name
            )
        own = (local_regions, remote_regions) if remote_agent is None else (local_regions,)
        if one_region:
            own_ids = tuple(dict.fromkeys(int(r[0]) for r in own if r.shape[0]))
        else:
            own_ids = tuple(int(r) for r in np.unique(np.concatenate(own)))
        req = TransferRequest(
            op=op,
            local=take_runs(ldescs, starts, lengths),
            remote=take_runs(rdescs, starts, lengths),
            remote_agent=remote_agent,
            local_regions=local_regions,
            remote_regions=remote_regions,
            registrations=self._registry.regions,
            first_index=starts,
            caller_lengths=ldescs.length if merged else None,
            caller_local=ldescs if merged else None,
            caller_remote=rdescs if merged else None,
            notify=bytes(notify),
            timeout=seconds,
            one_region=one_region,
            own_regions=own_ids,
            remote_ident=remote_ident,
        )
        req.plan = backend.plan(req)
        return Transfer(self._host, backend, req, descriptors=n, tracker=self._registry, peers=self._peers)

    def transfer(
        self,
        op: str,
        local: Any,
        remote: Any,
        agent: str | None,
        notify: bytes,
        backends: str | list[str] | None,
        timeout: float | None,
    ) -> Transfer:
        """Validate both sides, make the transfer and post it (see ``Agent.transfer``)."""
        op = Op.parse(op)
        remote_agent = None if agent is None or agent == self._host.name else agent
        table = self._registry.table
        meta = None if remote_agent is None else self._peers.get(remote_agent)
        key, by_rows = None, False
        if type(local) is DescList and type(remote) is DescList:
            # the same lists again (the same object, or for small lists the same rows), against the same
            # regions and peer metadata: the last transfer's validation, coalescing, backend and plan hold
            key, by_rows = _oneshot_key(local, remote, op, remote_agent, backends, notify, timeout)
            x = None
            with self._oneshot_lock:  # never held across a post: another thread's transfer() would wait on it
                hit = self._oneshot.get(key)
                if hit is not None and hit.table is table and hit.meta is meta and hit.holds(local, remote):
                    x = hit.last.fork()
                    if x is not None:
                        hit.last = x
            if x is not None:
                return x.post()
        ldescs, rdescs = _as_desclist(local), _as_desclist(remote)
        lrid = table.lookup_one(ldescs)
        if remote_agent is None:
            rrid = table.lookup_one(rdescs)
        else:
            rrid = None if meta is None else meta.table.lookup_one(rdescs)
        lreg: np.ndarray | int
        rreg: np.ndarray | int
        if lrid is not None and rrid is not None:  # each side inside one region: nothing more to look up
            lreg, rreg = lrid, rrid
        else:
            lreg = self._registry.lookup(ldescs)
            rreg = self._registry.lookup(rdescs) if remote_agent is None else self._peers.lookup(rdescs, remote_agent)
        ident = None if meta is None else meta.ident
        x = self.make(op, ldescs, lreg, rdescs, rreg, remote_agent, notify, backends, timeout, ident)
        if key is not None:
            entry = _OneShot(local, remote, by_rows, table, meta, x)
            with self._oneshot_lock:
                if table is self._registry.table:
                    if len(self._oneshot) >= _ONESHOT_CACHE:
                        self._oneshot.pop(next(iter(self._oneshot)))
                    self._oneshot[key] = entry
        return x.post()


class _OneShot:
    """``transfer``'s memory of one call: what it was checked against, its transfer, and (for a key by
    identity) the lists, weakly, so that a new list at a reused address is not taken for the old one."""

    __slots__ = ("last", "local", "meta", "remote", "table")

    def __init__(self, local: DescList, remote: DescList, by_rows: bool, table: RegionTable, meta: Any, last: Transfer):
        self.local = self.remote = None
        if not by_rows:
            self.local, self.remote = weakref.ref(local), weakref.ref(remote)
        self.table, self.meta, self.last = table, meta, last

    def holds(self, local: DescList, remote: DescList) -> bool:
        return self.local is None or (self.local() is local and self.remote() is remote)


#: how many distinct (lists, op, peer, ...) calls ``transfer`` remembers
_ONESHOT_CACHE = 64
#: lists of at most this many rows (and no owner objects) are remembered by their rows, not their identity
_BY_ROWS = 256


def _oneshot_key(
    local: DescList, remote: DescList, op: Op, agent: str | None, backends: Any, notify: bytes, timeout: Any
) -> tuple[tuple, bool]:
    """(key, by rows?): what ``transfer`` remembers a call by.

    Its arguments, with the two lists by their rows when small (the rows themselves, compared in full on a
    hash match: a list built anew with the same rows is the same call), or else by their identity.
    """
    only = backends if backends is None or isinstance(backends, str) else tuple(backends)
    head = (op, agent, only, bytes(notify), timeout)
    if len(local) <= _BY_ROWS and len(remote) <= _BY_ROWS and not local.owners and not remote.owners:
        lrows, rrows = local.rows.tobytes("A"), remote.rows.tobytes("A")
        return (*head, local.mem_type, local.keys, lrows, remote.mem_type, remote.keys, rrows), True
    return (*head, id(local), id(remote)), False


def _as_desclist(x: Any) -> DescList:
    return x if isinstance(x, DescList) else DescList.from_buffers(x)


def _index_array(idx: Any, n: int, what: str) -> np.ndarray:
    arr = np.arange(n, dtype=np.int64) if idx is None else np.asarray(idx)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidDescriptor(f"{what} indices must be a 1-D integer array")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        bad = int(np.flatnonzero((arr < 0) | (arr >= n))[0])
        raise InvalidDescriptor(f"{what} index {int(arr[bad])} is out of range for {n} prepared descriptors", index=bad)
    return arr


_SAME: dict[tuple[int, int], np.ndarray] = {}


def _same(n: int, rid: int) -> np.ndarray:
    """``n`` times region id ``rid`` (read-only; made once per (n, rid) for small ``n``)."""
    out = _SAME.get((n, rid))
    if out is None:
        out = np.empty(n, dtype=np.int64)
        out.fill(rid)
        out.setflags(write=False)
        if n <= 4096:
            if len(_SAME) >= 256:
                _SAME.clear()
            _SAME[(n, rid)] = out
    return out


def _is_identity(idx: np.ndarray) -> bool:
    return idx.shape[0] == 0 or (int(idx[0]) == 0 and bool((np.diff(idx) == 1).all()))
