"""``_ucp.DataWorker``: a UCP worker of our own in serialized mode, every call on it under one mutex.

Two UCP contexts in this process: a ucxx worker is the target (it owns the memory and, for put/get that UCX
emulates over shared memory or tcp, must be progressed), the DataWorker the initiator. Bytes are checked after
every transfer.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from datamover.backends import backend_status
from datamover.backends.ucx import rma
from datamover.backends.ucx.config import import_ucxx, make_context

ok, why = backend_status("ucx")
pytestmark = [
    pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}"),
    pytest.mark.skipif(rma.native() is None, reason=rma.data_path()),
]

N, BLOCK = 64, 4096
UCS_THREAD_MODE_SERIALIZED, UCS_THREAD_MODE_MULTI = 1, 2


def _thread_mode(worker: int) -> int:
    """The worker's thread mode, as ``ucp_worker_query`` reports it (field_mask, then thread_mode at offset 8)."""
    lib = ctypes.CDLL(rma._loaded("libucp"))
    lib.ucp_worker_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    attr = (ctypes.c_uint64 * 64)()
    attr[0] = 1  # UCP_WORKER_ATTR_FIELD_THREAD_MODE
    assert lib.ucp_worker_query(worker, attr) == 0
    return ctypes.c_int.from_buffer(attr, 8).value


@pytest.fixture
def pair():
    """(DataWorker, its endpoint to the target, the target's ucxx worker, target buffer, its rkey on the endpoint)."""
    u, _ = import_ucxx()
    config = {"TLS": "tcp,self"}
    ctx_t, ctx_i = make_context(u, config, False)[0], make_context(u, config, False)[0]
    target = u.UCXWorker(ctx_t)
    data = rma.native().DataWorker(ctx_i.handle)
    buf = np.zeros(N * BLOCK, np.uint8)
    memh = rma.mem_map(ctx_t.handle, buf.ctypes.data, buf.nbytes)
    ep = data.connect(target.address.tobytes())
    rkey = data.rkey_unpack(ep, rma.rkey_pack(ctx_t.handle, memh))
    try:
        yield data, ep, target, buf, rkey
    finally:
        data.rkey_destroy(rkey)
        data.close_ep(ep)
        data.close()
        rma.mem_unmap(ctx_t.handle, memh)
        del target


def _move(data, ep, target, get: bool, local: np.ndarray, buf: np.ndarray, rkey: int, perm: np.ndarray) -> None:
    """One WRITE (or READ, ``get``) of N rows, block i of ``local`` to slot perm[i] of ``buf``; the target is
    progressed between the initiator's drives (one thread)."""
    laddr = local.ctypes.data + np.arange(N, dtype=np.uint64) * BLOCK
    raddr = buf.ctypes.data + perm.astype(np.uint64) * BLOCK
    rows = rma.native_rows(laddr, np.full(N, BLOCK, np.uint64), raddr, np.full(N, rkey, np.uint64), [None] * N)
    flush = rma.native().post(get, ep, rows, None, None, 0, data)
    assert not isinstance(flush, int), flush
    deadline = time.monotonic() + 10
    while flush.poll() == rma.UCS_INPROGRESS:
        assert time.monotonic() < deadline, "the flush did not end"
        flush.drive(data.handle, time.monotonic() + 0.001)
        target.progress()
    assert flush.status == rma.UCS_OK


def test_a_data_worker_is_serialized_where_ucxx_workers_are_multi_threaded(pair):
    data, _, target, _, _ = pair
    assert _thread_mode(target.handle) == UCS_THREAD_MODE_MULTI  # the query's layout, checked on a known worker
    assert _thread_mode(data.handle) == UCS_THREAD_MODE_SERIALIZED


def test_a_data_worker_moves_permuted_rows_both_ways(pair):
    data, ep, target, buf, rkey = pair
    perm = np.random.default_rng(5).permutation(N)
    src = np.frombuffer(np.random.default_rng(6).bytes(N * BLOCK), np.uint8).copy()
    _move(data, ep, target, False, src, buf, rkey, perm)
    assert np.array_equal(buf.reshape(N, BLOCK)[perm], src.reshape(N, BLOCK))
    back = np.zeros_like(src)
    _move(data, ep, target, True, back, buf, rkey, perm)
    assert np.array_equal(back, src)


def test_threads_sharing_a_data_worker_take_turns(pair):
    """Four threads post and drive READs on one serialized worker at once (the target progressed by a fifth):
    its mutex keeps them apart, and every row arrives."""
    data, ep, target, buf, rkey = pair
    buf[:] = np.frombuffer(np.random.default_rng(7).bytes(buf.nbytes), np.uint8)
    stop, errors = threading.Event(), []

    def serve():
        while not stop.is_set():
            target.progress()

    def read(seed: int) -> None:
        try:
            perm = np.random.default_rng(seed).permutation(N)
            for _ in range(20):
                out = np.zeros(N * BLOCK, np.uint8)
                laddr = out.ctypes.data + np.arange(N, dtype=np.uint64) * BLOCK
                raddr = buf.ctypes.data + perm.astype(np.uint64) * BLOCK
                keys = np.full(N, rkey, np.uint64)
                rows = rma.native_rows(laddr, np.full(N, BLOCK, np.uint64), raddr, keys, [None] * N)
                flush = rma.native().post(True, ep, rows, None, None, 0, data)
                deadline = time.monotonic() + 10
                while flush.poll() == rma.UCS_INPROGRESS and time.monotonic() < deadline:
                    flush.drive(data.handle, time.monotonic() + 0.001)
                assert flush.status == rma.UCS_OK
                assert np.array_equal(out.reshape(N, BLOCK), buf.reshape(N, BLOCK)[perm])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    server = threading.Thread(target=serve)
    server.start()
    readers = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    try:
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
    finally:
        stop.set()
        server.join(10)
    assert not errors, errors


def test_a_closed_data_worker_refuses_work_and_post_refuses_other_objects(pair):
    _, ep, _, _, _ = pair
    rows = np.zeros((0, 5), np.uint64)
    with pytest.raises(TypeError, match="DataWorker"):
        rma.native().post(True, ep, rows, None, None, 0, object())
    u, _ = import_ucxx()
    ctx = make_context(u, {"TLS": "tcp,self"}, False)[0]  # outlives the worker made on it
    other = rma.native().DataWorker(ctx.handle)
    other.close()
    other.close()  # idempotent
    assert other.handle == 0
    with pytest.raises(ValueError, match="closed"):
        rma.native().post(True, ep, rows, None, None, 0, other)
    with pytest.raises(ValueError, match="closed"):
        other.connect(b"x")


def test_a_progress_thread_serves_a_data_workers_request_nobody_drives(pair):
    """Progress(worker, data=D): a request posted on D with the thread held, then handed to it (unhold), ends
    without its caller progressing anything: the thread progresses D too (the target served by a second one)."""
    data, ep, target, buf, rkey = pair
    lib = rma.native()
    buf[:] = np.frombuffer(np.random.default_rng(8).bytes(buf.nbytes), np.uint8)
    u, _ = import_ucxx()
    ctx = make_context(u, {"TLS": "tcp,self"}, False)[0]
    idle = u.UCXWorker(ctx)  # the thread's first worker: nothing on it
    served = lib.Progress(target.handle)
    progress = lib.Progress(idle.handle, data=data)
    try:
        perm = np.random.default_rng(9).permutation(N)
        out = np.zeros(N * BLOCK, np.uint8)
        laddr = out.ctypes.data + np.arange(N, dtype=np.uint64) * BLOCK
        raddr = buf.ctypes.data + perm.astype(np.uint64) * BLOCK
        rows = rma.native_rows(laddr, np.full(N, BLOCK, np.uint64), raddr, np.full(N, rkey, np.uint64), [None] * N)
        flush = lib.post(True, ep, rows, progress, None, 0, data)
        assert flush.holding
        flush.unhold()
        deadline = time.monotonic() + 10
        while flush.poll() == rma.UCS_INPROGRESS:
            assert time.monotonic() < deadline, progress.stats
            time.sleep(0.001)
        assert flush.status == rma.UCS_OK
        assert np.array_equal(out.reshape(N, BLOCK), buf.reshape(N, BLOCK)[perm])
        assert progress.stats["progressed"] > 0
    finally:
        progress.close()
        served.close()
    with pytest.raises(TypeError, match="DataWorker"):
        lib.Progress(idle.handle, data=object())


@pytest.mark.parametrize("ends", ["never", "before it is let go of", "after it is let go of"])
def test_a_data_worker_is_destroyed_only_once_nothing_is_queued_on_it(ends):
    """A flush let go of (``abandon``) while its puts wait for a target nobody progresses: closing the worker then
    leaves it undestroyed (UCX would assert on, or free under the transport, operations still queued) and counts it
    leaked. Where the flush ended first, or ended after it was let go of (the worker progressed meanwhile), the
    worker is destroyed."""
    u, _ = import_ucxx()
    config = {"TLS": "tcp,self"}
    ctx_t, ctx_i = make_context(u, config, False)[0], make_context(u, config, False)[0]
    target = u.UCXWorker(ctx_t)
    lib = rma.native()
    data = lib.DataWorker(ctx_i.handle, ctx_i)  # keeps its context alive, for as long as the worker lives
    buf, src = np.zeros(N * BLOCK, np.uint8), np.ones(N * BLOCK, np.uint8)
    memh = rma.mem_map(ctx_t.handle, buf.ctypes.data, buf.nbytes)
    ep = data.connect(target.address.tobytes())
    rkey = data.rkey_unpack(ep, rma.rkey_pack(ctx_t.handle, memh))
    laddr = src.ctypes.data + np.arange(N, dtype=np.uint64) * BLOCK
    raddr = buf.ctypes.data + np.arange(N, dtype=np.uint64) * BLOCK
    rows = rma.native_rows(laddr, np.full(N, BLOCK, np.uint64), raddr, np.full(N, rkey, np.uint64), [None] * N)
    flush = lib.post(False, ep, rows, None, None, 0, data)
    assert not isinstance(flush, int), flush

    def serve() -> None:
        deadline = time.monotonic() + 10
        while flush.poll() == rma.UCS_INPROGRESS or data.orphans:
            assert time.monotonic() < deadline, "the puts did not end"
            data.progress()
            target.progress()

    if ends == "before it is let go of":
        serve()
    assert flush.poll() == (rma.UCS_OK if ends.startswith("before") else rma.UCS_INPROGRESS)
    flush.abandon()
    assert data.orphans == (0 if ends.startswith("before") else 1)
    if ends == "after it is let go of":
        serve()
    leaked = lib.post_stats()["leaked_workers"]
    data.rkey_destroy(rkey)
    data.close()
    assert data.leaked == (ends == "never") and data.handle == 0
    assert lib.post_stats()["leaked_workers"] == leaked + (ends == "never")
    if ends != "never":
        assert np.array_equal(buf, src)
        rma.mem_unmap(ctx_t.handle, memh)
