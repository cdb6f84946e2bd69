"""`lfu`: least frequently used with dynamic aging (LFU-DA, Arlitt et al. 2000).

A chunk's priority is its use count while resident plus the tier's age `L`, the priority of the last chunk
evicted; the lowest priority leaves first (ties: the one whose priority was set longest ago). The age lets
chunks that were popular once give way to new ones without a decay constant to tune.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence

from .base import Key, Policy, PolicySettings, TierPolicy, found_prefix


class LFUTier(TierPolicy):
    """LFU-DA over one tier. Chunks are grouped by priority, each group in the order its chunks' priorities were
    set (the tie-break), and a min-heap holds the priorities in use (a priority whose group emptied leaves the
    heap when it reaches the top): a victim is the first chunk of the lowest group, without sifting a heap of
    every use."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.age = 0.0
        self._count: dict[Key, int] = {}
        self._prio: dict[Key, float] = {}
        self._groups: dict[float, OrderedDict[Key, None]] = {}
        self._heap: list[float] = []

    def _set(self, key: Key, count: int) -> None:
        """Give `key` (in no group) `count` uses and the priority age + count, newest of its group."""
        self._count[key] = count
        p = self.age + count
        self._prio[key] = p
        group = self._groups.get(p)
        if group is None:
            group = self._groups[p] = OrderedDict()
            heap = self._heap
            heapq.heappush(heap, p)
            if len(heap) > 2 * len(self._groups) + 64:
                self._heap = list(self._groups)
                heapq.heapify(self._heap)
        group[key] = None

    def _unset(self, key: Key) -> None:
        """Take `key` out of its group (its count stays to the caller)."""
        p = self._prio.pop(key)
        group = self._groups[p]
        del group[key]
        if not group:
            del self._groups[p]

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        if key in self._prio:
            self._unset(key)
        self._set(key, 1)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        count = self._count[key] + 1
        self._unset(key)
        self._set(key, count)

    def remove(self, key: Key) -> None:
        del self._count[key]
        self._unset(key)

    def priority(self, key: Key) -> float:
        """The current priority of resident `key` (uses + age when last set)."""
        return self._prio[key]

    def _evict_one(self) -> Key | None:
        """Take out the chunk of least priority (the oldest of its group), ageing the cache to it; None if empty.
        The common case of `evict` (one victim, nothing pinned), also what `ref` and `ref_request` evict with."""
        heap, groups = self._heap, self._groups
        while heap:
            p = heap[0]
            group = groups.get(p)
            if group is None:
                heapq.heappop(heap)
                continue
            key = group.popitem(last=False)[0]
            if not group:
                del groups[p]
            self.age = p
            del self._count[key], self._prio[key]
            return key
        return None

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        heap, groups = self._heap, self._groups
        if count == 1 and not pinned:  # the common case, without the bookkeeping for pins
            key = self._evict_one()
            return [] if key is None else [key]
        out: list[Key] = []
        seen: list[float] = []  # priorities taken off the heap whose groups still hold chunks
        while len(out) < count and heap:
            p = heapq.heappop(heap)
            group = groups.get(p)
            if group is None:
                continue
            seen.append(p)
            taken = []
            for key in group:  # oldest first, pinned ones stay
                if key not in pinned:
                    taken.append(key)
                    if len(out) + len(taken) == count:
                        break
            for key in taken:
                del group[key], self._count[key], self._prio[key]
                self.age = p
                out.append(key)
            if not group:
                del groups[p]
                seen.pop()
        for p in seen:
            heapq.heappush(heap, p)
        return out

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """`evict(1)`, then while the victim is in `avoid` and tries remain, `restore` it (as inserted: one use at
        the new age) and `evict(1)` again; written out for the case with nothing pinned."""
        if pinned:
            return super().evict_avoiding(avoid, tries, now, pinned)
        while (key := self._evict_one()) is not None:
            if tries <= 0 or key not in avoid:
                return key
            tries -= 1
            self._set(key, 1)
        return None

    def ref(self, key: Key, now: float) -> bool:
        count = self._count.get(key)
        if count is not None:
            self._unset(key)
            self._set(key, count + 1)
            return True
        if len(self._count) >= self.capacity:
            self._evict_one()
        self._set(key, 1)
        return False

    def ref_request(self, keys: Sequence[Key], now: float) -> list[int]:
        """`TierPolicy.ref_request` with `ref` written out (the default's shadows run this per request)."""
        counts = self._count
        n = found_prefix(keys, counts)
        hits = [*range(n - 1, -1, -1)]
        for i in hits:
            key = keys[i]
            self._unset(key)
            self._set(key, counts[key] + 1)
        capacity = self.capacity
        for i in range(len(keys) - 1, n - 1, -1):
            key = keys[i]
            count = counts.get(key)
            if count is not None:
                self._unset(key)
                self._set(key, count + 1)
                hits.append(i)
                continue
            if len(counts) >= capacity:
                self._evict_one()
            self._set(key, 1)
        return hits

    def holds(self, key: Key) -> bool:
        return key in self._count

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first (a policy switch), each with its use count from `counts`
        (at least 1; ties leave oldest first)."""
        counts = counts or {}
        for key in keys:
            if key in self._prio:
                self._unset(key)
            self._set(key, max(1, counts.get(key, 1)))

    def assume(self, shadow: LFUTier, resident: list[Key]) -> None:
        """Take over `resident` (oldest first) with the counts and priorities `shadow`, an LFU-DA cache of this
        size fed the same references, gives them, and its age; the chunks it does not hold (it would have
        evicted them) get no uses and the lowest priority (the age), so they leave first."""
        self.age = shadow.age
        for key in resident:
            if key not in shadow._count:
                self._set(key, 0)
        wanted = set(resident)
        for p in sorted(shadow._groups):
            group = None
            for key in shadow._groups[p]:
                if key in wanted:
                    if group is None:
                        group = self._groups.get(p)
                        if group is None:
                            group = self._groups[p] = OrderedDict()
                            heapq.heappush(self._heap, p)
                    group[key] = None
                    self._count[key] = shadow._count[key]
                    self._prio[key] = p

    def __len__(self) -> int:
        return len(self._count)


class LFUPolicy(Policy):
    """LFU with dynamic aging in every tier; admits everything."""

    name = "lfu"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """LFU-DA has no constants; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return LFUTier(capacity)
