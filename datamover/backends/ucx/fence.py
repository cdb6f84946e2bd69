"""Cancellation that ends: a cancelled request (timed out or released) is cut off before its caller hears of it."""

from __future__ import annotations

from ...errors import BackendUnavailable, RemoteDisconnected, TransferAborted
from . import rma
from .config import _FENCE_S, log
from .messages import Cancel
from .state import Fenced


class Fencing:
    """The fence ``Fenced`` completions run inside ``cancel()``: see ``_cut`` for what each path does."""

    def _fenced(self) -> Fenced:
        completion = Fenced(1)
        completion.fence = self._fence
        return completion

    def _fence(self, completion: Fenced) -> None:
        """Cut off a cancelled request (timed out or released) before its caller hears of it; see ``_cut``."""
        if self._stop:
            return
        try:
            # once _cut returned, nothing of the request can land any more; the completion itself is finished
            # by the service thread's next command, which the caller need not wait for
            if not self._call(lambda: self._cut(completion), timeout=_FENCE_S):
                log.warning("the ucx service thread did not cut off a cancelled request within %g s", _FENCE_S)
        except RemoteDisconnected:
            return  # the backend closed meanwhile: its worker is gone, nothing of the request can land

    def _cut(self, completion: Fenced) -> None:
        """On the service thread: end the request of ``completion`` so that none of its bytes lands afterwards.

        A request not started yet ends here. One whose UCX operations all
        ended ends with its error. Otherwise: a WRITE only reads the caller's
        memory and ends now (the owner is told to drop it; its remote range is
        undefined, as after any failed WRITE); a READ still has gets or
        receives in flight into the caller's memory, which UCX cannot call
        back one by one, so the worker is replaced and the old one is never
        progressed again: the bytes of a thawed or late peer arrive at an
        endpoint nobody reads.
        """
        why = completion.error or TransferAborted("transfer released while in flight", backend=self.name)
        for direct in list(self._directs):  # a waiter may drop its finished one meanwhile
            if direct.completion is completion:
                with direct.lock:
                    if direct.done or direct.flush.poll() != rma.UCS_INPROGRESS:
                        break  # ended (or ending): whoever saw it finishes it
                if direct.op == "READ":
                    self._reset_worker(
                        f"a cancelled READ from agent {direct.peer.name!r} still had gets in flight",
                        quarantine=True,
                        culprit=direct.peer.name,
                    )
                self._submit(lambda d=direct: self.one_sided._finish_direct(d, why))
                return
        for peer in self._peers.values():
            for op in list(peer.ops.values()):
                if op.completion is not completion:
                    continue
                if op.reqs is None:
                    self._submit(lambda op=op: self.tagged._end(op, why))
                    return
                pending = op.reqs.poll() is False
                if peer.conn is not None and peer.state == "ready":
                    peer.conn.send(Cancel(op.id))  # the owner refuses what it has not started
                if pending and op.req.op == "READ":
                    self._reset_worker(
                        f"a cancelled READ from agent {peer.name!r} still had receives in flight",
                        quarantine=True,
                        culprit=peer.name,
                    )
                self._submit(lambda op=op: self.tagged._end(op, why))
                return

    def _reads_held(self, peer: str, op: str) -> BackendUnavailable | None:
        """Why a READ from ``peer`` that needs UCX gets or receives is refused, or None.

        Each READ cut off with those still in flight keeps a UCX worker (never progressed again, so the late
        bytes cannot land; freeing it would progress it) until close(). A peer that stopped answering that
        often, or this agent holding that many such workers in all, bounds them: such READs are refused, and
        the caller is told why, instead of fds running out.
        """
        if op != "READ":
            return None
        mine, total = self._quarantines_by.get(peer, 0), len(self._quarantined)
        per_peer, cap = int(self.params["max_quarantines_per_peer"]), int(self.params["max_quarantined_workers"])
        if mine < per_peer and total < cap:
            return None
        why = (
            f"agent {peer!r} stopped answering {mine} time(s) with READs in flight"
            if mine >= per_peer
            else f"{total} READs were cut off with bytes in flight"
        )
        return BackendUnavailable(
            f"READ from agent {peer!r} refused: {why}; the UCX workers those READs used are held until close() so "
            f"that their late bytes cannot land (max_quarantines_per_peer={per_peer}, "
            f"max_quarantined_workers={cap}); WRITEs, and READs by direct cma, still run",
            backend=self.name,
        )
