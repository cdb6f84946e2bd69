"""gds: VRAM/DRAM <-> FILE through kvikio (cuFile / GPUDirect Storage, or its POSIX compat mode).

A registered file is opened once, as a ``kvikio.CuFile``, at registration.
``post`` hands the request to a few worker threads; each issues
``CuFile.pread``/``pwrite`` per coalesced row (kvikio splits a row into
``task_size`` tasks on its own thread pool) and waits on the returned
``IOFuture`` objects, keeping at most ``inflight`` of them outstanding. The
completion is a ``ReadFence`` entered by each worker for all it issues:
kvikio's threads write into (READ) or read (WRITE) the caller's memory until
its futures are waited on, so ERR and ``release`` come only after that, and
nothing is issued after.
kvikio's thread count, task size and compat mode come from this backend's
parameters. kvikio is imported on first use, never at ``import datamover``.
"""

from __future__ import annotations

import errno as errno_mod
import importlib.metadata
import importlib.util
import logging
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...descriptors import MemType
from ...errors import InvalidParameter, TransferIOError
from ...units import parse_size
from ..base import Backend, BackendHost, Completion, TransferRequest, run_parts, split_by_bytes
from ..cuda.backend import driver_missing
from ..fence import ReadFence

log = logging.getLogger("datamover.gds")

COMPAT_MODES = ("on", "off", "auto")
_config_lock = threading.Lock()


def _kvikio():
    import kvikio
    import kvikio.defaults

    return kvikio


class DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` as a 1-D uint8 ``__cuda_array_interface__`` (what kvikio reads)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def validate_params(params: dict[str, Any]) -> dict[str, Any]:
    """Check and normalise the gds backend's parameters; raises ValueError naming the bad one."""
    out = dict(params)
    for key in ("threads", "workers", "inflight"):
        v = out[key]
        if key == "threads" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidParameter(f"parameter {key!r} must be a positive integer, got {v!r}", backend="gds")
    if out["task_size"] is not None:
        out["task_size"] = parse_size(out["task_size"], "gds parameter 'task_size'")
        if out["task_size"] == 0:
            raise InvalidParameter("parameter 'task_size' must be > 0", backend="gds")
    out["min_part_bytes"] = parse_size(out["min_part_bytes"], "gds parameter 'min_part_bytes'")
    mode = out["compat_mode"]
    if mode is not None:
        mode = str(mode).lower()
        if mode not in COMPAT_MODES:
            raise InvalidParameter(
                f"parameter 'compat_mode' must be one of {COMPAT_MODES} or None, got {mode!r}", backend="gds"
            )
        out["compat_mode"] = mode
    return out


def configure_kvikio(kvikio, threads: int | None, compat_mode: str | None) -> None:
    """Apply the process-wide kvikio settings (thread pool size, compat mode), old and new kvikio APIs."""
    d = kvikio.defaults
    with _config_lock:
        if compat_mode is not None:
            value = getattr(kvikio.CompatMode, compat_mode.upper()) if hasattr(kvikio, "CompatMode") else None
            if hasattr(d, "set"):
                d.set("compat_mode", value)
            else:  # kvikio < 24.12: compat_mode_reset(bool); 'auto' has no equivalent there
                d.compat_mode_reset(compat_mode == "on")
        if threads is not None:
            if hasattr(d, "set"):
                if d.get("num_threads") != threads:
                    d.set("num_threads", threads)
            elif d.get_num_threads() != threads:
                d.num_threads_reset(threads)


def kvikio_setting(kvikio, name: str) -> Any:
    """A kvikio default by its new name (``num_threads``, ``task_size``, ``compat_mode``) on any version."""
    d = kvikio.defaults
    if hasattr(d, "get"):
        return d.get(name)
    return {"num_threads": d.get_num_threads, "task_size": d.task_size, "compat_mode": d.compat_mode}[name]()


@dataclass
class FileHandle:
    """A registered file opened once as a kvikio CuFile."""

    cufile: Any
    path: str
    size: int


@dataclass(eq=False)
class GdsPlan:
    """One request's kvikio calls: ``rows`` = (row ids, buffers, sizes, file offsets, file handles), and the
    ``ranges`` of rows each worker takes."""

    rows: tuple[np.ndarray, list[Any], list[int], list[int], list[Any]]
    ranges: list[tuple[int, int]]


class GdsBackend(Backend):
    """GPU or host memory to and from registered files, with kvikio."""

    name = "gds"
    pairs = frozenset({(MemType.VRAM, MemType.FILE), (MemType.DRAM, MemType.FILE)})
    default_params = {
        # kvikio's thread pool size (process-wide); None leaves kvikio's setting (KVIKIO_NTHREADS)
        "threads": 8,
        # bytes per kvikio task; None uses kvikio's default (KVIKIO_TASK_SIZE, 4 MiB)
        "task_size": 4 << 20,
        # 'on' (POSIX only), 'off' (cuFile only), 'auto'; None leaves kvikio's setting (KVIKIO_COMPAT_MODE)
        "compat_mode": None,
        # our threads that issue kvikio calls and wait on their futures
        "workers": 4,
        # futures each worker keeps outstanding before waiting on the oldest
        "inflight": 64,
        # each worker gets at least this many bytes of a request
        "min_part_bytes": 1 << 20,
    }
    loose_params = frozenset({"threads", "task_size", "min_part_bytes"})  # None, sizes as "4M": validate_params

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        self.params = validate_params(self.params)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._kv = None

    @classmethod
    def available(cls) -> tuple[bool, str]:
        driver = driver_missing()
        if importlib.util.find_spec("kvikio") is None:
            if driver:
                return False, f"kvikio is not installed (pip install 'datamover[gds]'); it also needs libcuda: {driver}"
            return False, "kvikio is not installed (pip install 'datamover[gds]')"
        if driver:
            return False, f"kvikio needs libcuda: {driver}"
        try:
            kvikio = _kvikio()
        except Exception as exc:  # e.g. libcufile missing: report, never crash `datamover info`
            return False, f"kvikio cannot load: {type(exc).__name__}: {exc}"
        return True, f"kvikio {kvikio.__version__}, {_io_mode(kvikio)}"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        out: dict[str, Any] = {"driver": driver_missing() or "libcuda.so.1 loads"}
        if importlib.util.find_spec("kvikio") is None:
            out["kvikio"] = "not installed (pip install 'datamover[gds]')"
            return out
        if driver_missing():  # kvikio is not loaded without the driver it needs
            out["kvikio"] = _installed_version() or "installed"
            return out
        try:
            kvikio = _kvikio()
        except Exception as exc:
            out["kvikio"] = f"cannot load: {type(exc).__name__}: {exc}"
            return out
        out["kvikio"] = kvikio.__version__
        out["io"] = _io_mode(kvikio)
        return out

    def _kvikio(self):
        kv = self._kv
        if kv is None:
            with self._lock:
                if self._kv is None:
                    kv = _kvikio()
                    configure_kvikio(kv, self.params["threads"], self.params["compat_mode"])
                    self._pool = ThreadPoolExecutor(int(self.params["workers"]), thread_name_prefix="dm-gds")
                    self._kv = kv
                kv = self._kv
        return kv

    # -- registration ------------------------------------------------------------
    def register(self, reg) -> FileHandle | None:
        if reg.mem_type != MemType.FILE:
            return None
        kvikio = self._kvikio()
        try:
            cufile = kvikio.CuFile(reg.path, "r+")
        except (RuntimeError, OSError) as exc:
            raise TransferIOError(f"kvikio cannot open {reg.path!r}: {exc}", backend=self.name) from exc
        return FileHandle(cufile, reg.path, reg.length)

    def deregister(self, reg, handle: FileHandle | None) -> None:
        if handle is not None:
            handle.cufile.close()

    # -- planning ------------------------------------------------------------------
    def plan(self, req: TransferRequest) -> GdsPlan:
        self._kvikio()
        mem, fil = req.local, req.remote
        n = len(mem)
        keep = mem.length > 0
        rows = np.arange(n, dtype=np.int64) if keep.all() else np.flatnonzero(keep)
        ln = mem.length[rows]
        file_ids = np.unique(req.remote_regions[rows])
        handles = np.empty(file_ids.shape[0], dtype=object)
        handles[:] = [req.registrations[int(r)].handles[self.name] for r in file_ids.tolist()]
        files = handles[np.searchsorted(file_ids, req.remote_regions[rows])].tolist()
        addr = mem.addr[rows]
        if mem.mem_type == MemType.VRAM:
            bufs = [DeviceBytes(a, z) for a, z in zip(addr.tolist(), ln.tolist())]
        else:
            mem_regs = req.local_regions[rows]
            base = np.array([req.registrations[int(r)].addr for r in mem_regs.tolist()], dtype=np.int64)
            off = (addr - base).tolist()
            arrays = [req.registrations[int(r)].array for r in mem_regs.tolist()]
            bufs = [arr[o : o + z] for arr, o, z in zip(arrays, off, ln.tolist())]
        return GdsPlan(
            rows=(rows, bufs, ln.tolist(), fil.addr[rows].tolist(), files),
            ranges=split_by_bytes(ln, int(self.params["workers"]), int(self.params["min_part_bytes"])),
        )

    # -- execution -----------------------------------------------------------------
    def post(self, req: TransferRequest) -> Completion:
        write = req.op == "WRITE"

        def work(a: int, b: int, completion: Completion) -> None:
            self._run(req, a, b, write, completion)

        return run_parts(self._pool, req.plan.ranges, work, backend=self.name, completion_type=ReadFence)

    def _run(self, req: TransferRequest, first: int, last: int, write: bool, completion: Completion) -> None:
        fence = completion if type(completion) is ReadFence else None
        if fence is None:
            return self._issue(req, first, last, write, completion)
        if not fence.enter():
            return None
        try:
            return self._issue(req, first, last, write, completion)
        finally:
            fence.leave()  # every future this part issued was waited on

    def _issue(self, req: TransferRequest, first: int, last: int, write: bool, completion: Completion) -> None:
        """Rows [first, last) as kvikio calls, ``inflight`` at a time; returns once every one issued has ended."""
        rows, bufs, sizes, offsets, files = req.plan.rows
        task_size = self.params["task_size"]
        inflight = int(self.params["inflight"])
        pending: deque = deque()
        error: BaseException | None = None
        for i in range(first, last):
            if completion.cancelled:
                break
            h = files[i]
            try:
                if write:
                    fut = h.cufile.pwrite(bufs[i], sizes[i], offsets[i], task_size)
                else:
                    fut = h.cufile.pread(bufs[i], sizes[i], offsets[i], task_size)
            except (RuntimeError, OSError) as exc:
                error = self._error(req, rows, i, h, write, exc)
                break
            pending.append((i, fut))
            if len(pending) >= inflight:
                error = self._reap(req, rows, pending.popleft(), files, sizes, write)
                if error is not None:
                    break
        while pending:  # every issued future is waited on: its buffer is in use until then
            err = self._reap(req, rows, pending.popleft(), files, sizes, write)
            error = error or err
        if error is not None:
            raise error

    def _reap(self, req, rows, item, files, sizes, write: bool) -> TransferIOError | None:
        i, fut = item
        try:
            got = fut.get()
        except (RuntimeError, OSError) as exc:
            return self._error(req, rows, i, files[i], write, exc)
        if got != sizes[i]:
            what = "wrote" if write else "read"
            return TransferIOError(
                f"kvikio {what} {got} of {sizes[i]} bytes on {files[i].path!r}"
                + ("" if write else " (past the end of the file?)"),
                errno=errno_mod.EIO,
                index=req.caller_index(int(rows[i])),
                backend=self.name,
            )
        return None

    def _error(self, req, rows, i: int, h: FileHandle, write: bool, exc: BaseException) -> TransferIOError:
        what = "pwrite" if write else "pread"
        return TransferIOError(
            f"kvikio {what} on {h.path!r} failed: {exc}",
            errno=getattr(exc, "errno", None) or errno_mod.EIO,
            index=req.caller_index(int(rows[i])),
            backend=self.name,
        )

    # -- reporting and lifetime ----------------------------------------------------
    def describe(self) -> dict[str, Any]:
        kvikio = self._kvikio()
        return {
            "kvikio": kvikio.__version__,
            "io": _io_mode(kvikio),
            "threads": kvikio_setting(kvikio, "num_threads"),
            "task_size": self.params["task_size"] or kvikio_setting(kvikio, "task_size"),
            "workers": self.params["workers"],
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _installed_version() -> str | None:
    """kvikio's version from its distribution's metadata, without importing it."""
    for dist in ("kvikio-cu12", "kvikio-cu13", "kvikio"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _io_mode(kvikio) -> str:
    """Whether kvikio will use cuFile (GDS) or its POSIX compat mode here."""
    try:
        preferred = kvikio.defaults.is_compat_mode_preferred()
    except AttributeError:
        preferred = bool(kvikio.defaults.compat_mode())
    return "POSIX compat mode (cuFile not used)" if preferred else "cuFile (GPUDirect Storage)"
