"""The runtime cache hands the policy each request as the replay does (last chunk first, parents, reference
indexes, `served` when the request is done), so what the replay measures is what a TieredCache user gets."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from datamover.policy.adaptive import AdaptiveTier
from datamover.policy.cache import TieredCache
from datamover.policy.engine import TierStack, tier_specs
from datamover.policy.keys import ChunkKey, chunk_keys
from datamover.policy.lru import LRUTier
from datamover.policy.policies import make_policy
from datamover.policy.tracegen import generate

from .test_cache import PAGE, chunks, tiers


def one_tier(tmp: Path, capacity: int, policy: str = "default"):
    return tiers(tmp, l1=capacity, l2=0, l3=None, policy={"name": policy})


def requests(shape: str, count: int, seed: int) -> list[list[ChunkKey]]:
    return [chunk_keys(row["hash_ids"], "m", "t") for row in generate(shape, count, seed)]


def test_get_then_put_of_the_rest_decides_as_the_replay(tmp_path):
    """A generated chat workload through a one-tier cache of 300 chunks (over 256: the default's shadows are
    miniatures, which see each request only when it is served) as a serving engine drives it: get the request,
    put what was not delivered. Every decision is the replay's: the same usable prefixes, evictions, resident
    chunks and expert switches. Before the cache had request boundaries it handed chunks in order, without
    parents or reference indexes, and its tier drifted from the replay's within the first requests."""
    config = one_tier(tmp_path, 300)
    stack = TierStack(make_policy("default"), tier_specs(config))
    work = requests("chat", 500, 7)
    times = [float(i) for i in range(len(work))]
    now = [0.0]
    delivered_runtime, delivered_replay, ref = [], [], 0
    with TieredCache(config, clock=lambda: now[0]) as cache:
        tier = cache.engine.orders[0]
        assert isinstance(tier, AdaptiveTier) and tier.miniature
        for keys, t in zip(work, times, strict=True):
            now[0] = t
            dst = np.zeros(len(keys) * PAGE, np.uint8)
            n = cache.get(keys, dst)
            assert (dst[: n * PAGE] == chunks(keys[:n])).all()
            if n < len(keys):
                cache.put(keys[n:], chunks(keys[n:]))
            delivered_runtime.append(n)
            delivered_replay.append(stack.access_request(keys, t, ref))
            ref += len(keys)
            assert cache.engine.resident[0] == stack.resident[0], f"tiers differ after request {len(delivered_runtime)}"
        assert delivered_runtime == delivered_replay
        assert cache.engine.evictions == stack.evictions and sum(stack.evictions) > 1000
        assert tier.switches == stack.orders[0].switches and tier.leader == stack.orders[0].leader
        assert cache.stats()["hits"]["l1_hbm"] == sum(delivered_replay)


class Told(LRUTier):
    """LRU that records what the cache tells it: each reference (key, index) and each request's end."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.log: list[tuple] = []

    def insert(self, key, now, ref=-1):
        super().insert(key, now, ref)
        self.log.append((key.prefix_hash, ref))

    def touch(self, key, now, ref=-1):
        super().touch(key, now, ref)
        self.log.append((key.prefix_hash, ref))

    def served(self, now):
        self.log.append(("served", now))


def test_request_boundaries_and_reference_indexes(tmp_path):
    """A get opens a request (its keys take the next reference indexes); a put of the keys after the prefix it
    delivered ends it; a put of anything else is a request of its own; a get whose prefix was all the request
    had is ended by the next operation, at its own time. Chunks come last first, as in the replay."""
    now = [0.0]
    with TieredCache(one_tier(tmp_path, 8, "lru"), clock=lambda: now[0]) as cache:
        told = Told(8)
        cache.engine.orders = [told]
        a, b, c, d, e = chunk_keys([1, 2, 3, 4, 5], "m", "t")
        cache.put([a, b], chunks([a, b]))  # a request of its own: references 0, 1
        assert told.log == [(2, 1), (1, 0), ("served", 0.0)]
        told.log.clear()
        now[0] = 1.0
        assert cache.get([a, b, c, d], np.zeros(4 * PAGE, np.uint8)) == 2  # references 2..5
        assert told.log == [(2, 3), (1, 2)]  # the found prefix, last chunk first; not yet served
        now[0] = 2.0
        cache.put([c, d], chunks([c, d]))  # the rest of that request
        assert told.log[2:] == [(4, 5), (3, 4), ("served", 1.0)]
        told.log.clear()
        now[0] = 3.0
        assert cache.get([a, b], np.zeros(2 * PAGE, np.uint8)) == 2  # references 6, 7: all found, left open
        now[0] = 4.0
        cache.put([e], chunks([e]))  # not the rest of [a, b]: that request is done, this is another (8)
        assert told.log == [(2, 7), (1, 6), ("served", 3.0), (5, 8), ("served", 4.0)]
