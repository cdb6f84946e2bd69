"""Belady's offline optimum: evict the chunk whose next use is furthest; never admit a chunk used later than
every resident one. It needs the future, so only the replay can use it (the bound every policy is shown against).
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence

import numpy as np

from .base import NEVER, Key, Policy, TierPolicy


def next_use(ids: np.ndarray) -> np.ndarray:
    """For each reference i of an integer id sequence, the index of the next reference to the same id
    (NEVER if none), in O(n log n) numpy."""
    ids = np.asarray(ids)
    n = len(ids)
    out = np.full(n, NEVER, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


class BeladyTier(TierPolicy):
    """Evicts the chunk used furthest in the future; a max-heap with lazy deletion."""

    def __init__(self, capacity: int, oracle: BeladyPolicy) -> None:
        super().__init__(capacity)
        self.oracle = oracle
        self._next: dict[Key, int] = {}
        self._heap: list[tuple[int, Key]] = []

    def _set(self, key: Key) -> None:
        n = self.oracle.next_of[key]
        self._next[key] = n
        heapq.heappush(self._heap, (-n, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [(-v, k) for k, v in self._next.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._set(key)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._set(key)

    def remove(self, key: Key) -> None:
        del self._next[key]

    def _valid_top(self) -> tuple[int, Key] | None:
        heap = self._heap
        while heap:
            neg, key = heap[0]
            if self._next.get(key) == -neg:
                return heap[0]
            heapq.heappop(heap)
        return None

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        top = self._valid_top()
        return top is None or self.oracle.next_of[key] < -top[0]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        held = []
        while len(out) < count and self._valid_top() is not None:
            entry = heapq.heappop(self._heap)
            if entry[1] in pinned:
                held.append(entry)
            else:
                out.append(entry[1])
                del self._next[entry[1]]
        for entry in held:
            heapq.heappush(self._heap, entry)
        return out

    def __len__(self) -> int:
        return len(self._next)


class BeladyPolicy(Policy):
    """Belady's offline optimum; `next_uses[i]` is the index of the next use of reference i's chunk."""

    name = "belady"

    def __init__(self, next_uses: np.ndarray) -> None:
        self._next_uses = next_uses.tolist()
        self.next_of: dict[Key, int] = {}

    def tier(self, capacity: int) -> TierPolicy:
        return BeladyTier(capacity, self)

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        self.next_of[key] = self._next_uses[ref]


def belady_hits(ids: Sequence[int] | np.ndarray, capacity: int) -> int:
    """Hits of Belady's optimum (with bypass) on one tier of `capacity` chunks: the bound for any policy."""
    ids = np.asarray(ids, dtype=np.int64)
    if capacity <= 0:
        return 0
    nxt = next_use(ids).tolist()
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, key in enumerate(ids.tolist()):
        n = nxt[i]
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while resident.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if n >= -heap[0][0]:
                continue
            del resident[heapq.heappop(heap)[1]]
        resident[key] = n
        heapq.heappush(heap, (-n, key))
        if len(heap) > 4 * capacity + 64:
            heap = [(-v, k) for k, v in resident.items()]
            heapq.heapify(heap)
    return hits
