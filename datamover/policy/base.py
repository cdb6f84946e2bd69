"""The policy contract: a `Policy` is the shared brain of one cache, a `TierPolicy` orders one tier's chunks.

The Policy sees every reference once (`observe`) and hands each tier a `TierPolicy` that orders that tier's
resident chunks. The cache (or the replay simulator) owns the tiers and asks the tier policy three questions:
may this chunk come in (`admit`), which chunks leave (`evict`), and it reports what happened (`insert`,
`touch`, `remove`). The engine presents the chunks of one request leaf first (deepest chunk first, the
request's first chunk last), so a policy ordered by recency keeps prefixes whole, as a radix tree does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .config import PolicyConfig, TierConfig

Key = Hashable
NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class PolicySettings:
    """What a policy may be tuned by (from the `policy:` section and l2_dram.hysteresis_cooldown_s)."""

    half_life_s: float = 300.0
    history_factor: float = 8.0
    cooldown_s: float = 5.0
    admission: bool = True

    @classmethod
    def from_config(cls, config: TierConfig) -> PolicySettings:
        """Settings as the tier config gives them."""
        p: PolicyConfig = config.policy
        return cls(p.half_life_s, p.history_factor, config.l2_dram.hysteresis_cooldown_s, p.admission)


class TierPolicy(ABC):
    """Orders the resident chunks of one tier. The owner keeps the chunks; this keeps only their order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        """`key` became resident at time `now` (reference index `ref` in a replay)."""

    @abstractmethod
    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        """Resident `key` was used."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Resident `key` left the tier for a reason of the owner's (not chosen by `evict`)."""

    @abstractmethod
    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        """Choose up to `count` resident chunks to leave, never a pinned one, forget them and return them."""

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, key: Key, now: float, ref: int = -1) -> bool:
        """Whether `key` may replace a resident chunk of this full tier (True: admission control off)."""
        return True

    def served(self, now: float) -> None:
        """The request whose chunks this tier was just told about (`insert`, `touch`) is done. The engine calls
        this after each `access_request` and `access`; an owner that passes reference indexes (`ref` >= 0) must
        too, since a policy may hold a request's references until then (default: nothing to do)."""

    def restore(self, key: Key, now: float) -> None:
        """Take back the chunk `evict` just gave up, as just used (default: as a newly inserted chunk)."""
        self.insert(key, now)

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """One victim: `evict(1)`, then, while the victim is in `avoid` and tries remain, `restore` it and
        `evict(1)` again (None if nothing can leave). Policies may do the same steps faster."""
        got = self.evict(1, now, pinned)
        while got and tries > 0 and got[0] in avoid:
            tries -= 1
            self.restore(got[0], now)
            got = self.evict(1, now, pinned)
        return got[0] if got else None

    def ref(self, key: Key, now: float) -> bool:
        """One reference to a key-only cache of `capacity` chunks run by this policy (a shadow cache): whether
        it hit; a miss comes in, evicting one chunk if the cache is full and admission lets it in."""
        if self.holds(key):
            self.touch(key, now)
            return True
        if len(self) >= self.capacity:
            if not self.admit(key, now):
                return False
            self.evict(1, now)
        self.insert(key, now)
        return False

    def ref_request(self, keys: Sequence[Key], now: float) -> list[int]:
        """One request's references to a key-only cache (`ref`), in the order the engine hands a request to a
        tier that holds what this one holds: the found prefix last chunk first, then the rest last chunk first.
        Returns the positions in `keys` that hit. Policies may take the same steps faster."""
        ref = self.ref
        return [i for i in served_order(keys, self.holds) if ref(keys[i], now)]

    def holds(self, key: Key) -> bool:
        """Whether `key` is resident (for `ref`; the owner of a real tier keeps its own set)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run as a shadow cache")


class Policy(ABC):
    """One cache's policy: sees every reference (`observe`) and makes a TierPolicy per tier."""

    name = "policy"

    @abstractmethod
    def tier(self, capacity: int) -> TierPolicy:
        """A fresh TierPolicy for a tier of `capacity` chunks."""

    def observe(self, key: Key, now: float, ref: int = -1) -> None:
        """Every reference, once, before the cache looks the key up (default: nothing to learn)."""

    def link(self, key: Key, parent: Key | None) -> None:
        """The chunk before `key` in the request being served (None for a request's first chunk), told just
        before `observe`, for policies that use the prefix structure (default: ignored)."""


def found_prefix(keys: Sequence[Key], held: Container[Key]) -> int:
    """How many of a request's `keys`, from its first, `held` contains without a gap (its found prefix)."""
    for i, key in enumerate(keys):
        if key not in held:
            return i
    return len(keys)


def served_order(keys: Sequence[Key], holds: Callable[[Key], bool]) -> list[int]:
    """Positions of a request's chunks (first to last) in the order the engine hands them to a tier that holds
    what `holds` says: the found prefix last chunk first, then the rest last chunk first."""
    n = len(keys)
    for i, key in enumerate(keys):
        if not holds(key):
            n = i
            break
    return [*range(n - 1, -1, -1), *range(len(keys) - 1, n - 1, -1)]


def first_unpinned(order, pinned: Container[Key]) -> Key | None:
    """The first key of an iterable order that is not pinned (None if all are)."""
    for key in order:
        if key not in pinned:
            return key
    return None


__all__ = ["NEVER", "Key", "Policy", "PolicySettings", "TierPolicy", "first_unpinned", "found_prefix", "served_order"]
