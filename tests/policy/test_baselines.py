"""Each baseline on small hand-made sequences whose right answer is worked out by hand (see each test)."""

from __future__ import annotations

import numpy as np
import pytest

from datamover.policy.arc import ARCTier
from datamover.policy.engine import TierSpec, TierStack
from datamover.policy.lecar import LeCaRTier
from datamover.policy.lfu import LFUTier
from datamover.policy.lru import LRUTier
from datamover.policy.policies import BASELINES, make_policy, policy_names
from datamover.policy.s3fifo import S3FIFOTier
from datamover.policy.tinylfu import FrequencySketch, WTinyLFUTier


def run(policy, capacity: int, seq) -> TierStack:
    stack = TierStack(policy, [TierSpec("l1_hbm", capacity)])
    for i, key in enumerate(seq):
        stack.access(key, float(i), i)
    return stack


def test_every_baseline_is_registered():
    assert set(BASELINES) | {"default", "adaptive", "scored"} <= set(policy_names())


def test_lru_evicts_the_least_recently_used():
    s = run(make_policy("lru"), 2, "abac")
    assert s.resident[0] == {"a", "c"}


def test_lfu_evicts_the_least_used_and_ages():
    # a a b c: c's arrival evicts b (1 use against a's 2); the age becomes b's priority, 1.
    t = LFUTier(2)
    s = TierStack(make_policy("lfu"), [TierSpec("l1_hbm", 2)])
    s.orders[0] = t
    for i, key in enumerate("aabc"):
        s.access(key, float(i), i)
    assert s.resident[0] == {"a", "c"} and t.age == 1.0
    # c entered at age 1 with one use: priority 2, as a's. With plain LFU c would go next; with aging the tie
    # goes to the older priority, a's, so d replaces a.
    assert t.priority("c") == t.priority("a") == 2.0
    s.access("d", 4.0, 4)
    assert s.resident[0] == {"c", "d"}


def test_arc_ghost_hits_move_the_target():
    t = ARCTier(2)
    s = TierStack(make_policy("arc"), [TierSpec("l1_hbm", 2)])
    s.orders[0] = t

    def ref(key):
        s.access(key, 0.0)

    for key in "aab":  # a used twice: T2 = [a]; b: T1 = [b]
        ref(key)
    ref("c")  # full: |T1| = 1 > p = 0, so T1's LRU b goes to the ghost B1
    assert list(t.t1) == ["c"] and list(t.t2) == ["a"] and list(t.b1) == ["b"] and t.p == 0
    ref("b")  # ghost hit in B1: p grows by max(|B2|/|B1|, 1) = 1; |T1| = 1 is not above p: T2's a goes to B2
    assert t.p == 1 and list(t.t2) == ["b"] and list(t.b2) == ["a"] and list(t.t1) == ["c"]
    ref("a")  # ghost hit in B2: p shrinks to 0; |T1| = 1 > p: T1's c goes to B1; a joins T2
    assert t.p == 0 and list(t.t2) == ["b", "a"] and not t.t1 and list(t.b1) == ["c"]
    assert s.hits[0] == 1  # only a's second use hit; the two ghost hits were misses that moved p
    fresh = ARCTier(2)  # and with the tier full of chunks used once, T1's LRU leaves without a ghost (case IV)
    s.orders[0], s.resident[0] = fresh, set()
    for key in "xyz":
        ref(key)
    assert list(fresh.t1) == ["y", "z"] and not fresh.b1


def test_s3fifo_demotes_one_hit_wonders_quickly():
    t = S3FIFOTier(10)  # S holds 1, M 9
    s = TierStack(make_policy("s3fifo"), [TierSpec("l1_hbm", 10)])
    s.orders[0] = t
    seq = ["h1", "h2", "h3", "h4", "h5"] * 2 + [f"x{i}" for i in range(20)]
    for i, key in enumerate(seq):
        s.access(key, float(i), i)
    hot = {"h1", "h2", "h3", "h4", "h5"}
    assert hot <= s.resident[0] and hot <= set(t.main)  # used twice: moved to M when S was evicted from
    assert set(t.small) <= {f"x{i}" for i in range(20)}
    assert set(t.small) == {f"x{i}" for i in range(15, 20)}
    # never reused: each left from S as the next came in, its key remembered in G (9 keys, the size of M)
    assert list(t.ghost) == [f"x{i}" for i in range(6, 15)]
    lru = run(make_policy("lru"), 10, seq)
    assert not hot & lru.resident[0]  # LRU let the scan push every hot chunk out
    s.access("x14", 99.0, 99)  # back from the ghost: straight into M
    assert "x14" in t.main


def test_wtinylfu_admits_only_what_is_used_more_than_the_victim():
    sketch = FrequencySketch(1000)
    t = WTinyLFUTier(3, sketch)  # window 1, main 2
    stack = TierStack(make_policy("wtinylfu"), [TierSpec("l1_hbm", 3)])
    stack.orders[0] = t

    def ref(key):
        sketch.add(key)
        stack.access(key, 0.0)

    for key in "aaabbc":  # a (3 uses) and b (2) reach probation; c is in the window
        ref(key)
    assert list(t.window) == ["c"] and list(t.probation) == ["a", "b"]
    ref("d")  # c (1 use) against probation's LRU a (3): c is refused, d takes the window
    assert stack.resident[0] == {"a", "b", "d"} and list(t.window) == ["d"]
    for _ in range(4):  # d now has 5 uses
        ref("d")
    ref("e")  # d (5) against a (3): d is admitted to probation and a leaves
    assert stack.resident[0] == {"b", "d", "e"} and "d" in t.probation


def test_wtinylfu_sketch_ages():
    sketch = FrequencySketch(64)
    for _ in range(20):
        sketch.add("a")
    assert sketch.estimate("a") == 15  # four-bit counts
    for i in range(44):
        sketch.add(i)
    assert sketch.estimate("a") == 7 and sketch.estimate(0) == 0  # halved after 64 additions; ones dropped


def test_lecar_penalises_the_expert_that_evicted_a_returning_key():
    t = LeCaRTier(2)
    t.insert("a", 0.0)
    t.insert("b", 1.0)
    t.touch("b", 2.0)
    t.rng.random = lambda: 0.0  # draw LRU
    assert t.evict(1, 3.0) == ["a"] and "a" in t.h_lru
    t.insert("c", 3.0)
    t.rng.random = lambda: 0.999  # draw LFU: c (1 use) goes, into LFU's history
    assert t.evict(1, 4.0) == ["c"] and "c" in t.h_lfu
    assert t.admit("a", 5.0) and t.w_lru < 0.5  # LRU was wrong about a
    w = t.w_lru
    t.evict(1, 5.0)
    t.insert("a", 5.0)
    assert t._freq["a"] == 2  # a resumes its count
    assert t.admit("c", 6.0) and t.w_lru > w  # LFU was wrong about c


def test_adaptive_switches_on_a_paired_lead_and_hands_over_warm():
    """The evidence is McNemar's: a challenger must win more than SIGMAS x sqrt(split) of the references it
    split with the leader (one hit, the other missed); references both hit say nothing, however many."""
    policy = make_policy("default")
    tier = policy.tier(64)  # small: every key is sampled
    stack = TierStack(policy, [TierSpec("l1_hbm", 64)])
    stack.orders[0] = tier
    for i in range(64):
        stack.access(i, float(i), i)
    for i in (3, 3, 5):  # chunks 3 and 5 used again: their counts in the sketch go up
        stack.access(i, 64.0, 64)
    assert isinstance(tier.real, S3FIFOTier) and tier.leader == 0
    assert [type(s) for s in tier.shadows] == [S3FIFOTier, WTinyLFUTier, ARCTier, LRUTier, LFUTier]
    assert not any(map(any, tier.wins))  # every shadow holds all 64: no reference was split

    def compare(up: float, down: float, expert: int = 2) -> None:
        tier.wins = [[0.0] * 5 for _ in range(5)]
        tier.wins[expert][tier.leader], tier.wins[tier.leader][expert] = up, down
        tier._unit, tier._until_check = 1.0, 1
        stack.access(0, 70.0, 70)  # a hit in every shadow: the split counts stay as set (then fade a little)

    compare(1025.0, 1000.0)  # 25 ahead on 2025 splits: under 3 sqrt(2025) = 135
    assert tier.leader == 0 and tier.switches == 0
    compare(55.0, 30.0)  # 25 ahead on 85: under 3 sqrt(85) = 27.7
    assert tier.leader == 0
    compare(40.0, 15.0)  # 25 ahead on 55: over 3 sqrt(55) = 22.2
    assert tier.leader == 2 and isinstance(tier.real, ARCTier) and tier.switches == 1
    assert set(tier.recency) == stack.resident[0] == set(range(64)) and len(tier.real) == 64
    assert set(tier.real.t2) == {0, 3, 5}  # warm: the chunks the sketch saw twice or more start in T2
    compare(400.0, 0.0, expert=3)  # LRU far ahead of ARC, now the leader
    assert tier.leader == 3 and isinstance(tier.real, LRUTier) and len(tier.real) == 64
    stack.access(999, 80.0, 80)  # the new policy runs the tier: one chunk out, the newcomer in
    assert len(stack.resident[0]) == 64 and 999 in stack.resident[0]


def test_the_paired_counts_take_only_the_references_the_shadows_split():
    tier = make_policy("default").tier(1)
    for key in (1, 2, 1, 2):  # 1-chunk shadows: every one misses every reference, nothing is split
        tier._sample(key, 0.0)
    assert not any(map(any, tier.wins))
    s3 = tier.shadows[0] = S3FIFOTier(1)
    tier._refs[0] = s3.ref
    s3.insert(7, 0.0)  # only S3-FIFO's shadow holds 7
    tier._sample(7, 1.0)
    assert [w > 0 for w in tier.wins[0]] == [False, True, True, True, True]
    assert not any(map(any, tier.wins[1:]))


def test_a_policy_switch_hands_each_expert_the_use_counts():
    counts = {2: 3, 4: 2}
    arc = ARCTier(8)
    arc.adopt([1, 2, 3, 4], counts)
    assert list(arc.t1) == [1, 3] and list(arc.t2) == [2, 4]
    lfu = LFUTier(8)
    lfu.adopt([1, 2, 3, 4], counts)
    assert [lfu.priority(k) for k in (1, 2, 3, 4)] == [1, 3, 1, 2] and lfu.evict(2, 0.0) == [1, 3]
    s3 = S3FIFOTier(8)
    s3.adopt([1, 2, 3, 4], counts)
    assert list(s3.main) == [1, 2, 3, 4] and s3.freq == {1: 0, 2: 2, 3: 0, 4: 1}
    lru = LRUTier(8)
    lru.adopt([1, 2, 3, 4], counts)
    assert lru.evict(1, 0.0) == [1]
    tiny = WTinyLFUTier(100, FrequencySketch())  # window 1, protected 79
    tiny.adopt(list(range(10)), {0: 2, 5: 4, 9: 2})
    assert list(tiny.window) == [9] and list(tiny.protected) == [0, 5]
    assert list(tiny.probation) == [1, 2, 3, 4, 6, 7, 8]


def test_arc_takes_back_a_handed_back_victim_without_a_ghost_hit():
    """The default's leaf guard hands a victim that still has children back to the policy: for ARC that is
    not a ghost hit (p stays), the chunk returns to its list and leaves its ghost list."""
    arc = ARCTier(2)
    for key in ("a", "b"):
        arc.insert(key, 0.0)
    assert arc.evict(1, 1.0) == ["a"] and "a" in arc.b1
    arc.restore("a", 1.0)
    assert arc.p == 0.0 and "a" not in arc.b1 and list(arc.t1) == ["b", "a"]


@pytest.mark.parametrize("name", ["default", *BASELINES, "scored"])
def test_every_policy_keeps_its_books_straight_with_pins(name):
    stack = TierStack(make_policy(name), [TierSpec("l1_hbm", 8), TierSpec("l2_dram", 16)])
    rng = np.random.default_rng(3)
    for r in range(400):
        keys = [int(k) for k in rng.integers(0, 60, int(rng.integers(1, 6)))]
        stack.access_request(list(dict.fromkeys(keys)), float(r))
        for j, order in enumerate(stack.orders):
            assert len(order) == len(stack.resident[j]) <= stack.specs[j].capacity
    assert not stack.pinned


def test_the_replay_counts_the_usable_prefix_and_serves_leaf_first():
    """Two identical requests [1, 2, 3] through LRU of 2 chunks. Leaf first, the first request leaves 1 and 2
    (3, the leaf, was least recent): the second request finds a usable prefix of 2. In key order LRU keeps 2
    and 3: the second request's 1 misses, and storing it and 2 again pushes out the very chunks that follow."""
    for leaf_first, usable, found in ((True, 2, 2), (False, 0, 0)):
        s = TierStack(make_policy("lru"), [TierSpec("l1_hbm", 2)])
        s.access_request([1, 2, 3], 0.0, 0, leaf_first)
        assert s.access_request([1, 2, 3], 1.0, 3, leaf_first) == usable
        assert sum(s.hits) == found


def test_the_default_evicts_leaves_before_their_parents():
    """A chain 0 -> 1 -> ... -> 9 fills a tier of 10; a new request's chunk must come in. S3-FIFO alone takes
    the oldest chunk of its small queue, which, the chain having been served leaf first, is the leaf 9; then
    the chain is touched in key order, so S3-FIFO's next victim would be the root 0, which still has children:
    the default hands it back and takes a leaf."""
    policy = make_policy("default")
    s = TierStack(policy, [TierSpec("l1_hbm", 10)])
    chain = list(range(10))
    s.access_request(chain, 0.0)
    for key in chain:  # used again, in key order: the root becomes the oldest use
        s.access(key, 1.0)
    tier = s.orders[0]
    assert tier.children[0] == {1} and not tier.children.get(9)
    s.access_request([100], 2.0)
    assert 0 in s.resident[0] and 100 in s.resident[0] and len(s.resident[0]) == 10
    gone = set(chain) - s.resident[0]
    assert len(gone) == 1 and not tier.children.get(gone.pop())  # what left had no children


def test_the_default_remembers_the_most_recently_linked_parents():
    """The parent book is bounded and kept in order of last use: a chunk linked again is kept over older ones,
    and takes the parent it was last linked with."""
    policy = make_policy("default")
    policy._limit = 3
    for key, parent in ((1, 0), (2, 1), (3, 2), (1, 9)):
        policy.link(key, parent)
    policy.link(4, 3)  # over the limit: the least recently linked (2) goes
    assert list(policy.parents.items()) == [(3, 2), (1, 9), (4, 3)]
    policy.link(5, None)  # a request's first chunk has no parent: nothing to remember
    assert 5 not in policy.parents
