"""Errors on merged descriptors name the caller's descriptor (issue 14, item 8): the coalesce layer's mapping."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from datamover import DescList
from datamover.descriptors.coalesce import caller_index_at, coalesce_runs, first_cross_overlap


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


_rows = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), min_size=1, max_size=12)


@given(_rows, _rows)
def test_first_cross_overlap_finds_a_pair_exactly_when_one_overlaps(src_rows, dst_rows):
    """Against the brute force over every pair: a pair is found exactly when some non-empty source row and some
    destination row share a byte, the source row is the first such, and the pair found does share one."""
    src = DescList.from_columns([a for a, _ in src_rows], [n for _, n in src_rows], 0, "DRAM")
    dst = DescList.from_columns([a for a, _ in dst_rows], [n for _, n in dst_rows], 0, "DRAM")

    def shares(i, j):
        (a, n), (b, m) = src_rows[i], dst_rows[j]
        return n > 0 and m > 0 and a < b + m and b < a + n

    want = [i for i in range(len(src_rows)) if any(shares(i, j) for j in range(len(dst_rows)))]
    got = first_cross_overlap(src, dst)
    if not want:
        assert got is None
    else:
        assert got is not None and got[0] == want[0] and shares(*got), got
