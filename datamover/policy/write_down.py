"""Chunks whose copy down to L4 failed on the store's side: kept where the plan allows, else dropped and counted.

By the time a plan runs, the engine has made L4 the chunk's tier: a demoted chunk has left the tier above (its
slot freed, often handed at once to the chunk that pushed it out), while a copy (write-through, a put's publish
to a shared pool, the writes of a shared pool's drain) is also held where it came from. When the write fails
because the store did not answer (a timeout, no connection, a 5xx, Mooncake's RPC_FAIL) or refused it (a 4xx,
another Mooncake status), or the read of its source timed out, the bytes it was read from are not in doubt. The
chunk leaves L4's index and:

1. stays in every other tier that holds it (the copies);
2. else stays in the tier it was leaving, at its own slot, when no later move of the plan writes that slot (an
   eviction down to a low watermark frees more slots than the plan fills);
3. else is copied at once, while its bytes are still there, to a free slot that no move of the plan touches: in
   the tier it was leaving if it has one, else in another open tier, the nearest to L4 first;
4. else is dropped: no tier holds it, and no lookup claims it.

A chunk kept by 2 or 3 enters its tier's policy as a new chunk (the policy forgot it when it evicted it).

A chunk leaving a tier being drained goes only below (drain's contract), and one a put sent to L4 alone has no
tier to stay in: both are dropped. A failed read of the source (from L3, not a timeout) drops its chunk as any
failed move does: its bytes are in doubt.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from .keys import ChunkKey
from .plan import Move, SlotEngine


class WriteDownFailures:
    """Finds each chunk of a failed write to L4 a place by the module's rules, and counts those kept and dropped."""

    def __init__(self, engine: SlotEngine, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        self.l4 = engine.names.index("l4_pool")
        self.kept = 0
        self.dropped = 0

    def place(
        self, move: Move, later: Container[tuple[int, int]], busy: Container[tuple[int, int]]
    ) -> tuple[int, int] | None:
        """Take `move`'s chunk out of L4's index and find it a (tier, slot), already its place in the engine. It
        is `move`'s own source slot (its bytes are there) or a slot to copy them to, then reported to `copied`.
        None: nothing to move (still held elsewhere, or dropped). `later` holds the slots moves after this one
        write, `busy` every slot the plan reads or writes."""
        eng, key = self.engine, move.key
        if key in eng.resident[self.l4] and eng.slots[self.l4].get(key) == move.dst_slot:
            eng.drop(self.l4, key)
        if eng.where(key) >= 0:
            self.kept += 1
            return None
        src = move.src
        if src < 0 or src == self.l4 or src in eng.closed:
            self.dropped += 1
            return None
        now = self.clock()
        if (src, move.src_slot) not in later and move.src_slot in eng.free[src]:
            eng.adopt(src, {key: move.src_slot}, now)
            self.kept += 1
            return src, move.src_slot
        for t in [src, *(t for t in range(self.l4 - 1, -1, -1) if t != src)]:
            if t in eng.closed:
                continue
            slot = next((s for s in eng.free[t] if (t, s) not in busy), None)
            if slot is not None:
                eng.adopt(t, {key: slot}, now)
                return t, slot
        self.dropped += 1
        return None

    def copied(self, key: ChunkKey, tier: int, ok: bool) -> None:
        """The copy `place` asked for ended: the chunk is kept there, or (`ok` False) dropped from it."""
        if ok:
            self.kept += 1
            return
        if key in self.engine.resident[tier]:
            self.engine.drop(tier, key)
        self.dropped += 1

    def counts(self) -> dict[str, int]:
        """Chunks of failed writes to L4 kept in some tier, and dropped (as `stats()` reports them)."""
        return {"kept": self.kept, "dropped": self.dropped}
