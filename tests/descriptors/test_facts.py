"""A DescList's facts (block, device, bounds, sorted_addr, adjacent) and the shortcuts built on them.

Each fact and each shortcut is checked against the plain definition or the general path it stands in for.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover import DescList
from datamover.descriptors.coalesce import coalesce_runs, first_overlap
from datamover.errors import InvalidDescriptor

rows_st = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 8), st.integers(0, 1)), max_size=20)


def _facts(d: DescList) -> tuple:
    return d.block, d.device, d.bounds, d.sorted_addr.tolist(), d.adjacent.tolist()


def _brute(rows: list[tuple[int, int, int]]) -> tuple:
    lengths, devs = {r[1] for r in rows}, {r[2] for r in rows}
    return (
        lengths.pop() if len(lengths) == 1 else None,
        devs.pop() if len(devs) == 1 else None,
        (min(r[0] for r in rows), max(r[0] + r[1] for r in rows)) if rows else None,
        sorted(r[0] for r in rows),
        [rows[i + 1][0] == rows[i][0] + rows[i][1] for i in range(len(rows) - 1)],
    )


@given(rows_st)
def test_facts_match_their_definitions(rows):
    assert _facts(DescList(np.array(rows, dtype=np.int64).reshape(-1, 3), "DRAM")) == _brute(rows)


@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40), st.integers(0, 1 << 20), st.integers(0, 3))
def test_from_columns_shortcut_builds_what_the_constructor_builds(addrs, length, dev):
    addr = np.array(addrs, dtype=np.int64)
    fast = DescList.from_columns(addr, length, dev)
    rows = [(a, length, dev) for a in addrs]
    assert fast == DescList(np.array(rows, dtype=np.int64), "DRAM")
    assert _facts(fast) == _brute(rows)
    assert not fast.rows.flags.writeable and not fast.sorted_addr.flags.writeable


def test_from_columns_shortcut_leaves_bad_and_large_values_to_the_general_checks():
    with pytest.raises(InvalidDescriptor, match="negative"):
        DescList.from_columns(np.array([5, -1], dtype=np.int64), 8)
    with pytest.raises(InvalidDescriptor, match="overflows"):
        DescList.from_columns(np.array([0, (1 << 63) - 4], dtype=np.int64), 8)
    big = DescList.from_columns(np.array([1 << 62, 3], dtype=np.int64), 8)  # valid, past the shortcut's range
    assert big.rows.tolist() == [[1 << 62, 8, 0], [3, 8, 0]] and big.bounds == (3, (1 << 62) + 8)
    many = DescList.from_columns(np.arange(5000, dtype=np.int64)[::-1] * 16, 16)  # past SMALL_LIST: no sort made
    assert many.bounds == (0, 4999 * 16 + 16) and many.block == 16


@given(st.lists(st.integers(0, 400), max_size=25), st.integers(1, 20), st.integers(0, 1))
def test_first_overlap_of_equal_blocks_matches_bruteforce(addrs, block, dev):
    d = DescList.from_columns(np.array(addrs, dtype=np.int64), block, dev) if addrs else DescList([], "DRAM")
    pairs = [
        (i, j)
        for i in range(len(addrs))
        for j in range(i + 1, len(addrs))
        if addrs[i] < addrs[j] + block and addrs[j] < addrs[i] + block
    ]
    found = first_overlap(d)
    assert (found in pairs) if pairs else found is None


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=20), st.integers(1, 4))
def test_coalescing_of_equal_blocks_in_one_region_matches_the_general_path(gaps, block):
    la, lb, a, b = [], [], 0, 1000
    for ga, gb in gaps:  # a gap of 0 on both sides makes rows that merge
        a, b = a + (ga % 3) * block, b + (gb % 3) * block
        la.append(a)
        lb.append(b)
        a, b = a + block, b + block
    if not la:
        return
    x = DescList.from_columns(np.array(la, dtype=np.int64), block)
    y = DescList.from_columns(np.array(lb, dtype=np.int64), block)
    same = np.zeros(len(la), dtype=np.int64)
    fast = coalesce_runs(x, y, None, None, one_region=True)
    general = coalesce_runs(DescList(x.rows.copy(), "DRAM"), DescList(y.rows.copy(), "DRAM"), same, same)
    assert fast[0].tolist() == general[0].tolist() and fast[1].tolist() == general[1].tolist()
