"""`lfu`: least frequently used with dynamic aging (LFU-DA, Arlitt et al. 2000).

A chunk's priority is its use count while resident plus the tier's age `L`, the priority of the last chunk
evicted; the lowest priority leaves first (ties: the one whose priority was set longest ago). The age lets
chunks that were popular once give way to new ones without a decay constant to tune.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Mapping

from .base import Key, Policy, PolicySettings, TierPolicy


class LFUTier(TierPolicy):
    """LFU-DA over one tier: a min-heap of (priority, sequence, key) with lazy deletion."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.age = 0.0
        self._count: dict[Key, int] = {}
        self._entry: dict[Key, tuple[float, int, Key]] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._seq = 0

    def _push(self, key: Key, count: int) -> None:
        self._count[key] = count
        self._seq += 1
        entry = (self.age + count, self._seq, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._push(key, 1)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._push(key, self._count[key] + 1)

    def remove(self, key: Key) -> None:
        del self._count[key], self._entry[key]

    def priority(self, key: Key) -> float:
        """The current priority of resident `key` (uses + age when last set)."""
        return self._entry[key][0]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        heap, entries = self._heap, self._entry
        if count == 1 and not pinned:  # the common case, without the bookkeeping for pins
            pop = heapq.heappop
            while heap:
                entry = pop(heap)
                key = entry[2]
                if entries.get(key) is entry:
                    self.age = entry[0]
                    del self._count[key], entries[key]
                    return [key]
            return []
        out: list[Key] = []
        held = []
        while len(out) < count and heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if entries.get(key) is not entry:
                continue
            if key in pinned:
                held.append(entry)
                continue
            self.age = entry[0]
            del self._count[key], entries[key]
            out.append(key)
        for entry in held:
            heapq.heappush(heap, entry)
        return out

    def ref(self, key: Key, now: float) -> bool:
        count = self._count.get(key)
        if count is not None:
            self._push(key, count + 1)
            return True
        if len(self._entry) >= self.capacity:
            self.evict(1, now)
        self._push(key, 1)
        return False

    def holds(self, key: Key) -> bool:
        return key in self._entry

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first (a policy switch), each with its use count from `counts`
        (at least 1; ties leave oldest first)."""
        counts = counts or {}
        for key in keys:
            self._push(key, max(1, counts.get(key, 1)))

    def __len__(self) -> int:
        return len(self._entry)


class LFUPolicy(Policy):
    """LFU with dynamic aging in every tier; admits everything."""

    name = "lfu"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """LFU-DA has no constants; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return LFUTier(capacity)
