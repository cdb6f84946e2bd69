"""Cross-memory attach: a same-host peer's registered memory read and written with process_vm_readv/writev.

UCX's cma transport makes one syscall per put or get; here one syscall moves
up to ``IOV_MAX`` rows (the kernel's limit per side), from iovec arrays built
once per prepared request with numpy. A dying peer makes the syscall fail
(ESRCH, EFAULT) instead of aborting this process, as UCX does with error
handling off. A peer is written this way only after a probe showed that its
pid is that very peer on this host and that the kernel lets this process
attach to it (same user; ptrace_scope and container policy permitting): the
peer offers a random token and its address, and this process reads it back.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..base import cap_runs

_TOKEN_BYTES = 32
#: the largest pid Linux hands out (PID_MAX_LIMIT)
_PID_MAX = 1 << 22

_ARGS = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_fns: tuple[Any, Any] | None = None


def _calls() -> tuple[Any, Any] | None:
    """libc's (process_vm_readv, process_vm_writev), or None where there are none."""
    global _fns
    if _fns is None and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        fns = tuple(getattr(libc, name, None) for name in ("process_vm_readv", "process_vm_writev"))
        if all(fn is not None for fn in fns):
            for fn in fns:
                fn.restype, fn.argtypes = ctypes.c_ssize_t, _ARGS
            _fns = fns  # type: ignore[assignment]
    return _fns


def availability(yama: str = "/proc/sys/kernel/yama/ptrace_scope") -> str:
    """What this host allows direct cma to do, for ``datamover info`` (each peer is still probed)."""
    if _calls() is None:
        return "unavailable: no process_vm_readv/writev on this platform"
    try:
        with open(yama) as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return "available: same-user peers on this host (no Yama ptrace restriction)"
    return {
        0: "available: same-user peers on this host (Yama ptrace_scope=0)",
        1: "limited: Yama ptrace_scope=1 lets a process attach only to its descendants; other peers use UCX",
        2: "limited: Yama ptrace_scope=2 needs CAP_SYS_PTRACE; without it peers use UCX",
    }.get(scope, f"off: Yama ptrace_scope={scope} forbids attaching; peers use UCX")


class Token:
    """What a target offers so that same-host peers can prove they may attach to it: pid, address, bytes."""

    def __init__(self) -> None:
        self._buf = np.frombuffer(bytearray(os.urandom(_TOKEN_BYTES)), dtype=np.uint8)

    def offer(self) -> dict[str, Any]:
        offer = {"pid": os.getpid(), "addr": int(self._buf.ctypes.data), "token": self._buf.tobytes()}
        pidns = pid_namespace()
        if pidns:
            offer["pidns"] = pidns
        return offer


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def probe(offer: Mapping[str, Any] | None) -> tuple[int, str]:
    """(the peer's pid, "ok") when this process can attach to the peer that made ``offer``, else (0, why not)."""
    if not offer:
        return 0, "the peer offered no token (another host, or cma disabled there)"
    calls = _calls()
    if calls is None:
        return 0, "process_vm_readv is unavailable on this platform"
    pid, addr, token = offer.get("pid"), offer.get("addr"), offer.get("token")
    if not (
        type(pid) is int
        and 0 < pid <= _PID_MAX
        and type(addr) is int
        and 0 <= addr < 1 << 63
        and type(token) is bytes
        and len(token) == _TOKEN_BYTES
    ):  # checked before use: int() or bytes() of a peer's field could allocate 2**62 bytes, or overflow a uint64
        return 0, "malformed token offer"
    if pid == os.getpid():
        return 0, "the peer is this very process (UCX serves it)"
    theirs, ours = offer.get("pidns"), pid_namespace()
    if isinstance(theirs, int) and theirs and ours and theirs != ours:
        return 0, "the peer is in another pid namespace (another host or container): its pid means nothing here"
    got = np.zeros(_TOKEN_BYTES, dtype=np.uint8)
    local = np.array([[got.ctypes.data, _TOKEN_BYTES]], dtype=np.uint64)
    remote = np.array([[addr, _TOKEN_BYTES]], dtype=np.uint64)
    n = calls[0](pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
    if n < 0:
        err = ctypes.get_errno()
        return 0, f"process_vm_readv of the peer's token failed: {errno_mod.errorcode.get(err, err)}"
    if n != _TOKEN_BYTES or got.tobytes() != token:
        return 0, f"pid {pid} on this host is not that peer (token differs)"
    return pid, "ok"


class CmaPlan:
    """One request's rows as iovec pairs, cut into chunks of one syscall each.

    ``local`` and ``remote`` are (rows, 2) uint64 arrays of {address,
    length}. A chunk holds at most ``IOV_MAX`` rows and, unless one row is
    larger, at most ``chunk_bytes``: the unit a caller can stop between
    (cancel, deadline) and spread over threads; a row larger than
    ``chunk_bytes`` is cut into pieces of that size first, so that one big
    row can be copied by several threads too. ``chunks`` lists (first piece,
    end piece, bytes); ``row_of`` maps a piece back to its row.
    """

    __slots__ = ("bases", "chunks", "ends", "local", "nbytes", "ranges", "remote", "row_of")

    def __init__(
        self, local_addr: np.ndarray, remote_addr: np.ndarray, lengths: np.ndarray, chunk_bytes: int = 8 << 20
    ) -> None:
        if _calls() is None:
            raise OSError(errno_mod.ENOSYS, "process_vm_readv/writev are unavailable on this platform")
        lengths = np.asarray(lengths, dtype=np.int64)
        local_addr, remote_addr = np.asarray(local_addr, dtype=np.int64), np.asarray(remote_addr, dtype=np.int64)
        self.row_of: np.ndarray | None = None
        if lengths.shape[0] and int(lengths.max()) > chunk_bytes:
            pieces = -(-lengths // chunk_bytes)
            self.row_of = np.repeat(np.arange(lengths.shape[0]), pieces)
            into = (np.arange(self.row_of.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * chunk_bytes
            local_addr = local_addr[self.row_of] + into
            remote_addr = remote_addr[self.row_of] + into
            lengths = np.minimum(lengths[self.row_of] - into, chunk_bytes)
        n = int(lengths.shape[0])
        self.local = np.empty((n, 2), dtype=np.uint64)
        self.remote = np.empty((n, 2), dtype=np.uint64)
        self.local[:, 0], self.remote[:, 0] = local_addr, remote_addr
        self.local[:, 1] = self.remote[:, 1] = lengths
        self.ends = np.cumsum(lengths)
        self.nbytes = int(self.ends[-1]) if n else 0
        starts = self.ends - lengths
        cut = np.ones(n, dtype=bool)
        cut[1:] = starts[1:] // chunk_bytes != starts[:-1] // chunk_bytes
        first = cap_runs(np.flatnonzero(cut), n)
        last = np.append(first[1:], n)
        nbytes = self.ends[last - 1] - starts[first] if n else np.zeros(0, dtype=np.int64)
        self.chunks = list(zip(first.tolist(), last.tolist(), nbytes.tolist()))
        self.ranges: list[tuple[int, int]] | None = None  # chunk ranges copied in parallel, set by the user
        self.bases = (self.local.ctypes.data, self.remote.ctypes.data)  # looked up once: microseconds each

    def run(self, pid: int, write: bool, first: int = 0, last: int | None = None) -> tuple[int, int] | None:
        """Copy chunks [first, last) to the peer (WRITE) or from it (READ): None when done, else (row, errno)."""
        fn = _fns[1] if write else _fns[0]  # type: ignore[index]
        lbase, rbase = self.bases
        for a, b, nbytes in self.chunks[first:last] if first or last is not None else self.chunks:
            got = fn(pid, lbase + a * 16, b - a, rbase + a * 16, b - a, 0)
            if got != nbytes:
                stop = self._finish(fn, pid, a, b, max(got, 0))
                if stop is not None:
                    return (stop[0] if self.row_of is None else int(self.row_of[stop[0]])), stop[1]
        return None

    def _finish(self, fn: Any, pid: int, a: int, b: int, done: int) -> tuple[int, int] | None:
        """Rows [a, b) after a copy that moved only ``done`` bytes of them: the rest row by row (rare: a fault)."""
        base = int(self.ends[a - 1]) if a else 0
        row = a + int(np.searchsorted(self.ends[a:b] - base, done, side="right"))
        into = done - (int(self.ends[row - 1]) - base if row > a else 0)
        one_local, one_remote = np.zeros((1, 2), dtype=np.uint64), np.zeros((1, 2), dtype=np.uint64)
        for r in range(row, b):
            off = into if r == row else 0
            laddr, raddr, n = int(self.local[r, 0]), int(self.remote[r, 0]), int(self.local[r, 1])
            while off < n:
                one_local[0] = (laddr + off, n - off)
                one_remote[0] = (raddr + off, n - off)
                got = fn(pid, one_local.ctypes.data, 1, one_remote.ctypes.data, 1, 0)
                if got <= 0:
                    return r, (ctypes.get_errno() if got < 0 else 0) or errno_mod.EFAULT
                off += got
        return None
