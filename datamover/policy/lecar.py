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
        self._entry: dict[Key, tuple[int, int, Key]] = {}
        self._heap: list[tuple[int, int, Key]] = []
        self.h_lru: OrderedDict[Key, tuple[int, int]] = OrderedDict()  # key -> (evicted at, uses)
        self.h_lfu: OrderedDict[Key, tuple[int, int]] = OrderedDict()
        self._learned: Key | None = None

    def _push(self, key: Key, freq: int) -> None:
        self._freq[key] = freq
        self.clock += 1
        entry = (freq, self.clock, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

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
        self._push(key, 1 if old is None else old[1] + 1)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._lru.move_to_end(key)
        self._push(key, self._freq[key] + 1)

    def remove(self, key: Key) -> None:
        del self._lru[key], self._freq[key], self._entry[key]

    def _lfu_victim(self, pinned: Container[Key]) -> Key | None:
        heap, entries = self._heap, self._entry
        while heap:  # drop stale entries from the top; the least used live one, if unpinned, is the answer
            entry = heap[0]
            if entries.get(entry[2]) is not entry:
                heapq.heappop(heap)
            elif entry[2] not in pinned:
                return entry[2]
            else:
                break
        held, found = [], None
        while heap:
            entry = heapq.heappop(heap)
            if entries.get(entry[2]) is not entry:
                continue
            held.append(entry)
            if entry[2] not in pinned:
                found = entry[2]
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        draw, lru, freq = self.rng.random, self._lru, self._freq
        while len(out) < count:
            use_lru = draw() < self.w_lru
            key = first_unpinned(lru, pinned) if use_lru else self._lfu_victim(pinned)
            if key is None:
                break
            history = self.h_lru if use_lru else self.h_lfu
            history[key] = (self.clock, freq.pop(key))
            if len(history) > self.capacity:
                history.popitem(last=False)
            del lru[key], self._entry[key]
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
