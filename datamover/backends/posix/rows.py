"""posix rows moved by synchronous system calls: one preadv/pwritev resumed until every byte moved, and rows
O_DIRECT cannot take (unaligned offset, length or address) through an aligned bounce buffer, read-modify-write for
partial blocks; the bounce buffers are shared and bounded (``BouncePool``). A row goes on past a syscall only while
its transfer does (``Halt``), and a failed one is a typed error naming the caller's descriptor (``row_error``)."""

from __future__ import annotations

import errno as errno_mod
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...descriptors import aligned_empty
from ...errors import DatamoverError, TransferAborted, TransferIOError, TransferTimeout
from ..base import Completion, clock


class Halted(Exception):
    """A row stopped before its next syscall (``Halt``): ``moved`` bytes of the call under way had gone."""

    def __init__(self, moved: int = 0) -> None:
        super().__init__(moved)
        self.moved = moved


class Halt:
    """Whether a transfer's rows stop, asked before each syscall but a row's first (a short one resumed, a bounce
    piece or block) and before the caller's memory takes what one brought back: a syscall stuck on a hung device
    outlives its transfer, and what it does on its return must not reach the caller.

    A pool part stops once its completion is cancelled: a timeout or a release (whose fence may have given up on the
    part while its syscall was stuck), or another part's failure. Work run inside ``post``, which nothing can cancel
    (its transfer's lock is held; ``Transfer`` gives up on it ``FENCE_S`` past its deadline), stops once its
    ``deadline`` passed, asked before each of its groups too."""

    __slots__ = ("completion", "deadline")

    def __init__(self, completion: Completion, deadline: float = math.inf) -> None:
        self.completion, self.deadline = completion, deadline

    def __call__(self) -> bool:
        return self.completion.cancelled or clock() > self.deadline

    def error(self, index: int, write: bool, path: str, backend: str) -> DatamoverError:
        """The typed error of a row stopped at the caller's descriptor ``index``."""
        what = f"{'WRITE to' if write else 'READ from'} {path!r} stopped at descriptor {index}"
        if self.completion.cancelled:
            why = "the transfer was cancelled (timed out, released, or another part failed) during a syscall of it"
            return TransferAborted(f"{what}: {why}; nothing more of it was moved", index=index, backend=backend)
        why = "past its deadline inside post(), where nothing else stops it"
        return TransferTimeout(f"{what}: {why}; nothing more of it was moved", index=index, backend=backend)


@dataclass
class FileHandle:
    """An open registered file: its fd, whether it is O_DIRECT, and a lock for read-modify-write.

    ``tail_fd`` is the same file opened buffered, on first need (``-1`` until then): an unaligned write whose
    last block lies past the end of the file goes through it, so the file grows to the end of the caller's bytes
    and not a byte further.

    Parts on pool threads ``hold`` the file while they run: ``close`` leaves it open until the last one ``drop``s it
    (a part still inside a syscall on a hung device, past its transfer's cancel, may issue more on the fd)."""

    fd: int
    path: str
    direct: bool
    size: int
    note: str = ""
    rmw_lock: threading.Lock = field(default_factory=threading.Lock)
    tail_fd: int = -1
    users: int = 0
    closing: bool = False
    closed: bool = False
    use_lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self) -> None:
        """A part starts on this file: its fds stay open until the matching ``drop``."""
        with self.use_lock:
            self.users += 1

    def drop(self) -> None:
        """A part is done with this file: the last one closes it if ``close`` was called meanwhile."""
        with self.use_lock:
            self.users -= 1
            last = self.closing and not self.users
            if last:
                self.closing = False
        if last:
            self._close_fds()

    def close(self) -> bool:
        """Close the file now (True), or when the last part holding it drops it (False).

        An I/O the kernel has taken (an AIO in flight, a syscall under way) holds the open file itself, so closing
        the fd does not touch it; what must not outlive the fd is a syscall still to be issued on its number, which
        any open in the process may take over: a part that resumes a short pwritev would write into that file."""
        with self.use_lock:
            if self.users:
                self.closing = True
                return False
        self._close_fds()
        return True

    def _close_fds(self) -> None:
        self.closed = True
        os.close(self.fd)
        if self.tail_fd >= 0:
            os.close(self.tail_fd)


def vectored(
    fd: int, views: list[memoryview], offset: int, write: bool, halt: Callable[[], bool] | None = None
) -> None:
    """One preadv/pwritev, resumed until every byte moved (short I/O is retried) while ``halt()`` is False: else
    ``Halted``, and no later call touches ``views``."""
    n = os.pwritev(fd, views, offset) if write else os.preadv(fd, views, offset)
    if n == sum(v.nbytes for v in views):
        return
    views, moved = list(views), 0
    while True:
        if n == 0:
            err = OSError(errno_mod.EIO, "pwritev wrote 0 bytes") if write else EOFError(f"no bytes at {offset}")
            err.moved = moved  # type: ignore[attr-defined]  # what did move names the failing row
            raise err
        offset += n
        moved += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if not views:
            return
        if n:
            views[0] = views[0][n:]
        if halt is not None and halt():
            raise Halted(moved)
        try:
            n = os.pwritev(fd, views, offset) if write else os.preadv(fd, views, offset)
        except OSError as exc:
            exc.moved = moved  # type: ignore[attr-defined]
            raise


def read_upto(h: FileHandle, span: np.ndarray, offset: int, halt: Callable[[], bool] | None = None) -> int:
    """Read as much of ``span`` as the file holds; returns the byte count (short only at EOF). A short read is
    resumed while ``halt()`` is False: else ``Halted``."""
    got = 0
    mv = memoryview(span).cast("B")
    while got < span.shape[0]:
        if got and halt is not None and halt():
            raise Halted(got)
        try:
            n = os.preadv(h.fd, [mv[got:]], offset + got)
        except OSError as exc:
            exc.moved = got  # type: ignore[attr-defined]  # what did move names the failing byte
            raise
        if n == 0:
            break
        got += n
    return got


def read_block(h: FileHandle, block: np.ndarray, offset: int, halt: Callable[[], bool] | None = None) -> None:
    got = read_upto(h, block, offset, halt)
    if got < block.shape[0]:
        block[got:] = 0


def tail_fd(h: FileHandle) -> int:
    """``h``'s file opened buffered (once; under ``h.rmw_lock``), checked to be the file ``h.fd`` is."""
    if h.tail_fd < 0:
        try:
            fd = os.open(f"/proc/self/fd/{h.fd}", os.O_RDWR)  # the file itself, renamed or unlinked since
        except OSError:
            fd = os.open(h.path, os.O_RDWR)
        now, then = os.fstat(fd), os.fstat(h.fd)
        if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
            os.close(fd)
            raise OSError(errno_mod.ESTALE, "the path no longer names the file registered there")
        h.tail_fd = fd
    return h.tail_fd


class BouncePool:
    """Aligned bounce buffers of ``size`` bytes, one per unaligned row in flight, shared by the pool threads and
    inline callers; at most ``keep`` are kept between rows (any number of caller threads may run unaligned rows at
    once: what they leave behind stays within keep x size)."""

    def __init__(self, size: int, alignment: int, keep: int) -> None:
        self.size, self.alignment, self.keep = size, alignment, keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        """A bounce buffer for one row: a kept one, else a new one (hand it back with ``give``)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return aligned_empty(self.size, self.alignment)

    def give(self, buf: np.ndarray) -> None:
        """Keep ``buf`` for the next row unless ``keep`` are kept already."""
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


def bounce_row(
    req: Any,
    h: FileHandle,
    row: int,
    offset: int,
    view: memoryview,
    write: bool,
    halt: Halt,
    bounce: np.ndarray,
    alignment: int,
    backend: str,
) -> None:
    """Move an unaligned row through the aligned ``bounce`` buffer, a bounce-sized piece at a time, each syscall and
    each copy to or from the caller's memory only while ``halt()`` is False: partial blocks read, modified and
    written back under the file's ``rmw_lock``. A failure is a typed error naming the caller's byte where it stopped."""
    user = np.frombuffer(view, dtype=np.uint8)
    A = alignment
    step = bounce.shape[0] - 2 * A
    done = 0
    total = user.shape[0]
    while done < total:
        piece = min(step, total - done)
        off = offset + done
        lo = off - off % A
        hi = -(-(off + piece) // A) * A
        span = bounce[: hi - lo]
        at = lo  # the file offset the call under way starts at: a failure names the descriptor of its byte
        try:
            _go_on(halt)
            if write:
                with h.rmw_lock:
                    if (off + piece) % A and hi > os.fstat(h.fd).st_size:
                        # the piece's last block reaches past the end of the file: a whole-block write would
                        # grow it past the caller's bytes, and cutting it back could cut off a write that grew
                        # it meanwhile; a buffered write grows it to the end of the caller's bytes at most
                        at = off
                        vectored(tail_fd(h), [memoryview(user[done : done + piece])], off, True, halt)
                    else:
                        if off != lo:
                            read_block(h, span[:A], lo, halt)
                        if (off + piece) % A and (hi - A != lo or off == lo):
                            at = hi - A
                            _go_on(halt)
                            read_block(h, span[-A:], at, halt)
                        at = lo
                        _go_on(halt)
                        span[off - lo : off - lo + piece] = user[done : done + piece]
                        vectored(h.fd, [span], lo, True, halt)
            else:
                got = read_upto(h, span, lo, halt)
                _go_on(halt)
                if got < off - lo + piece:
                    raise TransferIOError(
                        f"read past the end of {h.path!r}: wanted [{off}, {off + piece}), file ends at {lo + got}",
                        errno=errno_mod.EIO, index=req.caller_index(row, done + max(0, lo + got - off)),
                        backend=backend,
                    )  # fmt: skip
                user[done : done + piece] = span[off - lo : off - lo + piece]
        except (OSError, Halted) as exc:
            if isinstance(exc, TransferIOError):
                raise
            failed = at + getattr(exc, "moved", 0) - offset  # the caller's byte where the call stopped
            moved = min(max(failed, done), done + piece - 1)
            if isinstance(exc, Halted):
                raise halt.error(req.caller_index(row, moved), write, h.path, backend) from None
            raise row_error(req, row, h, exc, write, backend, moved) from exc
        done += piece


def _go_on(halt: Halt) -> None:
    if halt():
        raise Halted()


def row_error(
    req: Any,
    row: int,
    h: FileHandle,
    exc: OSError,
    write: bool,
    backend: str,
    moved: int = 0,
    views: list | None = None,
) -> TransferIOError:
    """A failed preadv/pwritev as a typed error: ``moved`` bytes of ``views`` (rows from ``row`` on, one call) went
    before ``exc``, which names the caller's descriptor (without ``views``, byte ``moved`` of row ``row``)."""
    what = "pwritev" if write else "preadv"
    return TransferIOError(
        f"{what} on {h.path!r} failed: {exc.strerror or exc}",
        errno=exc.errno,
        index=req.caller_index(row, moved) if views is None else index_at(req, row, views, moved),
        backend=backend,
    )


def index_at(req: Any, first: int, views: list, moved: int) -> int:
    """The caller's descriptor of byte ``moved`` of one vectored call over rows ``first``, ``first + 1``, ..."""
    for k, v in enumerate(views):
        if moved < v.nbytes or k == len(views) - 1:
            return req.caller_index(first + k, moved)
        moved -= v.nbytes
    return req.caller_index(first)
