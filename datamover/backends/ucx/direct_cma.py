"""Direct cma: a same-host peer's registered DRAM read and written with process_vm_readv/writev."""

from __future__ import annotations

import errno as errno_mod
import os
import time
from typing import Any

import numpy as np

from ...errors import (
    DatamoverError,
    RemoteDisconnected,
    TransferIOError,
    TransferTimeout,
)
from ...processes import pid_alive as alive
from ..base import (
    Completion,
    TransferRequest,
    run_parts,
    split_by_bytes,
)
from ..workers import Workers
from . import cma
from .config import _FENCE_S
from .state import Fenced, Peer


class DirectCma:
    """Direct cma: a same-host peer's registered DRAM read and written with process_vm_readv/writev."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    def _start_cma_parts(
        self, peer: Peer, req: TransferRequest, plan: cma.CmaPlan, deadline: float, op_id: int
    ) -> Completion:
        """Copy a large direct cma request in parts on the cma threads (and in a waiting caller).

        The caller entered it in ``_cma_ops`` while its rows were checked; it
        stays there until every part ended, so a revocation of a region it
        touches is confirmed to the peer only after that, and a local region it
        reads or writes is not unmapped before.
        """
        if self.b._cma_pool is None:
            self.b._cma_pool = Workers(int(self.b.params["cma_threads"]), f"dm-ucx-cma-{self.b.host.name}")
        self.b.counts["one-sided"] += 1
        self.b.counts["of them direct cma"] += 1
        pid = peer.cma_pid
        if plan.ranges is None:
            sizes = np.array([c[2] for c in plan.chunks], dtype=np.int64)
            # at least 2 MiB a part: a smaller one costs more in hand-over than a second core gains
            plan.ranges = split_by_bytes(sizes, int(self.b.params["cma_threads"]), 2 << 20)

        def part(first: int, last: int, completion: Completion) -> None:
            error = self._copy_chunks(peer, pid, req, plan, first, last, deadline, completion)
            if error is not None:
                raise error

        def done(c: Completion) -> None:
            with self.b._rma_lock:
                self.b._cma_ops.pop(op_id, None)
                revokes = self.b._revokes and not self._cma_copying(peer)
            try:
                if revokes:
                    self.b._submit(self.b.one_sided._check_revokes)
                if c.error is None and req.notify:
                    self.b._submit(lambda: self.b._send_after(peer, req.notify))
            except RemoteDisconnected:
                pass  # the backend closed meanwhile: there is no peer left to tell

        inner = run_parts(self.b._cma_pool, plan.ranges, part, backend=self.b.name)
        inner.add_done_callback(done)
        # the caller's completion ends when every part did: cancelling it stops the parts and waits for a
        # chunk in progress, so no byte is copied after ERR
        outer = Fenced(1)
        outer.fence = lambda c: (inner.cancel(c.error), inner.wait(_FENCE_S))
        inner.add_done_callback(lambda c: outer.finish_part(c.error))
        outer.set_assist(inner.assist)  # a waiting caller still copies parts itself
        return outer

    def _cma_copying(self, peer: Peer) -> bool:
        """Whether a direct cma request to or from ``peer`` is still copying in parts."""
        return any(p is peer for p, _ in list(self.b._cma_ops.values()))

    def _copy_cma(self, peer: Peer, req: TransferRequest, plan: cma.CmaPlan, deadline: float) -> DatamoverError | None:
        """Copy every row of ``plan`` to (WRITE) or from (READ) the peer now, locked; the typed error if one failed."""
        self.b.counts["one-sided"] += 1
        self.b.counts["of them direct cma"] += 1
        if len(plan.chunks) == 1:
            stop = plan.run(peer.cma_pid, req.op == "WRITE")
            return None if stop is None else self._cma_error(peer, req, *stop)
        return self._copy_chunks(peer, peer.cma_pid, req, plan, 0, len(plan.chunks), deadline)

    def _copy_chunks(
        self,
        peer: Peer,
        pid: int,
        req: TransferRequest,
        plan: cma.CmaPlan,
        first: int,
        last: int,
        deadline: float,
        completion: Completion | None = None,
    ) -> DatamoverError | None:
        """Copy chunks [first, last) of ``plan``; the typed error of a failed or late copy, else None.

        A part (``completion`` given) stops before any chunk once cancelled or past the deadline; a copy
        inside ``post()`` (no completion) checks the deadline from its second chunk on.
        """
        write, session, rids = req.op == "WRITE", peer.session, frozenset(np.unique(req.remote_regions).tolist())
        for i in range(first, last):
            if completion is not None and completion.cancelled:
                return None
            if (completion is not None or i > first) and time.monotonic() > deadline:
                return self._cma_timeout(req)
            if not self._still_offered(peer, session, rids):
                return RemoteDisconnected(
                    f"agent {peer.name!r} disconnected or revoked a region of this {req.op}: the copy stopped",
                    backend=self.b.name,
                )
            stop = plan.run(pid, write, i, i + 1)
            if stop is not None:
                return self._cma_error(peer, req, *stop)
        return None

    def _still_offered(self, peer: Peer, session: int, rids: frozenset[int]) -> bool:
        """Whether the connection the rows were checked on is up and the peer still offers every region they touch.

        Checked before each chunk: a target that revokes a region (or drops us) cannot stop a process_vm_writev
        already under way, so it is fenced one chunk late at most; it confirms the revocation only after that.
        """
        with self.b._rma_lock:
            return peer.state == "ready" and peer.session == session and rids <= peer.regions.keys()

    def _cma_timeout(self, req: TransferRequest) -> TransferTimeout:
        return TransferTimeout(
            f"{req.op} of {len(req.local)} row(s) did not complete within {req.timeout:g} s", backend=self.b.name
        )

    def _cma_error(self, peer: Peer, req: TransferRequest, row: int, err: int) -> DatamoverError:
        """A failed process_vm_writev/readv as a typed error naming the caller's descriptor."""
        call = "process_vm_writev" if req.op == "WRITE" else "process_vm_readv"
        what = f"{call} into agent {peer.name!r} failed: {errno_mod.errorcode.get(err, err)} ({os.strerror(err)})"
        if err == errno_mod.ESRCH or not alive(peer.cma_pid):
            return RemoteDisconnected(
                f"agent {peer.name!r} went away ({what})", index=req.caller_index(row), backend=self.b.name
            )
        return TransferIOError(what, errno=err, index=req.caller_index(row), backend=self.b.name)
