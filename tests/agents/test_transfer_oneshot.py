"""Agent.transfer, the one-shot form: what it remembers between calls with the same lists, and when it must not."""

import threading

import numpy as np
import pytest

from datamover import Agent, DescList, MemType, XferState
from datamover.backends import Backend, register_backend
from datamover.backends.base import Completion
from datamover.errors import NotRegistered

N, B = 32, 4096


@pytest.fixture
def pool():
    with Agent("one", {"backends": {"memcpy": {}}}) as agent:
        src, dst = np.zeros(2 * N * B, np.uint8), np.zeros(2 * N * B, np.uint8)
        sreg, dreg = agent.register_memory(src), agent.register_memory(dst)
        perm = np.random.default_rng(0).permutation(2 * N)[:N]
        s = DescList.from_columns(src.ctypes.data + np.arange(N) * B, B, 0, "DRAM")
        d = DescList.from_columns(dst.ctypes.data + perm * B, B, 0, "DRAM")
        yield agent, src, dst, s, d, perm, sreg, dreg


def _expect(src, dst, perm):
    for i, p in enumerate(perm):
        assert (dst[p * B : (p + 1) * B] == src[i * B : (i + 1) * B]).all(), i


def test_the_same_lists_again_move_the_new_bytes_each_time(pool):
    agent, src, dst, s, d, perm, _, _ = pool
    for k in range(3):
        src[:] = np.random.default_rng(k).integers(0, 256, src.shape[0], dtype=np.uint8)
        assert agent.transfer("WRITE", s, d).wait() == XferState.DONE
        _expect(src, dst, perm)


def test_no_two_posts_share_a_plan(pool):
    agent, _, _, s, d, _, _, _ = pool
    x1 = agent.transfer("WRITE", s, d)
    x1.wait()
    x2 = agent.transfer("WRITE", s, d)
    assert x2 is not x1 and x2.request is not x1.request
    assert x2.request.plan is x1.request.plan  # the remembered plan passed on to the new transfer ...
    x1.post().wait()
    assert x1.request.plan is not x2.request.plan  # ... and the old handle, posted again, planned anew
    assert x2.wait() == XferState.DONE


def test_a_change_of_registrations_is_seen(pool):
    agent, _, _, s, d, _, _, dreg = pool
    agent.transfer("WRITE", s, d).wait()
    agent.deregister_memory(dreg)
    with pytest.raises(NotRegistered):
        agent.transfer("WRITE", s, d)


def test_equal_but_distinct_lists_are_checked_again(pool):
    agent, _, _, s, d, _, _, _ = pool
    agent.transfer("WRITE", s, d).wait()
    outside = DescList.from_columns(d.addr + (1 << 40), d.length, 0, "DRAM")
    with pytest.raises(NotRegistered):
        agent.transfer("WRITE", s, outside)


class Held(Backend):
    """Posts that stay in flight until the test finishes them."""

    name = "held"
    pairs = frozenset({(MemType.DRAM, MemType.DRAM)})
    posted: list[Completion] = []

    @classmethod
    def available(cls):
        return True, "ok"

    def plan(self, req):
        return object()

    def post(self, req):
        c = Completion(1)
        Held.posted.append(c)
        return c


def test_a_transfer_in_flight_keeps_its_plan():
    register_backend("held", Held)
    with Agent("h", {"backends": {"held": {}}}) as agent:
        a, b = np.zeros(4 * B, np.uint8), np.zeros(4 * B, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        s, d = DescList.blocks(a, B), DescList.blocks(b, B)
        x1 = agent.transfer("WRITE", s, d)
        x2 = agent.transfer("WRITE", s, d)  # x1 still in flight: x2 must not take its plan
        assert x1.state == XferState.PROC and x2.request.plan is not x1.request.plan
        for c in Held.posted:
            c.finish_part()
        assert x1.wait() == x2.wait() == XferState.DONE


def test_lists_built_anew_with_the_same_rows_reuse_the_plan(pool):
    agent, src, dst, s, d, perm, _, _ = pool
    x1 = agent.transfer("WRITE", s, d)
    x1.wait()
    s2, d2 = DescList.from_columns(s.addr.copy(), B), DescList.from_columns(d.addr.copy(), B)
    src[:] = 7
    x2 = agent.transfer("WRITE", s2, d2)
    assert x2.request.plan is x1.request.plan and x2.wait() == XferState.DONE
    _expect(src, dst, perm)
    other = DescList.from_columns(d.addr[::-1].copy(), B)  # other rows: checked and planned anew
    assert agent.transfer("WRITE", s2, other).request.plan is not x2.request.plan


def test_lists_that_keep_buffers_alive_are_remembered_only_as_the_same_objects():
    with Agent("o", {"backends": {"memcpy": {}}}) as agent:
        a, b = np.zeros(4 * B, np.uint8), np.zeros(4 * B, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        x1 = agent.transfer("WRITE", DescList.blocks(a, B), DescList.blocks(b, B))
        x1.wait()
        x2 = agent.transfer("WRITE", DescList.blocks(a, B), DescList.blocks(b, B))  # same rows, owners: not reused
        assert x2.request.plan is not x1.request.plan and x2.wait() == XferState.DONE


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_rows_that_merge_move_the_caller_blocks(op):
    """Permutations with runs that merge on both sides: the one-shot gather moves what prepare + make does."""
    rng = np.random.default_rng(5)
    with Agent("m", {"backends": {"memcpy": {}}}) as agent:
        a, b = np.zeros(2 * N * B, np.uint8), np.zeros(2 * N * B, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        for k in range(20):
            la = np.sort(rng.permutation(2 * N)[:N])  # sorted slots: many neighbours, so rows merge
            lb = np.sort(rng.permutation(2 * N)[:N])
            s = DescList.from_columns(a.ctypes.data + la * B, B)
            d = DescList.from_columns(b.ctypes.data + lb * B, B)
            a[:] = rng.integers(0, 256, a.shape[0], dtype=np.uint8)
            b[:] = rng.integers(0, 256, b.shape[0], dtype=np.uint8)
            want_a, want_b = a.copy(), b.copy()
            src, dst, sl, dl = (want_a, want_b, la, lb) if op == "WRITE" else (want_b, want_a, lb, la)
            for i in range(N):
                dst[dl[i] * B : (dl[i] + 1) * B] = src[sl[i] * B : (sl[i] + 1) * B]
            x = agent.transfer(op, s, d)
            assert x.wait() == XferState.DONE
            assert (a == want_a).all() and (b == want_b).all(), k
            if k == 0:
                assert x.request.caller_local is s and len(x.request.local) < N  # rows merged ...
                assert x.request.plan.mode == "gather" and x.request.plan.block == B  # ... and gathered as blocks


class Slow(Held):
    """Posts whose plan is kept in ``plans``; the second blocks inside ``post`` (as a backend running its work
    inline does) until ``go`` is set."""

    name = "slow"
    inside = threading.Event()
    go = threading.Event()
    plans: list[object] = []

    def post(self, req):
        Slow.plans.append(req.plan)
        if len(Slow.plans) == 2:
            Slow.inside.set()
            Slow.go.wait(30)
        return super().post(req)


def test_a_transfer_still_inside_its_backends_post_keeps_its_plan():
    """The same lists again from another thread while the last post has not returned from the backend: the call
    does not wait for it, and the new transfer plans anew (before, transfer() waited for every post under way, and
    without that wait the fork took the plan the post was running on: two posts in flight on one plan)."""
    register_backend("slow", Slow)
    with Agent("s", {"backends": {"slow": {}}}) as agent:
        a, b = np.zeros(4 * B, np.uint8), np.zeros(4 * B, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        s, d = DescList.blocks(a, B), DescList.blocks(b, B)
        mine = len(Held.posted)
        x0 = agent.transfer("WRITE", s, d)
        Held.posted[-1].finish_part()
        assert x0.wait() == XferState.DONE
        second: list = []
        t = threading.Thread(target=lambda: second.append(agent.transfer("WRITE", s, d)))
        t.start()
        try:
            assert Slow.inside.wait(30)  # the second post (x0's plan passed on) is inside the backend's post
            x2 = agent.transfer("WRITE", s, d)
            assert t.is_alive()  # it did not wait for the post under way (that held every transfer() until it ended)
        finally:
            Slow.go.set()
            t.join(30)
        assert len(Slow.plans) == 3 and Slow.plans[1] is Slow.plans[0] and Slow.plans[2] is not Slow.plans[1]
        for c in Held.posted[mine + 1 :]:
            c.finish_part()
        assert second[0].wait() == x2.wait() == XferState.DONE


def test_repr_of_a_transfer_past_its_deadline_does_not_time_it_out():
    """repr() (what a log line prints) only looks: before, it timed the transfer out itself, cancelling it (and
    waiting for its fence) from whatever thread logged it."""
    register_backend("held", Held)
    with Agent("r", {"backends": {"held": {}}}) as agent:
        a, b = np.zeros(4 * B, np.uint8), np.zeros(4 * B, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        x = agent.transfer("WRITE", DescList.blocks(a, B), DescList.blocks(b, B), timeout=1e-6)
        c = Held.posted[-1]
        assert "state=PROC" in repr(x) and not c.cancelled
        assert x.state == XferState.ERR and c.cancelled  # the state itself still times it out
        c.finish_part()
