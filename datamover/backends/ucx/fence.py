"""Cancellation that ends: a cancelled request (timed out or released) is cut off before its caller hears of it."""

from __future__ import annotations

import time
from functools import partial

from ...errors import BackendUnavailable, RemoteDisconnected, TransferAborted
from . import rma
from .cancel_drain import ENDED, EXPIRED, PENDING, STUCK, CancelDrain
from .config import _FENCE_S, log
from .messages import Cancel
from .state import Direct, Fenced, OutOp


class Fencing:
    """The fence ``Fenced`` completions run inside ``cancel()``: see ``_cut`` for what each path does."""

    def _fenced(self) -> Fenced:
        completion = Fenced(1)
        completion.fence = self._fence
        completion.fence_s = 2 * _FENCE_S + float(self.params["cancel_drain_s"])  # the fence waits for the drain
        return completion

    def _fence(self, completion: Fenced) -> None:
        """Cut off a cancelled request (timed out or released) before its caller hears of it; see ``_cut``.

        The drain runs on the service loop beside its other work; this thread waits for it to be settled."""
        if self._stop:
            return
        box: list[CancelDrain | None] = []
        try:
            # once the cut is settled, nothing of the request can land any more; the completion itself is
            # finished by the service thread's next command, which the caller need not wait for
            if not self._call(lambda: box.append(self._cut(completion)), timeout=_FENCE_S):
                log.warning("the ucx service thread did not cut off a cancelled request within %g s", _FENCE_S)
                return
        except RemoteDisconnected:
            return  # the backend closed meanwhile: its worker is gone, nothing of the request can land
        drain = box[0] if box else None
        bound = float(self.params["cancel_drain_s"]) + _FENCE_S
        if drain is not None and not drain.wait(bound, self._thread.is_alive) and self._thread.is_alive():
            log.warning("a cancelled request to agent %r was not cut off within %g s", drain.peer, bound)

    def _cut(self, completion: Fenced) -> CancelDrain | None:
        """On the service thread: end the request of ``completion`` so that none of its bytes lands afterwards.

        A request not started yet ends here. A started one's UCX operations get
        ``cancel_drain_s`` to end (a responsive peer ends them; their bytes move
        before the caller hears of ERR, which is allowed): unless they already
        have, the drain is returned pending, and the service loop looks at it on
        every turn (``cancel_drain``) while it serves every other peer; the
        caller's fence waits for it. Operations still running when it runs out
        point into the caller's memory (a READ's gets or receives write it; a
        WRITE's puts or sends, queued in UCX until the peer takes them, read it),
        and UCX cannot call them back one by one, so the worker is replaced and
        the old one is never progressed again: the bytes of a thawed or late peer
        arrive at an endpoint nobody reads, and nothing queued is sent. The owner
        of an owner-served request is told to drop it too, once the drain is over;
        a WRITE's remote range is undefined afterwards, as after any failed WRITE,
        but no byte of it lands there later: an owner-served WRITE's drain ends
        only once the owner answered too (its receives ended: sends that ended
        here may still be on their way to it).
        """
        why = completion.error or TransferAborted("transfer released while in flight", backend=self.name)
        deadline = time.monotonic() + float(self.params["cancel_drain_s"])
        for direct in list(self._directs):  # a waiter may drop its finished one meanwhile
            if direct.completion is completion:
                if direct.held():
                    direct.flush.unhold()  # the native progress thread may progress it while it drains
                settle = partial(self._settle_direct, direct, why)
                drain = CancelDrain(direct.peer.name, self._worker, partial(_flushed, direct), settle, deadline)
                return self._cut_drains.start(drain)
        for peer in self._peers.values():
            for op in list(peer.ops.values()):
                if op.completion is not completion:
                    continue
                if op.drain is not None:  # it failed with rows posted: already draining
                    return op.drain
                if op.reqs is None:
                    self._submit(lambda op=op: self.tagged._end(op, why))
                    return None
                settle = partial(self._settle_served, op, why)
                drain = CancelDrain(peer.name, self._worker, partial(_answered, op), settle, deadline)
                return self._cut_drains.start(drain)
        return None

    def _fail_served(self, op: OutOp, why: BaseException) -> None:
        """End an owner-served request that failed (its owner refused or failed it, or a row of it failed here) with
        ``why``, once none of its rows can touch the caller's memory any more.

        Rows still posted would: a READ's receives take what the owner sent, a WRITE's sends read the caller's
        buffer, after ERR. A READ's receives nothing matched yet end at once (empty messages from this worker);
        the rest get ``cancel_drain_s``, as a cancelled request's do (see ``_cut``): ended, or the worker replaced
        and kept, before the caller hears of ERR.
        """
        if op.drain is not None or op.abandoned:
            return
        reqs = op.reqs
        if reqs is None or not reqs.pending():
            self.tagged._end(op, why)
            return
        if op.req.op == "READ":
            self.tagged._self_complete(op.tag0, reqs.pending())
        op.failure = why
        deadline = time.monotonic() + float(self.params["cancel_drain_s"])
        op.drain = CancelDrain(op.peer.name, self._worker, partial(_posted, op), partial(self._settle_served, op, why),
                               deadline)  # fmt: skip
        self._cut_drains.start(op.drain)

    def _settle_direct(self, direct: Direct, why: BaseException, outcome: str) -> None:
        """A one-sided request's drain is over: ended (whoever saw it finishes it), or its worker is replaced."""
        if outcome == ENDED:
            return
        if outcome in (EXPIRED, STUCK):
            what, name = ("gets" if direct.op == "READ" else "puts"), direct.peer.name
            self._reset_worker(
                f"a cancelled {direct.op} {_towards(direct.op)} agent {name!r} still had {what} in flight",
                quarantine=True,
                culprit=name,
            )
        self._undriven(direct)
        self._submit(lambda d=direct: self.one_sided._finish_direct(d, why))

    def _settle_served(self, op: OutOp, why: BaseException, outcome: str) -> None:
        """An owner-served request's drain is over: the owner is told to drop it (a responsive one ended it
        meanwhile), and its worker replaced if its receives or sends still run."""
        peer = op.peer
        if peer.conn is not None and peer.state == "ready":
            peer.conn.send(Cancel(op.id))  # the owner refuses what it has not started
        if outcome in (EXPIRED, STUCK):
            what = "receives" if op.req.op == "READ" else "sends"
            self._reset_worker(
                f"a cancelled {op.req.op} {_towards(op.req.op)} agent {peer.name!r} still had {what} in flight",
                quarantine=True,
                culprit=peer.name,
            )
        self._submit(lambda: self.tagged._end(op, why))

    def _undriven(self, direct: Direct) -> None:
        """Wait until no waiter drives ``direct``: a waiter's drive may be in a slice of progress on the worker just
        replaced (up to 10 ms in C), and its bytes must not move after the caller hears of ERR. Once it sees the
        worker replaced it stops; bounded by the fence's wait."""
        end = time.monotonic() + _FENCE_S
        while direct.driven:
            if time.monotonic() > end:
                log.warning("a waiter still drove a cancelled request %g s after its worker was replaced", _FENCE_S)
                return
            time.sleep(0.0005)

    def _process_of(self, peer: str) -> tuple[str, bytes]:
        """The process of ``peer`` now (its name and incarnation; b"" when unknown): quarantines count against the
        process that stopped answering, so that a peer restarted under its old name starts afresh."""
        known = self._peers.get(peer)
        return peer, (known.info.get("incarnation") or b"") if known is not None else b""

    def _held(self, peer: str, op: str) -> BackendUnavailable | None:
        """Why a transfer with ``peer`` that needs UCX operations (not direct cma) is refused, or None.

        Each transfer cut off with those still in flight keeps a UCX worker (never progressed again, so a READ's
        late bytes cannot land and a WRITE's queued sends cannot read the caller's memory; freeing it would
        progress it) until close(). A peer process that stopped answering that often (a restarted peer is another
        process), or this agent holding that many such workers in all, bounds them: such transfers are refused, and
        the caller is told why, instead of fds running out.
        """
        mine, total = self._quarantines_by.get(self._process_of(peer), 0), len(self._quarantined)
        per_peer, cap = int(self.params["max_quarantines_per_peer"]), int(self.params["max_quarantined_workers"])
        if mine < per_peer and total < cap:
            return None
        why = (
            f"agent {peer!r} stopped answering {mine} time(s) with transfers in flight"
            if mine >= per_peer
            else f"{total} transfers were cut off with UCX operations in flight"
        )
        return BackendUnavailable(
            f"{op} {_towards(op)} agent {peer!r} refused: {why}; the UCX workers those transfers used are held until "
            f"close() so that their late bytes cannot land nor their queued sends read the caller's memory "
            f"(max_quarantines_per_peer={per_peer}, max_quarantined_workers={cap}); transfers by direct cma still run",
            backend=self.name,
        )


def _towards(op: str) -> str:
    return "from" if op == "READ" else "to"


def _flushed(direct: Direct) -> str:
    """Whether a cancelled one-sided request's puts or gets ended: its flush ended (STUCK once it was let go
    unseen, e.g. its peer's connection dropped: nothing will say they ended)."""
    with direct.lock:
        if direct.abandoned:
            return STUCK
        return ENDED if direct.done or direct.flush.poll() != rma.UCS_INPROGRESS else PENDING


def _answered(op: OutOp) -> str:
    """As ``_posted``, and a WRITE's ends only once its owner answered (Done, Refuse or Fail: its receives ended), or
    the request was ended meanwhile: a send that ended here may have only left, its bytes not landed yet."""
    seen = _posted(op)
    if seen != ENDED or op.done_msg or op.abandoned:
        return seen
    return PENDING if op.peer.ops.get(op.id) is op else STUCK


def _posted(op: OutOp) -> str:
    """Whether a cancelled (or failed) owner-served request's receives or sends all ended (completed or failed);
    STUCK once its peer's connection dropped with some still posted (nobody sends for those receives, nor takes
    those sends)."""
    reqs = op.reqs
    seen = reqs.poll()  # type: ignore[union-attr]
    if seen is True or (seen is not False and not reqs.pending()):  # type: ignore[union-attr]
        return ENDED
    return PENDING if op.peer.ops.get(op.id) is op else STUCK
