"""`lecar`: LeCaR (Vietri et al., HotStorage'18): learn online how to mix LRU and LFU.

Two experts propose a victim: LRU (the least recently used chunk) and LFU (the least frequently used one).
Each eviction follows one expert, drawn with probability equal to its weight, and the evicted key goes to that
expert's history. A miss whose key is in an expert's history shows that expert was wrong: its weight is
multiplied by exp(-learning_rate * discount^age), where age counts references since the eviction, and the
weights are renormalised. The constants are the paper's: learning rate 0.45, discount 0.005^(1/capacity).
A key coming back from a history resumes the use count it had.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Container

from .base import Key, Policy, PolicySettings, TierPolicy, first_unpinned

LEARNING_RATE = 0.45


class LeCaRTier(TierPolicy):
    """LeCaR over one tier; the random draws are seeded, so a replay is repeatable."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        super().__init__(capacity)
        self.w_lru = 0.5
        self.discount = 0.005 ** (1.0 / max(1, capacity))
        self.rng = random.Random(seed)
        self.clock = 0
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        # LFU's order: chunks grouped by use count, each group oldest use first, and a min-heap of the counts
        # in use (a count whose group emptied leaves the heap when it reaches the top)
        self._groups: dict[int, OrderedDict[Key, None]] = {}
        self._heap: list[int] = []
        self.h_lru: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # key -> (evicted at, uses)
        self.h_lfu: OrderedDict[Key, tuple[int, int]] = OrderedDict()
        self._learned: Key | None = None

    def _push(self, key: Key, freq: int) -> None:
        """`key` (in no group) was used: `freq` uses, newest of its group; the clock counts every use."""
        self._freq[key] = freq
        self.clock += 1
        group = self._groups.get(freq)
        if group is None:
            group = self._groups[freq] = OrderedDict()
            heapq.heappush(self._heap, freq)
            if len(self._heap) > 2 * len(self._groups) + 64:
                self._heap = list(self._groups)
                heapq.heapify(self._heap)
        group[key] = None

    def _ungroup(self, key: Key, freq: int) -> None:
        group = self._groups[freq]
        del group[key]
        if not group:
            del self._groups[freq]

    def _learn(self, key: Key) -> None:
        old = self.h_lru.get(key)
        is_lru = old is not None
        if not is_lru:
            old = self.h_lfu.get(key)
            if old is None:
                return
        penalty = math.exp(-LEARNING_RATE * self.discount ** (self.clock - old[0]))
        w_lru, w_lfu = self.w_lru, 1.0 - self.w_lru
        if is_lru:
            w_lru *= penalty
        else:
            w_lfu *= penalty
        self.w_lru = min(0.99, max(0.01, w_lru / (w_lru + w_lfu)))

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        self._learn(key)
        self._learned = key
        return True

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        if self._learned != key:
            self._learn(key)
        self._learned = None
        old = self.h_lru.pop(key, None) or self.h_lfu.pop(key, None)
        self._lru[key] = None
        if key in self._freq:
            self._ungroup(key, self._freq[key])
        self._push(key, 1 if old is None else old[1] + 1)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._lru.move_to_end(key)
        freq = self._freq[key]
        self._ungroup(key, freq)
        self._push(key, freq + 1)

    def remove(self, key: Key) -> None:
        del self._lru[key]
        self._ungroup(key, self._freq.pop(key))

    def _lfu_victim(self, pinned: Container[Key]) -> Key | None:
        """The least used unpinned chunk, the one used longest ago among equals (None if all are pinned)."""
        heap, groups = self._heap, self._groups
        while heap and heap[0] not in groups:  # counts whose groups emptied
            heapq.heappop(heap)
        if not heap:
            return None
        for key in groups[heap[0]]:
            if key not in pinned:
                return key
        for freq in sorted(groups):  # the lowest group is all pinned: the next ones, in order
            for key in groups[freq]:
                if key not in pinned:
                    return key
        return None

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        draw, lru, freq = self.rng.random, self._lru, self._freq
        while len(out) < count:
            use_lru = draw() < self.w_lru
            key = first_unpinned(lru, pinned) if use_lru else self._lfu_victim(pinned)
            if key is None:
                break
            history = self.h_lru if use_lru else self.h_lfu
            uses = freq.pop(key)
            history[key] = (self.clock, uses)
            if len(history) > self.capacity:
                history.popitem(last=False)
            del lru[key]
            self._ungroup(key, uses)
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._lru)


class LeCaRPolicy(Policy):
    """LeCaR in every tier (each tier learns its own weights); admits everything."""

    name = "lecar"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """LeCaR's constants are the paper's; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return LeCaRTier(capacity)
