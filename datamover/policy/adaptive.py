"""`adaptive` (the default): run the tier with whichever classic policy is winning on this workload.

How it decides, for one tier of C chunks:
1. Five shadow caches, one per expert (S3-FIFO, W-TinyLFU, ARC, LRU, LFU-DA), replay the tier's own references
   on a sample of the keys (keys chosen by a hash; each shadow holds that share of C: at least 256 chunks when C
   allows and at least 1/8 of the keys: spatially sampled miniature simulation, Waldspurger et al., ATC'17).
   Shadows hold keys only, no data. Over 256 chunks (miniature shadows) each shadow is handed each request, once
   it is served, as that expert running the tier would have been: its own found prefix, then the rest, each
   last chunk first (the order the tier gets depends on what the running expert holds, and would bias the
   other experts' shadows; BENCHMARKS.md).
2. The shadows see the same references, so their hits are strongly correlated; the evidence is therefore paired
   (McNemar's test): for each pair of experts it counts the sampled references where one hit and the other
   missed, with exponential forgetting over the last 10 x (shadow size, at least 256) sampled references, so the
   counts say which policy is winning now, not over all time.
3. The tier runs one expert for real (S3-FIFO first). Sixteen times per horizon it compares: a challenger that
   won `up` of the references split with the leader, and lost `down`, leads by more than three standard
   deviations when up - down > 3 x sqrt(up + down) (with no real difference each split is a coin toss); the
   challenger furthest ahead takes over the resident chunks, so it does not start cold, and nothing is moved.
   When the shadows sample every key (tiers of up to 256 chunks), the challenger's shadow is that policy run
   on this tier's references: the new policy takes its state (queues, lists, counts, ghosts, ARC's target,
   LFU-DA's age) for the chunks both hold, and the chunks the shadow does not hold, which it would have
   evicted, go first. Over 256 chunks the new policy is rerun at the tier's size over the tier's last 10 x C
   references (the sketch's horizon), request by request as above, and the tier takes that state the same way.
   Without request boundaries (a cache that never calls `served`) the chunks come in their recency order with
   their use counts from the cache's frequency sketch (ARC puts chunks used twice in T2, W-TinyLFU in its
   protected segment, LFU-DA and S3-FIFO start from the counts), and ARC takes its shadow's T1 target as a
   share of the tier.
4. Prefixes: the engine hands each request's chunks to the policy leaf first (the request's first chunk ends
   most recent), and tells it each chunk's parent. When the leading policy picks a victim that still has
   children in the tier, the victim is handed back (as just used) and the policy picks again (up to 8
   times, then a leaf below the victim goes instead), so leaves go first, as in a radix tree: a chunk whose
   parent is gone can never be part of a usable prefix.

Why these five: they are the project's classic baselines (LeCaR, itself a mix of LRU and LFU, aside), and each
is the best of them somewhere: S3-FIFO and W-TinyLFU at small sizes (quick demotion of one-time chunks;
frequency-sketch admission of a few very popular prefixes), ARC, LRU and LFU-DA at large ones, where recency
and long-run frequency win. The constants are published ones (sample size from miniature simulation, the
10 x C horizon of TinyLFU's sketch), statistical conventions (a paired test, three standard deviations for
many looks at five experts) or costs (shadows at 1/8 of the keys cost about 5/8 of the tier's own work), none
fitted to a trace.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from operator import itemgetter

from .arc import ARCTier
from .base import Key, Policy, PolicySettings, TierPolicy
from .lfu import LFUTier
from .lru import LRUTier
from .s3fifo import S3FIFOTier
from .tinylfu import MAX_COUNT, SAMPLE_FACTOR, FrequencySketch, WTinyLFUTier

SHADOW_MIN = 256  # chunks a shadow holds at least (when the tier holds that many)
SHADOW_SHARE = 0.125  # share of the keys each shadow samples at least: five shadows cost about 5/8 of the tier
LEAF_TRIES = 8  # victims with children handed back before one is taken anyway
LEAF_DEPTH = 4096  # longest walk down to a leaf (a 2M-token prompt in 512-token chunks)
SIGMAS = 3.0  # the paired lead must exceed three standard deviations (five experts, many looks)
CHECKS = 16  # comparisons per horizon
EXPERTS = ("s3fifo", "wtinylfu", "arc", "lru", "lfu")
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_FIRST = itemgetter(0)  # a pending reference's index


class AdaptiveTier(TierPolicy):
    """One tier run by the leading expert; the experts' shadows pick the leader."""

    def __init__(
        self,
        capacity: int,
        experts: list[Callable[[int], TierPolicy]],
        parents: dict[Key, Key] | None = None,
        sketch: FrequencySketch | None = None,
    ) -> None:
        super().__init__(capacity)
        self.sketch = sketch
        self.parents = parents if parents is not None else {}
        self.children: dict[Key, set[Key]] = {}  # chunk -> its resident children in this tier
        self.experts = experts
        rate = min(1.0, max(SHADOW_MIN / capacity, SHADOW_SHARE)) if capacity > 0 else 1.0
        self.threshold = int(rate * (1 << 64))
        size = max(1, round(capacity * rate))
        horizon = float(SAMPLE_FACTOR * max(size, SHADOW_MIN))
        self.shadows = [make(size) for make in experts]  # key-only caches, run by `TierPolicy.ref`
        self._refs = [shadow.ref for shadow in self.shadows]
        self._pairs: dict[int, list[tuple[int, int]]] = {}  # hit mask -> (hit, missed) expert pairs
        n = len(experts)
        # wins[i][j]: sampled references where expert i's shadow hit and j's missed, faded over `horizon`
        # (kept in units of `_unit`, which grows by 1/keep each sampled reference instead of fading them all)
        self.wins = [[0.0] * n for _ in range(n)]
        self._keep = 1.0 - 1.0 / horizon
        self._unit = 1.0
        self.check_every = max(1, int(horizon / CHECKS))
        self._until_check = self.check_every
        self.leader = 0
        self.switches = 0
        self.real: TierPolicy = experts[0](capacity)
        self._admits = type(self.real).admit is not TierPolicy.admit  # whether the real policy may refuse
        self.recency: OrderedDict[Key, Key | None] = OrderedDict()  # resident chunk -> its parent (when known)
        # Miniature shadows (threshold < 2**64) see each request as the expert they simulate would (`served`): the
        # references of the request being served, and the last SAMPLE_FACTOR x C references, request by request
        self.miniature = self.threshold <= _MASK
        self._pending: list[tuple[int, Key]] = []
        self.history: deque[list[Key]] = deque()
        self._history_refs = 0
        self._history_limit = SAMPLE_FACTOR * capacity

    def sampled(self, key: Key) -> bool:
        """Whether the shadows see `key` (its hash is under the sampling threshold)."""
        return (hash(key) * _GOLDEN) & _MASK < self.threshold

    def _sample(self, key: Key, now: float) -> None:
        """One reference of a sampled key (`insert` and `touch` test the hash): to every shadow, then count."""
        hit, bit = 0, 1
        for ref in self._refs:  # which shadows hit, as a bit mask
            if ref(key, now):
                hit |= bit
            bit <<= 1
        self._count((hit,), bit)

    def served(self, now: float) -> None:
        """A request is done: its references (in chunk order) join the history, and each miniature shadow takes
        its sampled ones as that expert running the tier would have been handed them: its own found prefix
        last chunk first, then the rest last chunk first (the engine's order, which depends on what the tier
        holds, would bias the shadows of the experts not running it). Then they are counted, in chunk order."""
        pending = self._pending
        if not pending:
            return
        pending.sort(key=_FIRST)
        keys = [key for _, key in pending]
        pending.clear()
        history = self.history
        history.append(keys)
        self._history_refs += len(keys)
        while self._history_refs - len(history[0]) >= self._history_limit:
            self._history_refs -= len(history.popleft())
        threshold = self.threshold
        sampled = [key for key in keys if (hash(key) * _GOLDEN) & _MASK < threshold]
        if not sampled:
            return
        masks = [0] * len(sampled)
        bit = 1
        for shadow in self.shadows:
            for i in shadow.ref_request(sampled, now):
                masks[i] |= bit
            bit <<= 1
        self._count(masks, bit)

    def _count(self, masks: list[int] | tuple[int, ...], full: int) -> None:
        """Sampled references, in order, whose shadows hit as each bit mask says (`full` - 1 if all did): every
        (hit, missed) pair of experts counts one, faded; the leader is checked every `check_every` of them."""
        unit, keep, every = self._unit, self._keep, self._pairs
        wins, all_hit, until = self.wins, full - 1, self._until_check
        for hit in masks:
            unit /= keep
            if 0 < hit < all_hit:
                pairs = every.get(hit)
                if pairs is None:
                    n = len(self._refs)
                    pairs = every[hit] = [
                        (i, j) for i in range(n) if hit >> i & 1 for j in range(n) if not hit >> j & 1
                    ]
                for i, j in pairs:
                    wins[i][j] += unit
            if unit > 1e150:
                wins = self.wins = [[x / unit for x in row] for row in wins]
                unit = 1.0
            until -= 1
            if until <= 0:
                until = self._until_check = self.check_every
                self._unit = unit
                self._check()
        self._unit, self._until_check = unit, until

    def _check(self) -> None:
        """Switch to the challenger whose paired lead over the leader is the most standard deviations, if that
        is more than SIGMAS: of the sampled references where exactly one of the two hit (faded), the challenger
        hit `up` and the leader `down`; with no real difference each is a coin toss, sd sqrt(up + down)."""
        lead, wins = self.leader, self.wins
        best, best_z = lead, SIGMAS
        for i in range(len(wins)):
            if i == lead:
                continue
            up, down = wins[i][lead] / self._unit, wins[lead][i] / self._unit
            if up > down and (up - down) > best_z * math.sqrt(up + down):
                best, best_z = i, (up - down) / math.sqrt(up + down)
        if best != lead:
            self._switch(best)

    def _switch(self, expert: int) -> None:
        """Hand the resident chunks to a fresh instance of `expert`. When its shadow samples every key (so it is
        that policy run on this tier's references), in the shadow's own order and state, the chunks the shadow
        does not hold first to go; else oldest first with their use counts from the cache's frequency sketch.
        Either way the new policy does not start cold, and nothing is moved."""
        self.leader = expert
        self.switches += 1
        self.real = self.experts[expert](self.capacity)
        self._admits = type(self.real).admit is not TierPolicy.admit
        shadow = self.shadows[expert]
        if self.threshold > _MASK and shadow.capacity == self.capacity:
            self.real.assume(shadow, list(self.recency))  # type: ignore[attr-defined]
            return
        if self.history:  # the expert run at full size over the history is what the tier would hold
            rerun = self.experts[expert](self.capacity)
            for keys in self.history:
                rerun.ref_request(keys, 0.0)
            self.real.assume(rerun, list(self.recency))  # type: ignore[attr-defined]
            return
        counts = self.sketch.counts if self.sketch is not None else {}
        self.real.adopt(list(self.recency), counts)  # type: ignore[attr-defined]
        if isinstance(shadow, ARCTier):  # what ARC has learnt, T1's target, is a share of the cache: scale it
            self.real.p = shadow.p * self.capacity / shadow.capacity  # type: ignore[attr-defined]

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        return self.real.admit(key, now, ref) if self._admits else True

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        parent = self.parents.get(key)
        if parent is None:
            self.recency.setdefault(key, None)
        else:
            self.recency[key] = parent
            kids = self.children.get(parent)
            if kids is None:
                self.children[parent] = {key}
            else:
                kids.add(key)
        self.real.insert(key, now, ref)
        if self.miniature and ref >= 0:
            self._pending.append((ref, key))
        elif (hash(key) * _GOLDEN) & _MASK < self.threshold:
            self._sample(key, now)

    def _gone(self, key: Key) -> None:
        parent = self.recency.pop(key)
        if parent is not None:
            kids = self.children[parent]
            kids.discard(key)
            if not kids:
                del self.children[parent]

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self.recency.move_to_end(key)
        self.real.touch(key, now, ref)
        if self.miniature and ref >= 0:
            self._pending.append((ref, key))
        elif (hash(key) * _GOLDEN) & _MASK < self.threshold:
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
        real, children, recency = self.real, self.children, self.recency
        for _ in range(count):  # one victim a round, or none left
            key = real.evict_avoiding(children, LEAF_TRIES, now, pinned)
            if key is None:
                break
            if key in children:  # still a parent: a leaf below it goes instead
                leaf = self._leaf_under(key, pinned)
                if leaf is not None and leaf not in out:
                    real.restore(key, now)
                    real.remove(leaf)
                    key = leaf
            parent = recency.pop(key)  # `_gone`, written out
            if parent is not None:
                kids = children[parent]
                kids.discard(key)
                if not kids:
                    del children[parent]
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
    """The default: each tier run by whichever of the five experts (``EXPERTS``) its shadows show winning."""

    name = "adaptive"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.sketch = FrequencySketch()
        self.chunks = 0
        self.parents: OrderedDict[Key, Key] = OrderedDict()  # recent chunks -> the chunk before them
        self._limit = 1024

    def tier(self, capacity: int) -> TierPolicy:
        self.chunks += capacity
        self.sketch.period = max(64, SAMPLE_FACTOR * self.chunks)
        self._limit = 2 * self.chunks + 1024  # parents remembered: every tier's chunks twice, and some
        sketch = self.sketch
        make: dict[str, Callable[[int], TierPolicy]] = {
            "s3fifo": S3FIFOTier,
            "wtinylfu": lambda c: WTinyLFUTier(c, sketch),
            "arc": ARCTier,
            "lru": LRUTier,
            "lfu": LFUTier,
        }
        return AdaptiveTier(capacity, [make[name] for name in EXPERTS], self.parents, sketch)

    def link(self, key: Key, parent: Key | None) -> None:
        if parent is None:
            return
        parents = self.parents
        size = len(parents)
        parents[key] = parent
        if len(parents) == size:  # known: most recent now; no new entry, so nothing to trim
            parents.move_to_end(key)
        elif size >= self._limit:
            parents.popitem(last=False)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        sketch = self.sketch  # FrequencySketch.add, inlined: this runs on every reference
        counts = sketch.counts
        c = counts.get(key, 0)
        if c < MAX_COUNT:
            counts[key] = c + 1
        sketch.added += 1
        if sketch.added >= sketch.period:
            sketch.halve()
