"""`scored`: the decayed-use-count policy that was the default before `adaptive`, kept as a baseline.

A chunk's score is a decayed use count: each use adds 1 and the score halves every `half_life_s` unused (LRFU's
combined recency-frequency). Scores of evicted chunks are remembered (`history_factor`), so a chunk that comes
back resumes its score instead of starting over; one-shot chunks therefore leave before chunks that were
reused. A chunk placed or used less than the hysteresis cooldown ago is evicted only when nothing else can go.
A full tier admits a chunk only if it outscores the chunk it would replace. Its constants were tuned on the
shared trace, which is why it is no longer the default.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Container

from .base import Key, Policy, PolicySettings, TierPolicy


class ScoreBook:
    """Decayed use counts of chunks, resident or recently evicted, shared by all tiers of a cache.

    score(t) = sum over uses u of 2^-((t - t_u) / half_life). Between uses every score decays by the same
    factor, so it is stored as the time-invariant log key `log2(score(t)) + t / half_life`: ordering by key is
    ordering by current score, and a heap over keys never needs re-sorting.
    """

    def __init__(self, half_life_s: float, max_entries: int) -> None:
        self.rate = 1.0 / half_life_s
        self.max_entries = max(1, max_entries)
        self._keys: OrderedDict[Key, float] = OrderedDict()

    def record(self, key: Key, now: float) -> float:
        """Count one use of `key` at `now`; return its new log key."""
        base = self.rate * now
        old = self._keys.get(key)
        if old is None:
            new = base
        else:
            e = old - base  # log2 of the decayed score before this use
            new = base + (e + math.log2(1.0 + 2.0**-e) if e > 0 else math.log2(1.0 + 2.0**e))
            self._keys.move_to_end(key)
        self._keys[key] = new
        if len(self._keys) > self.max_entries:
            self._keys.popitem(last=False)
        return new

    def key(self, key: Key, now: float) -> float:
        """The log key of `key` (a chunk never seen counts as one use now)."""
        return self._keys.get(key, self.rate * now)

    def score(self, key: Key, now: float) -> float:
        """The decayed use count of `key` at `now` (0 if unknown)."""
        k = self._keys.get(key)
        return 0.0 if k is None else 2.0 ** (k - self.rate * now)

    def grow(self, entries: int) -> None:
        """Remember `entries` more chunks (a tier was added)."""
        self.max_entries += entries


class ScoredTier(TierPolicy):
    """Evicts the lowest score first, never a chunk in its cooldown while another can go, admits by score.

    A chunk placed or used less than `cooldown_s` ago waits in a FIFO and joins the score heap when its
    cooldown ends, so eviction never scans over cooling chunks. Stale heap and FIFO entries are skipped lazily.
    """

    def __init__(self, capacity: int, book: ScoreBook, settings: PolicySettings) -> None:
        super().__init__(capacity)
        self.book = book
        self.cooldown = settings.cooldown_s
        self.admission = settings.admission
        self._key: dict[Key, float] = {}  # every resident chunk -> its log key
        self._cooling: dict[Key, float] = {}  # chunk in its cooldown -> when it started
        self._fifo: deque[tuple[float, Key]] = deque()  # (start, chunk), oldest first; stale if restarted
        self._live: dict[Key, int] = {}  # chunk in the heap -> sequence number of its valid entry
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0
        self._cooled_at = -math.inf

    def _to_heap(self, key: Key) -> None:
        self._seq += 1
        self._live[key] = self._seq
        heapq.heappush(self._heap, (self._key[key], self._seq, key))

    def _place(self, key: Key, now: float) -> None:
        self._key[key] = self.book.key(key, now)
        if self.cooldown > 0:
            self._live.pop(key, None)
            self._cooling[key] = now
            self._fifo.append((now, key))
        else:
            self._to_heap(key)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._place(key, now)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._place(key, now)

    def remove(self, key: Key) -> None:
        del self._key[key]
        self._cooling.pop(key, None)
        self._live.pop(key, None)

    def _cool_down(self, now: float) -> None:
        """Move chunks whose cooldown has ended from the FIFO into the heap (nothing new ends at the same now)."""
        if now == self._cooled_at:
            return
        self._cooled_at = now
        fifo, cooling, limit = self._fifo, self._cooling, now - self.cooldown
        while fifo and fifo[0][0] <= limit:
            since, key = fifo.popleft()
            if cooling.get(key) == since:
                del cooling[key]
                self._to_heap(key)
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale entries
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _valid_top(self) -> tuple[float, int, Key] | None:
        heap, live = self._heap, self._live
        while heap:
            if live.get(heap[0][2]) == heap[0][1]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _cooling_order(self) -> list[Key]:
        """Chunks still cooling down, the longest-cooling first, each once (two uses at one time leave two
        FIFO entries of the same start)."""
        return list(dict.fromkeys(k for since, k in self._fifo if self._cooling.get(k) == since))

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        if not self.admission:
            return True
        self._cool_down(now)
        top = self._valid_top()
        if top is not None:
            return self.book.key(key, now) >= top[0]
        cooling = self._cooling_order()
        return not cooling or self.book.key(key, now) >= self._key[cooling[0]]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        self._cool_down(now)
        heap, live, keys = self._heap, self._live, self._key
        out: list[Key] = []
        held: list[tuple[float, int, Key]] = []
        while len(out) < count and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if live.get(key) != entry[1]:  # stale
                continue
            if key in pinned:
                held.append(entry)
                continue
            out.append(key)
            del live[key], keys[key]
        for entry in held:
            heapq.heappush(heap, entry)
        if len(out) < count:  # last resort: chunks still cooling down, the longest-cooling first
            cooling = [k for k in self._cooling_order() if k not in pinned][: count - len(out)]
            for key in cooling:
                self.remove(key)
            out += cooling
        return out

    def __len__(self) -> int:
        return len(self._key)


class ScoredPolicy(Policy):
    """Frequency and recency (decayed use counts with memory), hysteresis cooldown, score-based admission."""

    name = "scored"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()
        self.book = ScoreBook(self.settings.half_life_s, 0)

    def tier(self, capacity: int) -> TierPolicy:
        self.book.grow(int((1.0 + self.settings.history_factor) * capacity))
        return ScoredTier(capacity, self.book, self.settings)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.book.record(key, now)
