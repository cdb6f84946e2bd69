"""The tier engine: where each chunk of one cache lives, decided by one policy, shared by replay and runtime.

A reference looks the chunk up tier by tier (L1 first); a hit in a lower tier promotes it to L1 when the policy
admits it there; a miss is a prefill, and the new chunk is placed in L1 (or, if L1's admission refuses it, in
the next tier). A full tier evicts down to its low watermark; an evicted chunk is demoted to the next tier
(write-back) unless it is already there, and the last tier drops it. With write-through every placement is
copied to the next tier at once. The engine only keeps the bookkeeping: the replay counts what it does, and
the runtime cache (`datamover.policy.cache`) turns its placements into slot-to-slot moves through hooks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .base import TierPolicy, found_prefix
from .config import TierConfig
from .policies import Policy

PREFILL = "prefill"  # the source of a chunk that no tier held: it was computed (prefilled) by the caller


@dataclass(frozen=True)
class TierSpec:
    """One simulated tier: name, capacity in chunks, and its watermarks (fractions of capacity)."""

    name: str
    capacity: int
    high_watermark: float = 1.0
    low_watermark: float = 1.0


class TierStack:
    """The simulated tiers of one cache under one policy; `access` replays one reference."""

    def __init__(
        self, policy: Policy, tiers: Sequence[TierSpec], promote_on_hit: bool = True, write_through: bool = False
    ) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self.policy = policy
        self.specs = list(tiers)
        self.names = [t.name for t in self.specs]
        self.resident: list[set[Hashable]] = [set() for _ in self.specs]
        self.orders = [policy.tier(t.capacity) for t in self.specs]
        self.high = [max(1, int(t.capacity * t.high_watermark)) for t in self.specs]
        self.low = [
            max(1, min(h, int(t.capacity * t.low_watermark))) for h, t in zip(self.high, self.specs, strict=True)
        ]
        self.promote = promote_on_hit
        self.write_through = write_through
        self.hits = [0] * len(self.specs)
        self.misses = 0
        self.evictions = [0] * len(self.specs)
        self.moved: Counter = Counter()
        self.pinned: set[Hashable] = set()  # never evicted
        self.closed: set[int] = set()  # tiers being drained: no new chunks
        cls = type(self)  # none of the steps a subclass may hook overridden: one tier can take the short path
        self._plain = all(
            getattr(cls, name) is getattr(TierStack, name) for name in ("hit", "place", "evict", "_placed", "_removed")
        )

    def access(self, key: Hashable, now: float, ref: int = -1) -> int:
        """Replay one reference (a request of one chunk); return the tier index that served it, or -1 for a miss."""
        self.policy.observe(key, now, ref)
        j = self.where(key)
        if j >= 0:
            self.hit(j, key, now, ref)
        else:
            self.misses += 1
            self.place(0, key, now, ref, PREFILL)
        for order in self.orders:
            if type(order).served is not TierPolicy.served:
                order.served(now)
        return j

    def access_request(self, keys: Sequence[Hashable], now: float, first_ref: int = -1, leaf_first: bool = True) -> int:
        """Replay one request, its chunks first to last (a prefix chain), as the cache serves it: the longest
        found prefix is pinned and served (hits, promoted as the policy says), then the rest is stored (a chunk
        already held only counts as used). With `leaf_first` each phase hands its chunks to the policy last
        chunk first, so the request's first chunk ends most recent, and tells the policy each chunk's parent
        (without it, in order and without parents). Every found chunk
        counts in `hits`; each tier's policy is then told the request was served (`TierPolicy.served`). Returns
        the usable prefix, the number of leading chunks found."""
        if self._plain and len(self.resident) == 1 and not self.closed:
            return self._one_tier_request(keys, now, first_ref, leaf_first)
        where, pinned, policy = self.where, self.pinned, self.policy
        n = len(keys)
        for i, key in enumerate(keys):
            if where(key) < 0:
                n = i
                break
        held = [k for k in keys[:n] if k not in pinned]
        pinned.update(held)
        link = policy.link if leaf_first and type(policy).link is not Policy.link else None
        observe = policy.observe if type(policy).observe is not Policy.observe else None
        hit, place, hits, touch = self.hit, self.place, self.hits, self.orders[0].touch
        for i in range(n - 1, -1, -1) if leaf_first else range(n):
            key, ref = keys[i], first_ref + i if first_ref >= 0 else -1
            if link is not None:
                link(key, keys[i - 1] if i else None)
            if observe is not None:
                observe(key, now, ref)
            j = where(key)
            if j >= 0:  # (a key repeated in one request may have gone since the lookup)
                hit(j, key, now, ref)
            else:
                self.misses += 1
                place(0, key, now, ref, PREFILL)
        pinned.difference_update(held)
        for i in range(len(keys) - 1, n - 1, -1) if leaf_first else range(n, len(keys)):
            key, ref = keys[i], first_ref + i if first_ref >= 0 else -1
            if link is not None:
                link(key, keys[i - 1] if i else None)
            if observe is not None:
                observe(key, now, ref)
            j = where(key)
            if j == 0:
                hits[0] += 1
                touch(key, now, ref)
            elif j > 0:
                hits[j] += 1
                self.orders[j].touch(key, now, ref)
            else:
                self.misses += 1
                place(0, key, now, ref, PREFILL)
        for order in self.orders:
            if type(order).served is not TierPolicy.served:
                order.served(now)
        return n

    def _one_tier_request(self, keys: Sequence[Hashable], now: float, first_ref: int, leaf_first: bool) -> int:
        """`access_request` for one open tier with none of the hooks overridden (the replay's `--single-tier`):
        the same steps, with `hit`, `place` and `evict` written out in the loop (one tier: a found chunk is
        only touched, a missing one is placed in the tier or refused, a victim just leaves)."""
        only, order, pinned, policy = self.resident[0], self.orders[0], self.pinned, self.policy
        n = found_prefix(keys, only)
        held = [k for k in keys[:n] if k not in pinned]
        pinned.update(held)
        link = policy.link if leaf_first and type(policy).link is not Policy.link else None
        observe = policy.observe if type(policy).observe is not Policy.observe else None
        admit = order.admit if type(order).admit is not TierPolicy.admit else None
        touch, insert, evict, add, drop = order.touch, order.insert, order.evict, only.add, only.remove
        high, low = self.high[0], self.low[0]
        missed = refused = evicted = 0  # every other step found its chunk
        last = len(keys) - 1
        if leaf_first:
            steps = [*range(n - 1, -1, -1), *range(last, n - 1, -1)]
        else:
            steps = range(len(keys))
        for step, i in enumerate(steps):
            if step == n:  # the found prefix is served: its pins go before the rest is stored
                pinned.difference_update(held)
            key, ref = keys[i], first_ref + i if first_ref >= 0 else -1
            if link is not None:
                link(key, keys[i - 1] if i else None)
            if observe is not None:
                observe(key, now, ref)
            if key in only:
                touch(key, now, ref)
                continue
            missed += 1
            if len(only) >= high:
                if admit is None or admit(key, now, ref):
                    victims = evict(len(only) + 1 - low, now, pinned)
                    for victim in victims:
                        drop(victim)
                    evicted += len(victims)
                if len(only) >= high:  # refused, or all that is left is pinned: the only tier has no next
                    refused += 1
                    continue
            add(key)
            insert(key, now, ref)
        if n == len(keys):
            pinned.difference_update(held)
        if type(order).served is not TierPolicy.served:
            order.served(now)
        self.hits[0] += len(keys) - missed
        self.misses += missed
        self.evictions[0] += evicted
        if missed > refused:
            self.moved[PREFILL, self.names[0]] += missed - refused
        return n

    def where(self, key: Hashable) -> int:
        """Index of the fastest tier holding `key`, or -1."""
        for j, resident in enumerate(self.resident):
            if key in resident:
                return j
        return -1

    def hit(self, j: int, key: Hashable, now: float, ref: int = -1) -> None:
        """Count a hit of `key` in tier `j` and promote it to L1 if the policy says so."""
        self.hits[j] += 1
        self.orders[j].touch(key, now, ref)
        if j and self.promote:
            self.place(0, key, now, ref, self.names[j])

    def place(self, j: int, key: Hashable, now: float, ref: int, source: str) -> bool:
        """Make `key` resident in tier `j` (copied from `source`), evicting as the watermarks ask; a refused new
        chunk goes to the next tier. Return whether it was placed in some tier."""
        resident, order = self.resident[j], self.orders[j]
        if key in resident:
            return True
        last = j + 1 == len(self.resident)
        if len(resident) >= self.high[j] or j in self.closed:
            if j not in self.closed and order.admit(key, now, ref):
                for victim in order.evict(len(resident) + 1 - self.low[j], now, self.pinned):
                    self.evict(j, victim, now, ref)
            if len(resident) >= self.high[j] or j in self.closed:  # refused, or all that is left is pinned
                if source == PREFILL and not last:  # write around the tier that refused it
                    return self.place(j + 1, key, now, ref, source)
                return False
        resident.add(key)
        order.insert(key, now, ref)
        self.moved[source, self.names[j]] += 1
        self._placed(source, j, key)
        if self.write_through and not last:
            self.place(j + 1, key, now, ref, self.names[j])
        return True

    def evict(self, j: int, victim: Hashable, now: float, ref: int = -1) -> None:
        """`victim` (already forgotten by tier j's policy) leaves tier j, demoted to the next tier if not there."""
        self.resident[j].remove(victim)
        self.evictions[j] += 1
        if j + 1 < len(self.resident) and victim not in self.resident[j + 1]:
            self.place(j + 1, victim, now, ref, self.names[j])
        self._removed(j, victim)

    def drop(self, j: int, key: Hashable) -> None:
        """Remove `key` from tier `j` without demoting it (invalid data, or already copied elsewhere)."""
        self.resident[j].remove(key)
        self.orders[j].remove(key)
        self._removed(j, key)

    def _placed(self, source: str, j: int, key: Hashable) -> None:
        """Hook: `key` was just copied from `source` into tier `j` (the real cache allocates a slot here)."""

    def _removed(self, j: int, key: Hashable) -> None:
        """Hook: `key` left tier `j`, after any demotion copy of it was placed (its slot may be reused now)."""


def tier_specs(config: TierConfig) -> list[TierSpec]:
    """The enabled tiers of a config as simulation specs."""
    return [
        TierSpec(name, config.capacity_chunks(name), config.tier(name).high_watermark, config.tier(name).low_watermark)
        for name in config.enabled_tiers()
    ]


__all__ = ["PREFILL", "TierSpec", "TierStack", "tier_specs"]
