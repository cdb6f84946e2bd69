"""LRU: every tier evicts its least recently used chunk and admits everything (the baseline)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence

from .base import Key, Policy, PolicySettings, TierPolicy, found_prefix


class LRUTier(TierPolicy):
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        self._order[key] = None

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        for key in self._order:
            if len(out) == count:
                break
            if key not in pinned:
                out.append(key)
        for key in out:
            del self._order[key]
        return out

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """`evict(1)`, then while the victim is in `avoid` and tries remain, `restore` it and `evict(1)` again:
        the same steps in one call (the default's leaf guard asks this for every chunk it evicts)."""
        order = self._order
        while True:
            for key in order:  # the least recently used unpinned chunk
                if key not in pinned:
                    break
            else:
                return None
            del order[key]
            if tries <= 0 or key not in avoid:
                return key
            tries -= 1
            self.restore(key, now)

    def ref(self, key: Key, now: float) -> bool:
        order = self._order
        if key in order:
            order.move_to_end(key)
            return True
        if len(order) >= self.capacity:
            order.popitem(last=False)
        order[key] = None
        return False

    def ref_request(self, keys: Sequence[Key], now: float) -> list[int]:
        """`TierPolicy.ref_request` with `ref` written out (the default's shadows run this per request)."""
        order = self._order
        n = found_prefix(keys, order)
        hits = [*range(n - 1, -1, -1)]
        move = order.move_to_end
        for i in hits:
            move(keys[i])
        capacity = self.capacity
        for i in range(len(keys) - 1, n - 1, -1):
            key = keys[i]
            if key in order:
                move(key)
                hits.append(i)
                continue
            if len(order) >= capacity:
                order.popitem(last=False)
            order[key] = None
        return hits

    def holds(self, key: Key) -> bool:
        return key in self._order

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first (a policy switch); use counts do not matter to LRU."""
        for key in keys:
            self._order[key] = None

    def assume(self, shadow: LRUTier, resident: list[Key]) -> None:
        """Take over `resident` (oldest first) in the order `shadow`, an LRU cache of this size fed the same
        references, keeps them; the chunks it does not hold (it would have evicted them) go first."""
        held = shadow._order
        for key in resident:
            if key not in held:
                self._order[key] = None
        wanted = set(resident)
        for key in held:
            if key in wanted:
                self._order[key] = None

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(Policy):
    """The baseline: every tier evicts its least recently used chunk, admits everything."""

    name = "lru"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """LRU takes no settings; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return LRUTier(capacity)
