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
4. Prefixes: the engine hands each request's chunks to the policy leaf first (the request's first chunk ends
   most recent), and tells it each chunk's parent. When the leading policy picks a victim that still has
   children in the tier, the victim is handed back (as just used) and the policy picks again (up to 8
   times, then a leaf below the victim goes instead), so leaves go first, as in a radix tree: a chunk whose
   parent is gone can never be part of a usable prefix.

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
LEAF_TRIES = 8  # victims with children handed back before one is taken anyway
LEAF_DEPTH = 4096  # longest walk down to a leaf (a 2M-token prompt in 512-token chunks)
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

    def __init__(
        self, capacity: int, experts: list[Callable[[int], TierPolicy]], parents: dict[Key, Key] | None = None
    ) -> None:
        super().__init__(capacity)
        self.parents = parents if parents is not None else {}
        self._up: dict[Key, Key] = {}  # resident chunk -> its parent (when known)
        self.children: dict[Key, set[Key]] = {}  # chunk -> its resident children in this tier
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
        parent = self.parents.get(key)
        if parent is not None:
            self._up[key] = parent
            kids = self.children.get(parent)
            if kids is None:
                self.children[parent] = {key}
            else:
                kids.add(key)
        self.real.insert(key, now, ref)
        self._sample(key, now)

    def _gone(self, key: Key) -> None:
        del self.recency[key]
        parent = self._up.pop(key, None)
        if parent is not None:
            kids = self.children[parent]
            kids.discard(key)
            if not kids:
                del self.children[parent]

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self.recency.move_to_end(key)
        self.real.touch(key, now, ref)
        self._sample(key, now)

    def remove(self, key: Key) -> None:
        self._gone(key)
        self.real.remove(key)

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        """The leading policy's victims, leaves only: a victim that still has children in the tier is handed
        back to the policy (as a chunk just used) and the policy is asked again, up to LEAF_TRIES times; then
        a leaf below the last one goes instead (a chunk whose parent is gone is of no use: evict leaves
        first, as a radix tree does)."""
        out: list[Key] = []
        real, children = self.real, self.children
        while len(out) < count:
            got = real.evict(1, now, pinned)
            for _ in range(LEAF_TRIES):
                if not got or got[0] not in children:
                    break
                real.insert(got[0], now)
                got = real.evict(1, now, pinned)
            if not got:
                break
            key = got[0]
            if key in children:  # still a parent: a leaf below it goes instead
                leaf = self._leaf_under(key, pinned)
                if leaf is not None and leaf not in out:
                    real.insert(key, now)
                    real.remove(leaf)
                    key = leaf
            self._gone(key)
            out.append(key)
        return out

    def _leaf_under(self, key: Key, pinned: Container[Key]) -> Key | None:
        """A resident chunk with no resident children below `key` (None if none, or it is pinned)."""
        node = key
        for _ in range(LEAF_DEPTH):  # keys that are not prefix hashes may link in a cycle: walk a bounded way
            kids = self.children.get(node)
            if not kids:
                return None if node == key or node in pinned else node
            node = next(iter(kids))
        return None

    def __len__(self) -> int:
        return len(self.recency)


class AdaptivePolicy(Policy):
    """The default: each tier run by S3-FIFO or W-TinyLFU, whichever its shadows show winning."""

    name = "adaptive"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.sketch = FrequencySketch()
        self.chunks = 0
        self.parents: OrderedDict[Key, Key] = OrderedDict()  # recent chunks -> the chunk before them

    def tier(self, capacity: int) -> TierPolicy:
        self.chunks += capacity
        self.sketch.period = max(64, SAMPLE_FACTOR * self.chunks)
        sketch = self.sketch
        return AdaptiveTier(capacity, [S3FIFOTier, lambda c: WTinyLFUTier(c, sketch)], self.parents)

    def link(self, key: Key, parent: Key | None) -> None:
        if parent is None:
            return
        parents = self.parents
        if key in parents:
            parents.move_to_end(key)
        parents[key] = parent
        if len(parents) > 2 * self.chunks + 1024:
            parents.popitem(last=False)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.sketch.add(key)
