"""Transfer: one prepared move with the shared lifecycle post -> PROC -> DONE | ERR -> release."""

from __future__ import annotations

import logging
import time
from enum import Enum

from ..backends.base import Backend, BackendHost, Completion, Op, TransferRequest, clock
from ..errors import TransferStateError, TransferTimeout
from ..telemetry.transfer import TransferTelemetry

_now = clock
log = logging.getLogger(__name__)

#: a poll of ``state`` runs work no backend thread has started this long after ``post``: long enough that a
#: state check right after posting (NIXL's ``transfer()`` returns one) never blocks, short enough that a
#: polling loop, which holds the GIL a pool thread needs, takes the work over instead of spinning on it
POLL_ASSIST_AFTER_S = 200e-6


#: how long ``release`` waits past a post's deadline for its backend's workers to stop
RELEASE_GRACE_S = 10.0


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
        "_completion",
        "_error",
        "_host",
        "_post_duration",
        "_posted_at",
        "_posted_wall",
        "_released",
        "_replan",
        "backend",
        "descriptors",
        "nbytes",
        "request",
    )  # fmt: skip

    def __init__(self, host: BackendHost, backend: Backend, request: TransferRequest, descriptors: int) -> None:
        self._host = host
        self.backend = backend
        self.request = request
        self.descriptors = descriptors
        self.nbytes = request.local.nbytes
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._released = False
        self._posted_at = 0.0
        self._posted_wall = 0.0
        self._post_duration = 0.0
        self._replan = False

    @property
    def op(self) -> Op:
        return self.request.op

    def post(self) -> Transfer:
        """Start the transfer; returns self. Posting one still in flight is an error.

        A request small enough for its backend (``inline_bytes``) runs right
        here and comes back DONE or ERR, without a thread hop.
        """
        if self._released:
            raise TransferStateError("transfer was released", backend=self.backend.name)
        c = self._completion
        if c is not None and c.finished_at is None and self._state(False) == XferState.PROC:
            raise TransferStateError(
                "transfer is still in flight; wait for it before posting again", backend=self.backend.name
            )
        self._error = None
        self._posted_wall = time.time()
        req = self.request
        if self._replan:  # a later transfer took over this one's plan (``fork``): make one of its own first
            self._replan = False
            req.plan = self.backend.plan(req)
        self._posted_at = t0 = _now()
        req.deadline = t0 + req.timeout  # the one deadline of this post: backends wait against it
        self._completion = c = self.backend.post(req)
        if req.notify and req.remote_agent is None:
            c.add_done_callback(self._notify_self)
        self._post_duration = _now() - t0
        return self

    def fork(self) -> Transfer | None:
        """A new, unposted transfer of the same request and plan, or None while this one is in flight or released.

        What makes a repeated ``Agent.transfer`` cheap: the plan passes to the
        new transfer, and this one, if ever posted again, plans anew first, so
        no two posts in flight share a plan.
        """
        c = self._completion
        if self._released or (c is not None and c.finished_at is None):
            return None
        self._replan = True
        return Transfer(self._host, self.backend, self.request.copy(), self.descriptors)

    def _notify_self(self, completion: Completion) -> None:
        if completion.error is None:
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

    def _state(self, assist: bool) -> XferState:
        if self._released:
            return XferState.RELEASED
        c = self._completion
        if c is None:
            return XferState.INIT
        if c.finished_at is None:
            if self._error is not None:
                return XferState.ERR
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
        say which objects a cut-short WRITE committed and which it aborted.
        """
        if not self._released:
            c = self._completion
            if c is not None and c.finished_at is None:
                c.cancel()
                c.wait(max(0.0, self.request.deadline - _now()) + min(RELEASE_GRACE_S, self.request.timeout))
                if c.finished_at is None:
                    log.warning(
                        "%s released before its %s backend stopped; its outcome is not settled yet",
                        self,
                        self.backend.name,
                    )
            self._released = True
        return self.error

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
            f"backend={self.backend.name}, state={self._state(False).value})"
        )
