"""In-flight UCX requests are let go only once they ended, or with every other progress of their worker stopped.

Dropping the last reference to an in-flight ucxx request cancels it, under the request's lock and then the
worker's; the request's completion, inside the native progress thread's progress, takes them the other way round.
Under load an owner that dropped a cancelled WRITE's receives as its initiator's last bytes came in deadlocked so
(service thread in ``ucp_request_cancel``, progress thread in ``Request::setStatus``) and never served again: the
next 4 KiB WRITE to it timed out (the steps of test_ucx_cancel's releasing test under load: 5 of 113 rounds;
0 of 460 after).
"""

from __future__ import annotations

import contextlib
import gc
import threading

import numpy as np
import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.errors import TransferAborted
from datamover.testing import HostBuffer
from datamover.testing.waiting import until

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


class _Watched:
    """A ucxx request that records, when its last reference goes, whether it was in flight and nobody else could
    progress its worker (the owner's gate held by the thread letting it go)."""

    def __init__(self, real, backend, drops: list) -> None:
        self._real, self._backend, self._drops = real, backend, drops

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def completed(self) -> bool:
        return self._real.completed

    def __del__(self) -> None:
        gate = getattr(self._backend, "_progress_gate", None)
        quiet = gate is not None and gate.locked() and threading.current_thread() is self._backend._thread
        self._drops.append((self._real.completed, quiet))


def test_an_owner_cancels_a_cancelled_writes_receives_only_with_its_worker_quiesced(monkeypatch):
    """The known point: the initiator's native progress thread is held from before the post, so the WRITE's
    rendezvous data stays queued in its UCX and the owner's receives, posted and matched, stay in flight. The
    release gives up on them after ``cancel_drain_s``, tells the owner ``Cancel`` and quarantines its worker: the
    receives can never end. The owner must keep them until it cancels them with its worker quiesced (before: it
    dropped them at the ``Cancel``, in flight, with its progress thread free to be completing them)."""
    from datamover.backends.ucx import tagged

    drops: list[tuple[bool, bool]] = []
    cfg = {"backends": {"ucx": {"one_sided": False, "cancel_drain_s": 0.2}}}
    with Agent("retire-owner", cfg) as owner, Agent("retire-writer", cfg) as writer:
        served, sender = owner.backend("ucx"), writer.backend("ucx")
        if served._progress is None or sender._progress is None:
            pytest.skip("no native progress thread (the extension is not built): nothing to hold")
        real = tagged.Requests

        def watched(reqs: list, *sink):  # the owner's (served on its service thread), not the writer's own sends
            mine = threading.current_thread() is served._thread
            return real([_Watched(r, served, drops) for r in reqs] if mine else reqs, *sink)

        monkeypatch.setattr(tagged, "Requests", watched)
        size, bs = 16 << 20, 4 << 20
        n = size // bs
        dst, src = HostBuffer(owner, size), HostBuffer(writer, size)
        writer.add_remote(owner.metadata())
        small = writer.transfer("WRITE", src.descs([0], [4096]), dst.descs([0], [4096]), "retire-owner")
        assert small.wait()
        drops.clear()
        progress = sender._progress
        progress.hold()
        try:
            # the owner's rows in reverse order: nothing coalesces, every row is its own send and receive
            remote = dst.descs((n - 1 - np.arange(n)) * bs, bs)
            xfer = writer.transfer("WRITE", src.descs(np.arange(n) * bs, bs), remote, "retire-owner", timeout=60)
            until(lambda: served.served_rows() == n, what="the owner posting the WRITE's receives")
            assert isinstance(xfer.release(), TransferAborted)
        finally:
            progress.release()  # a no-op: the release replaced that worker and stopped its thread
        assert sender.resets == 1, "the release should have quarantined the initiator's worker"
        until(lambda: served.served_rows() == 0, what="the owner taking the Cancel")
        gc.collect()
        early = [d for d in drops if not d[0] and not d[1]]
        assert not early, f"{len(early)} in-flight receives let go with the owner's progress thread free"
        until(lambda: not len(served._retired), what="the owner cancelling the receives after cancel_drain_s")
        assert [d for d in drops if not d[0]] == [(False, True)] * n
        assert served.describe()["requests let go in flight"] == {"held": 0, "cancelled": n}
        # the owner still serves: its worker was never deadlocked nor replaced
        again = writer.transfer("WRITE", src.descs([0], [4096]), dst.descs([0], [4096]), "retire-owner")
        assert again.wait()
        assert served.resets == 0


def test_a_sweep_drops_ended_requests_at_once_and_cancels_late_ones_only_quiesced():
    from datamover.backends.ucx.retired import Retired

    class Req:
        def __init__(self, completed: bool) -> None:
            self.completed = completed

    inside: list[bool] = []
    quiet = [False]

    @contextlib.contextmanager
    def quiesced():
        quiet[0] = True
        try:
            yield
        finally:
            quiet[0] = False

    class Tracked(Req):
        def __del__(self) -> None:
            inside.append(quiet[0])

    retired = Retired()
    ended, stuck = Tracked(False), Tracked(False)
    retired.add([ended, stuck, None, Req(True)])  # None and an ended one are not kept
    assert len(retired) == 2
    del ended, stuck
    retired._held[0][1].completed = True
    retired.sweep(3600.0, quiesced)  # within the grace: the ended one goes (not quiesced), the other stays
    assert inside == [False] and len(retired) == 1
    retired.sweep(-1.0, quiesced)  # past it: cancelled, quiesced
    assert inside == [False, True] and len(retired) == 0 and retired.cancelled == 1
