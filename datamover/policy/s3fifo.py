"""`s3fifo`: S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

New chunks enter the small queue S (10% of the tier); a chunk whose key is in the ghost queue G enters the
main queue M. Each resident chunk counts its uses (0..3). Evicting from S: a chunk used since it came in moves
to M, one that was not leaves and its key goes to G (quick demotion of one-hit wonders). Evicting from M: a
chunk with uses left goes back to M's head with one use fewer (a 2-bit CLOCK), else it leaves. S is evicted
from while it holds at least its share, M otherwise. G remembers as many keys as M holds chunks (90%).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence

from .base import Key, Policy, PolicySettings, TierPolicy, found_prefix

SMALL_RATIO = 0.1  # the paper's size of S
MAX_FREQ = 3  # two bits of use count
MOVE_THRESHOLD = 1  # uses in S that earn a place in M


class S3FIFOTier(TierPolicy):
    """S3-FIFO over one tier; queues are OrderedDicts whose first key is the oldest (the tail)."""

    def __init__(self, capacity: int, small_ratio: float = SMALL_RATIO) -> None:
        super().__init__(capacity)
        self.small: OrderedDict[Key, None] = OrderedDict()
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}
        self.small_size = max(1, round(capacity * small_ratio))
        self.ghost_size = max(1, capacity - self.small_size)

    def insert(self, key: Key, now: float, ref: int = -1) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def touch(self, key: Key, now: float, ref: int = -1) -> None:
        f = self.freq[key]
        if f < MAX_FREQ:
            self.freq[key] = f + 1

    def remove(self, key: Key) -> None:
        del self.freq[key]
        if key in self.small:
            del self.small[key]
        else:
            del self.main[key]

    def _evict_small(self, pinned: Container[Key]) -> Key | None:
        small, freq = self.small, self.freq
        for _ in range(len(small)):
            key = small.popitem(last=False)[0]
            if key in pinned:
                small[key] = None
            elif freq[key] >= MOVE_THRESHOLD:
                self.main[key] = None
                freq[key] = 0
                if len(self.main) > self.capacity - self.small_size:  # M is full: it gives up a chunk
                    victim = self._evict_main(pinned)
                    if victim is not None:
                        return victim
            else:
                del freq[key]
                self.ghost[key] = None
                if len(self.ghost) > self.ghost_size:
                    self.ghost.popitem(last=False)
                return key
        return None

    def _evict_main(self, pinned: Container[Key]) -> Key | None:
        main, freq = self.main, self.freq
        for _ in range(MAX_FREQ * len(main) + len(main)):
            if not main:
                break
            key = next(iter(main))
            f = freq[key]
            if key in pinned or f > 0:
                main.move_to_end(key)
                if f > 0:
                    freq[key] = f - 1
                continue
            del main[key], freq[key]
            return key
        return None

    def _evict_one(self, pinned: Container[Key]) -> Key | None:
        """The next victim: from the small queue once it is full (or the main one is empty), else from the main."""
        key = None
        if len(self.small) >= self.small_size or not self.main:
            key = self._evict_small(pinned)
        if key is None:
            key = self._evict_main(pinned)
        if key is None:
            key = self._evict_small(pinned)
        return key

    def evict(self, count: int, now: float, pinned: Container[Key] = ()) -> list[Key]:
        out: list[Key] = []
        while len(out) < count and (key := self._evict_one(pinned)) is not None:
            out.append(key)
        return out

    def evict_avoiding(self, avoid: Container[Key], tries: int, now: float, pinned: Container[Key] = ()) -> Key | None:
        """`evict(1)`, then while the victim is in `avoid` and tries remain, `restore` it and `evict(1)` again:
        the same steps in one call (the default's leaf guard asks this for every chunk it evicts)."""
        while True:
            key = self._evict_one(pinned)
            if key is None or tries <= 0 or key not in avoid:
                return key
            tries -= 1
            self.restore(key, now)

    def ref(self, key: Key, now: float) -> bool:
        freq = self.freq
        f = freq.get(key)
        if f is not None:
            if f < MAX_FREQ:
                freq[key] = f + 1
            return True
        if len(freq) >= self.capacity:  # `evict(1)`, written out
            victim = None
            if len(self.small) >= self.small_size or not self.main:
                victim = self._evict_small(())
            if victim is None and self._evict_main(()) is None:
                self._evict_small(())
        ghost = self.ghost  # `insert`, written out (after the eviction, which may push `key` out of the ghosts)
        if key in ghost:
            del ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        freq[key] = 0
        return False

    def ref_request(self, keys: Sequence[Key], now: float) -> list[int]:
        """`TierPolicy.ref_request` with `ref` written out (the default's shadows run this per request)."""
        freq, small, main, ghost = self.freq, self.small, self.main, self.ghost
        n = found_prefix(keys, freq)
        hits = [*range(n - 1, -1, -1)]
        for i in hits:
            key = keys[i]
            f = freq[key]
            if f < MAX_FREQ:
                freq[key] = f + 1
        capacity, small_size = self.capacity, self.small_size
        for i in range(len(keys) - 1, n - 1, -1):
            key = keys[i]
            f = freq.get(key)
            if f is not None:
                if f < MAX_FREQ:
                    freq[key] = f + 1
                hits.append(i)
                continue
            if len(freq) >= capacity:
                victim = None
                if len(small) >= small_size or not main:
                    victim = self._evict_small(())
                if victim is None and self._evict_main(()) is None:
                    self._evict_small(())
            if key in ghost:
                del ghost[key]
                main[key] = None
            else:
                small[key] = None
            freq[key] = 0
        return hits

    def holds(self, key: Key) -> bool:
        return key in self.freq

    def adopt(self, keys: list[Key], counts: Mapping[Key, int] | None = None) -> None:
        """Take over resident chunks, oldest first, into the main queue (a policy switch), each with the uses
        beyond its first that `counts` gives (at most 3)."""
        counts = counts or {}
        for key in keys:
            self.main[key] = None
            self.freq[key] = min(MAX_FREQ, max(0, counts.get(key, 0) - 1))

    def assume(self, shadow: S3FIFOTier, resident: list[Key]) -> None:
        """Take over `resident` (oldest first) in the queues and with the use counts that `shadow`, an S3-FIFO
        cache of this size fed the same references, gives them; the chunks it does not hold (it would have
        evicted them) go to the tail of the small queue with no uses, so they leave first. Its ghosts come too."""
        held = shadow.freq
        for key in resident:
            if key not in held:
                self.small[key] = None
                self.freq[key] = 0
        wanted = set(resident)
        for queue, mine in ((shadow.small, self.small), (shadow.main, self.main)):
            for key in queue:
                if key in wanted:
                    mine[key] = None
                    self.freq[key] = held[key]
        for key in shadow.ghost:
            if key not in wanted:
                self.ghost[key] = None

    def __len__(self) -> int:
        return len(self.freq)


class S3FIFOPolicy(Policy):
    """S3-FIFO in every tier (S at 10%, as the paper); admits everything."""

    name = "s3fifo"

    def __init__(self, settings: PolicySettings | None = None) -> None:
        """S3-FIFO's constants are the paper's; the argument keeps every policy constructible the same way."""

    def tier(self, capacity: int) -> TierPolicy:
        return S3FIFOTier(capacity)
