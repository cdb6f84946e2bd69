"""The contract between the Agent and its backends: ``BackendHost``, ``Backend``, the request and its completion.

A backend moves bytes for one or more (local, remote) memory-type pairs. The
Agent validates descriptors, coalesces them and hands the backend a
``TransferRequest``; ``plan`` turns it once into the backend's own typed
plan, ``post`` starts the work and returns a ``Completion`` that the backend
finishes from any thread. A backend sees the Agent only as a ``BackendHost``.
Optional dependencies are imported inside methods, never at module import,
so ``datamover info`` can list a backend whose library is missing.
"""

from __future__ import annotations

import _thread
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol

import numpy as np

from ..descriptors import DescList, MemType, RegionTable, Registration
from ..descriptors.coalesce import caller_index_at
from ..errors import DatamoverError, InvalidDescriptor, InvalidParameter, TransferAborted

#: the one clock of every deadline and timestamp: ``BackendHost.clock`` is this, ``Completion.finished_at`` reads it
clock = time.monotonic


class Op(str, Enum):
    """Which way a transfer moves bytes: WRITE local -> remote, READ remote -> local (NIXL's strings)."""

    WRITE = "WRITE"
    READ = "READ"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any) -> Op:
        """An Op from itself or its name in any case; InvalidParameter otherwise."""
        if isinstance(value, Op):
            return value
        op = _OPS.get(value) if type(value) is str else None
        if op is not None:
            return op
        try:
            return cls(str(value).upper())
        except ValueError:
            raise InvalidParameter(f"op must be 'WRITE' or 'READ', got {value!r}") from None


_OPS = {"WRITE": Op.WRITE, "READ": Op.READ}


class BackendHost(Protocol):
    """What a backend may see of the Agent that runs it, and all it may see.

    The Agent implements this; backends (and ``Transfer``) use nothing else of
    it. ``regions`` is a live read-only view of the registrations by id;
    ``region_table`` the lookup table over them, replaced (a new object) on
    every registration change, so a backend may cache against its identity.
    """

    @property
    def name(self) -> str:
        """The agent's name, as peers know it."""

    @property
    def secret(self) -> bytes | None:
        """The shared secret that authenticates metadata and control connections, if set."""

    @property
    def timeout_s(self) -> float:
        """The default bound, in seconds, on a transfer (and on waits such as a deregistration's)."""

    @property
    def regions(self) -> Mapping[int, Registration]:
        """This agent's registrations by id: a live, read-only view."""

    @property
    def region_table(self) -> RegionTable:
        """The lookup table over ``regions`` (a new object after each registration change)."""

    def deliver_notification(self, peer: str, message: bytes) -> None:
        """Hand a notification from ``peer`` to this agent's users (``get_notifications`` and friends)."""

    def clock(self) -> float:
        """Now, on the clock every deadline is on (``datamover.backends.base.clock``)."""


#: the locks of every completion run inline (``run_inline``): it is finished before anyone can wait on it, so its
#: latch is never taken, and its state lock is only held for an instant by ``cancel``/``add_done_callback``
_INLINE_LOCK = _thread.allocate_lock()


class Completion:
    """One posted request's outcome, finished once from whichever thread ends last.

    A request may be split into ``parts`` run concurrently; the completion is
    done when every part reported. The first error wins; ``cancel`` asks the
    remaining parts to stop early (they poll ``cancelled``). Waiting uses a
    latch lock (cheap to create: posting stays a few microseconds).
    """

    __slots__ = ("_assist", "_callbacks", "_latch", "_lock", "_remaining", "cancelled", "error", "finished_at")

    def __init__(self, parts: int = 1) -> None:
        self._lock = _thread.allocate_lock()
        self._latch = _thread.allocate_lock()
        self._remaining = parts
        self.error: BaseException | None = None
        self.cancelled = False
        self.finished_at: float | None = None
        self._callbacks: list[Callable[[Completion], None]] | None = None
        self._assist: Callable[[], None] | None = None
        if parts == 0:
            self.finished_at = clock()
        else:
            self._latch.acquire()

    def finish_part(self, error: BaseException | None = None) -> None:
        """Report one part done (with its error, if it failed)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
                self.cancelled = True
            self._remaining -= 1
            if self._remaining > 0:
                return
            self.finished_at = clock()
            callbacks, self._callbacks = self._callbacks, None
        self._latch.release()
        if callbacks:
            for cb in callbacks:
                cb(self)

    def add_parts(self, n: int) -> None:
        """Announce ``n`` more parts before the current ones can all finish."""
        with self._lock:
            self._remaining += n

    def done(self) -> bool:
        return self.finished_at is not None

    def set_assist(self, fn: Callable[[], None]) -> None:
        """Let the first waiter run ``fn`` (the rest of the work) itself rather than sleep until a pool thread wakes.

        ``fn`` must be safe to call from two threads: the backend's worker and
        the waiter race for it, and the loser must return at once.
        """
        self._assist = fn

    def assist(self) -> bool:
        """Run the work the backend left for a waiter (``set_assist``), if no one took it yet; True if done after."""
        fn, self._assist = self._assist, None
        if fn is not None:
            fn()
        return self.finished_at is not None

    def wait(self, timeout: float | None = None, assist: bool = False) -> bool:
        """Block until done or ``timeout`` seconds pass; True when done.

        With ``assist``, a waiter first runs the work the backend left for it
        (see ``set_assist``), which can take longer than ``timeout``; the wait after
        it is what is left of ``timeout``.
        """
        if self.finished_at is not None:
            return True
        if assist:
            fn, self._assist = self._assist, None
            if fn is not None:
                end = None if timeout is None else clock() + timeout
                fn()
                if end is not None:
                    timeout = end - clock()
        if self._latch.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._latch.release()
        return self.finished_at is not None

    def cancel(self, error: BaseException | None = None) -> None:
        """Ask unfinished parts to stop; ``error`` is recorded if none is yet."""
        with self._lock:
            self.cancelled = True
            if self.error is None and self.finished_at is None:
                self.error = error or TransferAborted("transfer released while in flight")

    def add_done_callback(self, fn: Callable[[Completion], None]) -> None:
        """Call ``fn(self)`` once when done (at once if already done)."""
        with self._lock:
            if self.finished_at is None:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)


@dataclass(eq=False)
class TransferRequest:
    """What a backend executes: coalesced, validated descriptors and where they came from.

    ``local`` are this agent's descriptors; ``remote`` the peer's (or this
    agent's own when ``remote_agent`` is None). WRITE moves local -> remote,
    READ remote -> local. ``first_index[i]`` is the caller's index of the
    first descriptor that row ``i`` covers, for error messages, and
    ``caller_lengths`` the caller's lengths before merging (None when no row
    was merged): ``caller_index(row, offset)`` names the descriptor holding a
    failing byte. ``plan`` is
    what the backend's ``plan`` returned for it (its own type). ``deadline``
    is absolute, on ``clock``: set once by each post (``timeout`` seconds
    after it), and every backend waits against it and nothing else.
    """

    op: Op
    local: DescList
    remote: DescList
    remote_agent: str | None
    local_regions: np.ndarray
    remote_regions: np.ndarray
    registrations: Mapping[int, Registration]
    first_index: np.ndarray
    caller_lengths: np.ndarray | None = None
    #: the caller's lists before merging (None when no row was merged), for a backend that wants the rows
    caller_local: DescList | None = None
    caller_remote: DescList | None = None
    notify: bytes = b""
    timeout: float = 30.0
    plan: Any = None
    deadline: float = math.inf
    #: True when the Agent found each side inside one registered region on one device, so each of
    #: ``local_regions`` and ``remote_regions`` holds one id throughout (False: not known, check)
    one_region: bool = False
    #: the ids of this agent's own regions the request touches (each post checks they are still registered)
    own_regions: tuple[int, ...] = ()
    #: the identity (``AgentMetadata.ident``) of the peer's metadata ``remote`` was checked against: a post after
    #: its metadata names another (the peer restarted) is refused
    remote_ident: bytes | None = None

    @property
    def src(self) -> DescList:
        return self.local if self.op is Op.WRITE else self.remote

    @property
    def dst(self) -> DescList:
        return self.remote if self.op is Op.WRITE else self.local

    @property
    def src_regions(self) -> np.ndarray:
        return self.local_regions if self.op is Op.WRITE else self.remote_regions

    @property
    def dst_regions(self) -> np.ndarray:
        return self.remote_regions if self.op is Op.WRITE else self.local_regions

    def copy(self) -> TransferRequest:
        """The same request (sharing its arrays and plan) with its own deadline, not yet posted."""
        new = object.__new__(TransferRequest)
        new.__dict__.update(self.__dict__)
        new.deadline = math.inf
        return new

    def caller_index(self, row: int, offset: int = 0) -> int:
        """The caller's descriptor index for byte ``offset`` of coalesced row ``row`` (its first byte by default)."""
        if self.caller_lengths is None:
            return int(self.first_index[row])
        return caller_index_at(self.first_index, self.caller_lengths, row, offset)


def check_param_types(
    backend: str, defaults: Mapping[str, Any], params: Mapping[str, Any], loose: frozenset[str] = frozenset()
) -> None:
    """Refuse (``InvalidParameter`` naming backend, key, value and the type wanted) a parameter whose default is
    a flag, a whole number or a number and whose value is not one: the backend would otherwise fail later with a
    bare ValueError from ``int()`` or take ``"false"`` for true. Keys in ``loose`` are left to the backend."""
    for key, value in params.items():
        default = defaults.get(key)
        if key in loose or default is None:
            continue
        if isinstance(default, bool):
            ok, wanted = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, wanted = isinstance(value, int) and not isinstance(value, bool), "a whole number"
        elif isinstance(default, float):
            ok, wanted = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        else:
            continue
        if not ok:
            raise InvalidParameter(
                f"parameter {key!r} must be {wanted}, got {value!r} ({type(value).__name__})", backend=backend
            )


class Backend(ABC):
    """How bytes move: one subclass per backend, registered by name.

    Subclasses declare ``name``, the (local, remote) memory-type ``pairs``
    they move, and whether they move within one agent (``supports_local``),
    to other agents (``supports_remote``) and carry notifications.
    """

    name: ClassVar[str]
    pairs: ClassVar[frozenset[tuple[MemType, MemType]]]
    supports_local: ClassVar[bool] = True
    supports_remote: ClassVar[bool] = False
    supports_notifications: ClassVar[bool] = False
    #: parameters accepted in the agent config, with their defaults
    default_params: ClassVar[Mapping[str, Any]] = {}
    #: parameters whose value need not have the type of their default (a size as "64M", None for the library's
    #: own setting, a path where the default is a flag): the backend checks those itself
    loose_params: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        self.host = host
        unknown = set(params or {}) - set(self.default_params)
        if unknown:
            known = ", ".join(sorted(self.default_params)) or "none"
            raise InvalidParameter(f"unknown parameter(s) {sorted(unknown)}; known: {known}", backend=self.name)
        check_param_types(self.name, self.default_params, params or {}, self.loose_params)
        self.params: dict[str, Any] = {**self.default_params, **(params or {})}

    @classmethod
    def mem_types(cls) -> frozenset[MemType]:
        """Every memory type appearing on either side of ``pairs``."""
        return frozenset(m for pair in cls.pairs for m in pair)

    @classmethod
    @abstractmethod
    def available(cls) -> tuple[bool, str]:
        """Whether this backend can run here, and if not, exactly why."""

    @classmethod
    def environment(cls) -> dict[str, Any]:
        """Facts about this machine that matter to the backend (for `datamover info`)."""
        return {}

    @classmethod
    def moves(cls, local: MemType, remote: MemType, remote_agent: bool) -> bool:
        """Whether this backend moves the (local, remote) pair, locally or to a peer."""
        if (local, remote) not in cls.pairs:
            return False
        return cls.supports_remote if remote_agent else cls.supports_local

    def register(self, reg: Registration) -> Any:
        """Prepare a newly registered region for this backend; returns its handle."""
        return None

    def deregister(self, reg: Registration, handle: Any) -> None:
        """Undo ``register``."""

    def plan(self, req: TransferRequest) -> Any:
        """Precompute what ``post`` needs, once per request; the Agent keeps the result as ``req.plan``."""
        return None

    @abstractmethod
    def post(self, req: TransferRequest) -> Completion:
        """Start moving ``req``'s bytes; never blocks for long, never raises for I/O errors."""

    def connection_info(self) -> dict[str, Any]:
        """What peers need to reach this backend, carried in the agent's metadata."""
        return {}

    def add_remote(self, name: str, info: Mapping[str, Any]) -> None:
        """Load a peer's connection info (connecting lazily is fine)."""

    def remove_remote(self, name: str) -> None:
        """Forget a peer and drop its connections."""

    def send_notification(self, remote: str, message: bytes) -> None:
        """Deliver ``message`` to ``remote`` without data."""
        raise NotImplementedError(f"backend {self.name!r} carries no notifications")

    def describe(self) -> dict[str, Any]:
        """Facts for `datamover info` and benchmark headers (transports, I/O mode)."""
        return {}

    def close(self) -> None:
        """Release threads, connections and handles."""


def refuse_offset_writes(req: TransferRequest, key_of: Callable[[int], str], store: str, backend: str) -> None:
    """Object stores write whole objects: a WRITE descriptor at a non-zero object offset is refused when the
    transfer is made, with an ``InvalidDescriptor`` naming the descriptor and its key (``key_of(row)``)."""
    obj = req.remote
    if req.op != "WRITE" or not len(obj):
        return
    bad = np.flatnonzero(obj.addr != 0)
    if bad.size:
        row = int(bad[0])
        raise InvalidDescriptor(
            f"{store} writes whole objects: a WRITE descriptor must have offset 0, got {int(obj.addr[row])} "
            f"for key {key_of(row)!r}",
            index=req.caller_index(row),
            backend=backend,
        )


def split_by_bytes(lengths: np.ndarray, parts: int, min_bytes: int) -> list[tuple[int, int]]:
    """Cut rows into at most ``parts`` contiguous ranges of roughly equal bytes.

    Fewer ranges when the total is small: each range carries at least
    ``min_bytes`` (except when there is only one).
    """
    n = int(lengths.shape[0])
    if n == 0:
        return []
    total = int(lengths.sum())
    parts = max(1, min(parts, n, total // max(1, min_bytes)))
    if parts == 1:
        return [(0, n)]
    cum = np.cumsum(lengths)
    targets = (np.arange(1, parts) * total) // parts
    cuts = np.searchsorted(cum, targets, side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.clip(cuts, 1, n - 1), [n])))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


#: the most iovecs one vectored syscall takes (preadv, process_vm_writev, ...)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def cap_runs(starts: np.ndarray, n: int, most: int = IOV_MAX) -> np.ndarray:
    """First rows of runs over ``n`` rows, with every run longer than ``most`` rows cut every ``most`` rows."""
    sizes = np.diff(np.append(starts, n))
    if not (sizes > most).any():
        return starts
    extra = [np.arange(a + most, a + z, most) for a, z in zip(starts.tolist(), sizes.tolist()) if z > most]
    return np.unique(np.concatenate([starts, *extra]))


def typed_error(exc: BaseException, backend: str, index: int | None = None) -> DatamoverError:
    """``exc`` itself when it is a DatamoverError, else one wrapping it, so callers always see a typed error."""
    if isinstance(exc, DatamoverError):
        return exc
    err = DatamoverError(f"{type(exc).__name__}: {exc}", index=index, backend=backend)
    err.__cause__ = exc
    return err


def run_inline(ranges: Sequence[tuple[int, int]], work: Callable[..., None], *args: Any, backend: str) -> Completion:
    """Run ``work(*args, start, stop, completion)`` for each range here, in order; returns the finished completion.

    For requests too small to be worth a thread hop: no pool, no latch, no
    wake-up, so ``Transfer.post`` returns DONE (or ERR). The first error stops
    the remaining ranges; anything not a DatamoverError is wrapped, as in
    ``run_parts``.
    """
    c = _new_completion(Completion)
    c._lock = c._latch = _INLINE_LOCK
    c._remaining = 0
    c.error = c.finished_at = c._callbacks = c._assist = None
    c.cancelled = False
    try:
        for start, stop in ranges:
            work(*args, start, stop, c)
    except BaseException as exc:
        c.error = typed_error(exc, backend)
        if not isinstance(exc, Exception):  # Ctrl-C or exit on the caller's thread: finished ERR, then raised on
            c.finished_at = clock()
            raise
    c.finished_at = clock()
    return c


_new_completion = object.__new__


def finished_completion() -> Completion:
    """A completion that is already done without error: for work a backend finished inside ``post``."""
    c = _new_completion(Completion)
    c._lock = c._latch = _INLINE_LOCK
    c._remaining = 0
    c.error = c._callbacks = c._assist = None
    c.cancelled = False
    c.finished_at = clock()
    return c


def run_parts(
    executor: Executor | None,
    ranges: Sequence[tuple[int, int]],
    work: Callable[[int, int, Completion], None],
    *,
    backend: str,
    completion_type: type[Completion] = Completion,
    assist: bool = True,
) -> Completion:
    """Run ``work(start, stop, completion)`` for each range on ``executor``; inline (``run_inline``) when it is None.

    Errors raised by ``work`` finish its part with that error; anything not a
    DatamoverError is wrapped so the caller always sees a typed error.
    ``completion_type`` is the completion made (a backend's subclass whose ``cancel`` fences its parts).
    ``assist=False``: a waiting caller never runs a part itself (for work that can block far past a deadline).
    """
    if executor is None:
        return run_inline(ranges, work, backend=backend)
    completion = completion_type(len(ranges))

    def one(start: int, stop: int) -> None:
        err: BaseException | None = None
        try:
            if not completion.cancelled:
                work(start, stop, completion)
        except BaseException as exc:
            err = typed_error(exc, backend)
            if not isinstance(exc, Exception):  # Ctrl-C in a caller running a part (assist): the part ends ERR
                completion.finish_part(err)
                raise
        completion.finish_part(err)

    claims = [_thread.allocate_lock() for _ in ranges]

    def claim(i: int) -> None:
        # a pool thread and a waiting caller race for each part; whoever takes it runs it
        if claims[i].acquire(blocking=False):
            one(*ranges[i])

    for i in range(len(ranges)):
        executor.submit(claim, i)
    if assist:
        completion.set_assist(lambda: [claim(i) for i in reversed(range(len(ranges)))])
    return completion
