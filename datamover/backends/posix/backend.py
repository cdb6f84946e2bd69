"""posix: DRAM <-> FILE with os.preadv / os.pwritev on a thread pool, O_DIRECT by default.

Aligned rows go straight between the user's buffer and the disk; rows that
O_DIRECT cannot take (offset, length or address unaligned) go through a
aligned bounce buffer (read-modify-write for partial blocks; at most ``threads`` kept between rows).
Rows contiguous in the file become one vectored syscall. Batches that
are all O_DIRECT-aligned go through Linux native AIO instead (``.aio``):
up to ``aio_depth`` I/Os in flight from one thread, the way NIXL's POSIX
backend runs them; anything that comes back short or failed is redone on
the synchronous path. Where the
filesystem refuses O_DIRECT the file is opened buffered and that is logged
once and shown in ``describe()``. Small requests (see ``inline_bytes``) run
inside ``post()`` on the caller's thread: no pool hop, no wake-up.
"""

from __future__ import annotations

import _thread
import errno as errno_mod
import logging
import math
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...descriptors import MemType, aligned_empty
from ...errors import InvalidParameter, TransferIOError, TransferTimeout
from ...units import size_text
from .. import fence
from ..base import (
    Backend,
    BackendHost,
    Completion,
    Op,
    TransferRequest,
    cap_runs,
    clock,
    finished_completion,
    run_inline,
    run_parts,
    split_by_bytes,
    typed_error,
)
from ..fence import ReadFence
from ..workers import Workers
from . import rows
from .aio import AioContext, AioRun, IocbBatch, aio_available
from .rows import FileHandle

log = logging.getLogger("datamover.posix")

_warned_devices: set[int] = set()

#: the longest ``close`` waits for the pool's threads and the AIO contexts' I/Os: on a hung device (I/Os that never
#: end) what is still busy past it is left behind, with a warning, and with the memory it moves
CLOSE_S = 10.0


def probe_direct(directory: str) -> tuple[bool, str]:
    """Whether files in ``directory`` can be opened with O_DIRECT, and why not."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    import tempfile

    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".dm-direct-probe-")
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror}"
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            buf = aligned_empty(4096)
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
        return True, "O_DIRECT works"
    except OSError as exc:
        return False, f"filesystem refuses O_DIRECT ({errno_mod.errorcode.get(exc.errno, exc.errno)}: {exc.strerror})"
    finally:
        os.unlink(path)


_ONE_RANGE = ((0, 1),)


def _reraise(exc: BaseException, first: int, last: int, completion: Completion) -> None:
    raise exc


class _AioReap:
    """The rest of one AIO transfer: reap it (and submit what did not fit), on the pool or in a waiting caller.

    The pool thread and a caller in ``Transfer.wait`` race for it; the first
    to take ``claim`` runs it and the other returns at once. A caller that
    wins saves waiting for the pool thread's wake-up. A caller arriving after
    the request's timeout leaves it to the pool, so that its wait times out
    rather than blocking until the I/O is done.

    The completion is a ``ReadFence`` entered from the first io_submit (in ``post``) until every I/O
    submitted is reaped: the kernel writes into (READ) or reads (WRITE) the caller's memory until then, so
    ``cancel`` (ERR, release) returns only after that, and nothing is submitted once it is cancelled. A
    cancel that finds the job not yet taken (every pool thread busy, e.g. in other transfers' hung syscalls)
    takes it and reaps on its own thread (the fence's ``drain``), for at most the fence's bound.

    On a hung device (I/Os that never end) the reap gives up ``FENCE_S`` after it sees the cancel, or after the
    deadline when nothing cancels it (then ERR, ``TransferTimeout``): the context is retired (``AioRun.finish``),
    nothing is redone, and the fence stays shut, so the cancel warns that bytes may still land.
    """

    __slots__ = ("backend", "claim", "completion", "deadline", "p", "req", "run", "write")

    def __init__(self, backend: PosixBackend, req, p, run: AioRun, write: bool) -> None:
        self.backend, self.req, self.p, self.run, self.write = backend, req, p, run, write
        self.completion = ReadFence(1)
        self.completion.enter()  # a fresh fence: cannot be cancelled before post() returns it
        self.completion.drain = self.reap_once
        self.claim = _thread.allocate_lock()
        self.deadline = req.deadline

    def assist(self) -> None:
        if clock() < self.deadline:
            self.reap_once()

    def cancelled(self) -> bool:
        return self.completion.cancelled

    def reap_once(self, limit_s: float | None = None) -> None:
        """Reap the rest (at most ``limit_s`` seconds when given: a cancel's own reap; else to the deadline and the
        fence's bound past it), unless another took it."""
        if not self.claim.acquire(blocking=False):
            return
        completion, backend = self.completion, self.backend
        err: BaseException | None = None
        grace = fence.FENCE_S
        handles = list(self.p.handles.values())
        for h in handles:  # its io_submits, and a redo, issue syscalls on the files' fds
            h.hold()
        try:
            # always runs, even once cancelled: I/O already submitted must be reaped before buffers are released
            run = self.run
            # no polling when all of it went out in post(): a batch too big to run inline takes far longer
            # than the spin, and a poll loop only trades the GIL back and forth with the woken pool thread
            spin = run.nxt < run.stop and limit_s is None
            if limit_s is None:
                limit_s = self.deadline + grace - clock()
            try:
                run.finish(self.cancelled, spin, limit_s, grace)
            finally:
                backend._aio_back(run)
                if not run.inflight:  # an I/O never reaped keeps the fence shut (cancel warns)
                    completion.leave()
            if run.inflight:  # given up on (a hung device): redoing it would race the I/Os still to come
                if not completion.cancelled:
                    raise backend._hung_error(self.req, run)
            elif not completion.cancelled and (not run.ok or (self.write and backend.params["fsync"])):
                backend._aio_done(self.req, self.p, run, self.write, 0, 1, completion)
        except BaseException as exc:
            err = typed_error(exc, backend.name)
        finally:
            for h in handles:
                h.drop()
        completion.finish_part(err)


@dataclass(eq=False)
class PosixPlan:
    """One request's syscalls, built once: ``groups`` (start row, end row, O_DIRECT-aligned) each one vectored
    call, the per-row ``fds``/``offs``/``views``; ``single`` the one-syscall fast path, ``aio`` the AIO batch."""

    groups: list[tuple[int, int, bool]]
    fds: list[int]
    offs: list[int]
    views: list[memoryview]
    handles: dict[int, FileHandle]
    write: bool
    inline: bool = False
    single: tuple[int, list[memoryview], int, int] | None = None
    ranges: list[tuple[int, int]] | None = None
    aio: IocbBatch | None = None


class PosixBackend(Backend):
    """Host memory to and from registered files with vectored POSIX I/O."""

    name = "posix"
    pairs = frozenset({(MemType.DRAM, MemType.FILE)})
    default_params = {
        "threads": 4,
        "direct": True,  # False opens every file buffered
        "alignment": 4096,  # O_DIRECT granularity for file offsets and lengths
        "mem_alignment": 512,  # O_DIRECT granularity for buffer addresses
        "bounce_bytes": 8 << 20,  # per row in flight; at most threads x bounce are kept: within the 64 MiB budget
        "fsync": False,  # fdatasync every written file before a WRITE completes
        # post() runs a request itself, on the caller's thread, when it is one syscall (one file-contiguous run or
        # one unaligned row) or one AIO batch of at most inline_bytes, or several synchronous syscalls (buffered
        # files, unaligned rows, no AIO) of at most inline_batch_bytes: post() then blocks about as long as the
        # device takes to move that much, and saves the two thread wake-ups a pool hop costs
        "inline_bytes": 1 << 20,
        "inline_batch_bytes": 256 << 10,
        "min_part_bytes": 1 << 20,
        "aio": True,  # O_DIRECT batches go through Linux native AIO (many I/Os per syscall) where it works
        "aio_depth": 256,  # I/Os in flight per AIO context
        # AIO contexts kept at most (one per AIO batch in flight; each takes aio_depth of the machine's
        # fs.aio-max-nr, shared by every process): a batch finding none free past this runs synchronously
        "aio_contexts": 16,
        "aio_spin_us": 100,  # poll this long for the last completions before sleeping in io_getevents
    }

    def __init__(self, host: BackendHost, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(host, params)
        _check_params(self.params)
        self._pool = Workers(int(self.params["threads"]), "dm-posix")
        self._bounces = rows.BouncePool(
            int(self.params["bounce_bytes"]), int(self.params["alignment"]), int(self.params["threads"])
        )
        self._aio_free: queue.SimpleQueue = queue.SimpleQueue()
        self._aio_all: list = []
        self._aio_lock = threading.Lock()  # over _aio_all: making and dropping contexts
        self._aio_refused = False  # io_setup refused a context once (logged once)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        if not hasattr(os, "preadv"):
            return False, "os.preadv/os.pwritev are not available on this platform"
        return True, "ok"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        import tempfile

        here = {}
        for directory in dict.fromkeys([os.getcwd(), tempfile.gettempdir()]):
            _, why = probe_direct(directory)
            here[f"O_DIRECT in {directory}"] = why
        d = cls.default_params
        here["inline"] = (
            f"post() runs one syscall or one AIO batch of <= {size_text(d['inline_bytes'])} (param inline_bytes), "
            f"or several synchronous syscalls of <= {size_text(d['inline_batch_bytes'])} (inline_batch_bytes), "
            "on the caller's thread; larger requests go to the pool"
        )
        return here

    # -- registration ------------------------------------------------------
    def register(self, reg) -> FileHandle | None:
        if reg.mem_type != MemType.FILE:
            return None
        want_direct = bool(reg.direct and self.params["direct"] and hasattr(os, "O_DIRECT"))
        note = "" if want_direct else "buffered (O_DIRECT not requested)"
        fd = -1
        if want_direct:
            try:
                fd = os.open(reg.path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise self._open_error(reg.path, exc) from exc
                note = f"buffered: the filesystem refuses O_DIRECT ({exc.strerror})"
        if fd < 0:
            try:
                fd = os.open(reg.path, os.O_RDWR)
            except OSError as exc:
                raise self._open_error(reg.path, exc) from exc
            dev = os.fstat(fd).st_dev
            if want_direct and dev not in _warned_devices:
                _warned_devices.add(dev)
                log.warning("posix: %s refuses O_DIRECT; falling back to buffered I/O", reg.path)
        return FileHandle(fd=fd, path=reg.path, direct=fd >= 0 and not note, size=reg.length, note=note or "O_DIRECT")

    def _open_error(self, path: str, exc: OSError) -> TransferIOError:
        return TransferIOError(f"cannot open {path!r}: {exc.strerror}", errno=exc.errno, backend=self.name)

    def deregister(self, reg, handle: FileHandle | None) -> None:
        """Close the file, or, while a part of a transfer still runs on it (cut short, its syscall on a hung device
        not returned), once that part is done: until then no other file may take its fd's number."""
        if handle is not None and not handle.close():
            log.warning("posix: %s deregistered with a transfer's part still on it; closed once it returns", reg.path)

    def describe(self) -> dict[str, Any]:
        files = {}
        for reg in list(self.host.regions.values()):
            h = reg.handles.get(self.name)
            if h is not None:
                files[h.path] = h.note
        return {"files": files, "threads": self.params["threads"]}

    # -- planning ------------------------------------------------------------
    def plan(self, req: TransferRequest) -> PosixPlan:
        """Group rows into vectored syscalls and build every buffer view once, so posts only do I/O."""
        mem, fil = req.local, req.remote
        n = len(mem)
        regs = req.registrations
        file_ids, file_inv = np.unique(req.remote_regions, return_inverse=True)
        handles = [regs[int(r)].handles[self.name] for r in file_ids]
        fds = np.array([h.fd for h in handles], dtype=np.int64)[file_inv]
        direct = np.array([h.direct for h in handles], dtype=bool)[file_inv]
        A, MA = int(self.params["alignment"]), int(self.params["mem_alignment"])
        ln, off, addr = mem.length, fil.addr, mem.addr
        aligned = direct & (off % A == 0) & (ln % A == 0) & (addr % MA == 0)
        # a group is a run of rows that one vectored syscall can serve
        brk = np.ones(n, dtype=bool)
        if n > 1:
            brk[1:] = (fds[1:] != fds[:-1]) | (off[1:] != off[:-1] + ln[:-1]) | (aligned[1:] != aligned[:-1])
            brk[1:] |= ~aligned[1:] & direct[1:]  # bounce rows go one by one
        starts = cap_runs(np.flatnonzero(brk), n)
        ends = np.append(starts[1:], n)
        mem_ids, mem_inv = np.unique(req.local_regions, return_inverse=True)
        arrays = [regs[int(r)].array for r in mem_ids]
        mem_off = addr - np.array([regs[int(r)].addr for r in mem_ids], dtype=np.int64)[mem_inv]
        views = [memoryview(arrays[k][o : o + m]) for k, o, m in zip(mem_inv.tolist(), mem_off.tolist(), ln.tolist())]
        p = PosixPlan(
            groups=list(zip(starts.tolist(), ends.tolist(), aligned[starts].tolist())),
            fds=fds.tolist(),
            offs=off.tolist(),
            views=views,
            handles={h.fd: h for h in handles},
            write=req.op is Op.WRITE,
        )
        total = int(ln.sum()) if n else 0
        group_bytes = np.add.reduceat(ln, starts) if n else np.zeros(0, dtype=np.int64)
        p.inline = total <= self.params["inline_batch_bytes"] or (
            total <= self.params["inline_bytes"] and len(starts) <= 1
        )
        if p.inline and len(starts) == 1 and not self.params["fsync"]:
            s, e, whole = p.groups[0]
            if whole or not direct[0]:
                # one vectored syscall: post() issues it with nothing else around it
                p.single = (int(fds[0]), views[s:e], int(off[0]), total)
        threads = 1 if p.inline else int(self.params["threads"])
        p.ranges = split_by_bytes(group_bytes, threads, int(self.params["min_part_bytes"]))
        if len(starts) > 1 and self.params["aio"] and bool(aligned.all()) and aio_available()[0]:
            # in file order, rows that tile a file range become one vectored I/O whatever their memory
            # order; reordering is safe because the Agent refuses overlapping destinations
            order = np.lexsort((off, fds))
            sf, so, sl = fds[order], off[order], ln[order]
            cut = np.ones(n, dtype=bool)
            cut[1:] = (sf[1:] != sf[:-1]) | (so[1:] != so[:-1] + sl[:-1])
            runs = cap_runs(np.flatnonzero(cut), n)
            # the batch keeps the caller's buffers: a hung device's I/Os may move their bytes after ERR, and the
            # memory must not be freed under them (``AioContext.retire``)
            owners = tuple(regs[int(r)].owner for r in mem_ids)
            p.aio = IocbBatch(sf, so, addr[order], sl, p.write, runs, keep=owners)
            p.ranges = [(0, len(p.aio))]
            p.inline = total <= self.params["inline_bytes"]  # one io_submit: the I/Os overlap in the device
        return p

    def post(self, req: TransferRequest) -> Completion:
        p = req.plan
        single = p.single
        if single is not None:
            # the fast path for one syscall, with as little Python as possible around it: each Python frame
            # between the syscall and post() returning costs more right after a syscall than in a warm loop
            fd, views, offset, nbytes = single
            try:
                if (os.pwritev(fd, views, offset) if p.write else os.preadv(fd, views, offset)) == nbytes:
                    return finished_completion()
            except OSError:
                pass  # the general path below does it again and reports a typed error, or bounces on EINVAL
            # a short read or write: the general path below redoes it, resuming until done
        write = p.write

        if p.aio is not None:
            return self._post_aio(req, p, write)
        return self._post_groups(req, p, write, p.ranges, p.inline)

    def _post_groups(self, req, p, write: bool, ranges: list[tuple[int, int]], inline: bool) -> Completion:
        """The synchronous path: ``ranges`` of groups, here (``inline``) or on the pool."""
        if inline:
            # no thread hop: post() returns DONE or ERR
            return run_inline(ranges, self._run_groups, req, p, write, backend=self.name)

        handles = list(p.handles.values())

        def work(a: int, b: int, completion: Completion) -> None:
            # held before the part's first fence.enter: a deregistration, which closes the file only once it
            # cancelled the transfer, either finds the file held or the fence shut to the part
            for h in handles:
                h.hold()
            try:
                self._run_groups(req, p, write, a, b, completion)
            finally:
                for h in handles:
                    h.drop()

        # a READ's preadv writes into the caller's memory, a WRITE's pwritev reads it (a buffer reused after ERR
        # must not reach the file under this transfer's name): once it is cancelled (timed out, released) its
        # fence waits for the syscalls in flight, and no later one starts
        return run_parts(self._pool, ranges, work, backend=self.name, completion_type=ReadFence)

    # -- native AIO ----------------------------------------------------------
    def _post_aio(self, req, p, write: bool) -> Completion:
        """Submit the first ``aio_depth`` I/Os right here, then reap (and submit the rest) here or on the pool.

        This is the hot path of every aligned batch, and on a small VM each Python line or numpy call between
        the syscalls costs microseconds (cold caches after the device's interrupt): it keeps to a few attribute
        lookups, no numpy, and no completion object at all when the batch is inline and succeeds.
        """
        try:
            ctx = self._aio_free.get_nowait()
        except queue.Empty:
            ctx = self._new_aio_context()
            if ctx is None:
                return self._post_groups(req, p, write, [(0, len(p.groups))], p.inline)
        try:
            run = ctx.start(p.aio, rows=False)
        except BaseException:
            self._aio_free.put(ctx)
            raise
        if p.inline:
            try:  # nothing submitted past the deadline; a hung device holds post() no longer than FENCE_S past it
                run.finish(lambda: clock() > req.deadline, limit_s=req.deadline + fence.FENCE_S - clock())
            except BaseException as exc:
                return run_inline(_ONE_RANGE, _reraise, exc, backend=self.name)
            finally:
                self._aio_back(run)
            if run.ok and not (write and self.params["fsync"]):
                return finished_completion()
            if run.inflight:
                return run_inline(_ONE_RANGE, _reraise, self._hung_error(req, run), backend=self.name)
            return run_inline(_ONE_RANGE, self._aio_done, req, p, run, write, backend=self.name)
        job = _AioReap(self, req, p, run, write)
        job.completion.set_assist(job.assist)
        try:
            self._pool.submit(job.reap_once)
        except RuntimeError:  # the pool is shut down (backend closing): finish here
            job.reap_once()
        return job.completion

    def _new_aio_context(self) -> AioContext | None:
        """A new AIO context, or None: ``aio_contexts`` exist already (all busy), or the machine has none to give
        (fs.aio-max-nr, a budget every process shares, used up). Either way the batch runs synchronously."""
        with self._aio_lock:
            self._aio_all[:] = [c for c in self._aio_all if not c.gone]  # retired ones whose I/Os ended since
            if len(self._aio_all) >= int(self.params["aio_contexts"]):
                return None
            try:
                ctx = AioContext(int(self.params["aio_depth"]), float(self.params["aio_spin_us"]))
            except OSError as exc:
                if not self._aio_refused:
                    self._aio_refused = True
                    log.warning("posix: no AIO context to be had (%s); such batches run synchronously", exc)
                return None
            self._aio_all.append(ctx)
            return ctx

    def _aio_back(self, run: AioRun) -> None:
        """Hand ``run``'s context out again, unless it is still busy (finish never ran) or retired (its reap failed
        or gave up). A retired one is dropped once its I/Os ended; until then it counts against ``aio_contexts``
        (it holds its share of fs.aio-max-nr), and a later ``_new_aio_context`` drops it when they do."""
        ctx = run.ctx
        if not ctx.alive:
            if ctx.gone:
                with self._aio_lock:
                    if ctx in self._aio_all:
                        self._aio_all.remove(ctx)
        elif not ctx._lock.locked() and not run.inflight:
            self._aio_free.put(ctx)

    def _hung_error(self, req, run: AioRun) -> TransferTimeout:
        """ERR for a batch given up on with I/Os in flight (a hung device), saying what they may still do."""
        where = "from the caller's memory into the file" if run.batch.write else "into the caller's memory"
        return TransferTimeout(
            f"{req.op.value}: {run.inflight} of its AIO I/O(s) had not ended"
            f" {fence.FENCE_S:g} s past the deadline (a hung device?); they may still move bytes {where}",
            backend=self.name,
        )

    def _aio_done(self, req, p, run: AioRun, write: bool, first: int, last: int, completion: Completion) -> None:
        """If any I/O came back short or failed, the transfer is redone synchronously; then fsync if asked."""
        if not run.ok:
            self._run_groups(req, p, write, 0, len(p.groups), completion)
        if write and self.params["fsync"]:
            for h in p.handles.values():
                try:
                    os.fdatasync(h.fd)
                except OSError as exc:
                    raise self._sync_error(req, p, h, exc) from exc

    # -- execution -----------------------------------------------------------
    def _run_groups(self, req, p, write: bool, first: int, last: int, completion: Completion) -> None:
        touched = set()
        fence = completion if type(completion) is ReadFence else None
        # inline (no fence) nothing can cancel the run: its deadline stops it, as Transfer gives up on it past that
        halt = rows.Halt(completion, math.inf if fence is not None else req.deadline)
        for g in range(first, last):
            if fence is None:
                if halt():
                    s = p.groups[g][0]
                    raise halt.error(req.caller_index(s), write, p.handles[p.fds[s]].path, self.name)
                touched.add(self._run_group(req, p, g, write, halt))
                continue
            if not fence.enter():
                return
            try:
                touched.add(self._run_group(req, p, g, write, halt))
            finally:
                fence.leave()
        if write and self.params["fsync"]:
            if halt():  # a post given up on may find its files closed since, their fd numbers another file's
                s = p.groups[first][0]
                raise halt.error(req.caller_index(s), write, p.handles[p.fds[s]].path, self.name)
            for fd in touched:
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    raise self._sync_error(req, p, p.handles[fd], exc) from exc

    def _run_group(self, req, p, g: int, write: bool, halt: rows.Halt) -> int:
        """Group ``g``'s one vectored syscall (or its rows through the bounce buffer); the fd it used."""
        fds, offs, views = p.fds, p.offs, p.views
        s, e, aligned = p.groups[g]
        h = p.handles[fds[s]]
        if h.direct and not aligned:
            for i in range(s, e):
                self._bounce_io(req, h, i, offs[i], views[i], write, halt)
            return h.fd
        try:
            rows.vectored(h.fd, views[s:e], offs[s], write, halt)
        except rows.Halted as exc:
            raise halt.error(rows.index_at(req, s, views[s:e], exc.moved), write, h.path, self.name) from None
        except OSError as exc:
            if exc.errno == errno_mod.EINVAL and h.direct:
                # the device wants stricter alignment than configured: take the bounce path
                for i in range(s, e):
                    self._bounce_io(req, h, i, offs[i], views[i], write, halt)
                return h.fd
            raise rows.row_error(req, s, h, exc, write, self.name, getattr(exc, "moved", 0), views[s:e]) from exc
        except EOFError as exc:
            raise TransferIOError(
                f"read past the end of {h.path!r} ({exc})",
                errno=errno_mod.EIO,
                index=rows.index_at(req, s, views[s:e], exc.moved),
                backend=self.name,
            ) from None
        return h.fd

    def _bounce_io(
        self, req, h: FileHandle, row: int, offset: int, view: memoryview, write: bool, halt: rows.Halt
    ) -> None:
        """Move an unaligned row through a bounce buffer of the pool (none once ``halt()``)."""
        bounce = self._bounces.take()
        try:
            rows.bounce_row(req, h, row, offset, view, write, halt, bounce, int(self.params["alignment"]), self.name)
        finally:
            self._bounces.give(bounce)

    def _sync_error(self, req, p, h: FileHandle, exc: OSError) -> TransferIOError:
        """fdatasync does not say which block it lost: name the first of the caller's descriptors in that file."""
        return TransferIOError(
            f"fdatasync of {h.path!r} failed after this WRITE wrote it: {exc.strerror or exc}; what it wrote there"
            " may not be on the disk",
            errno=exc.errno,
            index=req.caller_index(p.fds.index(h.fd)),
            backend=self.name,
        )

    def close(self) -> None:
        """Stop the pool and destroy the AIO contexts, within ``CLOSE_S`` in all: a thread still inside a syscall
        on a hung device, or a retired context whose I/Os never end, is left behind with a warning."""
        end = clock() + CLOSE_S
        stuck = self._pool.shutdown(wait=True, timeout=CLOSE_S)
        if stuck:
            log.warning(
                "posix: %d pool thread(s) still busy %g s into close (a syscall on a hung device?); left running",
                stuck,
                CLOSE_S,
            )
        with self._aio_lock:  # a copy: an inline caller may drop a destroyed context meanwhile
            kept = list(self._aio_all)
        for ctx in kept:
            ctx.close(timeout=max(0.0, end - clock()))


def _check_params(p: Mapping[str, Any]) -> None:
    """Refuse (``InvalidParameter``) what would fail later untyped, or spin: alignments that are not powers of two,
    a bounce buffer with no room for a block between a row's two partial ones, an AIO context of no I/Os."""
    for key in ("alignment", "mem_alignment"):
        value = p[key]
        if value < 1 or value & (value - 1):
            raise InvalidParameter(f"{key} must be a power of two, got {value!r}", backend="posix")
    if p["bounce_bytes"] < 3 * p["alignment"]:
        raise InvalidParameter(
            f"bounce_bytes must be at least 3 x alignment ({3 * p['alignment']}), got {p['bounce_bytes']!r}",
            backend="posix",
        )
    if p["aio_contexts"] < 1:
        raise InvalidParameter(f"aio_contexts must be at least 1, got {p['aio_contexts']!r}", backend="posix")
    if p["aio_depth"] < 1:
        raise InvalidParameter(f"aio_depth must be at least 1, got {p['aio_depth']!r}", backend="posix")
