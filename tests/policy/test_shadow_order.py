"""The default's miniature shadows (tiers over 256 chunks) see each request as the expert they simulate would
have been handed it, whatever the tier holds, and a switch there hands the tier the new expert's state from a
rerun of the recent requests. The engine tells each tier policy when a request is done (`served`)."""

from __future__ import annotations

from datamover.policy.adaptive import AdaptiveTier
from datamover.policy.base import served_order
from datamover.policy.engine import TierSpec, TierStack
from datamover.policy.lru import LRUTier
from datamover.policy.policies import make_policy


def test_served_order_is_the_found_prefix_then_the_rest_each_last_chunk_first():
    keys = ["a", "b", "c", "d", "e"]
    held = {"a", "b", "d"}  # the found prefix is a, b (c is missing; d is found later but is not in it)
    assert served_order(keys, held.__contains__) == [1, 0, 4, 3, 2]
    assert served_order(keys, set().__contains__) == [4, 3, 2, 1, 0]
    assert served_order(keys, set(keys).__contains__) == [4, 3, 2, 1, 0]


def miniature(capacity: int = 1000) -> AdaptiveTier:
    tier = make_policy("default").tier(capacity)
    assert isinstance(tier, AdaptiveTier) and tier.miniature and tier.shadows[3].capacity == 256
    return tier


def test_a_miniature_shadow_sees_the_request_in_its_experts_order_not_the_tiers():
    """Request 1 (s1, s2, s3) reaches the tier first chunk first, request 2 (s1, s2, s4) with the found prefix
    last: LRU running the tier would have been handed both last chunk first (nothing found, then its found
    prefix s1, s2 before s4), so its shadow orders them s3, s2, s1, s4 and not as they came."""
    tier = miniature()
    s1, s2, s3, s4 = [k for k in range(100_000) if tier.sampled(k)][:4]
    for ref, key in enumerate([s1, s2, s3]):
        tier.insert(key, 0.0, ref)
    lru = tier.shadows[3]
    assert isinstance(lru, LRUTier) and len(lru) == 0  # nothing seen before the request is served
    tier.served(0.0)
    assert list(lru._order) == [s3, s2, s1]
    tier.insert(s4, 1.0, 5)
    tier.touch(s2, 1.0, 4)
    tier.touch(s1, 1.0, 3)
    tier.served(1.0)
    assert list(lru._order) == [s3, s2, s1, s4]


def test_a_miniature_switch_reruns_the_history_as_the_new_expert():
    """Over 256 chunks a switch reruns the new expert at the tier's size over the recent requests (each as it
    would have been handed them) and the tier takes that state. Here LRU (capacity 300): its rerun gets each
    request last chunk first, so of a, b, c it evicts c, b, a as 300 new chunks come and then x299 for b; the
    tier (told of each chunk first to last, and asked to evict nothing) holds them all. Its new order: the
    chunks the rerun evicted first (a, c, x299 in the tier's recency order), then the rerun's own."""
    tier = miniature(300)
    for ref, key in enumerate(["a", "b", "c", *(f"x{i}" for i in range(300))]):
        tier.insert(key, 0.0, ref)
        if ref in (2, 302):
            tier.served(0.0)
    tier.touch("b", 1.0, 303)
    tier.served(1.0)
    tier._switch(3)
    assert isinstance(tier.real, LRUTier)
    order = list(tier.real._order)
    assert order[:4] == ["a", "c", "x299", "x298"] and order[-3:] == ["x1", "x0", "b"]
    assert len(order) == 303


def test_the_history_is_bounded_by_the_sketchs_horizon():
    """The rerun's history keeps the last 10 x C references (whole requests), not all of them."""
    tier = miniature(300)
    for r in range(100):  # 100 requests of 40 chunks: 4000 references
        for i in range(40):
            tier.insert((r, i), float(r), r * 40 + i)
        tier.served(float(r))
    assert 3000 <= sum(map(len, tier.history)) < 3000 + 40


class Counting(LRUTier):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.requests = 0

    def served(self, now: float) -> None:
        self.requests += 1


def test_the_engine_tells_every_tier_when_a_request_is_done():
    for tiers in ([TierSpec("l1_hbm", 4)], [TierSpec("l1_hbm", 2), TierSpec("l2_dram", 4)]):
        stack = TierStack(make_policy("lru"), tiers)
        stack.orders = [Counting(t.capacity) for t in tiers]
        stack.access_request([1, 2, 3], 0.0, 0)
        stack.access_request([1, 2, 4], 1.0, 3)
        stack.access(9, 2.0, 6)
        assert [o.requests for o in stack.orders] == [3] * len(tiers)
