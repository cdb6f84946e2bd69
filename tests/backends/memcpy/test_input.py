"""memcpy and input it cannot copy as asked: parameters out of range, sources that overlap destinations."""

from __future__ import annotations

import numpy as np
import pytest

from datamover import Agent, DescList
from datamover.errors import InvalidParameter, OverlappingDestination


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_below_one_are_refused_when_the_backend_starts(threads):
    """The pool cannot have no thread: a ValueError from ThreadPoolExecutor came out of the first transfer."""
    with Agent("m", {"backends": {"memcpy": {"threads": threads}}}) as agent:
        with pytest.raises(InvalidParameter, match="threads") as info:
            agent.backend("memcpy")
        assert info.value.backend == "memcpy"


@pytest.mark.parametrize("block", [4 << 10, 128 << 10], ids=["gather", "memmove"])
@pytest.mark.parametrize("params", [{}, {"inline_bytes": 0, "min_part_bytes": 1}], ids=["inline", "pool"])
def test_a_source_row_overlapping_another_rows_destination_is_refused(block, params):
    """Rows 0 -> 1 and 1 -> 3 (in blocks, one region): row 1 reads what row 0 writes. What landed in block 3
    depended on the path (gather or memmove, inline or pool) and, across threads, on timing; it is refused,
    naming the destination descriptor, before anything is copied."""
    with Agent("m", {"backends": {"memcpy": params}}) as agent:
        mem = np.repeat(np.arange(8, dtype=np.uint8), block)
        agent.register_memory(mem)
        before = mem.copy()
        src = DescList.from_columns(mem.ctypes.data + np.array([0, 1]) * block, block)
        dst = DescList.from_columns(mem.ctypes.data + np.array([1, 3]) * block, block)
        with pytest.raises(OverlappingDestination, match="source descriptor 1") as info:
            agent.transfer("WRITE", src, dst)
        assert info.value.index == 0 and info.value.backend == "memcpy", str(info.value)
        assert np.array_equal(mem, before)
        # rows that overlap no destination are copied
        agent.transfer("WRITE", src, DescList.from_columns(mem.ctypes.data + np.array([4, 6]) * block, block)).wait()
        assert [int(mem[k * block]) for k in range(8)] == [0, 1, 2, 3, 0, 5, 1, 7]
