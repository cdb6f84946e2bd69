"""``Fenced.cancel`` returns only once the request is cut off, for every thread that cancels it at once."""

from __future__ import annotations

import sys
import threading
import time

from datamover.backends.ucx.state import Fenced


def _waiting(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in a ``threading`` wait (read from its stack, not guessed from time)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def test_a_second_cancel_waits_for_the_fence_the_first_is_running():
    entered, go, cut = threading.Event(), threading.Event(), threading.Event()
    runs = []

    def fence(completion: Fenced) -> None:
        runs.append(1)
        entered.set()
        assert go.wait(60), "the test never let the fence go"
        cut.set()

    c = Fenced(1)
    c.fence = fence
    first = threading.Thread(target=c.cancel)
    first.start()
    assert entered.wait(60)
    returned_early = []

    def second() -> None:
        c.cancel()
        returned_early.append(not cut.is_set())

    t = threading.Thread(target=second)
    t.start()
    deadline = time.monotonic() + 60
    while t.is_alive() and not _waiting(t):  # the second cancel either returned, or waits
        assert time.monotonic() < deadline, "the second cancel neither returned nor waited"
        time.sleep(0.01)
    go.set()
    first.join(60)
    t.join(60)
    assert returned_early == [False], "a second cancel returned while the first was still cutting the request off"
    assert runs == [1], "the fence ran more than once"


class _Ended:
    """A UCX request that ended without error."""

    completed = True

    def check_error(self) -> None:
        pass


def test_a_cut_owner_served_write_is_over_only_once_its_owner_answered():
    """A send that ended here may only have left: its bytes can still land in the owner's memory. The drain of a cut
    owner-served WRITE stays pending, every send ended, until the owner answers (Done; a Refuse or Fail ends the
    request), and is stuck once the owner's connection is gone; a READ's is over once its receives ended."""
    from types import SimpleNamespace

    from datamover.backends.ucx.cancel_drain import ENDED, PENDING, STUCK
    from datamover.backends.ucx.fence import _answered
    from datamover.backends.ucx.state import OutOp, Peer, Requests

    peer = Peer("owner", {})
    write = OutOp(1, peer, SimpleNamespace(op="WRITE"), Fenced(1), 0.0)  # type: ignore[arg-type]
    write.reqs = Requests([_Ended(), _Ended()])
    peer.ops[write.id] = write
    assert _answered(write) == PENDING, "a cut WRITE was over before its owner said its receives ended"
    write.done_msg = True
    assert _answered(write) == ENDED
    write.done_msg = False
    write.abandoned = True  # ended meanwhile: a Refuse or Fail from the owner
    assert _answered(write) == ENDED
    write.abandoned = False
    del peer.ops[write.id]  # the owner's connection dropped: nobody will answer
    assert _answered(write) == STUCK
    read = OutOp(2, peer, SimpleNamespace(op="READ"), Fenced(1), 0.0)  # type: ignore[arg-type]
    read.reqs = Requests([_Ended()])
    peer.ops[read.id] = read
    assert _answered(read) == ENDED
