"""The requests a TieredCache's policy sees, as the replay's: reference indexes, the request a get opened (and
the put of its missing chunks that ends it), and keys handed to the policy last chunk first, each linked to the
chunk before it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .base import Policy, TierPolicy
from .keys import ChunkKey
from .plan import SlotEngine


class Requests:
    """The reference index so far and the open request: (its keys, first reference index, time, chunks delivered)."""

    def __init__(self, engine: SlotEngine) -> None:
        self.engine = engine
        self.refs = 0  # references handed to the policy so far (what a replay's reference index counts)
        self.open: tuple[list[ChunkKey], int, float, int] | None = None

    def begin(self, keys: Sequence[ChunkKey], now: float, delivered: int) -> int:
        """Open a new request of `keys` (any request still open is done first); its first reference index."""
        self.served()
        first = self.refs
        self.refs += len(keys)
        self.open = (list(keys), first, now, delivered)
        return first

    def continued(self, keys: Sequence[ChunkKey], now: float) -> tuple[int, ChunkKey | None]:
        """The reference index of `keys[0]` and its parent: where it stands in the request the last get opened
        when `keys` end that request's keys after the prefix it delivered, else as the first chunk of a new
        request (any other request still open is done first)."""
        if self.open is not None:
            request, first, _, delivered = self.open
            at = len(request) - len(keys)
            if at >= delivered and request[at:] == list(keys):
                return first + at, request[at - 1] if at else None
        return self.begin(keys, now, 0), None

    def served(self) -> None:
        """Tell every tier's policy that the open request (if any) is done (`TierPolicy.served`, at its time)."""
        if self.open is None:
            return
        when = self.open[2]
        self.open = None
        for order in self.engine.orders:
            if type(order).served is not TierPolicy.served:
                order.served(when)

    def observed(
        self, keys: Sequence[ChunkKey], parent: ChunkKey | None, now: float, first: int
    ) -> Iterator[tuple[int, ChunkKey, int]]:
        """Hand `keys` (reference indexes from `first`) to the policy as the replay does, last chunk first so the
        first ends most recent, each linked to the chunk before it (`parent` for keys[0]) where the policy uses
        links; yields (i, key, the tier holding it or -1) after each, for the caller's hit or placement."""
        eng = self.engine
        policy = eng.policy
        link = policy.link if type(policy).link is not Policy.link else None
        observe = policy.observe
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if link is not None:
                link(key, keys[i - 1] if i else parent)
            observe(key, now, first + i)
            yield i, key, eng.where(key)
