"""Linux native AIO (io_submit / io_getevents) through ctypes: many O_DIRECT reads or writes per syscall.

A thread pool of blocking preadv/pwritev keeps only as many I/Os in flight
as it has threads, and pays a Python call and a thread wake-up per I/O. Here
a batch of I/Os is described once as a numpy array of ``struct iocb``
(prepare once, post many) and handed to the kernel ``depth`` at a time in
one syscall; completions are reaped in bulk with the GIL released. Only
x86_64 and aarch64 Linux, and only files opened with O_DIRECT (buffered
files make io_submit synchronous).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ...errors import BackendUnavailable

_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE, IOCB_CMD_PREADV, IOCB_CMD_PWRITEV = 0, 1, 7, 8

#: struct iocb from <linux/aio_abi.h>, little-endian 64-bit layout (64 bytes)
IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<i4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
#: struct io_event (32 bytes)
IO_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and IO_EVENT.itemsize == 32

log = logging.getLogger("datamover.posix")

#: the longest one io_getevents sleeps in a bounded reap (a limit, or a cancel it must notice); a wake-up per slice
#: costs nothing next to a batch that takes that long
WAIT_SLICE_S = 0.1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None
_nr: dict[str, int] = {}
_status: tuple[bool, str] | None = None


_NR_SUBMIT = _NR_GETEVENTS = -1  # set by aio_available(): the hot paths call libc's syscall() with them directly


def _syscall(name: str, *args) -> int:
    ret = _libc.syscall(_nr[name], *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return ret


def aio_available() -> tuple[bool, str]:
    """Whether native AIO works here (the syscalls exist and a context can be created), and why not."""
    global _libc, _status, _NR_SUBMIT, _NR_GETEVENTS
    if _status is not None:
        return _status
    arch = platform.machine()
    if not sys.platform.startswith("linux") or arch not in _SYSCALLS or sys.byteorder != "little":
        _status = (False, f"native AIO is only wired up for little-endian Linux on {', '.join(_SYSCALLS)}")
        return _status
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long
    _nr.update(_SYSCALLS[arch])
    _NR_SUBMIT, _NR_GETEVENTS = _nr["io_submit"], _nr["io_getevents"]
    ctx = ctypes.c_ulong(0)
    try:
        _syscall("io_setup", ctypes.c_uint(1), ctypes.byref(ctx))
        _syscall("io_destroy", ctx)
        _status = (True, "ok")
    except OSError as exc:
        _status = (False, f"io_setup failed: {exc.strerror}")
    return _status


class IocbBatch:
    """A prepared batch of I/Os, one iocb per group of rows, built once with numpy.

    Rows ``starts[g]:starts[g+1]`` are contiguous in the file and become one
    vectored iocb (PREADV/PWRITEV over their buffers); a group of one row is
    a plain PREAD/PWRITE. ``expect[g]`` is the byte count group g must move.
    ``keep``: what owns the memory the iocbs point into, held as long as the batch (see ``AioContext.retire``).
    """

    def __init__(
        self,
        fds: np.ndarray,
        offsets: np.ndarray,
        addrs: np.ndarray,
        lengths: np.ndarray,
        write: bool,
        starts: np.ndarray | None = None,
        keep: object = None,
    ) -> None:
        self.keep = keep
        rows = int(lengths.shape[0])
        starts = np.arange(rows, dtype=np.int64) if starts is None else np.asarray(starts, dtype=np.int64)
        n = int(starts.shape[0])
        counts = np.diff(np.append(starts, rows))
        self.iov = np.empty((rows, 2), dtype=np.uint64)  # struct iovec {base, len}, kept alive with the iocbs
        self.iov[:, 0] = addrs
        self.iov[:, 1] = lengths
        single = counts == 1
        self.iocbs = np.zeros(n, dtype=IOCB)
        self.iocbs["data"] = np.arange(n, dtype=np.uint64)
        plain, vectored = (IOCB_CMD_PWRITE, IOCB_CMD_PWRITEV) if write else (IOCB_CMD_PREAD, IOCB_CMD_PREADV)
        self.iocbs["opcode"] = np.where(single, plain, vectored)
        self.iocbs["fildes"] = np.asarray(fds)[starts] if rows else 0
        iov_addr = self.iov.ctypes.data + starts.astype(np.uint64) * np.uint64(16)
        self.iocbs["buf"] = np.where(single, np.asarray(addrs, dtype=np.uint64)[starts], iov_addr) if rows else 0
        self.iocbs["nbytes"] = np.where(single, np.asarray(lengths)[starts], counts) if rows else 0
        self.iocbs["offset"] = np.asarray(offsets)[starts] if rows else 0
        base = self.iocbs.ctypes.data if n else 0
        self.ptrs = (base + np.arange(n, dtype=np.uint64) * np.uint64(IOCB.itemsize)).astype(np.uint64)
        self.ptrs_addr = int(self.ptrs.ctypes.data)  # looked up once: ndarray.ctypes costs microseconds
        self.expect = np.add.reduceat(np.asarray(lengths, dtype=np.int64), starts) if rows else np.zeros(0, np.int64)
        self.total = int(self.expect.sum())  # bytes the whole batch moves when every I/O completes in full
        self.write = write
        # the io_submit arguments for "all of it", built once: ctypes objects cost microseconds per post
        self.c_count, self.c_ptrs = ctypes.c_long(n), ctypes.c_void_p(self.ptrs_addr)
        self.n = n

    def __len__(self) -> int:
        return self.n


class AioContext:
    """One kernel AIO context with room for ``depth`` I/Os in flight; runs a batch to completion."""

    def __init__(self, depth: int = 128, spin_us: float = 0.0) -> None:
        ok, reason = aio_available()
        if not ok:
            raise BackendUnavailable(reason, backend="posix")
        self.depth = int(depth)
        self.spin_s = float(spin_us) * 1e-6
        self._no_wait = _Timespec(0, 0)
        self._no_wait_ref = ctypes.byref(self._no_wait)
        self._slice = _Timespec(0, int(WAIT_SLICE_S * 1e9))
        self._slice_ref = ctypes.byref(self._slice)
        self._ended: threading.Event | None = None  # set by ``retire``: set once its io_destroy returned
        self._ctx = ctypes.c_ulong(0)
        _syscall("io_setup", ctypes.c_uint(self.depth), ctypes.byref(self._ctx))
        self._events = np.zeros(self.depth, dtype=IO_EVENT)
        self._events_ptr = ctypes.c_void_p(self._events.ctypes.data)
        # the events as int64 words (4 per event, res is word 2): summing res over a memoryview needs no numpy call
        self._words = memoryview(self._events).cast("B").cast("q")
        self._max_nr = ctypes.c_long(self.depth)
        self._lock = threading.Lock()  # one batch at a time per context

    def run(
        self, batch: IocbBatch, cancelled: Callable[[], bool] = lambda: False, first: int = 0, last: int | None = None
    ) -> np.ndarray:
        """Run rows [first, last) of ``batch``; returns each row's result: bytes moved, or -errno.

        Rows never submitted because ``cancelled()`` turned true read
        -ECANCELED. What is in flight is always reaped before returning, so
        no buffer is touched afterwards.
        """
        return self.start(batch, first, last, cancelled).finish(cancelled)

    def start(
        self,
        batch: IocbBatch,
        first: int = 0,
        last: int | None = None,
        cancelled: Callable[[], bool] | None = None,
        rows: bool = True,
    ) -> AioRun:
        """Submit the first ``depth`` rows now (io_submit does not wait for O_DIRECT I/O); finish() does the rest.

        The context is busy until ``finish`` returns, which may happen on another thread. With ``rows=False``
        the run keeps no per-row results, only whether every row moved all its bytes (``AioRun.ok``): what a
        caller that redoes the whole batch on any failure needs, without numpy work per completion.
        """
        self._lock.acquire()
        try:
            run = AioRun(self, batch, first, batch.n if last is None else last, rows)
            if cancelled is None and first == 0 and run.stop == batch.n and batch.n <= self.depth:
                # the common case, all of it in one io_submit, with nothing built per call
                got = _libc.syscall(_NR_SUBMIT, self._ctx, batch.c_count, batch.c_ptrs)
                if got == batch.n:
                    run.nxt = run.inflight = got
                    return run
                if got > 0:
                    run.nxt = run.inflight = got
            run.submit(cancelled)  # the rest, or all of it again after a refusal (errno recorded per iocb)
        except BaseException:
            self._lock.release()
            raise
        return run

    @property
    def alive(self) -> bool:
        """The kernel context still exists (not closed, not retired): it may run a batch."""
        return bool(self._ctx.value)

    @property
    def gone(self) -> bool:
        """Closed, or retired and its io_destroy returned: none of its I/Os is in flight any more."""
        return not self._ctx.value and (self._ended is None or self._ended.is_set())

    def retire(self, keep: object, wait_s: float | None = 0.0) -> bool:
        """Take the context out of use for good while I/Os of it may be in flight, by the run holding it, and
        destroy it on a thread of its own: io_destroy returns once they ended (on a hung device, never; O_DIRECT AIO
        cannot be cancelled). ``keep`` (the batch, and through it the memory its I/Os move) stays referenced until
        then, so that memory is not freed under them. True if the destroy returned within ``wait_s`` s (None: no
        bound)."""
        handle, self._ctx = self._ctx.value, ctypes.c_ulong(0)
        ended = self._ended = threading.Event()
        try:
            threading.Thread(
                target=_destroy_when_ended, args=(handle, ended, keep), name="dm-aio-destroy", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had (interpreter shutdown): never destroyed, ``keep`` never freed
            _NEVER_ENDED.append(keep)
        if ended.wait(wait_s):
            return True
        log.warning(
            "posix: AIO I/Os did not end (a hung device?): their context is retired and destroyed once they do; until"
            " then the memory they read or write stays allocated, and their bytes may still land"
        )
        return False

    def close(self, timeout: float = 10.0) -> bool:
        """Destroy the kernel context once no run holds it, waiting ``timeout`` s at most in all: for a run holding
        it (then it is left alone), or for a retired context's I/Os to end (then they are left to its destroy
        thread, which keeps the memory they move). True once it is ``gone``."""
        end = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            # a run that was started and never finished: its reaper may still call io_getevents on this context
            log.warning("AIO context still busy after %.1f s at close; leaving it to the process exit", timeout)
            return False
        try:
            if self._ctx.value:
                # returns at once: no I/O of it is in flight (a run that leaves any retires the context first)
                _syscall("io_destroy", self._ctx)
                self._ctx = ctypes.c_ulong(0)
        finally:
            self._lock.release()
        ended = self._ended
        if ended is not None and not ended.wait(max(0.0, end - time.monotonic())):
            log.warning(
                "posix: a retired AIO context's I/Os have not ended %.1f s into close (a hung device?); left to its"
                " destroy thread, which keeps the memory they move until they do",
                timeout,
            )
            return False
        return True

    def __del__(self) -> None:
        try:
            if self.alive:
                self.close(timeout=0)
        except Exception:
            pass


#: what retired contexts that could not be destroyed keep (see ``AioContext.retire``): never freed
_NEVER_ENDED: list[object] = []


def _destroy_when_ended(handle: int, ended: threading.Event, keep: object) -> None:
    """io_destroy a retired context, which returns once every I/O of it ended; ``keep`` is let go after that."""
    try:
        _syscall("io_destroy", ctypes.c_ulong(handle))
    except OSError as exc:  # EINVAL: no such context in the kernel, so no I/O of it either
        log.warning("posix: io_destroy of a retired AIO context failed (%s)", exc)
    ended.set()
    log.info("posix: a retired AIO context is destroyed: its I/Os ended")


class AioRun:
    """One batch in flight on an AioContext: ``submit`` tops up the queue, ``finish`` reaps until all are done.

    ``moved`` sums every completion's result (bytes, or -errno). ``refused``: a row was refused by io_submit, or
    lost with its context when io_getevents failed. The kernel
    never reports more bytes than an I/O asked for, so ``moved`` equals the
    batch's expected bytes only if every I/O moved all of its bytes: ``ok``.
    """

    __slots__ = ("batch", "ctx", "expected", "first", "inflight", "moved", "nxt", "refused", "res", "stop")

    def __init__(self, ctx: AioContext, batch: IocbBatch, first: int, stop: int, rows: bool = True) -> None:
        self.ctx, self.batch, self.first, self.stop = ctx, batch, first, stop
        self.res = np.full(stop - first, -errno_mod.ECANCELED, dtype=np.int64) if rows else None
        self.nxt, self.inflight, self.moved, self.refused = first, 0, 0, False
        self.expected = batch.total if first == 0 and stop == batch.n else int(batch.expect[first:stop].sum())

    @property
    def ok(self) -> bool:
        """Every row of the run was submitted and moved all of its bytes."""
        return not self.refused and self.nxt >= self.stop and not self.inflight and self.moved == self.expected

    def submit(self, cancelled: Callable[[], bool] | None = None) -> None:
        """Submit rows until ``depth`` are in flight or none are left."""
        ctx = self.ctx
        depth = ctx.depth
        batch = self.batch
        while self.nxt < self.stop and self.inflight < depth and (cancelled is None or not cancelled()):
            want = min(depth - self.inflight, self.stop - self.nxt)
            if self.nxt == 0 and want == batch.c_count.value:
                count, ptr = batch.c_count, batch.c_ptrs  # the whole batch at once: the common case
            else:
                count, ptr = ctypes.c_long(want), ctypes.c_void_p(batch.ptrs_addr + self.nxt * 8)
            got = _libc.syscall(_NR_SUBMIT, ctx._ctx, count, ptr)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno_mod.EINTR or (err == errno_mod.EAGAIN and self.inflight):
                    return
                # the kernel refused this iocb (EINVAL, EBADF, ...): record it, go on with the next
                if self.res is not None:
                    self.res[self.nxt - self.first] = -(err or errno_mod.EIO)
                self.refused = True
                self.nxt += 1
                continue
            self.nxt += got
            self.inflight += got
            if got < want:
                return

    def finish(
        self,
        cancelled: Callable[[], bool] | None = None,
        spin: bool = True,
        limit_s: float | None = None,
        grace_s: float | None = None,
    ) -> np.ndarray | None:
        """Reap (GIL released while waiting) and keep the queue full until every row is done; frees the context.

        Returns the per-row results (None for a run started with ``rows=False``; see ``ok``). With ``limit_s``
        it returns after that many seconds even with I/Os still in flight, and with ``grace_s`` at most that long
        after it sees ``cancelled()`` turn true: a hung device (I/Os that never end) holds no thread for ever. A run
        that returns with I/Os ``inflight`` has retired its context (``AioContext.retire``): their completions are
        still to come, and no other run may count them.
        Each wait asks for a quarter of the queue (or all that is in flight
        once nothing is left to submit), so a batch costs a few wake-ups,
        not one per I/O. With ``spin_us`` (and ``spin``), the last ones are first polled for
        that long (a thread woken from sleep is late by tens of microseconds).
        """
        ctx = self.ctx
        words = ctx._words
        spin_until = None
        spin_s = ctx.spin_s if spin else 0.0
        limit_at = None if limit_s is None else time.monotonic() + limit_s
        watch = cancelled if grace_s is not None else None  # a cancel not seen yet, which brings the limit in
        last = False  # the limit passed: one poll more, and it gives up if that reaps nothing
        try:
            while True:
                if self.nxt < self.stop:
                    self.submit(cancelled)
                if not self.inflight:
                    if self.nxt >= self.stop or (cancelled is not None and cancelled()):
                        return self.res
                    continue
                if watch is not None and watch():
                    watch, give_up_at = None, time.monotonic() + grace_s  # type: ignore[operator]
                    limit_at = give_up_at if limit_at is None else min(limit_at, give_up_at)
                # one wake-up per quarter queue, or for everything once nothing is left to submit
                refill = self.nxt < self.stop and (cancelled is None or not cancelled())
                min_nr = max(1, min(self.inflight, ctx.depth // 4)) if refill else self.inflight
                timeout = None
                if spin_s:
                    if not refill and spin_until is None:
                        spin_until = time.perf_counter() + spin_s
                    if spin_until is not None and time.perf_counter() < spin_until:
                        min_nr, timeout = 0, ctx._no_wait_ref  # poll: a sleeping thread wakes late
                if timeout is None and (limit_at is not None or watch is not None):
                    timeout = ctx._slice_ref  # a slice at a time: the limit, or a cancel, is seen when it comes
                    if limit_at is not None:
                        left = limit_at - time.monotonic()
                        if left <= 0:  # a reap that starts late still takes what ended meanwhile
                            min_nr, timeout, last = 0, ctx._no_wait_ref, True
                        elif left < WAIT_SLICE_S:
                            timeout = ctypes.byref(_Timespec(0, int(left * 1e9)))
                n = _libc.syscall(_NR_GETEVENTS, ctx._ctx, ctypes.c_long(min_nr), ctx._max_nr, ctx._events_ptr, timeout)
                if n < 0:
                    err = ctypes.get_errno()
                    if err == errno_mod.EINTR:
                        continue
                    self._lose(err or errno_mod.EIO, f"io_getevents failed: {os.strerror(err)}", limit_at)
                    return self.res
                if n:
                    self.moved += sum(words[2 : 4 * n : 4])
                    if self.res is not None:
                        done = ctx._events[:n]
                        self.res[done["data"].astype(np.int64) - self.first] = done["res"]
                    self.inflight -= n
                elif last:
                    return self.res
        except BaseException as exc:
            if self.inflight:  # Ctrl-C, or a failure here: it leaves only once the kernel is done with the buffers
                self._lose(errno_mod.EINTR, f"{type(exc).__name__} while reaping", limit_at)
            raise
        finally:
            if self.inflight and ctx.alive:  # given up on: no other run may count their events
                ctx.retire(self.batch)
            ctx._lock.release()

    def _lose(self, err: int, why: str, limit_at: float | None) -> None:
        """The I/Os in flight can no longer be reaped: retire the context, whose io_destroy waits for them to end,
        and wait for that until ``limit_at`` (None: no bound). What they moved is unknown: their rows read ``-err``
        and the run is not ``ok`` (refused). Those that did not end by then (a hung device) stay ``inflight``."""
        log.warning("posix: %s with %d AIO I/Os in flight; destroying the context (waits for them)", why, self.inflight)
        wait_s = None if limit_at is None else max(0.0, limit_at - time.monotonic())
        if self.ctx.retire(self.batch, wait_s):
            self.inflight = 0
        if self.res is not None:
            sent = self.res[: self.nxt - self.first]
            sent[sent == -errno_mod.ECANCELED] = -err
        self.refused = True
