"""`adaptive` (the default): run the tier with whichever of S3-FIFO and W-TinyLFU is winning on this workload.

How it decides, for one tier of C chunks:
1. Two shadow caches, one S3-FIFO and one W-TinyLFU, replay the tier's own references on a sample of the keys
   (keys chosen by a hash, a fixed share of them; each shadow holds that share of C, and at least 256 chunks
   when C allows: spatially sampled miniature simulation, Waldspurger et al., ATC'17). Shadows hold keys only,
   no data.
2. Each shadow's hits are counted with exponential forgetting over the last 10 x (its size, at least 256)
   sampled references, so the count says which policy is winning now, not over all time.
3. The tier runs one of the two for real (S3-FIFO first). Every quarter of that horizon it compares the
   counts; when the other policy's count is higher by more than two standard deviations of the difference
   (2 x sqrt(sum), counting hits as Poisson), the tier switches to it: the new policy takes over the resident
   chunks in their recency order, and nothing is moved. A switch costs the state the old policy had learnt,
   so it happens only on clear evidence.
4. The engine hands each request's chunks to the policy leaf first, so within a request the first chunk is
   the most recent: evictions take the ends of prefixes before their beginnings, as a radix tree does.

Why these two: across the generated workload family, S3-FIFO (quick demotion of one-time chunks, a ghost queue
for ones that come back) is the best classic policy at most sizes, and W-TinyLFU (frequency-sketch admission)
where a small cache must hold a few very popular prefixes. The constants are the published ones (sample size
from miniature simulation, the 10 x C horizon of TinyLFU's sketch) or statistical conventions (two standard
deviations, a check every quarter horizon), none fitted to a trace.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Container

from .base import Key, Policy, PolicySettings, TierPolicy
from .s3fifo import S3FIFOTier
from .tinylfu import SAMPLE_FACTOR, FrequencySketch, WTinyLFUTier

SHADOW_MIN = 256  # chunks a shadow holds at least (when the tier holds that many)
SIGMAS = 2.0  # a challenger must lead by two standard deviations of the difference of (Poisson) hit counts
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class Shadow:
    """A key-only single-tier cache under one tier policy, fed a sample of the references."""

    def __init__(self, order: TierPolicy, capacity: int, horizon: float) -> None:
        self.order = order
        self.capacity = capacity
        self.resident: set[Key] = set()
        self.score = 0.0
        self.keep = 1.0 - 1.0 / horizon

    def ref(self, key: Key, now: float) -> None:
        self.score *= self.keep
        if key in self.resident:
            self.score += 1.0
            self.order.touch(key, now)
            return
        if len(self.resident) >= self.capacity:
            if not self.order.admit(key, now):
                return
            for victim in self.order.evict(len(self.resident) + 1 - self.capacity, now):
                self.resident.discard(victim)
        self.resident.add(key)
        self.order.insert(key, now)


class AdaptiveTier(TierPolicy):
    """One tier run by the leading expert; the experts' shadows pick the leader."""

    def __init__(self, capacity: int, experts: list[Callable[[int], TierPolicy]]) -> None:
        super().__init__(capacity)
        self.experts = experts
        rate = min(1.0, SHADOW_MIN / capacity) if capacity > 0 else 1.0
        self.threshold = int(rate * (1 << 64))
        size = max(1, round(capacity * rate))
        horizon = float(SAMPLE_FACTOR * max(size, SHADOW_MIN))
        self.shadows = [Shadow(make(size), size, horizon) for make in experts]
        self.check_every = max(1, int(horizon / 4))
        self._until_check = self.check_every
        self.leader = 0
        self.switches = 0
        self.real: TierPolicy = experts[0](capacity)
        self.recency: OrderedDict[Key, None] = OrderedDict()

    def _sample(self, key: Key, now: float) -> None:
        if (hash(key) * _GOLDEN) & _MASK >= self.threshold:
            return
        for shadow in self.shadows:
            shadow.ref(key, now)
        self._until_check -= 1
        if self._until_check <= 0:
            self._until_check = self.check_every
            scores = [s.score for s in self.shadows]
            best = max(range(len(scores)), key=scores.__getitem__)
            lead = scores[self.leader]
            if best != self.leader and scores[best] - lead > SIGMAS * math.sqrt(scores[best] + lead):
                self._switch(best)

    def _switch(self, expert: int) -> None:
        """Hand the resident chunks, oldest first, to a fresh instance of `expert`."""
        self.leader = expert
        self.switches += 1
        self.real = self.experts[expert](self.capacity)
        self.real.adopt(list(self.recency))  # type: ignore[attr-defined]

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        return self.real.admit(key, now, ref)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self.recency[key] = None
        self.real.insert(key, now, ref)
        self._sample(key, now)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self.recency.move_to_end(key)
        self.real.touch(key, now, ref)
        self._sample(key, now)

    def remove(self, key: Key) -> None:
        del self.recency[key]
        self.real.remove(key)

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out = self.real.evict(count, now, pinned)
        for key in out:
            del self.recency[key]
        return out

    def __len__(self) -> int:
        return len(self.recency)


class AdaptivePolicy(Policy):
    """The default: each tier run by S3-FIFO or W-TinyLFU, whichever its shadows show winning."""

    name = "adaptive"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.sketch = FrequencySketch()
        self.chunks = 0

    def tier(self, capacity: int) -> TierPolicy:
        self.chunks += capacity
        self.sketch.period = max(64, SAMPLE_FACTOR * self.chunks)
        sketch = self.sketch
        return AdaptiveTier(capacity, [S3FIFOTier, lambda c: WTinyLFUTier(c, sketch)])

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.sketch.add(key)
