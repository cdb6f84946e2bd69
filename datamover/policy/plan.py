"""The cache's plan: the tier engine's decisions recorded as slot-to-slot moves, and their order of execution.

`SlotEngine` is the `TierStack` the replay simulates, with slots: each placement allocates a slot of the tier's
slab and appends a `Move` (from the caller's buffer, or from the slot the chunk is copied from); each removal
frees the slot. `levels` orders a plan so that moves of one level touch no slot another move of the level
reads or writes, and can run as one batch per (source, destination) pair.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .config import TierConfig
from .engine import PREFILL, TierStack, tier_specs
from .keys import ChunkKey
from .policies import PolicySettings, make_policy

USER = -1  # a plan endpoint meaning the caller's buffer (the source of put, the destination of get)
STAGE = -2  # the host staging area


@dataclass(frozen=True)
class Move:
    """Copy chunk `key` from slot `src_slot` of `src` to slot `dst_slot` of `dst` (tier indices, USER, STAGE)."""

    key: ChunkKey
    src: int
    src_slot: int
    dst: int
    dst_slot: int


class FreeSlots:
    """The free slots of a tier of `capacity`, handed out lowest first, then the last freed first.

    Slots never handed out are a range, not a list: an L4 index of 1 TiB in 4 KiB chunks has 2**28 slots.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next = 0  # every slot from here up is free, but those in _taken
        self._taken: set[int] = set()  # slots at or above _next adopted (free again only if in _freed)
        self._freed: list[int] = []  # slots given back, the last one first out

    def __len__(self) -> int:
        return len(self._freed) + self.capacity - self._next - len(self._taken)

    def __iter__(self) -> Iterator[int]:
        yield from self._freed
        yield from (s for s in range(self._next, self.capacity) if s not in self._taken)

    def __contains__(self, slot: object) -> bool:
        if not isinstance(slot, int) or not 0 <= slot < self.capacity:
            return False
        return (slot >= self._next and slot not in self._taken) or slot in self._freed

    def peek(self) -> int:
        """The slot `pop` gives next (IndexError if none is free)."""
        if self._freed:
            return self._freed[-1]
        while self._next in self._taken:
            self._taken.remove(self._next)
            self._next += 1
        if self._next >= self.capacity:
            raise IndexError("no free slot")
        return self._next

    def pop(self) -> int:
        slot = self.peek()
        if self._freed:
            self._freed.pop()
        else:
            self._next += 1
        return slot

    def push(self, slot: int) -> None:
        """Give back a slot that was in use."""
        self._freed.append(slot)

    def take(self, slot: int) -> None:
        """Mark a free slot in use (a chunk found again at it)."""
        if slot >= self._next and slot not in self._taken:
            self._taken.add(slot)
        elif self._freed and self._freed[-1] == slot:
            self._freed.pop()
        else:
            self._freed.remove(slot)


class SlotEngine(TierStack):
    """The policy's decisions recorded as slot moves; slots are allocated and freed as chunks come and go.

    `on_removed(tier, key, slot)` is called when a chunk's slot is freed (after any demotion copy was planned).
    """

    def __init__(self, config: TierConfig, on_removed: Callable[[int, ChunkKey, int], None]) -> None:
        policy = make_policy(config.policy.name, PolicySettings.from_config(config))
        super().__init__(
            policy, tier_specs(config), config.policy.promote_on_hit, config.policy.write_mode == "write_through"
        )
        self.on_removed = on_removed
        self.slots: list[dict[ChunkKey, int]] = [{} for _ in self.specs]
        self.free = [FreeSlots(t.capacity) for t in self.specs]
        self.plan: list[Move] = []
        self.user_index: dict[ChunkKey, int] = {}
        self.origin: dict[tuple[int, ChunkKey], tuple[int, int]] = {}  # put from the caller in this plan

    def _placed(self, source: str, j: int, key: ChunkKey) -> None:
        slot = self.free[j].pop()
        self.slots[j][key] = slot
        if source == PREFILL:
            src = (USER, self.user_index[key])
        else:  # a chunk copied from the caller earlier in this plan is copied from the caller again
            t = self.names.index(source)
            src = self.origin.get((t, key), (t, self.slots[t][key]))
        if src[0] == USER:
            self.origin[j, key] = src
        self.plan.append(Move(key, src[0], src[1], j, slot))

    def _removed(self, j: int, key: ChunkKey) -> None:
        slot = self.slots[j].pop(key)
        self.free[j].push(slot)
        self.on_removed(j, key, slot)

    def release_slots(self, j: int) -> None:
        """Free the slots tier j still keeps for chunks that already left it (a drained tier, once the copies out
        of those slots have run)."""
        for key in list(self.slots[j]):
            self._removed(j, key)

    def adopt(self, j: int, slots: dict[ChunkKey, int], now: float) -> None:
        """Make each key resident in tier j at its slot without a move (found again in a persistent tier)."""
        for key, slot in slots.items():
            self.resident[j].add(key)
            self.orders[j].insert(key, now)
            self.slots[j][key] = slot
        for slot in slots.values():
            self.free[j].take(slot)

    def adopt_shared(self, j: int, keys: Sequence[ChunkKey], now: float) -> None:
        """Enter chunks no tier holds into tier j's index without a move (a shared pool holds them), forgetting
        the index's least valued entries if it is full (the pool keeps them: forgetting moves no byte)."""
        for key in keys:
            if self.where(key) >= 0:
                continue
            if not self.free[j]:
                for victim in self.orders[j].evict(1, now, self.pinned):
                    self.evict(j, victim, now)
                if not self.free[j]:
                    continue  # everything indexed is pinned: read as a miss
            self.adopt(j, {key: self.free[j].peek()}, now)

    def take_plan(self) -> list[Move]:
        """The moves planned since the last call, in order."""
        plan, self.plan = self.plan, []
        self.origin.clear()
        return plan


def levels(plan: list[Move]) -> list[dict[tuple[int, int], list[Move]]]:
    """The plan by level, each level's moves grouped by (source, destination): a move's level is one more than
    that of any earlier move whose slot it reads, writes or overwrites, so moves of one level are independent."""
    written: dict[tuple[int, int], int] = {}
    read: dict[tuple[int, int], int] = {}
    out: list[dict[tuple[int, int], list[Move]]] = []
    for m in plan:
        r, w = (m.src, m.src_slot), (m.dst, m.dst_slot)
        level = max(written.get(r, -1), written.get(w, -1), read.get(w, -1)) + 1
        read[r] = max(read.get(r, -1), level)
        written[w] = level
        if level == len(out):
            out.append(defaultdict(list))
        out[level][m.src, m.dst].append(m)
    return out
