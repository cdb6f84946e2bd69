"""Cross-memory attach (``datamover.backends.ucx.cma``): chunking, copies, where a failed copy stopped, the probe."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.backends.base import IOV_MAX
from datamover.backends.ucx import cma

pytestmark = pytest.mark.skipif(cma._calls() is None, reason="process_vm_readv/writev unavailable here")
SELF = os.getpid()  # a process may attach to itself: the copies below need no second process


def _plan(src: np.ndarray, dst: np.ndarray, rows: np.ndarray, block: int, chunk_bytes: int = 8 << 20):
    """Row i copies src block i to dst block rows[i]."""
    local = src.ctypes.data + np.arange(len(rows), dtype=np.int64) * block
    remote = dst.ctypes.data + rows.astype(np.int64) * block
    return cma.CmaPlan(local, remote, np.full(len(rows), block, dtype=np.int64), chunk_bytes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5 << 20), min_size=1, max_size=3000), st.sampled_from([1 << 20, 8 << 20]))
def test_chunks_cover_every_byte_once_within_the_limits(lengths, chunk_bytes):
    n = np.asarray(lengths, dtype=np.int64)
    local = (np.cumsum(n) - n) * 2 + (1 << 40)  # distinct, gapped addresses on both sides
    remote = local + (1 << 44)
    plan = cma.CmaPlan(local, remote, n, chunk_bytes)
    pieces = plan.local[:, 1].astype(np.int64)
    row_of = np.arange(len(n)) if plan.row_of is None else plan.row_of
    assert (pieces <= chunk_bytes).all()
    assert np.array_equal(np.bincount(row_of, weights=pieces, minlength=len(n)).astype(np.int64), n)
    starts = np.concatenate(([True], row_of[1:] != row_of[:-1]))  # each row's pieces follow each other
    lo, ro = plan.local[:, 0].astype(np.int64), plan.remote[:, 0].astype(np.int64)
    assert np.array_equal(lo[starts], local) and np.array_equal(ro[starts], remote)
    assert np.array_equal(lo[1:][~starts[1:]], (lo + pieces)[:-1][~starts[1:]])
    assert np.array_equal(ro - lo, np.full(len(lo), 1 << 44))
    assert plan.chunks[0][0] == 0 and plan.chunks[-1][1] == len(pieces)
    assert sum(c[2] for c in plan.chunks) == plan.nbytes == int(n.sum())
    for (a, b, nbytes), nxt in zip(plan.chunks, [*plan.chunks[1:], (len(pieces), None, None)]):
        assert b == nxt[0] and 0 < b - a <= IOV_MAX
        assert nbytes == int(pieces[a:b].sum())
        assert int(pieces[a : b - 1].sum()) < chunk_bytes  # all but the last start inside one chunk's span


def test_one_large_row_is_cut_into_pieces_and_copied_whole():
    src = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8).copy()
    dst = np.zeros(3 << 20, dtype=np.uint8)
    plan = cma.CmaPlan(np.array([src.ctypes.data]), np.array([dst.ctypes.data]), np.array([3 << 20]), 1 << 20)
    assert len(plan.local) == 3 and list(plan.row_of) == [0, 0, 0]
    assert plan.run(SELF, True) is None
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("write", [True, False])
def test_permuted_rows_over_many_chunks_land_where_they_should(write):
    block, count = 4096, 3 * IOV_MAX + 5  # several syscalls, the last one short
    mine = np.frombuffer(os.urandom(block * count), dtype=np.uint8).copy()
    theirs = np.zeros(block * count, dtype=np.uint8)
    if not write:
        mine, theirs = theirs, mine
    rows = np.random.default_rng(3).permutation(count)
    plan = _plan(mine, theirs, rows, block, chunk_bytes=1 << 20)
    assert len(plan.chunks) > 3
    assert plan.run(SELF, write) is None
    got = mine.reshape(count, block), theirs.reshape(count, block)
    assert np.array_equal(got[0], got[1][rows])


@pytest.mark.parametrize("pieces", [False, True], ids=["rows", "rows-cut-in-pieces"])
def test_a_copy_into_unmapped_memory_names_the_row_and_moves_the_rows_before_it(pieces):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + page, page) == 0  # [base, base + page) stays mapped, the next page does not
    try:
        src = np.frombuffer(os.urandom(4 * page), dtype=np.uint8).copy()
        # rows 0 and 1 fit in the mapped page; row 2 starts there and runs into the unmapped one
        local = src.ctypes.data + np.array([0, page // 4, page], dtype=np.int64)
        remote = base + np.array([0, page // 4, page // 2], dtype=np.int64)
        lengths = np.array([page // 4, page // 4, page], dtype=np.int64)
        stop = cma.CmaPlan(local, remote, lengths, page // 4 if pieces else 8 << 20).run(SELF, True)
        assert stop == (2, errno.EFAULT)
        landed = np.ctypeslib.as_array((ctypes.c_uint8 * page).from_address(base))
        assert np.array_equal(landed[: page // 2], src[: page // 2])
        assert np.array_equal(landed[page // 2 :], src[page : page + page // 2])  # row 2 up to the hole
    finally:
        libc.munmap(base, page)


def test_a_gone_process_is_reported_as_esrch():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    buf = np.zeros(4096, dtype=np.uint8)
    plan = cma.CmaPlan(np.array([buf.ctypes.data]), np.array([buf.ctypes.data]), np.array([4096]))
    assert plan.run(pid, True) == (0, errno.ESRCH)


def test_probe_accepts_only_the_process_that_made_the_offer():
    token = cma.Token()
    offer = token.offer()
    assert cma.probe(offer) == (0, "the peer is this very process (UCX serves it)")
    pid = os.fork()
    if pid == 0:  # the child reads the parent's token: the parent is its peer
        got = cma.probe(offer)
        forged = cma.probe({**offer, "token": bytes(32)})
        os._exit(0 if got == (offer["pid"], "ok") and forged[0] == 0 and "not that peer" in forged[1] else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert cma.probe(None)[0] == 0 and "no token" in cma.probe(None)[1]
    assert cma.probe({"pid": "x"})[1] == "malformed token offer"


_GOOD = {"pid": 1, "addr": 4096, "token": bytes(32)}


@pytest.mark.parametrize(
    "bad",
    [
        {"token": 1 << 62},  # bytes(2**62): MemoryError before
        {"token": 32},  # bytes(32) would have made a token of zeros
        {"token": "x" * 32},
        {"token": bytes(33)},
        {"addr": -1},  # OverflowError in the uint64 iovec before
        {"addr": 1 << 70},
        {"addr": 1 << 63},
        {"addr": 4096.0},
        {"addr": True},
        {"pid": 0},
        {"pid": (1 << 22) + 1},
        {"pid": 1 << 70},
        {"pid": "1"},
        {"pid": None},
    ],
    ids=repr,
)
def test_a_malformed_offer_is_refused_by_its_fields_before_they_are_used(bad):
    assert cma.probe({**_GOOD, **bad}) == (0, "malformed token offer")


def test_availability_reads_the_yama_policy(tmp_path):
    scope = tmp_path / "ptrace_scope"
    for value, word in (("0", "available"), ("1", "descendants"), ("2", "CAP_SYS_PTRACE"), ("3", "forbids")):
        scope.write_text(value + "\n")
        assert word in cma.availability(str(scope))
    assert "no Yama" in cma.availability(str(tmp_path / "absent"))


def test_probe_refuses_a_peer_in_another_pid_namespace_before_reading_anything(monkeypatch):
    offer = cma.Token().offer()
    assert offer["pidns"] == os.stat("/proc/self/ns/pid").st_ino
    offer["pid"] = os.getppid()  # a live process here, as the peer's own pid 1 would be
    offer["pidns"] += 1
    monkeypatch.setattr(cma, "_calls", lambda: (None, None))  # reading would fail the test
    pid, why = cma.probe(offer)
    assert pid == 0 and "another pid namespace" in why
