"""One-sided RMA: rows checked against the target's rkeys, one put/get per row and one endpoint flush."""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import numpy as np

from ...descriptors import MemType
from ...errors import (
    DatamoverError,
)
from ..base import (
    TransferRequest,
)
from . import cma, rma, tcp_sockets
from .config import _DIRECT_GRACE_S, ucx_error
from .messages import Revoked
from .state import Direct, OutOp, Peer


class Columns(NamedTuple):
    """A prepared one-sided request as numpy columns: what a native poster reads instead of ctypes rows."""

    laddr: np.ndarray  # int64, local address per row
    length: np.ndarray  # int64
    raddr: np.ndarray  # int64, remote address per row, inside the region its rkey opens
    rkey: np.ndarray  # uint64, the unpacked ucp_rkey_h per row (valid on the endpoint it was planned for)
    host: bool  # every local row in host memory (device rows need their memh: ctypes rows only)


class Rows(list):
    """ctypes-ready rows (``rma.make_row``) with the same request as ``Columns``; ``native``: the same rows as
    the (n, 5) uint64 array the native path posts (``rma.native_rows``), where that path is active."""

    columns: Columns
    native: np.ndarray | None = None


class NativePoster(Protocol):
    """The seam a native data path plugs into (issue 16): post one put (get) per row of ``columns`` on endpoint
    ``ep`` (a ``ucp_ep_h``), in native code; return UCS_OK or the first error status. Completion stays the
    endpoint flush this path posts after it (polled by the waiter or the service thread)."""

    def __call__(self, get: bool, ep: int, columns: Columns) -> int: ...


#: a poster plugged in here takes precedence; None: rows go out through the native extension where it is active
#: (``rma.post_native``: rows and flush posted, and the flush driven, in C), else through ctypes, a call per row
native_post: NativePoster | None = None

_CORK_LOOKUPS = 3  # READs that look for the sockets to cork before a peer's endpoint is taken to have none


class OneSided:
    """One-sided RMA: rows checked against the target's rkeys, one put/get per row and one endpoint flush."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    def _finish_direct(self, direct: Direct, why: BaseException | None = None) -> bool:
        """Finish ``direct`` if its flush ended (or with ``why``); True once it is finished."""
        with direct.lock:
            if direct.done:
                return True
            status = rma.UCS_INPROGRESS if why is not None else direct.flush.poll()
            if why is None and status == rma.UCS_INPROGRESS:
                return False
            if why is not None:
                direct.flush.abandon()
                direct.abandoned = True
            direct.done = True
        if why is None and status == rma.UCS_OK:
            if direct.notify:
                self.b._submit(lambda: self.b._send_after(direct.peer, direct.notify))
            direct.completion.finish_part()
        else:
            direct.completion.finish_part(why or self._status_error(status, direct.peer))
        return True

    @staticmethod
    def _in_flight(direct: Direct) -> bool:
        """Whether ``direct`` is unfinished with its flush not ended: its puts or gets may still move bytes."""
        with direct.lock:
            return not direct.done and direct.flush.poll() == rma.UCS_INPROGRESS

    def _worker(self) -> Any:
        """The worker one-sided rows go through: the data worker where there is one, else ucxx's."""
        return self.b._data if self.b._data is not None else self.b._worker

    def _drive(self, direct: Direct) -> None:
        """A waiter's assist: progress UCX until the flush ends, or leave it to the service thread.

        It stops at the request's deadline, so the waiter can report the timeout.
        """
        worker, deadline, clock, gate = self._worker(), direct.deadline, time.monotonic, self.b._progress_gate
        spin, pause = self.b.pacing.drive_spin_s(direct.peer), self.b.pacing.drive_pause_s(direct.peer, direct.op)
        direct.driven = True
        self.b._drivers.add(direct)
        native = not isinstance(direct.flush, rma.Flush)
        # the native progress thread leaves the worker to this waiter meanwhile: a native flush holds it off
        # from its post on (so the post's own events woke nobody) until it ends or unhold()
        progress = None if native else self.b._progress
        if progress is not None:
            progress.hold()
        try:
            while not self._finish_direct(direct) and direct.peer.state == "ready" and not self.b._stop:
                # a replaced worker is never progressed again (it may be quarantined; see _reset_worker)
                # each slice holds the gate: the service thread cancels let-go requests between slices
                with gate:
                    if native:
                        if self._worker() is worker:
                            # in C, the GIL released, until the flush ends; slices of 10 ms to see a lost peer
                            direct.flush.drive(worker.handle, min(deadline, clock() + 0.01), spin, pause)
                    else:
                        while self._worker() is worker and worker.progress_once():
                            pass
                if clock() > deadline:
                    return
        finally:
            if progress is not None:
                progress.release()
            elif native and not direct.done:
                direct.flush.unhold()  # given up (deadline, lost peer, closing): the progress thread takes over
            direct.driven = False
            self.b._drivers.discard(direct)
            if direct.done:
                self._forget_direct(direct)
            if self.b._progress is None and not self.b._drivers:
                self.b._wake()  # the service thread sleeps in select while a waiter drives: UCX is its again

    def _forget_direct(self, direct: Direct) -> None:
        """Stop tracking a finished request (its waiter or the service thread, whichever sees it first)."""
        try:
            self.b._directs.remove(direct)
        except ValueError:
            pass

    def _check_directs(self) -> None:
        """Finish callers' requests nobody drives; those a waiter drives are left alone, except to clear them."""
        late = time.monotonic() - _DIRECT_GRACE_S
        for d in list(self.b._directs):
            if d.done:
                self._forget_direct(d)
            elif not d.driven and d.since < late:
                if self._finish_direct(d):
                    self._forget_direct(d)
                elif d.held():
                    d.flush.unhold()  # nobody waits for it: the native progress thread progresses it from now on

    def _one_sided_rows(self, peer: Peer, req: TransferRequest) -> list[rma.Row] | cma.CmaPlan | None:
        """(local addr, length, remote addr, rkey) per row when the target opened every row to put/get, else None.

        For a peer this process may attach to (``direct_cma``), DRAM rows come as one ``cma.CmaPlan`` instead.

        The rows are checked against the bounds the target itself sent with
        its rkeys (not only against its metadata), so a stale or forged blob
        falls back to the served path, where the owner refuses it.
        """
        with self.b._rma_lock:
            cached = req.plan.one_sided
            if cached is not None and cached[0] == peer.epoch:
                return cached[1]
            rows = self._check_rows(peer, req)
            req.plan.one_sided = (peer.epoch, rows)
            return rows

    def _check_rows(self, peer: Peer, req: TransferRequest) -> list[rma.Row] | cma.CmaPlan | None:
        direct = bool(peer.cma_pid) and req.local.mem_type == MemType.DRAM and req.remote.mem_type == MemType.DRAM
        if (
            not direct
            and not self.b._rma_native
            and len(req.local)
            and int(req.local.length.max()) > self.b._emulated_max
        ):
            return None
        rows = None
        uniq, inv = np.unique(req.remote_regions, return_inverse=True)
        entries = [peer.regions.get(r) for r in uniq.tolist()]
        if all(e is not None and e[0] == req.remote.mem_type.value for e in entries):
            dev, start, length = (np.array([e[k] for e in entries], dtype=np.int64)[inv] for k in (1, 2, 3))  # type: ignore[index]
            addr, n = req.remote.addr, req.remote.length
            if ((addr >= start) & (addr + n <= start + length) & (req.remote.dev == dev)).all():
                if direct:
                    # chunks small enough that every cma thread gets a few, large enough to keep syscalls few
                    threads, most = int(self.b.params["cma_threads"]), int(self.b.params["cma_chunk_bytes"])
                    chunk = min(most, max(1 << 20, int(n.sum()) // (4 * threads)))
                    return cma.CmaPlan(req.local.addr, addr, n, chunk)
                keys = np.array([self._rkey(peer, r) for r in uniq.tolist()], dtype=np.uint64)[inv]
                params = [self.b.mapped_regions.request_params.get(r) for r in req.local_regions.tolist()]
                cols = (req.local.addr.tolist(), n.tolist(), addr.tolist(), keys.tolist(), params)
                rows = Rows(map(rma.make_row, *cols))
                rows.columns = Columns(req.local.addr, n, addr, keys, all(p is None for p in params))
                if rma.native() is not None:
                    rows.native = rma.native_rows(req.local.addr, n, addr, keys, params)
        return rows

    def _rkey(self, peer: Peer, rid: int) -> int:
        rkey = peer.rkeys.get(rid)
        if rkey is None:
            packed, data = peer.regions[rid][4], self.b._data
            if data is not None:
                rkey = peer.rkeys[rid] = data.rkey_unpack(peer.data_ep, packed)
            else:
                rkey = peer.rkeys[rid] = rma.rkey_unpack(peer.ep.handle, packed)
        return rkey

    def _post_one_sided(self, peer: Peer, op: str, rows: list[rma.Row]) -> tuple[rma.Flush | None, int]:
        """Post every row's put (WRITE) or get (READ), then one flush; (flush, UCS_OK) or (None, the error)."""
        with self.b._rma_lock:
            data = self.b._data
            ep = peer.data_ep if data is not None else peer.ep.handle
            if data is not None or (
                native_post is None and isinstance(rows, Rows) and rows.native is not None and rma.native() is not None
            ):
                # native: every row and the flush posted in C, the GIL released; the flush is driven in C too
                self.b.counts["one-sided"] += 1
                cork = self._cork(peer) if op == "READ" and len(rows) >= self.b.pacing.read_cork_rows(peer) else None
                push = int(self.b.params["far_read_cork_push"])
                return rma.post_native(op == "READ", ep, rows.native, self.b._progress, cork, push, data)
            poster = native_post
            if poster is not None and isinstance(rows, Rows) and rows.columns.host:
                status = poster(op == "READ", ep, rows.columns)
            else:
                status = rma.post_rows(op == "READ", ep, rows)
            self.b.counts["one-sided"] += 1
            return (rma.Flush(ep) if status == rma.UCS_OK else None), status

    def _cork(self, peer: Peer) -> tuple[tuple[int, int], ...] | None:
        """The worker's tcp sockets to ``peer`` for a READ to cork while posted; looked up once per endpoint (UCX
        connects on its first send, so a lookup that finds none is tried again, up to _CORK_LOOKUPS times)."""
        data = self.b._data
        ep = peer.data_ep if data is not None else peer.ep.handle
        cached = peer.cork
        if cached is not None and cached[0] == ep and (cached[1] or cached[2] >= _CORK_LOOKUPS):
            return cached[1] or None
        misses = cached[2] if cached is not None and cached[0] == ep else 0
        efd = data.efd if data is not None else rma.native().worker_efd(self.b._worker.handle)
        found = tcp_sockets.sockets_to(efd, peer.ip) if peer.ip else ()
        peer.cork = (ep, found, misses + (not found))
        return found or None

    def _launch_one_sided(self, peer: Peer, op: OutOp, rows: list[rma.Row] | cma.CmaPlan) -> None:
        """A queued request's one-sided posts: done when the flush ends (direct cma: at once)."""
        if isinstance(rows, cma.CmaPlan):
            with self.b._rma_lock:  # before the handshake only: copied here, whatever its size
                error = self.b.cma_path._copy_cma(peer, op.req, rows, op.deadline)
            if error is None and op.req.notify:
                self.b._send_after(peer, op.req.notify)
            self.b.tagged._end(op, error)
            return
        flush, status = self._post_one_sided(peer, op.req.op, rows)
        if flush is None:
            self.b.tagged._end(op, self._status_error(status, peer))
            return
        # from here it is tracked like a request its caller posted directly
        peer.ops.pop(op.id, None)
        direct = Direct(peer, op.req, op.completion, flush, op.deadline)
        direct.since = 0.0  # its caller may be asleep in wait() already: no grace before the service thread polls
        if not self._finish_direct(direct):
            self.b._directs.append(direct)
            op.completion.set_assist(lambda: self._drive(direct))

    def _forget_region(self, peer: Peer, rid: int) -> None:
        """The target deregistered ``rid``: stop using its rkey, confirm once our operations on it ended."""
        with self.b._rma_lock:
            known = rid in peer.regions or rid in peer.rkeys
            if known:
                peer.regions = {k: v for k, v in peer.regions.items() if k != rid}
                peer.epoch = next(self.b._epochs)
                # covers every put/get posted before it, from any thread
                data = self.b._data
                flush = rma.native().flush(peer.data_ep, data) if data is not None else rma.Flush(peer.ep.handle)
        if not known:
            peer.conn.send(Revoked(rid))  # type: ignore[union-attr]
            return
        self.b._revokes.append((peer, rid, flush))
        self._check_revokes()

    def _check_revokes(self) -> None:
        for entry in list(self.b._revokes):
            peer, rid, flush = entry
            if flush.poll() == rma.UCS_INPROGRESS or self.b.cma_path._cma_copying(peer):
                continue
            self.b._revokes.remove(entry)
            with self.b._rma_lock:
                rkey = peer.rkeys.pop(rid, None)
                if rkey is not None:
                    self.b._destroy_rkey(rkey)
            if peer.conn is not None:
                peer.conn.send(Revoked(rid))

    def _status_error(self, status: int, peer: Peer) -> DatamoverError:
        return ucx_error(rma.UcpError(rma.status_text(status), status=status), peer.name, 0, self.b.name)
