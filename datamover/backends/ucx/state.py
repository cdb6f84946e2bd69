"""The ucx backend's bookkeeping: peers, inbound connections, requests in flight, fenced completions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...descriptors import MemType
from ..base import (
    Completion,
    TransferRequest,
)
from . import rma
from .config import _DRAIN_IDLE_S, _DRAIN_WINDOW, _FENCE_S, log
from .messages import Req
from .protocol import FrameConn, new_nonce
from .rkeys import RkeyCheck


class CudaView:
    """A device range as ``__cuda_array_interface__``, so ucxx moves VRAM without a host copy."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }  # fmt: skip


def row_views(regs: Mapping[int, Any], rids: np.ndarray, addr: np.ndarray, length: np.ndarray, Array) -> list:
    """One ucxx Array per row, viewing the registered memory itself (no staging copy)."""
    out = []
    off = addr.tolist()
    ln = length.tolist()
    cache: dict[int, Any] = {}
    for rid, a, n in zip(rids.tolist(), off, ln):
        base = cache.get(rid)
        if base is None:
            reg = regs[rid]
            base = cache[rid] = (reg, memoryview(reg.array) if reg.mem_type == MemType.DRAM else None)
        reg, mv = base
        if mv is not None:
            start = a - reg.addr
            out.append(Array(mv[start : start + n]))
        else:
            out.append(Array(CudaView(a, n)))
    return out


class Fenced(Completion):
    """A completion whose ``cancel`` returns only once the request's bytes can no longer touch the caller's memory.

    ``Transfer`` reports ERR (timeout or release) right after cancelling, so the
    fence runs inside ``cancel``: the backend stops, cancels or quarantines what
    is still in flight before the caller is told.
    """

    __slots__ = ("_cut", "fence", "fence_s")

    def __init__(self, parts: int = 1) -> None:
        super().__init__(parts)
        self.fence: Callable[[Fenced], None] | None = None
        self.fence_s = 2 * _FENCE_S  # how long a second thread's cancel waits for the first one's fence
        self._cut: threading.Event | None = None

    def cancel(self, error: BaseException | None = None) -> None:
        super().cancel(error)
        with self._lock:
            fence, self.fence = self.fence, None
            if fence is not None:
                self._cut = threading.Event()
            cut = self._cut
        if fence is None:
            # another thread is running the fence: return (and let the caller report ERR) only once it has
            if cut is not None and not cut.wait(self.fence_s):
                log.warning("a cancelled request's fence, run by another thread, did not end within %g s", self.fence_s)
            return
        try:
            if self.finished_at is None:
                fence(self)
        finally:
            cut.set()


class Requests:
    """UCX requests of one operation, checked for completion in posting order.

    When it goes, those still in flight go to ``sink`` (``retired.Retired``): dropped here, their cancel could
    race their completion in another thread's progress and deadlock both.
    """

    __slots__ = ("k", "reqs", "sink")

    def __init__(self, reqs: list, sink: Any = None) -> None:
        self.reqs = reqs
        self.k = 0
        self.sink = sink

    def __del__(self) -> None:
        if self.sink is not None and self.k < len(self.reqs):
            self.sink.add(self.reqs[self.k :])

    def poll(self) -> BaseException | bool:
        """True when all completed, an exception on the first failure, False while pending."""
        reqs, k, n = self.reqs, self.k, len(self.reqs)
        while k < n:
            r = reqs[k]
            if not r.completed:
                self.k = k
                return False
            try:
                r.check_error()
            except Exception as exc:  # a UCX error object: map it for the caller
                self.k = k
                return exc
            k += 1
        self.k = n
        return True

    def pending(self) -> list[int]:
        return [i for i in range(self.k, len(self.reqs)) if not self.reqs[i].completed]


@dataclass(eq=False)
class UcxPlan:
    """One request, prepared once: local row views, the local regions it touches, the control message to the
    owner, and (cached by the first one-sided post) the peer epoch and rows it was planned against."""

    views: Any
    regions: frozenset[int]
    msg: Req
    one_sided: Any = None


class Direct:
    """A one-sided request's puts/gets, posted by the caller (or, queued behind the handshake, by the service
    thread), until the endpoint flush after them ends; finished once, by whoever sees it end."""

    __slots__ = (
        "abandoned", "completion", "deadline", "done", "driven", "flush", "lock", "notify", "op", "peer", "regions",
        "since",
    )  # fmt: skip

    def __init__(
        self, peer: Peer, req: TransferRequest, completion: Completion, flush: rma.Flush, deadline: float
    ) -> None:
        self.peer = peer
        self.deadline = deadline
        self.completion = completion
        self.flush = flush
        self.notify = req.notify
        self.op = req.op
        self.regions = req.plan.regions
        self.lock = threading.Lock()
        self.done = False
        self.abandoned = False  # finished with an error and its flush let go: nothing will say its puts/gets ended
        self.driven = False  # a waiter progresses UCX for it: the service thread keeps out of its way
        self.since = time.monotonic()

    def held(self) -> bool:
        """Whether its flush still holds the native progress thread off the worker (for a waiter to drive it)."""
        return bool(getattr(self.flush, "holding", False))


class Drain:
    """A refused WRITE's rows consumed into scratch memory, ``_DRAIN_WINDOW`` receives at a time.

    Its memory stays bounded whatever row count the request claimed; it ends
    when every row arrived, its connection dropped, or nothing came for
    ``_DRAIN_IDLE_S``.
    """

    __slots__ = ("Tag", "inbound", "n", "next", "reqs", "since", "sink", "tag0")

    def __init__(self, inbound: Inbound, tag0: int, n: int, scratch: int, Array: Any, Tag: Any) -> None:
        self.inbound, self.tag0, self.n, self.next, self.Tag = inbound, tag0, n, 0, Tag
        self.sink = Array(memoryview(bytearray(scratch)))
        self.reqs: list = []
        self.since = time.monotonic()

    def step(self, now: float) -> bool:
        """Post the next window once the current one is in; False when the drain is over."""
        if self.inbound.ep is None:
            return False
        if not all(r.completed for r in self.reqs):
            return now - self.since < _DRAIN_IDLE_S
        if self.next >= self.n:
            return False
        ep, last = self.inbound.ep, min(self.n, self.next + _DRAIN_WINDOW)
        self.reqs = [ep.tag_recv(self.sink, self.Tag(self.tag0 + i)) for i in range(self.next, last)]
        self.next, self.since = last, now
        return True


class OutOp:
    """A request this agent initiated, from post to completion."""

    __slots__ = (
        "abandoned", "completion", "deadline", "done_msg", "drain", "failure", "id", "peer", "req", "reqs", "tag0",
    )  # fmt: skip

    def __init__(self, op_id: int, peer: Peer, req: TransferRequest, completion: Completion, deadline: float) -> None:
        self.id = op_id
        self.deadline = deadline
        self.peer = peer
        self.req = req
        self.completion = completion
        self.abandoned = False
        self.done_msg = req.op == "READ"
        self.reqs: Requests | None = None
        self.tag0 = 0
        # failed with rows still posted: why, and the drain they get before it ends with that (Fencing._fail_served)
        self.failure: BaseException | None = None
        self.drain: Any = None

    def finish(self, error: BaseException | None = None) -> None:
        if self.completion.finished_at is None and not self.abandoned:
            self.completion.finish_part(error)
        self.abandoned = True


class Peer:
    """An outbound connection to one remote agent: control socket plus UCX data endpoint."""

    def __init__(self, name: str, info: Mapping[str, Any]) -> None:
        self.name = name
        self.info = dict(info)
        self.conn: FrameConn | None = None
        self.ep: Any = None
        self.data_ep: int | None = None  # its endpoint on the data worker (one-sided rows), when there is one
        self.state = "idle"  # idle -> connecting -> ready; back to idle when the connection drops
        self.since = 0.0  # when it began connecting (the handshake is given connect_timeout_s)
        self.nonce = b""
        self.nonce_t = b""
        self.conn_id = 0
        self.queue: list[tuple[str, Any]] = []  # what waits for the handshake
        self.ops: dict[int, OutOp] = {}
        # the target's regions open to put/get: id -> (mem type, dev, addr, length, packed rkey); and the
        # rkeys unpacked on the current endpoint. ``epoch`` changes with either, invalidating cached plans.
        self.regions: dict[int, tuple[str, int, int, int, bytes]] = {}
        self.rkeys: dict[int, int] = {}
        self.keys: RkeyCheck | None = None  # what packed keys the target's current address allows
        self.epoch = 0
        self.session = 0  # bumped by every disconnect: a direct cma copy checked on an older one stops
        self.cma_pid = 0  # the peer's pid when this process may attach to it (direct_cma), else 0
        self.cma_why = "not connected"  # why not, for describe()
        self.elsewhere = False  # on another machine (``config.peer_elsewhere`` of the control connection)
        self.ip = ""  # the address its control connection reached, for a peer elsewhere
        # the worker's tcp sockets to it that a READ's gets are corked on (``tcp_sockets.sockets_to``): (endpoint
        # handle they were found for, (fd, inode) pairs, lookups that found none); None until looked up
        self.cork: tuple[int, tuple[tuple[int, int], ...], int] | None = None


class Hangup:
    """A peer that hung up with receives posted for its WRITE: those receives, and a probe through this worker.

    The probe is a tagged message from a second worker of this process into this one: it travels the same
    shared-memory receive queue as every local peer's messages, so it arriving shows that queue is not stuck.
    """

    __slots__ = ("deadline", "ep", "name", "probe", "recv", "reqs", "send")

    def __init__(self, name: str, reqs: list[Requests], deadline: float) -> None:
        self.name = name
        self.reqs = reqs
        self.deadline = deadline
        self.ep: Any = None  # the peer's endpoint, closed once its requests went
        self.recv: Any = None
        self.send: Any = None
        self.probe = bytearray(8)

    def ended(self) -> bool:
        """Every receive of the peer's WRITEs ended and the probe came through."""
        return self.recv is not None and self.recv.completed and all(r.poll() is not False for r in self.reqs)


class Inbound:
    """A connection from an initiator that this agent serves."""

    def __init__(self, conn: FrameConn, conn_id: int) -> None:
        self.conn = conn
        self.conn_id = conn_id
        self.nonce = new_nonce()
        self.since = time.monotonic()  # a connection that has not said hello within connect_timeout_s is dropped
        self.name = ""
        self.ep: Any = None
        self.elsewhere = False  # the initiator runs on another machine
        # op id -> (requests, op, notify, first tag, ids of the registered regions it touches)
        self.ops: dict[int, tuple[Requests, str, bytes, int, frozenset[int]]] = {}
