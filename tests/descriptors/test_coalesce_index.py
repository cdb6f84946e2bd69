"""Errors on merged descriptors name the caller's descriptor (issue 14, item 8): the coalesce layer's mapping."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from datamover import DescList
from datamover.descriptors.coalesce import caller_index_at, coalesce_runs


@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=30))
def test_every_byte_of_a_merged_row_maps_to_the_descriptor_holding_it(rows):
    lengths = np.array([n for n, _ in rows], dtype=np.int64)
    gaps = np.array([gap for _, gap in rows], dtype=np.int64)  # a gap before a row breaks the run
    addr = np.cumsum(np.concatenate(([0], lengths[:-1] + gaps[1:]))) + 4096
    a = DescList.from_columns(addr, lengths, 0, "DRAM")
    b = DescList.from_columns(addr + (1 << 20), lengths, 0, "DRAM")
    regions = np.zeros(len(rows), dtype=np.int64)
    starts, run_lengths = coalesce_runs(a, b, regions, regions)
    for row, (first, total) in enumerate(zip(starts.tolist(), run_lengths.tolist())):
        for offset in range(total):
            got = caller_index_at(starts, lengths, row, offset)
            # the brute-force answer: the descriptor whose [start, end) within the run holds the byte
            pos = offset
            want = first
            while lengths[want] <= pos:
                pos -= lengths[want]
                want += 1
            assert got == want, (row, offset)
        assert caller_index_at(starts, None, row, 7) == first  # nothing merged: the row is the descriptor
