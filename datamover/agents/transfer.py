"""Transfer: one prepared move with the shared lifecycle post -> PROC -> DONE | ERR -> release."""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Protocol

from ..backends import fence
from ..backends.base import Backend, BackendHost, Completion, Op, TransferRequest, clock
from ..errors import TransferAborted, TransferStateError, TransferTimeout
from ..telemetry.transfer import TransferTelemetry

_now = clock
log = logging.getLogger(__name__)
#: held for a few bytecodes by ``Transfer.fork`` and by a post taking its plan, so a plan is never handed to two
#: posts at once (one lock for every transfer: it is never held across a call)
_HANDOFF = threading.Lock()

#: a poll of ``state`` runs work no backend thread has started this long after ``post``: long enough that a
#: state check right after posting (NIXL's ``transfer()`` returns one) never blocks, short enough that a
#: polling loop, which holds the GIL a pool thread needs, takes the work over instead of spinning on it
POLL_ASSIST_AFTER_S = 200e-6


#: how long ``release`` waits past a post's deadline for its backend's workers to stop
RELEASE_GRACE_S = 10.0


class TransferTracker(Protocol):
    """Who knows which regions are still registered (the agent's ``Registry``): told of every transfer made,
    asked before each post."""

    generation: int  # moves whenever a region goes (or the agent closes)

    def track(self, transfer: Transfer) -> None: ...

    def check_live(self, regions: tuple[int, ...], backend: str) -> None: ...


class PeerTracker(Protocol):
    """Who knows which process each peer's metadata describes (the agent's ``Peers``): asked before a post whose
    remote descriptors were checked against metadata loaded before the last change."""

    generation: int  # moves whenever a peer's metadata is loaded or forgotten

    def check_current(self, agent: str, ident: bytes | None, backend: str | None = None) -> None: ...


class XferState(str, Enum):
    """States of a transfer; the strings are NIXL's."""

    INIT = "INIT"  # made, never posted
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"
    RELEASED = "RELEASED"

    def __str__(self) -> str:
        return self.value


class Transfer:
    """A transfer made by ``Agent.make_transfer`` or ``Agent.transfer``.

    ``post`` starts it (again, once finished), ``state`` polls, ``wait``
    blocks up to the transfer's deadline and raises its error on ERR,
    ``release`` aborts or waits for an in-flight post and frees it.
    """

    __slots__ = (
        "__weakref__",
        "_checked",
        "_claimed",
        "_completion",
        "_error",
        "_host",
        "_lock",
        "_peers",
        "_peers_checked",
        "_post_duration",
        "_posted_at",
        "_posted_wall",
        "_posting",
        "_released",
        "_replan",
        "_tracker",
        "backend",
        "descriptors",
        "nbytes",
        "request",
    )  # fmt: skip

    def __init__(
        self,
        host: BackendHost,
        backend: Backend,
        request: TransferRequest,
        descriptors: int,
        tracker: TransferTracker | None = None,
        nbytes: int | None = None,
        peers: PeerTracker | None = None,
    ) -> None:
        self._host = host
        self._lock = threading.Lock()  # held by post and release: one of them at a time
        self._posting: float | None = None  # while a post is inside its backend's post(): that post's deadline
        self._tracker = tracker
        self._checked = -1  # the tracker's generation at which this transfer's regions were last found live
        self._peers = peers if request.remote_agent is not None else None
        self._peers_checked = -1  # the peers' generation at which its remote side was last found current
        self.backend = backend
        self.request = request
        self.descriptors = descriptors
        self.nbytes = request.local.nbytes if nbytes is None else nbytes
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._released = False
        self._posted_at = 0.0
        self._posted_wall = 0.0
        self._post_duration = 0.0
        self._replan = False
        self._claimed = False  # a post reads or makes the plan, until its completion is set (see ``fork``)
        if tracker is not None:
            tracker.track(self)

    @property
    def op(self) -> Op:
        return self.request.op

    def post(self) -> Transfer:
        """Start the transfer; returns self. Posting one still in flight is an error.

        A request small enough for its backend (``inline_bytes``) runs right
        here and comes back DONE or ERR, without a thread hop.
        """
        if not self._lock.acquire(blocking=False):
            raise TransferStateError(
                "transfer is being posted or released by another thread", backend=self.backend.name
            )
        try:
            return self._post()
        finally:
            self._lock.release()

    def _post(self) -> Transfer:
        if self._released:
            raise TransferStateError("transfer was released", backend=self.backend.name)
        c = self._completion
        if c is not None and c.finished_at is None and self._state(False) == XferState.PROC:
            raise TransferStateError(
                "transfer is still in flight; wait for it before posting again", backend=self.backend.name
            )
        tracker = self._tracker
        if tracker is not None and (generation := tracker.generation) != self._checked:
            tracker.check_live(self.request.own_regions, self.backend.name)
            self._checked = generation  # read before the check: a region going meanwhile is checked next time
        peers = self._peers
        if peers is not None and (generation := peers.generation) != self._peers_checked:
            peers.check_current(self.request.remote_agent, self.request.remote_ident, self.backend.name)  # type: ignore[arg-type]
            self._peers_checked = generation
        self._completion = None  # a post that fails below leaves no earlier outcome behind
        self._error = None
        self._posted_wall = time.time()
        req = self.request
        with _HANDOFF:
            self._claimed = True  # from here until its completion is set, ``fork`` leaves this plan alone
            replan, self._replan = self._replan, False
        try:
            if replan:  # a later transfer took over this one's plan (``fork``): make one of its own first
                req.plan = self.backend.plan(req)
            self._posted_at = t0 = _now()
            self._posting = req.deadline = t0 + req.timeout  # the one deadline of this post: backends wait on it
            try:
                self._completion = c = self.backend.post(req)
            finally:
                self._posting = None
        finally:
            self._claimed = False
        if req.notify and req.remote_agent is None:
            c.add_done_callback(self._notify_self)
        self._post_duration = _now() - t0
        return self

    def fork(self) -> Transfer | None:
        """A new, unposted transfer of the same request and plan, or None while this one is in flight (or inside its
        post), released, or its plan already passed on.

        What makes a repeated ``Agent.transfer`` cheap: the plan passes to the
        new transfer, and this one, if ever posted again, plans anew first, so
        no two posts in flight share a plan.
        """
        with _HANDOFF:  # a post of this one either saw ``_replan`` set below or is claimed: never both on one plan
            c = self._completion
            if self._released or self._claimed or self._replan or (c is not None and c.finished_at is None):
                return None
            self._replan = True
        forked = Transfer(
            self._host, self.backend, self.request.copy(), self.descriptors, self._tracker, self.nbytes, self._peers
        )
        forked._checked, forked._peers_checked = self._checked, self._peers_checked
        return forked

    def _notify_self(self, completion: Completion) -> None:
        if completion.error is None and self._error is None:
            self._host.deliver_notification(self._host.name, self.request.notify)

    @property
    def state(self) -> XferState:
        """INIT, PROC, DONE, ERR or RELEASED; a PROC past its deadline turns ERR (TransferTimeout).

        Polling a transfer still in PROC ``POLL_ASSIST_AFTER_S`` after its post
        runs a part of it that no backend thread has started yet (as ``wait()``
        does), so a polling loop does the work instead of spinning while a
        woken thread waits for the GIL; that poll returns once the part is done.
        """
        return self._state(True)

    def _state(self, assist: bool, look_only: bool = False) -> XferState:
        """The state; past the deadline it times the transfer out (cancel, fence) unless ``look_only`` (``repr``:
        a log line must not cancel, nor wait for a fence from whatever thread logs it)."""
        if self._released:
            return XferState.RELEASED
        c = self._completion
        if c is None:  # never posted, or a post still inside its backend, ERR once given up on (``_give_up``)
            return XferState.INIT if self._error is None else XferState.ERR
        if c.finished_at is None:
            if self._error is not None:
                return XferState.ERR
            if look_only:
                return XferState.PROC
            now = _now()
            if now > self.request.deadline:
                self._time_out(c)
                return XferState.ERR
            if not assist or now - self._posted_at < POLL_ASSIST_AFTER_S or not c.assist():
                return XferState.PROC
        return XferState.ERR if (c.error is not None or self._error is not None) else XferState.DONE

    def _time_out(self, c: Completion) -> None:
        err = TransferTimeout(
            f"{self.op} of {self.descriptors} descriptor(s) did not complete within {self.request.timeout:g} s",
            backend=self.backend.name,
        )
        # ERR is seen once _error is set: only after cancel returned (its fence held), for every thread polling
        # meanwhile too, since each of them comes here and waits in cancel itself
        c.cancel(err)
        if self._error is None:
            self._error = err

    @property
    def error(self) -> BaseException | None:
        """Why the transfer failed: None unless state is ERR, or RELEASED after a post that failed or that
        ``release`` cut short (then a ``TransferAborted``), so what the post left behind stays readable."""
        state = self._state(False)
        if state == XferState.RELEASED:
            c = self._completion
            return self._error or (c.error if c is not None else None)
        if state != XferState.ERR:
            return None
        if self._error is not None:
            return self._error
        return self._completion.error if self._completion else None

    @property
    def outcomes(self) -> dict[int, str] | None:
        """For a WRITE to objects that failed, timed out or was cut short by ``release``: caller descriptor
        index -> "committed", "aborted", "untouched" or "unknown" (the backend's ``outcomes``), also once
        RELEASED; None when the post did not fail or its backend reports no outcomes."""
        c = self._completion
        for err in (c.error if c is not None else None, self._error):
            found = getattr(err, "outcomes", None)
            if found is not None:
                return dict(found)
        return None

    def wait(self, timeout: float | None = None) -> XferState:
        """Block until DONE (returned), ERR (its error raised), or ``timeout`` s (PROC returned)."""
        c = self._completion
        if c is None and self._error is not None and not self._released:
            raise self._error  # its post, still inside its backend, was given up on
        if c is None or self._released:
            raise TransferStateError(
                "transfer was never posted" if c is None else "transfer was released", backend=self.backend.name
            )
        if c.finished_at is None:
            limit = self.request.deadline - _now()
            if timeout is not None and timeout < limit:
                limit = timeout
            # waiting without a timeout may run the backend's remaining work here instead of sleeping on it
            c.wait(limit if limit > 0.0 else 0.0, assist=timeout is None)
        elif c.error is None and self._error is None:
            return XferState.DONE  # the common case after an inline post: nothing to wait for
        state = self._state(False)
        if state == XferState.ERR:
            raise self.error  # type: ignore[misc]
        return state

    def release(self) -> BaseException | None:
        """Abort an in-flight post (waiting for its workers to stop) and free the transfer.

        The wait lasts to the deadline, and past it (a timed-out post) up to ``RELEASE_GRACE_S`` more, so that
        what the backend settles as it stops (an S3 upload committed or aborted) is settled when this returns.
        Returns the error that ended the last post (``TransferAborted`` when this call cut it short; None when
        it was DONE or never posted), as ``error`` goes on returning it: its ``outcomes`` (``self.outcomes``)
        say which objects a cut-short WRITE committed and which it aborted. A post still inside its backend's
        ``post`` (inline work) is waited for as long, then given up on (``_take_lock``).
        """
        if not self._take_lock():
            self._released = True
            return self.error
        try:
            if not self._released:
                self._stop(None)
                self._released = True
        finally:
            self._lock.release()
        return self.error

    def abort(self, reason: str = "transfer aborted") -> None:
        """Cut an in-flight post short (ERR with ``TransferAborted(reason)``), waiting as ``release`` does, but
        keep the transfer: it may be posted again. Nothing happens to a transfer not in flight."""
        if not self._take_lock():
            return
        try:
            if not self._released:
                self._stop(TransferAborted(reason, backend=self.backend.name))
        finally:
            self._lock.release()

    def _take_lock(self) -> bool:
        """Take the lock ``post`` holds: True once taken; False when a post is still inside its backend's ``post``
        ``FENCE_S`` past its deadline (inline work stuck in a call on a hung device), which is then given up on
        (``_give_up``) rather than waited for without bound."""
        lock, req = self._lock, self.request
        while True:
            deadline = self._posting  # None: a release, abort or settle holds it, or a post not yet in its backend
            wait = req.timeout + fence.FENCE_S if deadline is None else deadline + fence.FENCE_S - _now()
            if lock.acquire(timeout=max(0.0, wait)):
                return True
            if deadline is not None and self._posting == deadline:
                self._give_up()
                return False

    def _give_up(self) -> None:
        """ERR without the post still inside its backend, whose call under way (a syscall on a hung device) may
        still move bytes; posix's inline work starts nothing past the deadline (``rows.Halt``)."""
        if self._error is None:
            self._error = TransferTimeout(
                f"{self.op} of {self.descriptors} descriptor(s): its post was still inside the {self.backend.name}"
                f" backend {fence.FENCE_S:g} s past its {self.request.timeout:g} s deadline (a call on a hung"
                " device?) and was given up on; the call under way may still move bytes",
                backend=self.backend.name,
            )

    def _stop(self, error: BaseException | None) -> None:
        """Cancel the post in flight, if any, and wait for its backend's workers to stop (to the deadline and
        up to ``RELEASE_GRACE_S`` past it)."""
        c = self._completion
        if c is not None and c.finished_at is None:
            c.cancel(error)
            c.wait(max(0.0, self.request.deadline - _now()) + min(RELEASE_GRACE_S, self.request.timeout))
            if c.finished_at is None:
                log.warning(
                    "%s stopped before its %s backend did; its outcome is not settled yet", self, self.backend.name
                )

    def settle(self) -> None:
        """Wait for a post in flight (or being posted) to end: DONE or ERR, timed out at its deadline (its
        backend told to stop and, where it fences, waited for), so its memory is no longer touched; a post still
        inside its backend's ``post`` ``FENCE_S`` past its deadline is given up on (``_take_lock``)."""
        if not self._take_lock():
            return
        try:
            c = self._completion
            if self._released or c is None or c.finished_at is not None:
                return
            c.wait(max(0.0, self.request.deadline - _now()))
            if c.finished_at is None and self._error is None:
                self._time_out(c)
        finally:
            self._lock.release()

    @property
    def in_flight(self) -> bool:
        """True while a post runs or is in PROC: its memory (and files) may still be touched."""
        if self._lock.locked():
            return True
        c = self._completion
        return c is not None and c.finished_at is None and self._error is None and not self._released

    @property
    def telemetry(self) -> TransferTelemetry:
        c = self._completion
        done = c is not None and c.finished_at is not None
        return TransferTelemetry(
            start_time=self._posted_wall,
            post_duration_s=self._post_duration,
            transfer_duration_s=(c.finished_at - self._posted_at) if done else None,
            bytes=self.nbytes,
            descriptors=self.descriptors,
            rows=len(self.request.local),
            backend=self.backend.name,
        )

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"Transfer({self.op}, {self.descriptors} descriptors, {self.nbytes} bytes, "
            f"backend={self.backend.name}, state={self._state(False, look_only=True).value})"
        )
