"""StridedDescList: runs of equal blocks, one (addr, len, dev, stride, count) row per run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover.descriptors import MemType, StridedDescList
from datamover.errors import InvalidDescriptor


def naive(runs) -> list[tuple[int, int, int]]:
    return [(a + k * s, n, d) for a, n, d, s, c in runs for k in range(c)]


def test_layer_wise_layout_is_one_row_per_block_run():
    # 4 layers of 8 blocks each, 1 KiB blocks, layer stride 1 MiB: block b of every layer is one run
    layers, blocks, block, layer_stride = 4, 8, 1024, 1 << 20
    runs = [(0x10000 + b * block, block, 0, layer_stride, layers) for b in range(blocks)]
    s = StridedDescList(runs, "DRAM")
    assert isinstance(s, StridedDescList) and s.runs.shape == (blocks, 5)
    assert len(s) == layers * blocks and s.nbytes == layers * blocks * block
    assert s.expand().rows.tolist() == [list(r) for r in naive(runs)]
    # flat index 5 is block 1's layer 1
    assert s.select([5]).rows.tolist() == [[0x10000 + block + layer_stride, block, 0]]
    assert s.spans().rows.tolist()[0] == [0x10000, layer_stride * (layers - 1) + block, 0]


def test_select_out_of_range_and_empty_runs():
    s = StridedDescList.from_columns([100, 900], 10, 0, [20, 0], [3, 0], MemType.DRAM)
    assert len(s) == 3 and len(s.spans()) == 1
    with pytest.raises(IndexError, match="block index 3"):
        s.select([0, 3])
    with pytest.raises(IndexError):
        s.select([-1])
    assert len(StridedDescList(np.zeros((0, 5), dtype=np.int64), "VRAM")) == 0


@pytest.mark.parametrize(
    "row",
    [
        [-1, 8, 0, 8, 1],
        [0, 8, 0, -8, 2],
        [0, 8, 0, 8, -1],
        [2**62, 8, 0, 2**61, 3],  # the last block ends past int64
        [0, 2**62, 0, 2**62, 3],
    ],
)
def test_bad_rows_are_refused(row):
    with pytest.raises(InvalidDescriptor):
        StridedDescList(np.array([row], dtype=np.int64), "DRAM")


def test_shape_and_dtype_checked():
    with pytest.raises(InvalidDescriptor, match=r"\(N, 5\)"):
        StridedDescList(np.zeros((2, 3), dtype=np.int64), "DRAM")
    with pytest.raises(InvalidDescriptor, match="integers"):
        StridedDescList(np.zeros((2, 5)), "DRAM")


runs_st = st.lists(
    st.tuples(
        st.integers(0, 2**40), st.integers(0, 2**16), st.integers(0, 7), st.integers(0, 2**20), st.integers(0, 6)
    ),
    max_size=12,
)


@given(runs=runs_st, data=st.data())
def test_select_matches_the_naive_expansion(runs, data):
    s = StridedDescList(np.array(runs, dtype=np.int64).reshape(-1, 5), "DRAM")
    flat = naive(runs)
    assert len(s) == len(flat)
    if not flat:
        return
    idx = data.draw(st.lists(st.integers(0, len(flat) - 1), max_size=20))
    assert [tuple(r) for r in s.select(idx).rows.tolist()] == [flat[i] for i in idx]


@pytest.mark.parametrize("indices", [np.array([False, True, False]), [1.7], np.array([0.0, 2.0])])
def test_select_refuses_indices_that_are_not_integers(indices):
    """A boolean mask was taken as the indices 0 and 1, and 1.7 as 1: the wrong blocks, silently."""
    s = StridedDescList.from_columns(100, 10, 0, 20, 3, MemType.DRAM)
    with pytest.raises(IndexError, match="integers"):
        s.select(indices)
