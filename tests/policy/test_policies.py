"""Eviction policies against references: brute-force LRU, exhaustive optimum, and the default policy's rules."""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.policy.config import TierConfig
from datamover.policy.policies import (
    NEVER,
    Policy,
    PolicySettings,
    ScoreBook,
    ScoredPolicy,
    belady_hits,
    make_policy,
    next_use,
    policy_names,
    register_policy,
)
from datamover.policy.replay import TierSpec, TierStack, Trace, simulate, single_tier

traces = st.lists(st.integers(0, 12), min_size=1, max_size=120)


def as_trace(ids, times=None) -> Trace:
    keys = np.asarray(ids, dtype=np.int64)
    stamps = np.asarray(times if times is not None else np.arange(len(ids)) * 0.5, dtype=np.float64)
    return Trace(keys, stamps, np.arange(len(ids)))


def lru_reference(ids, capacity) -> int:
    """LRU by the book: a list, most recent last."""
    cache: list[int] = []
    hits = 0
    for k in ids:
        if k in cache:
            hits += 1
            cache.remove(k)
        elif len(cache) == capacity:
            cache.pop(0)
        cache.append(k)
    return hits


def optimum_reference(ids, capacity) -> int:
    """The true optimum by exhaustive search over every eviction (and bypass) choice."""

    @cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(ids):
            return 0
        k = ids[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        options = [best(i + 1, cache)] + [best(i + 1, (cache - {v}) | {k}) for v in cache]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=80, deadline=None)
@given(ids=traces, capacity=st.integers(1, 8))
def test_lru_matches_brute_force(ids, capacity):
    result = simulate(as_trace(ids), "lru", single_tier(TierConfig(), capacity))
    assert sum(result.hits) == lru_reference(ids, capacity)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=14), capacity=st.integers(1, 3))
def test_belady_is_the_optimum(ids, capacity):
    assert belady_hits(ids, capacity) == optimum_reference(tuple(ids), capacity)
    result = simulate(as_trace(ids), "belady", single_tier(TierConfig(), capacity))
    assert sum(result.hits) == belady_hits(ids, capacity)


@settings(max_examples=60, deadline=None)
@given(ids=traces, capacity=st.integers(1, 10), gaps=st.lists(st.floats(0, 10), min_size=120, max_size=120))
def test_belady_bounds_every_policy(ids, capacity, gaps):
    trace = as_trace(ids, np.cumsum(gaps[: len(ids)]))
    config = single_tier(TierConfig(), capacity)
    bound = belady_hits(ids, capacity)
    for name in policy_names():
        result = simulate(trace, name, config)
        assert sum(result.hits) <= bound, name
        assert sum(result.hits) + result.misses == len(ids)


def test_next_use():
    got = next_use(np.array([3, 1, 3, 3, 2, 1]))
    assert got.tolist() == [2, 5, 3, NEVER, NEVER, NEVER]


def test_score_book_decays_and_counts():
    book = ScoreBook(half_life_s=10.0, max_entries=100)
    book.record("a", 0.0)
    book.record("a", 0.0)
    assert book.score("a", 0.0) == pytest.approx(2.0)
    assert book.score("a", 10.0) == pytest.approx(1.0)
    book.record("a", 20.0)
    assert book.score("a", 20.0) == pytest.approx(1.5)
    assert book.score("never", 5.0) == 0.0
    far = book.record("a", 1e6)  # a huge gap must not overflow
    assert far == pytest.approx(1e6 / 10.0)


def stack(policy: Policy, capacity: int, high: float = 1.0, low: float = 1.0) -> TierStack:
    return TierStack(policy, [TierSpec("l1_hbm", capacity, high, low)])


def test_default_policy_resists_a_scan():
    """A hot working set survives a long run of one-shot chunks under the default policy, not under LRU."""
    hot = list(range(8))
    refs = hot * 5 + list(range(100, 400)) + hot
    results = {}
    for name in ("lru", "default"):
        s = stack(make_policy(name, PolicySettings(cooldown_s=0.0)), 10)
        for i, k in enumerate(refs):
            s.access(k, now=i * 0.01, ref=i)
        results[name] = s.hits[0]
    assert results["lru"] == 8 * 4
    assert results["default"] == 8 * 5


def test_cooldown_protects_recent_chunks():
    """With a cooldown, the chunk placed last is not the victim even though it scores lowest."""
    policy = ScoredPolicy(PolicySettings(cooldown_s=5.0, admission=False))
    tier = policy.tier(3)
    for key, now in (("old-hot", 0.0), ("old-hot", 0.1), ("old", 0.2)):
        policy.observe(key, now)
    tier.insert("old-hot", 0.1)
    tier.insert("old", 0.2)
    policy.observe("new", 9.0)
    tier.insert("new", 9.0)
    assert tier.evict(1, now=9.5) == ["old"]
    assert tier.evict(1, now=9.5) == ["old-hot"]  # the cooling chunk goes only as a last resort
    assert tier.evict(1, now=9.5) == ["new"]
    assert len(tier) == 0


def test_a_chunk_used_twice_at_one_time_is_evicted_once_from_its_cooldown():
    """Two uses at the same time leave two FIFO entries of one start: the last-resort eviction of cooling chunks
    must still give up each chunk once (it used to list the chunk twice and fail removing it again)."""
    policy = ScoredPolicy(PolicySettings(cooldown_s=5.0, admission=False))
    tier = policy.tier(3)
    policy.observe("a", 1.0)
    tier.insert("a", 1.0)
    tier.touch("a", 1.0)
    for key in ("b", "c"):
        policy.observe(key, 1.0)
        tier.insert(key, 1.0)
    assert tier.evict(2, now=1.5) == ["a", "b"]
    assert len(tier) == 1 and tier.evict(1, now=1.5) == ["c"]


def test_pinned_chunks_are_never_evicted():
    for name in ("lru", "default"):
        policy = make_policy(name, PolicySettings(cooldown_s=0.0))
        tier = policy.tier(4)
        for i, key in enumerate("abcd"):
            policy.observe(key, float(i))
            tier.insert(key, float(i))
        assert set(tier.evict(4, now=10.0, pinned={"a", "c"})) == {"b", "d"}
        assert tier.evict(1, now=10.0, pinned={"a", "c"}) == []
        assert len(tier) == 2


def test_admission_refuses_a_cold_chunk_into_a_hot_tier():
    policy = ScoredPolicy(PolicySettings(cooldown_s=0.0))
    tier = policy.tier(2)
    for key in ("a", "b"):
        for t in range(3):
            policy.observe(key, float(t))
        tier.insert(key, 2.0)
    policy.observe("cold", 3.0)
    assert not tier.admit("cold", 3.0)
    policy.observe("cold", 3000.0)  # used again much later, when the residents' scores have decayed
    assert tier.admit("cold", 3000.0)


def test_watermarks_evict_in_batches():
    s = stack(make_policy("lru"), 10, high=1.0, low=0.6)
    for i in range(11):
        s.access(i, now=float(i), ref=i)
    assert len(s.resident[0]) == 6  # the 11th chunk triggered eviction down to 60 %
    assert s.evictions[0] == 5
    assert s.resident[0] == set(range(5, 11))


def test_registered_policies():
    assert {"lru", "default"} <= set(policy_names())
    with pytest.raises(KeyError, match="registered"):
        make_policy("nope")

    class FIFO(Policy):
        name = "fifo-test"

        def __init__(self, settings):
            self.lru = make_policy("lru")

        def tier(self, capacity):
            tier = self.lru.tier(capacity)
            tier.touch = lambda key, now, ref=-1: None  # FIFO: a use does not reorder
            return tier

    register_policy("fifo-test", FIFO)
    ids = [1, 2, 1, 3, 1]
    result = simulate(as_trace(ids), "fifo-test", single_tier(TierConfig(), 2))
    assert result.hits == [1]  # LRU would keep 1 and hit twice


@pytest.mark.parametrize("capacity", [1, 2, 5])
def test_every_policy_counts_each_reference_once(capacity):
    ids = [k for k, _ in itertools.product(range(7), range(3))][::-1]
    for name in [*policy_names(), "belady"]:
        result = simulate(as_trace(ids), name, single_tier(TierConfig(), capacity))
        assert sum(result.hits) + result.misses == len(ids)
