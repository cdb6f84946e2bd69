"""`arc`: the Adaptive Replacement Cache (Megiddo and Modha, FAST'03).

T1 holds chunks used once recently, T2 chunks used at least twice; B1 and B2 remember the keys recently
evicted from each (ghosts, no data). A miss that finds its key in B1 means T1 was too small: the target size
`p` of T1 grows (by |B2|/|B1|, at least 1); one in B2 shrinks it. Eviction takes T1's LRU chunk while T1 is
above `p` (or at `p` when the incoming key was in B2), else T2's. Ghost hits enter T2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping

from .base import Key, Policy, PolicySettings, TierPolicy, first_unpinned


class ARCTier(TierPolicy):
    """ARC over one tier of `capacity` chunks."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0
        self._adapted: Key | None = None  # the incoming key whose ghost hit already moved p

    def _adapt(self, key: Key) -> None:
        b1, b2 = len(self.b1), len(self.b2)
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(b2 / b1, 1.0))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        self._adapt(key)
        self._adapted = key
        return True

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        from_b2 = self._adapted is not None and self._adapted in self.b2
        while len(out) < count:
            n1 = len(self.t1)
            t1_first = n1 >= 1 and (n1 > self.p or (from_b2 and n1 == self.p))
            order = ((self.t1, self.b1), (self.t2, self.b2)) if t1_first else ((self.t2, self.b2), (self.t1, self.b1))
            for src, ghost in order:
                key = first_unpinned(src, pinned)
                if key is not None:
                    del src[key]
                    ghost[key] = None
                    out.append(key)
                    break
            else:
                break
        return out

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        if key in self.b1 or key in self.b2:
            if self._adapted != key:
                self._adapt(key)
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._adapted = None
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]

    def restore(self, key: Key, now: float) -> None:
        """Take back the chunk `evict` just gave up, as just used, without its ghost entry moving `p`."""
        if self.b1.pop(key, 0) is None:
            self.t1[key] = None
        else:
            self.b2.pop(key, None)
            self.t2[key] = None

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """`evict(1)`, then while the victim is in `avoid` and tries remain, `restore` it and `evict(1)` again:
        the same steps in one call (the default's leaf guard asks this for every chunk it evicts)."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        while True:
            adapted = self._adapted
            n1 = len(t1)
            if n1 >= 1 and (n1 > self.p or (n1 == self.p and adapted is not None and adapted in b2)):
                src, ghost, other, other_ghost = t1, b1, t2, b2
            else:
                src, ghost, other, other_ghost = t2, b2, t1, b1
            for key in src:  # the first list's LRU unpinned chunk, else the other's
                if key not in pinned:
                    break
            else:
                src, ghost = other, other_ghost
                for key in src:
                    if key not in pinned:
                        break
                else:
                    return None
            del src[key]
            ghost[key] = None
            if tries <= 0 or key not in avoid:
                return key
            tries -= 1
            self.restore(key, now)

    def ref(self, key: Key, now: float) -> bool:
        t1, t2 = self.t1, self.t2
        if key in t1:
            del t1[key]
            t2[key] = None
            return True
        if key in t2:
            t2.move_to_end(key)
            return True
        # a miss: `admit`, `evict(1)` and `insert`, written out (the default's shadows run this per sampled miss)
        b1, b2 = self.b1, self.b2
        in_b1 = key in b1
        in_b2 = key in b2
        if in_b1 or in_b2:
            self._adapt(key)
        if len(t1) + len(t2) >= self.capacity:
            n1 = len(t1)
            if n1 >= 1 and (n1 > self.p or (in_b2 and n1 == self.p)):
                b1[t1.popitem(last=False)[0]] = None
            elif t2:
                b2[t2.popitem(last=False)[0]] = None
            elif t1:
                b1[t1.popitem(last=False)[0]] = None
        if in_b1 or in_b2:
            b1.pop(key, None)
            b2.pop(key, None)
            t2[key] = None
        else:
            t1[key] = None
        self._adapted = None
        c = self.capacity
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)
        return False

    def holds(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first (a policy switch): those the counts say were used at least
        twice into T2, the rest into T1."""
        counts = counts or {}
        for key in keys:
            (self.t2 if counts.get(key, 0) >= 2 else self.t1)[key] = None

    def assume(self, shadow: ARCTier, resident: list[Key]) -> None:
        """Take over `resident` (oldest first) in the lists `shadow`, an ARC cache of this size fed the same
        references, keeps them in, with its ghosts and its target `p`; the chunks it does not hold (it would
        have evicted them) go to T1's LRU end, the first that T1 gives up."""
        for key in resident:
            if key not in shadow.t1 and key not in shadow.t2:
                self.t1[key] = None
        wanted = set(resident)
        for lists in ((shadow.t1, self.t1), (shadow.t2, self.t2)):
            for key in lists[0]:
                if key in wanted:
                    lists[1][key] = None
        for lists in ((shadow.b1, self.b1), (shadow.b2, self.b2)):
            for key in lists[0]:
                if key not in wanted:
                    lists[1][key] = None
        self.p = shadow.p

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class ARCPolicy(Policy):
    """ARC in every tier; admits everything."""

    name = "arc"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """ARC has no constants; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return ARCTier(capacity)
