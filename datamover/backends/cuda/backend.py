"""cuda: VRAM <-> DRAM and VRAM <-> VRAM with cuda-python, on a dedicated copy stream per device.

Every device gets one non-blocking stream owned by this backend (never the
compute stream), a pool of events and a completer thread. ``post`` enqueues
the request's rows on the stream of the VRAM side's device (the source's for
VRAM -> VRAM) with one ``cudaMemcpyBatchAsync`` per chunk of rows where the
runtime and driver have it (CUDA >= 12.8), else one ``cudaMemcpyAsync`` per
coalesced row, records an event and returns; the completer thread waits for
the events in stream order and finishes the completion. DRAM regions are
page-locked with ``cudaHostRegister`` when registered, within a pinned-pool
limit, and unlocked when deregistered.

cuda-python is imported on first use, never at ``import datamover``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...descriptors import MemType
from ...errors import (
    CudaError,
    DatamoverError,
    InvalidDescriptor,
    InvalidParameter,
    PinnedPoolExhausted,
    TransferTimeout,
)
from ...units import parse_size
from ..base import Backend, BackendHost, Completion, TransferRequest, clock
from ..fence import ReadFence

log = logging.getLogger("datamover.cuda")

DRIVER_LIBRARY = "libcuda.so.1"
#: first CUDA version (runtime and driver) with cudaMemcpyBatchAsync
BATCH_MIN_VERSION = 12080


@functools.lru_cache(maxsize=1)
def driver_missing() -> str | None:
    """Why the CUDA driver library cannot be loaded, or None when it can."""
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError as exc:
        detail = str(exc)
        if "cannot open shared object file" in detail:
            return f"no CUDA driver: {DRIVER_LIBRARY} not found"
        return f"no usable CUDA driver: {detail}"
    return None


def _runtime():
    """The cuda.bindings runtime module (imported lazily)."""
    from cuda.bindings import runtime

    return runtime


def physical_memory() -> int:
    """Bytes of physical memory on this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class PinnedPool:
    """Accounting of host bytes page-locked by one backend, against a limit (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str = "region") -> None:
        """Count ``nbytes`` more pinned bytes; raises PinnedPoolExhausted past the limit."""
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                raise PinnedPoolExhausted(
                    f"page-locking {what} of {nbytes} bytes would pin {self.used + nbytes} bytes, over the "
                    f"pinned-pool limit of {self.limit} bytes ({self.used} in use); raise the cuda backend's "
                    "'pinned_pool_bytes' or deregister host memory first",
                    backend="cuda",
                )
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)


def validate_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check and normalise the cuda backend's parameters; raises ValueError naming the bad one."""
    out = dict(params)
    pool = out["pinned_pool_bytes"]
    if pool == "auto":
        phys = physical_memory()
        out["pinned_pool_bytes"] = phys // 2 if phys else None
    elif pool is not None:
        out["pinned_pool_bytes"] = parse_size(pool, "cuda parameter 'pinned_pool_bytes'")
    if out["batch"] not in ("auto", True, False):
        raise InvalidParameter(f"cuda parameter 'batch' must be 'auto', True or False, got {out['batch']!r}")
    chunk = out["batch_chunk"]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidParameter(f"cuda parameter 'batch_chunk' must be a positive integer, got {chunk!r}")
    for flag in ("pin_host", "blocking_sync", "peer_access", "prefer_overlap"):
        if not isinstance(out[flag], bool):
            raise InvalidParameter(f"cuda parameter {flag!r} must be True or False, got {out[flag]!r}")
    return out


def _ok(rt, err) -> bool:
    return err == rt.cudaError_t.cudaSuccess


def _clear_last_error(rt) -> None:
    """Reset the runtime's per-thread last error so a tolerated failure never surfaces in torch later."""
    rt.cudaGetLastError()


def cuda_error(rt, err, what: str, *, index: int | None = None) -> CudaError:
    """A CudaError for ``err`` returned by ``what``, with the CUDA error name and text."""
    _clear_last_error(rt)
    name = getattr(err, "name", None) or str(err)
    try:
        text = rt.cudaGetErrorString(err)[1].decode()
    except Exception:  # the name alone still says what failed
        text = ""
    return CudaError(f"{what} failed: {name}" + (f" ({text})" if text else ""), cuda_error=name, index=index)


def check(rt, result: tuple, what: str, *, index: int | None = None) -> Any:
    """The value of a cuda-python ``(err, value...)`` tuple; raises CudaError unless err is cudaSuccess."""
    err = result[0]
    if not _ok(rt, err):
        raise cuda_error(rt, err, what, index=index)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class _OnDevice:
    """Make ``dev`` the calling thread's current device, restoring the previous one on exit."""

    __slots__ = ("dev", "prev", "rt")

    def __init__(self, rt, dev: int) -> None:
        self.rt, self.dev, self.prev = rt, dev, None

    def __enter__(self) -> None:
        cur = check(self.rt, self.rt.cudaGetDevice(), "cudaGetDevice")
        if cur != self.dev:
            check(self.rt, self.rt.cudaSetDevice(self.dev), f"cudaSetDevice({self.dev})")
            self.prev = cur

    def __exit__(self, *exc: object) -> None:
        if self.prev is not None:
            self.rt.cudaSetDevice(self.prev)
            self.prev = None


@dataclass
class HostPin:
    """The cuda handle of a DRAM registration: whether this backend page-locked it."""

    addr: int
    length: int
    pinned_by_us: bool
    note: str


@dataclass
class _Group:
    """The rows of one request that run on one device's stream, as lists ready for the CUDA calls."""

    dev: int
    rows: np.ndarray  # coalesced row numbers, for error messages
    dst: list[int]
    src: list[int]
    size: list[int]
    chunks: list[tuple[int, int, list[int], list[int], list[int]]]


class _Lane:
    """One device's copy stream, its free events, and the thread that completes requests in stream order."""

    def __init__(self, rt, dev: int, blocking_sync: bool) -> None:
        self.rt = rt
        self.dev = dev
        self.event_flags = rt.cudaEventDisableTiming | (rt.cudaEventBlockingSync if blocking_sync else 0)
        with _OnDevice(rt, dev):
            self.stream = check(rt, rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self.lock = threading.Lock()  # issue order on the stream == order in ``pending``
        self.free_events: list[Any] = []
        self.all_events: list[Any] = []
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._complete, name=f"dm-cuda-dev{dev}", daemon=True)
        self.thread.start()

    def take_event(self) -> Any:
        """A free event of this device (caller holds ``lock`` with the device current)."""
        if self.free_events:
            return self.free_events.pop()
        ev = check(self.rt, self.rt.cudaEventCreateWithFlags(self.event_flags), "cudaEventCreateWithFlags")
        self.all_events.append(ev)
        return ev

    def _complete(self) -> None:
        rt = self.rt
        while True:
            item = self.pending.get()
            if item is None:
                return
            event, completion, deadline, error, what = item
            err = rt.cudaEventSynchronize(event)[0]
            completion.leave()  # the group's copies ended: none reads or writes the caller's memory any more
            if error is None and not _ok(rt, err):
                error = cuda_error(rt, err, f"{what} (cudaEventSynchronize)")
            elif error is None and clock() > deadline:
                error = TransferTimeout(f"{what} completed after its deadline", backend="cuda")
            self.free_events.append(event)
            completion.finish_part(error)

    def synchronize(self) -> None:
        """Wait for everything enqueued on this lane's stream."""
        self.rt.cudaStreamSynchronize(self.stream)

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=60)
        rt = self.rt
        with _OnDevice(rt, self.dev):
            rt.cudaStreamSynchronize(self.stream)
            for ev in self.all_events:
                rt.cudaEventDestroy(ev)
            rt.cudaStreamDestroy(self.stream)
        self.all_events.clear()
        self.free_events.clear()


@dataclass(eq=False)
class CudaPlan:
    """One request's copies, grouped per device lane, and its description for error messages."""

    groups: list[_Group]
    what: str


class CudaBackend(Backend):
    """GPU memory to and from host memory and other GPU memory, within one agent."""

    name = "cuda"
    pairs = frozenset(
        {
            (MemType.VRAM, MemType.DRAM),
            (MemType.DRAM, MemType.VRAM),
            (MemType.VRAM, MemType.VRAM),
        }
    )
    default_params = {
        # page-lock every DRAM region registered while this backend runs (cudaHostRegister)
        "pin_host": True,
        # most host bytes this backend may page-lock: bytes, '64G', None (no limit) or 'auto' (half of RAM)
        "pinned_pool_bytes": "auto",
        # cudaMemcpyBatchAsync: 'auto' (where runtime and driver have it), True (same, warn when absent), False
        "batch": "auto",
        # rows per cudaMemcpyBatchAsync call; cancellation is checked between calls
        "batch_chunk": 8192,
        # completer threads sleep in cudaEventSynchronize (cudaEventBlockingSync) instead of spinning
        "blocking_sync": False,
        # enable peer access between devices for VRAM -> VRAM across GPUs when they support it
        "peer_access": True,
        # hint that batched copies should overlap with compute (cudaMemcpyFlagPreferOverlapWithCompute)
        "prefer_overlap": True,
    }

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        self.params = validate_params(self.params)
        self.pool = PinnedPool(self.params["pinned_pool_bytes"])
        self._lock = threading.Lock()
        self._lanes: dict[int, _Lane] = {}
        self._pins: dict[int, HostPin] = {}
        self._peers: set[tuple[int, int]] = set()
        self._rt = None
        self._batch: bool | None = None
        self._batch_note = ""
        self._attrs = None
        self._closed = False

    # -- availability --------------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        missing = driver_missing()
        if missing:
            return False, missing
        try:
            rt = _runtime()
        except ImportError as exc:
            return False, f"cuda-python (cuda.bindings) is not installed: pip install 'datamover[cuda]' ({exc})"
        err, count = rt.cudaGetDeviceCount()
        if not _ok(rt, err):
            _clear_last_error(rt)
            name = getattr(err, "name", str(err))
            return False, f"CUDA runtime cannot start: {name} ({rt.cudaGetErrorString(err)[1].decode()})"
        if count == 0:
            return False, "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
        drv = rt.cudaDriverGetVersion()[1]
        run = rt.cudaRuntimeGetVersion()[1]
        return True, f"{count} CUDA device(s), driver {_version(drv)}, runtime {_version(run)}"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        out: dict[str, Any] = {}
        missing = driver_missing()
        out["driver"] = missing or f"{DRIVER_LIBRARY} loads"
        try:
            out["cuda-python"] = importlib.metadata.version("cuda-bindings")
        except importlib.metadata.PackageNotFoundError:
            out["cuda-python"] = "not installed (pip install 'datamover[cuda]')"
            return out
        if missing:
            return out
        rt = _runtime()
        out["runtime"] = _version(rt.cudaRuntimeGetVersion()[1])
        err, count = rt.cudaGetDeviceCount()
        if not _ok(rt, err):
            _clear_last_error(rt)
            return out
        out["driver version"] = _version(rt.cudaDriverGetVersion()[1])
        for d in range(count):
            err, prop = rt.cudaGetDeviceProperties(d)
            if _ok(rt, err):
                name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
                out[f"device {d}"] = name.rstrip("\x00")
        out["cudaMemcpyBatchAsync"] = _batch_support(rt)[1]
        return out

    # -- CUDA state ----------------------------------------------------------
    def _cuda(self):
        """The runtime module, with the batch API probed once."""
        rt = self._rt
        if rt is not None:
            return rt
        with self._lock:
            if self._rt is None:
                rt = _runtime()
                want = self.params["batch"]
                ok, note = _batch_support(rt) if want else (False, "disabled by the 'batch' parameter")
                if want is True and not ok:
                    log.warning(
                        "cuda: cudaMemcpyBatchAsync requested but unavailable (%s); using cudaMemcpyAsync", note
                    )
                if ok:
                    attrs = rt.cudaMemcpyAttributes()
                    attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
                    if self.params["prefer_overlap"]:
                        attrs.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
                    self._attrs = attrs
                self._batch, self._batch_note = ok, note
                self._rt = rt
        return self._rt

    def _lane(self, dev: int) -> _Lane:
        lane = self._lanes.get(dev)
        if lane is not None:
            return lane
        rt = self._cuda()
        with self._lock:
            lane = self._lanes.get(dev)
            if lane is None:
                lane = self._lanes[dev] = _Lane(rt, dev, self.params["blocking_sync"])
        return lane

    def _enable_peer(self, src_dev: int, dst_dev: int) -> None:
        """Let ``src_dev`` reach ``dst_dev`` directly when the hardware allows (else copies stage via host)."""
        key = (src_dev, dst_dev)
        if key in self._peers:
            return
        rt = self._cuda()
        can = check(rt, rt.cudaDeviceCanAccessPeer(src_dev, dst_dev), "cudaDeviceCanAccessPeer")
        if can:
            with _OnDevice(rt, src_dev):
                err = rt.cudaDeviceEnablePeerAccess(dst_dev, 0)[0]
            if err == rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled:
                _clear_last_error(rt)
            elif not _ok(rt, err):
                raise cuda_error(rt, err, f"cudaDeviceEnablePeerAccess({src_dev} -> {dst_dev})")
        self._peers.add(key)

    # -- registration ----------------------------------------------------------
    def register(self, reg) -> HostPin | int | None:
        if reg.mem_type == MemType.VRAM:
            self._check_device_memory(reg)
            return int(reg.dev)
        if reg.mem_type != MemType.DRAM or not self.params["pin_host"]:
            return None
        rt = self._cuda()
        kind = self._memory_type(rt, reg.addr)
        if kind == rt.cudaMemoryType.cudaMemoryTypeHost:
            return HostPin(reg.addr, reg.length, False, "page-locked already (not by datamover)")
        if kind != rt.cudaMemoryType.cudaMemoryTypeUnregistered:
            raise InvalidDescriptor(
                f"DRAM region [{reg.addr:#x}, +{reg.length}) is CUDA {kind.name} memory, not host memory",
                backend=self.name,
            )
        self.pool.reserve(reg.length, f"DRAM region [{reg.addr:#x}, +{reg.length})")
        err = rt.cudaHostRegister(reg.addr, reg.length, rt.cudaHostRegisterPortable)[0]
        if _ok(rt, err):
            pin = HostPin(reg.addr, reg.length, True, "page-locked by datamover (cudaHostRegister)")
            with self._lock:
                self._pins[reg.id] = pin
            return pin
        self.pool.release(reg.length)
        if err == rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered:
            # its pages overlap memory page-locked elsewhere; copies still work, staged where not pinned
            _clear_last_error(rt)
            log.warning("cuda: [%#x, +%d) shares pages with page-locked memory; left as it is", reg.addr, reg.length)
            return HostPin(reg.addr, reg.length, False, "shares pages with memory page-locked elsewhere")
        raise cuda_error(rt, err, f"cudaHostRegister([{reg.addr:#x}, +{reg.length}))")

    def deregister(self, reg, handle: Any) -> None:
        if not isinstance(handle, HostPin) or not handle.pinned_by_us:
            return
        rt = self._cuda()
        for lane in list(self._lanes.values()):
            lane.synchronize()  # no DMA may still be reading or writing pages about to be unlocked
        with self._lock:
            self._pins.pop(reg.id, None)
        err = rt.cudaHostUnregister(handle.addr)[0]
        self.pool.release(handle.length)
        if not _ok(rt, err):
            log.warning("cuda: %s", cuda_error(rt, err, f"cudaHostUnregister({handle.addr:#x})"))

    @staticmethod
    def _memory_type(rt, addr: int):
        attrs = check(rt, rt.cudaPointerGetAttributes(addr), f"cudaPointerGetAttributes({addr:#x})")
        return attrs.type

    def _check_device_memory(self, reg) -> None:
        """Refuse a VRAM region that is not device memory of the device it claims."""
        rt = self._cuda()
        for addr in (reg.addr, reg.addr + reg.length - 1):
            attrs = check(rt, rt.cudaPointerGetAttributes(addr), f"cudaPointerGetAttributes({addr:#x})")
            if attrs.type == rt.cudaMemoryType.cudaMemoryTypeManaged:
                continue
            if attrs.type != rt.cudaMemoryType.cudaMemoryTypeDevice:
                raise InvalidDescriptor(
                    f"VRAM region [{reg.addr:#x}, +{reg.length}) is not device memory ({attrs.type.name} at {addr:#x})",
                    backend=self.name,
                )
            if attrs.device != reg.dev:
                raise InvalidDescriptor(
                    f"VRAM region [{reg.addr:#x}, +{reg.length}) was registered as device {reg.dev} "
                    f"but lives on device {attrs.device}",
                    backend=self.name,
                )

    # -- planning ----------------------------------------------------------------
    def plan(self, req: TransferRequest) -> CudaPlan:
        src, dst = req.src, req.dst
        n = len(src)
        keep = src.length > 0
        rows = np.arange(n, dtype=np.int64) if keep.all() else np.flatnonzero(keep)
        lane_dev = (src.dev if src.mem_type == MemType.VRAM else dst.dev)[rows]
        if src.mem_type == MemType.VRAM and dst.mem_type == MemType.VRAM and self.params["peer_access"]:
            pairs = np.unique(np.stack([src.dev[rows], dst.dev[rows]], axis=1), axis=0) if rows.size else []
            for s, d in pairs:
                if s != d:
                    self._enable_peer(int(s), int(d))
        chunk = int(self.params["batch_chunk"])
        groups = []
        devs = np.unique(lane_dev)
        for dev in devs.tolist():
            sel = rows if devs.shape[0] == 1 else rows[lane_dev == dev]
            d, s, z = dst.addr[sel].tolist(), src.addr[sel].tolist(), src.length[sel].tolist()
            chunks = [(a, min(a + chunk, len(z))) for a in range(0, len(z), chunk)]
            groups.append(_Group(int(dev), sel, d, s, z, [(a, b, d[a:b], s[a:b], z[a:b]) for a, b in chunks]))
            self._lane(int(dev))
        return CudaPlan(groups, f"{req.op} of {n} row(s) {src.mem_type.value}->{dst.mem_type.value}")

    # -- execution -----------------------------------------------------------------
    def post(self, req: TransferRequest) -> Completion:
        p = req.plan
        groups: list[_Group] = p.groups
        # a copy on the stream cannot be stopped: a cancel (timeout, release) waits for the ones enqueued, so that
        # none lands in (or reads) the caller's memory after ERR; the ones not enqueued yet are not
        completion = ReadFence(len(groups))
        deadline = req.deadline
        for g in groups:
            self._submit(self._lanes[g.dev], req, g, completion, deadline, p.what)
        return completion

    def _submit(self, lane: _Lane, req, g: _Group, completion: ReadFence, deadline: float, what: str) -> None:
        """Enqueue one group's copies and an event on its lane (inside the fence until the lane's thread sees the
        event); never raises."""
        rt = self._rt
        event = None
        if not completion.enter():  # cancelled already: nothing of this group is enqueued
            completion.finish_part(None)
            return
        try:
            with lane.lock:
                with _OnDevice(rt, lane.dev):
                    error = self._enqueue(rt, lane.stream, req, g, completion)
                    event = lane.take_event()
                    check(rt, rt.cudaEventRecord(event, lane.stream), "cudaEventRecord")
                    lane.pending.put((event, completion, deadline, error, what))
        except BaseException as exc:
            if event is not None:
                lane.free_events.append(event)
            lane.synchronize()  # nothing tracks what was enqueued: wait for it before reporting
            completion.leave()
            err = exc if isinstance(exc, DatamoverError) else DatamoverError(f"{type(exc).__name__}: {exc}")
            if err.backend is None:
                err.backend = self.name
            completion.finish_part(err)

    def _enqueue(self, rt, stream, req, g: _Group, completion: Completion) -> DatamoverError | None:
        """Put the group's copies on ``stream``; returns the error that stopped it, if any."""
        start = 0
        if self._batch and len(g.size) > 1:
            for a, b, dsts, srcs, sizes in g.chunks:
                if completion.cancelled:
                    return None
                res = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, b - a, [self._attrs], [0], 1, stream)
                err = res[0]
                if _ok(rt, err):
                    start = b
                    continue
                if err in (rt.cudaError_t.cudaErrorNotSupported, rt.cudaError_t.cudaErrorCallRequiresNewerDriver):
                    _clear_last_error(rt)
                    self._batch, self._batch_note = False, f"unavailable at run time ({err.name})"
                    log.warning("cuda: cudaMemcpyBatchAsync returned %s; using cudaMemcpyAsync", err.name)
                    break
                fail = res[1] if len(res) > 1 and isinstance(res[1], int) and res[1] < b - a else None
                row = None if fail is None else req.caller_index(int(g.rows[a + fail]))
                return cuda_error(rt, err, f"cudaMemcpyBatchAsync of {b - a} copies", index=row)
            else:
                return None
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        copy = rt.cudaMemcpyAsync
        dst, src, size = g.dst, g.src, g.size
        for i in range(start, len(size)):
            if (i & 255) == 0 and completion.cancelled:
                return None
            err = copy(dst[i], src[i], size[i], kind, stream)[0]
            if not _ok(rt, err):
                return cuda_error(
                    rt, err, f"cudaMemcpyAsync of {size[i]} bytes", index=req.caller_index(int(g.rows[i]))
                )
        return None

    # -- reporting and lifetime ----------------------------------------------------
    def describe(self) -> dict[str, Any]:
        limit = self.pool.limit
        return {
            "streams": {dev: "non-blocking copy stream" for dev in sorted(self._lanes)},
            "cudaMemcpyBatchAsync": self._batch_note or "not probed yet",
            "pinned bytes": self.pool.used,
            "pinned pool limit": "none" if limit is None else limit,
            "completion": "cudaEventSynchronize, " + ("blocking" if self.params["blocking_sync"] else "spinning"),
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
            pins = list(self._pins.values())
            self._pins.clear()
        for lane in lanes:
            lane.close()
        rt = self._rt
        for pin in pins:
            err = rt.cudaHostUnregister(pin.addr)[0]
            self.pool.release(pin.length)
            if not _ok(rt, err):
                log.warning("cuda: %s", cuda_error(rt, err, f"cudaHostUnregister({pin.addr:#x})"))


def _version(v: int | None) -> str:
    if not v:
        return "none"
    return f"{v // 1000}.{(v % 1000) // 10}"


def _batch_support(rt) -> tuple[bool, str]:
    """Whether cudaMemcpyBatchAsync can be used here, and why not."""
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        return False, "not in this cuda-python (needs cuda-python >= 12.8)"
    err, run = rt.cudaRuntimeGetVersion()
    if not _ok(rt, err) or run < BATCH_MIN_VERSION:
        return False, f"CUDA runtime {_version(run)} predates 12.8"
    err, drv = rt.cudaDriverGetVersion()
    if not _ok(rt, err) or not drv:
        return False, "no CUDA driver"
    if drv < BATCH_MIN_VERSION:
        return False, f"CUDA driver {_version(drv)} predates 12.8"
    return True, f"used (runtime {_version(run)}, driver {_version(drv)})"
