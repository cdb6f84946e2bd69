"""A policy switch in the default hands the tier to the new expert in that expert's own state (`assume`): the
shadow that ran it on the tier's references says where each resident chunk goes, and the chunks the shadow
does not hold (it would have evicted them) leave first."""

from __future__ import annotations

from datamover.policy.arc import ARCTier
from datamover.policy.engine import TierSpec, TierStack
from datamover.policy.lfu import LFUTier
from datamover.policy.lru import LRUTier
from datamover.policy.policies import make_policy
from datamover.policy.s3fifo import S3FIFOTier
from datamover.policy.tinylfu import FrequencySketch, WTinyLFUTier


def feed(shadow, keys) -> None:
    for t, key in enumerate(keys):
        shadow.ref(key, float(t))


def test_lru_takes_the_shadows_order_and_the_extras_go_first():
    shadow = LRUTier(3)
    feed(shadow, [1, 2, 3, 1, 4])  # holds 3, 1, 4 (oldest first); 2 was evicted
    real = LRUTier(3)
    real.assume(shadow, [2, 4, 3])  # the tier still holds 2 and never got 1
    assert real.evict(3, 0.0) == [2, 3, 4]


def test_s3fifo_takes_the_shadows_queues_counts_and_ghosts():
    shadow = S3FIFOTier(4)  # small queue of 1, main 3, ghosts 3
    feed(shadow, [1, 1, 2, 3, 4, 5, 2, 1])  # 1 used in S -> M; 2 and 3 to the ghosts; 2 back into M
    assert list(shadow.small) == [4, 5] and list(shadow.main) == [1, 2] and list(shadow.ghost) == [3]
    real = S3FIFOTier(4)
    real.assume(shadow, [3, 7, 1, 4])  # 3 and 7 only in the tier, 2 and 5 only in the shadow
    assert list(real.small) == [3, 7, 4] and list(real.main) == [1]
    assert real.freq == {3: 0, 7: 0, 4: 0, 1: 1} and list(real.ghost) == []  # 3 is resident: not a ghost
    assert real.evict(2, 0.0) == [3, 7]  # the extras, with no uses, leave the small queue first
    assert list(real.ghost) == [3, 7]


def test_arc_takes_the_shadows_lists_ghosts_and_target():
    shadow = ARCTier(2)
    feed(shadow, [1, 2, 1, 3, 2])  # 2 evicted to B1, then a ghost hit: p grows, 2 enters T2, 1 goes to B2
    assert shadow.p == 1.0 and list(shadow.t1) == [3] and list(shadow.t2) == [2] and list(shadow.b2) == [1]
    real = ARCTier(2)
    real.assume(shadow, [1, 3])  # 1 only in the tier
    assert real.p == 1.0 and list(real.t1) == [1, 3] and list(real.t2) == []
    assert list(real.b1) == [] and list(real.b2) == []  # 1 is resident again: not a ghost
    assert real.evict(1, 0.0) == [1]  # T1 over p: its LRU end, the extra, goes


def test_lfu_takes_the_shadows_counts_age_and_tie_order():
    shadow = LFUTier(2)
    feed(shadow, [1, 1, 1, 2, 3])  # 2 (one use) evicted at age 1; 3 enters at priority 2
    assert shadow.age == 1.0 and shadow.priority(1) == 3 and shadow.priority(3) == 2
    real = LFUTier(2)
    real.assume(shadow, [5, 1])  # 5 only in the tier
    assert real.age == 1.0 and real.priority(5) == 1.0 and real.priority(1) == 3
    assert real.evict(2, 0.0) == [5, 1]
    again = LFUTier(3)
    again.assume(shadow, [1, 3])
    assert again.evict(2, 0.0) == [3, 1]  # by the shadow's priorities (2 before 3), not by recency


def test_wtinylfu_takes_the_shadows_segments():
    sketch = FrequencySketch()
    shadow = WTinyLFUTier(10, sketch)  # window 1, protected 7
    for t, key in enumerate([1, 2, 3, 2, 4]):
        sketch.add(key)
        shadow.ref(key, float(t))
    assert list(shadow.window) == [4] and list(shadow.probation) == [1, 3] and list(shadow.protected) == [2]
    real = WTinyLFUTier(10, sketch)
    real.assume(shadow, [9, 2, 3, 4])  # 9 only in the tier, 1 only in the shadow
    assert list(real.window) == [4] and list(real.probation) == [9, 3] and list(real.protected) == [2]


def test_the_default_switches_into_the_shadows_state_when_it_samples_every_key():
    """A tier small enough that its shadows sample every key: after a switch the running policy's state is the
    shadow's (here LFU-DA: its use counts, not the sketch's, which forgets), so the two evict alike."""
    policy = make_policy("default")
    tier = policy.tier(8)
    stack = TierStack(policy, [TierSpec("l1_hbm", 8)])
    stack.orders[0] = tier
    for i, key in enumerate([1, 1, 1, 2, 2, *range(10, 20)]):
        stack.access(key, float(i), i)
    lfu = tier.shadows[4]
    assert isinstance(lfu, LFUTier) and set(lfu._count) == stack.resident[0]
    tier._switch(4)
    assert isinstance(tier.real, LFUTier)
    assert {k: tier.real.priority(k) for k in stack.resident[0]} == {k: lfu.priority(k) for k in lfu._count}
    assert tier.real.age == lfu.age and tier.real.age > 0
