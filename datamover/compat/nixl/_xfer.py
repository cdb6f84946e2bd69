"""The binding agent's transfers: prepared lists (plain and strided), requests, posting, state, telemetry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...agents import Prepared, Transfer, XferState
from ...backends import get_backend_class
from ...descriptors import DescList, StridedDescList
from ...errors import DatamoverError, NotRegistered
from ._dlists import nixlRemoteDList, nixlXferDList
from ._errors import (
    NixlError,
    nixl_errors,
    nixlBackendError,
    nixlInvalidParamError,
    nixlNotAllowedError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRepostActiveError,
    status_of,
    translate,
)
from ._telemetry import nixlXferTelemetry
from ._types import (
    NIXL_INIT_AGENT,
    as_bytes,
    as_name,
    datamover_backend_name,
    mem_of,
    nixl_cost_t,
    nixl_status_t,
    nixl_xfer_op_t,
)


@dataclass
class PreppedList:
    """A list validated by prepXferDlist: plain (``prepared``) or runs of blocks (``strided``)."""

    peer: str | None  # None: this agent
    local: bool  # prepared as the initiator's side (NIXL_INIT_AGENT)
    prepared: Prepared | None
    strided: StridedDescList | None

    def __len__(self) -> int:
        return len(self.prepared) if self.prepared is not None else len(self.strided)  # type: ignore[arg-type]


@dataclass
class XferReq:
    """A transfer request: the datamover Transfer and what re-making it with a new notification needs."""

    xfer: Transfer
    remake: Any  # callable(notify) -> Transfer
    notify: bytes
    prepped: bool  # from makeXferReq (descCount counts merged descriptors, as NIXL's does)
    reported: bool = False  # this post's telemetry events were emitted


def _op(operation: Any) -> str:
    if isinstance(operation, nixl_xfer_op_t):
        return "WRITE" if operation == nixl_xfer_op_t.NIXL_WRITE else "READ"
    op = str(operation).upper()
    if op not in ("WRITE", "READ"):
        raise nixlInvalidParamError(f"operation must be NIXL_WRITE or NIXL_READ, got {operation!r}")
    return op


class XferMixin:
    """prepXferDlist, makeXferReq, createXferReq, postXferReq, getXferStatus, getXferTelemetry, ..."""

    agent: Any
    name: str
    _handles: dict[int, Any]
    _telemetry_on: bool
    _events: Any
    _cost: dict[str, tuple[float, float]]

    # -- descriptor lists ----------------------------------------------------
    def _peer(self, agent_name: Any) -> str | None:
        """None for this agent (loopback or local side), else the remote agent's name."""
        name = as_name(agent_name)
        return None if name in ("", NIXL_INIT_AGENT, self.name) else name

    def _prepare_rows(self, dl: DescList, peer: str | None) -> Prepared:
        """Validate ``dl`` against this agent's registrations or a peer's metadata. A peer's descriptors that
        metadata fetched from its listener does not cover trigger one refetch from there (it may have registered
        them since); metadata pushed to us, or loaded as bytes, has nowhere to be refetched from."""
        with nixl_errors():
            if peer is None:
                return self.agent.prepare(self._own_side(dl))  # type: ignore[attr-defined]
            try:
                return self.agent.prepare(dl, peer)
            except NotRegistered:
                if peer not in self.agent.remotes:
                    raise
                try:
                    self.agent.refresh_remote(peer)
                except (KeyError, DatamoverError):
                    pass
            return self.agent.prepare(dl, peer)

    def prepXferDlist(self, agent_name: Any, *args: Any) -> int:
        """Validate a list once: ``(agent_name, nixlXferDList, backends)`` or, for NIXL 1.5's strided
        lists, ``(agent_name, mem_type, Nx5 array, backends)``; returns the prepared list's handle."""
        if len(args) >= 2 and isinstance(args[1], np.ndarray):
            mem, rows = mem_of(args[0]), args[1]
            self._backend_names(args[2] if len(args) > 2 else ())  # type: ignore[attr-defined]
            with nixl_errors():
                strided = StridedDescList(rows, mem)
            return self._new_handle(self._prep_strided(as_name(agent_name), strided))  # type: ignore[attr-defined]
        descs = args[0]
        self._backend_names(args[1] if len(args) > 1 else ())  # type: ignore[attr-defined]
        if not isinstance(descs, nixlXferDList):
            raise TypeError(f"prepXferDlist takes a nixlXferDList, got {type(descs).__name__}")
        name = as_name(agent_name)
        peer = self._peer(name)
        pl = PreppedList(peer, name in ("", NIXL_INIT_AGENT), self._prepare_rows(descs.descs, peer), None)
        return self._new_handle(pl)  # type: ignore[attr-defined]

    def _prep_strided(self, name: str, strided: StridedDescList) -> PreppedList:
        """Check every run once (by its span; block by block only where a span crosses regions)."""
        peer = self._peer(name)
        try:
            self._prepare_rows(strided.spans(), peer)
        except NotRegistered:
            self._prepare_rows(strided.expand(), peer)
        return PreppedList(peer, name in ("", NIXL_INIT_AGENT), None, strided)

    def releasedDlistH(self, handle: int) -> None:
        """Free a prepared list's handle."""
        self._handles.pop(int(handle), None)

    def _prepped(self, handle: Any) -> PreppedList:
        pl = self._handles.get(int(handle)) if isinstance(handle, (int, np.integer)) else None
        if not isinstance(pl, PreppedList):
            raise nixlNotAllowedError(f"{handle!r} is not a live prepared descriptor list handle")
        return pl

    # -- requests --------------------------------------------------------------
    def makeXferReq(
        self,
        operation: Any,
        local_handle: int,
        local_indices: Any,
        remote_handle: int,
        remote_indices: Any,
        notif_msg: Any = b"",
        backends: Any = (),
        skip_desc_merge: bool = False,
    ) -> int:
        """A request from index lists (or 1-D int arrays) into two prepared lists; returns its handle."""
        op = _op(operation)
        only = self._backend_names(backends)  # type: ignore[attr-defined]
        lpl, rpl = self._prepped(local_handle), self._prepped(remote_handle)
        if not lpl.local:
            raise nixlInvalidParamError("the local side must be prepared with NIXL_INIT_AGENT")
        if rpl.local:
            raise nixlInvalidParamError("the remote side must be prepared with an agent's name, not NIXL_INIT_AGENT")
        if rpl.peer is not None and rpl.peer not in self.agent.remotes:
            raise nixlNotFoundError(f"the remote side was prepared for {rpl.peer!r}, which was removed since")
        li, ri = _indices(local_indices, "local_indices"), _indices(remote_indices, "remote_indices")
        if not len(li) or not len(ri):
            raise nixlInvalidParamError("make_prepped_xfer needs at least one index on each side")
        lp, li = self._side(lpl, li)
        rp, ri = self._side(rpl, ri)

        def remake(notify: bytes) -> Transfer:
            with nixl_errors():
                return self.agent.make_transfer(op, lp, li, rp, ri, notify=notify, backends=only)

        notify = as_bytes(notif_msg)
        return self._new_handle(XferReq(remake(notify), remake, notify, prepped=True))  # type: ignore[attr-defined]

    def _side(self, pl: PreppedList, idx: np.ndarray) -> tuple[Prepared, Any]:
        """The Prepared list and indices a transfer uses: a strided list's blocks are picked here."""
        if pl.prepared is not None:
            return pl.prepared, idx
        try:
            picked = pl.strided.select(idx)  # type: ignore[union-attr]
        except IndexError as exc:
            raise nixlInvalidParamError(str(exc)) from None
        return self._prepare_rows(picked, pl.peer), None

    def createXferReq(
        self,
        operation: Any,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: Any,
        notif_msg: Any = b"",
        backends: Any = (),
    ) -> int:
        """A request between two descriptor lists (``remote_agent`` may be this agent); returns its handle."""
        op = _op(operation)
        only = self._backend_names(backends)  # type: ignore[attr-defined]
        for what, d in (("local", local_descs), ("remote", remote_descs)):
            if not isinstance(d, nixlXferDList):
                raise TypeError(f"the {what} descriptors must be a nixlXferDList, got {type(d).__name__}")
        if as_name(remote_agent) == NIXL_INIT_AGENT:  # NIXL looks it up as a peer's name, and finds none
            raise nixlNotFoundError("remote_agent must name an agent (this one for loopback), not NIXL_INIT_AGENT")
        lp = self._prepare_rows(local_descs.descs, None)
        rp = self._prepare_rows(remote_descs.descs, self._peer(remote_agent))

        def remake(notify: bytes) -> Transfer:
            with nixl_errors():
                return self.agent.make_transfer(op, lp, None, rp, None, notify=notify, backends=only)

        notify = as_bytes(notif_msg)
        return self._new_handle(XferReq(remake(notify), remake, notify, prepped=False))  # type: ignore[attr-defined]

    def _req(self, handle: Any) -> XferReq:
        req = self._handles.get(int(handle)) if isinstance(handle, (int, np.integer)) else None
        if not isinstance(req, XferReq):
            raise nixlNotAllowedError(f"{handle!r} is not a live transfer request handle")
        return req

    def xfer_of(self, handle: Any) -> Transfer:
        """The datamover Transfer behind a request handle."""
        return self._req(handle).xfer

    def postXferReq(self, handle: int, notif_msg: Any = None) -> nixl_status_t:
        """Post a request; NIXL_SUCCESS when already done, NIXL_IN_PROG in flight; a failure raises, as NIXL's
        binding does (its ``throw_nixl_exception``): a post refused (the peer was removed, the request is in
        flight) raises before anything changes, a transfer failed at once raises its error's NIXL class.

        A non-empty ``notif_msg`` replaces the request's notification from this post on.
        """
        req = self._req(handle)
        if req.xfer.state == XferState.PROC:
            self._events.error(nixl_status_t.NIXL_ERR_REPOST_ACTIVE)
            raise nixlRepostActiveError("the transfer is still in flight; wait for DONE before posting it again")
        peer = req.xfer.request.remote_agent
        if peer is not None and peer not in self.agent.remotes:
            self._events.error(nixl_status_t.NIXL_ERR_NOT_FOUND)
            raise nixlNotFoundError(f"remote agent {peer!r} was removed; load its metadata again before posting")
        if notif_msg is not None and notif_msg != b"" and as_bytes(notif_msg) != req.notify:
            new = req.remake(as_bytes(notif_msg))
            req.xfer.release()
            req.xfer, req.notify = new, as_bytes(notif_msg)
        req.reported = False
        try:
            with nixl_errors():
                req.xfer.post()
        except DatamoverError as exc:
            self._events.error(status_of(exc))
            raise
        return self._status(req)

    def getXferStatus(self, handle: int) -> nixl_status_t:
        """NIXL_SUCCESS or NIXL_IN_PROG; a failed transfer raises its error as the NIXL class (nixlBackendError
        for I/O, nixlRemoteDisconnectError, ...), every time it is asked, as NIXL's binding does."""
        return self._status(self._req(handle))

    def _status(self, req: XferReq) -> nixl_status_t:
        state = req.xfer.state
        if state == XferState.INIT:
            self._events.error(nixl_status_t.NIXL_ERR_NOT_POSTED)
            raise nixlNotPostedError("the transfer was never posted; post it first")
        if state == XferState.PROC:
            return nixl_status_t.NIXL_IN_PROG
        if not req.reported:
            req.reported = True
            self._report(req)
        if state == XferState.DONE:
            return nixl_status_t.NIXL_SUCCESS
        raise _failure(req.xfer.error)

    def _report(self, req: XferReq) -> None:
        """Telemetry events of a finished post, and the cost model's update."""
        t = req.xfer.telemetry
        if req.xfer.state == XferState.DONE:
            post_us, xfer_us = self._times(t)
            self._events.transfer(req.xfer.op, int(t.bytes), xfer_us, post_us)
            if t.transfer_duration_s and t.bytes:
                bw, lat = self._cost.get(t.backend, (0.0, 0.0))
                sample = t.bytes / t.transfer_duration_s
                self._cost[t.backend] = (sample if not bw else 0.8 * bw + 0.2 * sample, lat or t.transfer_duration_s)
        else:
            self._events.error(status_of(req.xfer.error))

    @classmethod
    def _times(cls, t: Any) -> tuple[int, int]:
        """(post, transfer) durations in us; the transfer's includes its post, as NIXL's does."""
        post_us = cls._us(t.post_duration_s)
        if t.transfer_duration_s is None:
            return post_us, 0
        return post_us, max(post_us, cls._us(t.transfer_duration_s))

    @staticmethod
    def _us(seconds: float) -> int:
        """Whole microseconds, at least 1 for anything measured (NIXL's clock never reads 0 for a post)."""
        return max(1, math.ceil(seconds * 1e6)) if seconds > 0 else 0

    def getXferTelemetry(self, handle: int) -> nixlXferTelemetry:
        """Times (us), bytes and descriptor count of the last post; nixlNoTelemetryError when telemetry is off."""
        req = self._req(handle)
        if not self._telemetry_on:
            self._events.error(nixl_status_t.NIXL_ERR_NO_TELEMETRY)
            raise nixlNoTelemetryError("telemetry is off; set capture_telemetry=True or NIXL_TELEMETRY_ENABLE=y")
        if req.xfer.state == XferState.INIT:
            raise nixlNoTelemetryError("the transfer was never posted")
        t = req.xfer.telemetry
        post_us, xfer_us = self._times(t)
        return nixlXferTelemetry(
            startTime=int(t.start_time * 1e6),
            postDuration=post_us,
            xferDuration=xfer_us,
            totalBytes=int(t.bytes),
            descCount=int(t.rows if req.prepped else t.descriptors),
        )

    def queryXferBackend(self, handle: int) -> int:
        """The handle of the created backend the request runs on; where datamover moves the bytes with a backend
        NIXL has no plugin for (memcpy, DRAM -> DRAM in one agent), the created one that moves those memory
        types (NIXL's UCX does loopback itself). nixlNotFoundError when no created backend does."""
        xfer = self._req(handle).xfer
        name = xfer.backend.name
        created = self._handle_of  # type: ignore[attr-defined]
        for plugin, h in created.items():
            if datamover_backend_name(plugin) == name:
                return h
        pair = (xfer.request.local.mem_type, xfer.request.remote.mem_type)
        for plugin, h in created.items():
            try:
                cls = get_backend_class(datamover_backend_name(plugin))
            except DatamoverError:
                continue
            if pair in cls.pairs:
                return h
        raise nixlNotFoundError(f"no created backend moves {pair[0]} -> {pair[1]} (datamover runs it on {name!r})")

    def estimateXferCost(self, handle: int) -> tuple[int, int, nixl_cost_t]:
        """(duration us, error margin us, method): NIXL_COST_ANALYTICAL_BACKEND from this agent's measured
        throughput on that backend, NIXL_COST_UNKNOWN (0, 0) before any transfer on it."""
        req = self._req(handle)
        backend = req.xfer.backend.name
        nbytes = int(req.xfer.nbytes)
        bw, lat = self._cost.get(backend, (0.0, 0.0))
        if not bw:
            return 0, 0, nixl_cost_t.NIXL_COST_UNKNOWN
        est = lat + nbytes / bw
        return int(est * 1e6), int(est * 0.5e6), nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND

    def releaseXferReq(self, handle: int) -> None:
        """Free a request, aborting it (and waiting for the abort) when in flight."""
        req = self._handles.pop(int(handle), None)
        if isinstance(req, XferReq):
            req.xfer.release()

    # -- memory views (UCX GPU device API) -----------------------------------------
    def prepMemView(self, dlist: nixlXferDList | nixlRemoteDList, backends: Any = ()) -> int:
        raise nixlNotSupportedError("memory views need UCX's GPU device API, which datamover does not have")

    def releaseMemView(self, handle: int) -> None:
        raise nixlNotSupportedError("memory views need UCX's GPU device API, which datamover does not have")


def _failure(exc: BaseException | None) -> Exception:
    """A failed transfer's error as NIXL raises it: its NIXL class (and still its datamover class)."""
    if isinstance(exc, NixlError):
        return exc
    if isinstance(exc, DatamoverError):
        err = translate(exc)
        err.__cause__ = exc
        return err
    err = nixlBackendError(f"the transfer failed: {exc!r}" if exc is not None else "the transfer failed")
    err.__cause__ = exc
    return err


def _indices(idx: Any, what: str) -> np.ndarray:
    """Index lists as int64: NIXL's bindings take a list of ints or a 1-D integer array, never floats or strings
    (which numpy would truncate or parse into other blocks)."""
    arr = np.asarray(idx)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise nixlInvalidParamError(f"{what} must be a list or 1-D array of integers, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)
