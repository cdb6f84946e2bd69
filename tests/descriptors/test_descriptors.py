"""DescList construction, indexing, validation and coalescing."""

import mmap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from datamover import DescList, MemType
from datamover.descriptors import Registration, StridedDescList
from datamover.descriptors.coalesce import coalesce_runs, first_overlap, take_runs
from datamover.errors import InvalidDescriptor

rows_strategy = arrays(
    np.int64,
    st.tuples(st.integers(0, 50), st.just(3)),
    elements=st.integers(0, 2**40),
)


@given(rows_strategy)
def test_rows_roundtrip_and_columns(rows):
    d = DescList(rows, "DRAM")
    assert len(d) == rows.shape[0]
    assert np.array_equal(d.rows, rows)
    assert np.array_equal(d.addr, rows[:, 0]) and np.array_equal(d.length, rows[:, 1])
    assert np.array_equal(d.dev, rows[:, 2])
    assert d.nbytes == int(rows[:, 1].sum())
    assert list(d) == [tuple(int(v) for v in r) for r in rows]


@given(rows_strategy, st.data())
def test_index_array_and_slice_match_numpy(rows, data):
    d = DescList(rows, MemType.FILE)
    n = len(d)
    idx = np.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=20) if n else st.just([])), dtype=int)
    assert np.array_equal(d[idx].rows, rows[idx])
    assert np.array_equal(d[1:5].rows, rows[1:5])
    assert d[idx].mem_type == MemType.FILE
    if n:
        assert d[0] == tuple(int(v) for v in rows[0])


def test_immutable():
    d = DescList([[0, 10, 0]], "DRAM")
    with pytest.raises(ValueError):
        d.rows[0, 0] = 5
    with pytest.raises(ValueError):
        d.addr[0] = 5


@given(st.lists(st.tuples(st.integers(-(2**40), 2**40), st.integers(-5, 2**40), st.integers(-2, 8)), max_size=10))
def test_negative_fields_rejected_with_index(rows):
    arr = np.array(rows, dtype=np.int64).reshape(-1, 3)
    bad = np.flatnonzero((arr < 0).any(axis=1))
    if bad.size:
        with pytest.raises(InvalidDescriptor) as info:
            DescList(arr, "DRAM")
        assert info.value.index == int(bad[0])
    else:
        assert len(DescList(arr, "DRAM")) == len(rows)


@pytest.mark.parametrize("bad", [np.zeros((2, 2), dtype=np.int64), np.zeros((2, 3), dtype=float), [[1, 2]]])
def test_bad_shapes_and_dtypes(bad):
    with pytest.raises(InvalidDescriptor):
        DescList(bad, "DRAM")


def test_unknown_memtype():
    with pytest.raises(ValueError, match="unknown memory type"):
        DescList([[0, 1, 0]], "HBM3")
    assert MemType.parse("cpu") is MemType.DRAM and MemType.parse("vram") is MemType.VRAM


def test_from_buffers_kinds():
    a = np.zeros(100, dtype=np.float32)
    b = bytearray(33)
    m = mmap.mmap(-1, 4096)
    v = memoryview(bytearray(7))
    d = DescList.from_buffers([a, b, m, v])
    assert d.mem_type == MemType.DRAM
    assert d.length.tolist() == [400, 33, 4096, 7]
    assert d.addr[0] == a.ctypes.data
    assert d.addr[1] == np.frombuffer(b, dtype=np.uint8).ctypes.data


def test_from_buffers_torch():
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.int64)
    d = DescList.from_buffers(t)
    assert d[0] == (t.data_ptr(), 80, 0) and d.mem_type == MemType.DRAM
    with pytest.raises(InvalidDescriptor, match="not contiguous"):
        DescList.from_buffers(torch.zeros(4, 4).t())


def test_refuses_noncontiguous_and_readonly():
    a = np.zeros((10, 10))
    with pytest.raises(InvalidDescriptor, match="not contiguous"):
        DescList.from_buffers(a[:, ::2])
    ro = np.zeros(10)
    ro.setflags(write=False)
    with pytest.raises(InvalidDescriptor, match="read-only"):
        DescList.from_buffers(ro)
    with pytest.raises(InvalidDescriptor, match="immutable"):
        DescList.from_buffers(b"abc")
    with pytest.raises(InvalidDescriptor) as info:
        DescList.from_buffers([np.zeros(3), object()])
    assert info.value.index == 1


@given(st.integers(1, 10_000), st.integers(1, 5000))
def test_blocks_cover_buffer(nbytes, block):
    buf = np.zeros(nbytes, dtype=np.uint8)
    d = DescList.blocks(buf, block)
    assert d.nbytes == nbytes
    assert len(d) == -(-nbytes // block)
    assert (d.length[:-1] == block).all() and 0 < d.length[-1] <= block
    assert d.addr[0] == buf.ctypes.data and (np.diff(d.addr) == block).all()


def _naive_runs(a, b):
    runs = []
    for i in range(len(a)):
        if runs:
            s, n = runs[-1]
            if a[i][0] == a[s][0] + n and b[i][0] == b[s][0] + n and a[i][2] == a[s][2] and b[i][2] == b[s][2]:
                runs[-1] = (s, n + a[i][1])
                continue
        runs.append((i, a[i][1]))
    return runs


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 3)), max_size=30))
def test_coalesce_matches_naive(steps):
    # build lists that are often contiguous: each row starts at the previous end plus a small gap
    la, lb, a_pos, b_pos = [], [], 0, 1000
    for ga, gb, ln in steps:
        a_pos += ga
        b_pos += gb
        la.append((a_pos, ln, 0))
        lb.append((b_pos, ln, 0))
        a_pos += ln
        b_pos += ln
    a, b = DescList(np.array(la).reshape(-1, 3), "DRAM"), DescList(np.array(lb).reshape(-1, 3), "DRAM")
    regions = np.zeros(len(a), dtype=np.int64)
    starts, lengths = coalesce_runs(a, b, regions, regions)
    assert list(zip(starts.tolist(), lengths.tolist())) == _naive_runs(la, lb)
    merged = take_runs(a, starts, lengths)
    assert merged.nbytes == a.nbytes


def test_coalesce_respects_region_boundaries():
    a = DescList([[0, 10, 0], [10, 10, 0]], "DRAM")
    b = DescList([[100, 10, 0], [110, 10, 0]], "DRAM")
    same = np.array([1, 1])
    assert coalesce_runs(a, b, same, same)[0].tolist() == [0]
    assert coalesce_runs(a, b, np.array([1, 2]), same)[0].tolist() == [0, 1]


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 20), st.integers(0, 1)), max_size=25))
def test_first_overlap_matches_bruteforce(rows):
    d = DescList(np.array(rows, dtype=np.int64).reshape(-1, 3), "DRAM")
    pairs = [
        (i, j)
        for i in range(len(rows))
        for j in range(i + 1, len(rows))
        if rows[i][2] == rows[j][2]
        and rows[i][1] > 0
        and rows[j][1] > 0
        and rows[i][0] < rows[j][0] + rows[j][1]
        and rows[j][0] < rows[i][0] + rows[i][1]
    ]
    found = first_overlap(d)
    if pairs:
        assert found is not None and found in pairs
    else:
        assert found is None


@pytest.mark.parametrize("huge", [0, 1 << 20])
def test_aligned_empty_starts_large_buffers_on_a_huge_page(monkeypatch, huge):
    from datamover.descriptors import buffers

    monkeypatch.setattr(buffers, "_huge_page", huge)  # a made-up 1 MiB huge page: 1 in 256 odds per buffer by chance
    for nbytes, want in ((4096 * 3, 4096), (2 << 20, huge or 4096), (3 << 20, huge or 4096), (1 << 20, 4096)):
        buf = buffers.aligned_empty(nbytes)
        assert buf.nbytes == nbytes and buf.ctypes.data % want == 0 and not buf.any()
    assert buffers.aligned_empty(2 << 20, 8192).ctypes.data % max(huge, 8192) == 0


@pytest.mark.parametrize("size", [0, -4096])
def test_registration_blocks_of_a_size_not_positive_are_refused(size):
    """DescList.blocks refused these; Registration.blocks divided by zero, or cut a negative size into no blocks
    at all (a transfer of them moved nothing and was DONE)."""
    reg = Registration(1, MemType.DRAM, 1 << 20, 10_000, 0)
    with pytest.raises(InvalidDescriptor, match="block_size"):
        reg.blocks(size)


def test_blocks_larger_than_the_buffer_are_one_block_however_large():
    """A block size past int64 overflowed numpy's arange (OverflowError); it is one block of the whole buffer."""
    buf = np.zeros(10_000, dtype=np.uint8)
    reg = Registration(1, MemType.DRAM, 1 << 20, 10_000, 0)
    for size in (10_000, 1 << 40, 1 << 70):
        assert DescList.blocks(buf, size).rows.tolist() == [[buf.ctypes.data, 10_000, 0]]
        assert reg.blocks(size).rows.tolist() == [[1 << 20, 10_000, 0]]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DescList([[1, 2, 3], [4, 5]], "DRAM"), "shape"),  # ragged rows: numpy's bare ValueError
        (lambda: DescList([[1, 2, 3]], "NOPE"), "memory type"),
        (lambda: StridedDescList.from_columns([1, 2], [3, 4, 5], 0, 0, 1), "broadcast"),
        (lambda: StridedDescList.from_columns(np.array([2**63], np.uint64), 1, 0, 0, 1), "exceed int64"),
    ],
)
def test_malformed_lists_are_invalid_descriptors(make, match):
    with pytest.raises(InvalidDescriptor, match=match):
        make()
