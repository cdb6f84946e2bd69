"""The slot allocator of the cache's tiers: the same slots, in the same order, as a plain list of every slot."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.policy.plan import FreeSlots


class ListSlots:
    """The allocator as it was: a list of every free slot, popped from the end."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def pop(self) -> int:
        return self.free.pop()

    def push(self, slot: int) -> None:
        self.free.append(slot)

    def take(self, slot: int) -> None:
        self.free.remove(slot)


@settings(max_examples=500)
@given(st.integers(1, 40), st.lists(st.tuples(st.sampled_from(["pop", "push", "take"]), st.integers(0, 10**6))))
def test_free_slots_match_a_list_of_every_slot(capacity, ops):
    mine, ref = FreeSlots(capacity), ListSlots(capacity)
    used: list[int] = []
    for op, pick in ops:
        if op == "pop" and ref.free:
            assert mine.peek() == ref.free[-1]
            slot = mine.pop()
            assert slot == ref.pop()
            used.append(slot)
        elif op == "push" and used:
            slot = used.pop(pick % len(used))
            mine.push(slot)
            ref.push(slot)
        elif op == "take" and ref.free:
            slot = ref.free[pick % len(ref.free)]
            mine.take(slot)
            ref.take(slot)
            used.append(slot)
        assert len(mine) == len(ref.free) and bool(mine) == bool(ref.free)
        assert sorted(mine) == sorted(ref.free)
        assert [s for s in range(-1, capacity + 1) if s in mine] == sorted(ref.free)
    if not ref.free:
        with pytest.raises(IndexError):
            mine.pop()


def test_a_huge_tier_costs_nothing_up_front():
    start = time.process_time()
    slots = FreeSlots(1 << 40)  # an index of 4 PiB in 4 KiB chunks
    slots.take(5)
    assert [slots.pop() for _ in range(7)] == [0, 1, 2, 3, 4, 6, 7]
    assert len(slots) == (1 << 40) - 8
    assert time.process_time() - start < 1.0  # a list of every slot would not fit in memory
