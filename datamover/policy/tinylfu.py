"""`wtinylfu`: W-TinyLFU (Einziger, Friedman and Manes, ACM ToS 2017), the design of Caffeine's cache.

New chunks enter a small LRU window (1% of the tier). When the window overflows, its oldest chunk (the
candidate) competes with the main region's victim (the LRU chunk of its probation segment): the candidate gets
in only if the frequency sketch says it was used more often. The main region is a segmented LRU: a chunk used
again in probation moves to the protected segment (80% of main), whose overflow falls back to probation.

The frequency sketch is TinyLFU's aged counter: each reference adds one (capped at 15, four bits), and every
`10 x capacity` references all counts halve, so the sketch reflects recent popularity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence

from .base import Key, Policy, PolicySettings, TierPolicy, first_unpinned

WINDOW_RATIO = 0.01  # the paper's and Caffeine's initial window
PROTECTED_RATIO = 0.8  # share of the main region that is protected (SLRU)
SAMPLE_FACTOR = 10  # the sketch halves every SAMPLE_FACTOR x capacity references (TinyLFU's W)
MAX_COUNT = 15


class FrequencySketch:
    """TinyLFU's aged frequency counts: `add` on every reference, `estimate` for admission.

    The counts are exact (a dict of the keys referenced since the last halvings) rather than a count-min sketch:
    the keys of a KV cache are few next to the chunks' bytes, and no sketch library here is fast enough per
    call (datasketches' count_min_sketch costs several times the whole per-reference budget of the replay;
    BENCHMARKS.md).
    """

    def __init__(self, period: int = 64) -> None:
        self.period = max(64, period)
        self.added = 0
        self.counts: dict[Key, int] = {}

    def add(self, key: Key) -> None:
        c = self.counts.get(key, 0)
        if c < MAX_COUNT:
            self.counts[key] = c + 1
        self.added += 1
        if self.added >= self.period:
            self.halve()

    def halve(self) -> None:
        """Age the counts: halve them all (ones drop out) and the references counted since the last time."""
        self.counts = {k: v >> 1 for k, v in self.counts.items() if v > 1}
        self.added //= 2

    def estimate(self, key: Key) -> int:
        return self.counts.get(key, 0)


class WTinyLFUTier(TierPolicy):
    """A window LRU, a main SLRU (probation + protected), and sketch-based admission from window to main."""

    def __init__(self, capacity: int, sketch: FrequencySketch, window_ratio: float = WINDOW_RATIO) -> None:
        super().__init__(capacity)
        self.sketch = sketch
        self.window: OrderedDict[Key, None] = OrderedDict()
        self.probation: OrderedDict[Key, None] = OrderedDict()
        self.protected: OrderedDict[Key, None] = OrderedDict()
        self.set_window(max(1, round(capacity * window_ratio)))

    def set_window(self, size: int) -> None:
        """Resize the window (at least 1 chunk, at most capacity - 1 when the tier has 2 or more)."""
        self.window_size = max(1, min(size, self.capacity - 1)) if self.capacity > 1 else 1
        self.protected_size = int((self.capacity - self.window_size) * PROTECTED_RATIO)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        window = self.window
        window[key] = None
        while len(window) > self.window_size:  # room in main (the tier was not full): no contest
            old = next(iter(window))
            del window[old]
            self.probation[old] = None

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        if key in self.window:
            self.window.move_to_end(key)
        elif key in self.probation:
            del self.probation[key]
            protected = self.protected
            protected[key] = None
            while len(protected) > self.protected_size:
                old = next(iter(protected))
                del protected[old]
                self.probation[old] = None
        else:
            self.protected.move_to_end(key)

    def remove(self, key: Key) -> None:
        for segment in (self.window, self.probation, self.protected):
            if key in segment:
                del segment[key]
                return

    def _main_victim(self, pinned: Container[Key]) -> tuple[Key | None, OrderedDict]:
        for key in self.probation:
            if key not in pinned:
                return key, self.probation
        return first_unpinned(self.protected, pinned), self.protected

    def _rejected(self, key: Key) -> None:
        """Hook: the window candidate `key` lost to the main region's victim and leaves."""

    def _evicted_from_main(self, key: Key) -> None:
        """Hook: `key` left the main region to make room for a window candidate."""

    def _one(self, pinned: Container[Key]) -> Key | None:
        """Free one slot for the chunk about to enter the window."""
        window = self.window
        if len(window) >= self.window_size:
            candidate = None
            for key in window:  # the oldest unpinned window chunk
                if key not in pinned:
                    candidate = key
                    break
            if candidate is not None:
                victim, segment = self._main_victim(pinned)
                del window[candidate]
                if victim is None:
                    self._rejected(candidate)
                    return candidate
                counts = self.sketch.counts
                if counts.get(candidate, 0) > counts.get(victim, 0):
                    del segment[victim]
                    self.probation[candidate] = None
                    self._evicted_from_main(victim)
                    return victim
                self._rejected(candidate)
                return candidate
        victim, segment = self._main_victim(pinned)
        if victim is None:
            victim, segment = first_unpinned(window, pinned), window
            if victim is None:
                return None
            del segment[victim]
            self._rejected(victim)
            return victim
        del segment[victim]
        self._evicted_from_main(victim)
        return victim

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        if count == 1:
            key = self._one(pinned)
            return [] if key is None else [key]
        out: list[Key] = []
        while len(out) < count:
            key = self._one(pinned)
            if key is None:
                break
            out.append(key)
        return out

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """One victim, as `evict(1)` then, while the victim is in `avoid` and tries remain, `insert` it back
        (as just used) and `evict(1)` again: the same steps as that loop, in one call (the default's leaf
        guard asks this for nearly every chunk it evicts). A window candidate that loses the contest and is
        handed back only moves to the window's newest end, so runs of those are done in one pass."""
        window, probation, protected = self.window, self.probation, self.protected
        counts = self.sketch.counts
        while True:
            if len(window) != self.window_size:
                key = self._one(pinned)
            else:
                victim, segment = None, probation
                for victim in probation:  # main's victim: probation's oldest unpinned, else protected's
                    if victim not in pinned:
                        break
                else:
                    victim, segment = first_unpinned(protected, pinned), protected
                least = counts.get(victim, 0) if victim is not None else MAX_COUNT + 1
                rotated: list[Key] = []
                key, won = None, False
                for candidate in window:  # the window's unpinned chunks, oldest first, each against the victim
                    if candidate in pinned:
                        continue
                    if counts.get(candidate, 0) > least:
                        key, won = candidate, True
                        break
                    if len(rotated) >= tries or candidate not in avoid:
                        key = candidate
                        break
                    rotated.append(candidate)  # refused, handed back: it becomes the window's newest
                for candidate in rotated:
                    window.move_to_end(candidate)
                tries -= len(rotated)
                if key is None:
                    if rotated:  # every unpinned window chunk went round once: go round again
                        continue
                    key = self._one(pinned)  # the window is all pinned
                else:
                    del window[key]
                    if won:
                        del segment[victim]
                        probation[key] = None
                        key = victim
            if key is None or tries <= 0 or key not in avoid:
                return key
            tries -= 1
            window[key] = None  # insert
            while len(window) > self.window_size:
                old = next(iter(window))
                del window[old]
                probation[old] = None

    def ref(self, key: Key, now: float) -> bool:
        window, probation, protected = self.window, self.probation, self.protected
        if key in window:  # `touch`, written out
            window.move_to_end(key)
            return True
        if key in probation:
            del probation[key]
            protected[key] = None
            while len(protected) > self.protected_size:
                old = next(iter(protected))
                del protected[old]
                probation[old] = None
            return True
        if key in protected:
            protected.move_to_end(key)
            return True
        if len(window) + len(probation) + len(protected) >= self.capacity:
            self._one(())
        window[key] = None  # `insert`, written out
        while len(window) > self.window_size:
            old = next(iter(window))
            del window[old]
            probation[old] = None
        return False

    def ref_request(self, keys: Sequence[Key], now: float) -> list[int]:
        """`TierPolicy.ref_request` with `ref` written out (the default's shadows run this per request)."""
        window, probation, protected = self.window, self.probation, self.protected
        n = len(keys)
        for i, key in enumerate(keys):
            if key not in window and key not in probation and key not in protected:
                n = i
                break
        hits = []
        capacity, window_size, protected_size = self.capacity, self.window_size, self.protected_size
        for i in [*range(n - 1, -1, -1), *range(len(keys) - 1, n - 1, -1)]:
            key = keys[i]
            if key in window:  # `touch`, written out
                window.move_to_end(key)
                hits.append(i)
                continue
            if key in probation:
                del probation[key]
                protected[key] = None
                while len(protected) > protected_size:
                    old = next(iter(protected))
                    del protected[old]
                    probation[old] = None
                hits.append(i)
                continue
            if key in protected:
                protected.move_to_end(key)
                hits.append(i)
                continue
            if len(window) + len(probation) + len(protected) >= capacity:
                self._one(())
            window[key] = None  # `insert`, written out
            while len(window) > window_size:
                old = next(iter(window))
                del window[old]
                probation[old] = None
        return hits

    def holds(self, key: Key) -> bool:
        return key in self.window or key in self.probation or key in self.protected

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first (a policy switch): the newest into the window; of the rest,
        the most recent that `counts` says were used at least twice into protected, the others into probation."""
        counts = self.sketch.counts if counts is None else counts
        cut = max(0, len(keys) - self.window_size)
        room = self.protected_size
        protected: list[Key] = []
        for key in reversed(keys[:cut]):
            if room and counts.get(key, 0) >= 2:
                protected.append(key)
                room -= 1
        chosen = set(protected)
        for key in keys[:cut]:
            if key not in chosen:
                self.probation[key] = None
        for key in reversed(protected):
            self.protected[key] = None
        for key in keys[cut:]:
            self.window[key] = None

    def assume(self, shadow: WTinyLFUTier, resident: list[Key]) -> None:
        """Take over `resident` (oldest first) in the segments and order `shadow`, a W-TinyLFU cache of this
        size fed the same references, keeps them in; the chunks it does not hold (it would have evicted them)
        go to probation's LRU end, so they are the main region's first victims."""
        for key in resident:
            if key not in shadow.window and key not in shadow.probation and key not in shadow.protected:
                self.probation[key] = None
        wanted = set(resident)
        for theirs, mine in (
            (shadow.probation, self.probation),
            (shadow.protected, self.protected),
            (shadow.window, self.window),
        ):
            for key in theirs:
                if key in wanted:
                    mine[key] = None

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)


class WTinyLFUPolicy(Policy):
    """W-TinyLFU in every tier, one frequency sketch for the whole cache (it sees every reference)."""

    name = "wtinylfu"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.sketch = FrequencySketch()
        self.chunks = 0  # capacity of all tiers

    def tier(self, capacity: int) -> TierPolicy:
        self.chunks += capacity
        self.sketch.period = max(64, SAMPLE_FACTOR * self.chunks)
        return WTinyLFUTier(capacity, self.sketch)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.sketch.add(key)
