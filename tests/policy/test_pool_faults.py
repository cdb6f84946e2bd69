"""A TieredCache whose L4 is a Mooncake pool, against a real mooncake_master that is SIGKILLed between two
puts (a known point): the put whose L4 publish fails goes on with the rest of its plan, and every chunk the
cache delivers afterwards is the right one (a miss where it cannot be).

Before: the failed publish raised ObjectStoreError out of the middle of the put's plan while the engine already
counted every move of it as done, so the chunks it placed in L1 were never copied there: with that error caught,
a get of the second put's 4 chunks delivered all 4 with the first put's bytes.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest

from datamover.backends.mooncake import MAGIC, codes
from datamover.errors import ObjectStoreError, TransferStateError, TransferTimeout
from datamover.policy.cache import TieredCache
from datamover.policy.config import GIB, TierConfig, with_overrides
from datamover.policy.keys import chunk_keys
from datamover.policy.pool import SharedPool
from datamover.telemetry.metrics import CacheMetrics
from datamover.testing.mooncake import chunk_bytes
from datamover.testing.waiting import BOUND_S, HeldOnce

PAGE = 64 << 10


def pool_config(m, bucket: str) -> TierConfig:
    """Small L1/L2 in host memory and L4 on the real Mooncake pool of `m` (the mooncake_master fixture)."""
    return with_overrides(
        TierConfig(),
        l1_hbm={"page_size_bytes": PAGE, "block_pool_size": 4, "device": "dram"},
        l2_dram={"pinned_pool_gb": 4 * PAGE / GIB},
        l4_pool={
            "enabled": True, "backend": "mooncake", "capacity_gb": 1024 * PAGE / GIB, "bucket": bucket,
            "master_server_addr": m.master_addr, "metadata_service_url": m.metadata_url,
            "segment_gb": 32 * (1 << 20) / GIB,
        },
    )  # fmt: skip


def test_a_put_whose_pool_write_fails_never_serves_wrong_bytes(mooncake_master):
    m = mooncake_master
    metrics = CacheMetrics()
    cache = TieredCache(pool_config(m, "faults"), metrics=metrics)
    try:
        first = chunk_keys(list(range(100, 104)), "model@1", "tok@1")
        second = chunk_keys(list(range(200, 204)), "model@1", "tok@1")
        assert cache.put(first, np.stack([chunk_bytes(k, PAGE) for k in first])) == 4
        m.kill()  # the fault: the pool is gone before the second put publishes to it
        cache.put(second, np.stack([chunk_bytes(k, PAGE) for k in second]))
        failed = [
            (sample.labels, sample.value)
            for sample in metrics.errors.collect()[0].samples
            if sample.name.endswith("_total") and sample.labels["to_tier"] == "l4_pool"
        ]
        assert failed and all(labels["backend"] == "mooncake" and value >= 1 for labels, value in failed), failed
        delivered = {}
        for name, keys in (("second", second), ("first", first)):
            dst = np.full((len(keys), PAGE), 0xEE, dtype=np.uint8)
            n = delivered[name] = cache.get(keys, dst)
            wrong = [str(keys[i]) for i in range(n) if not np.array_equal(dst[i], chunk_bytes(keys[i], PAGE))]
            assert not wrong, f"wrong bytes delivered for {wrong}"
        # the first put's chunks were demoted to L2 by the second put's plan, intact
        assert delivered["first"] == 4, delivered
        m.start()  # a client closes in ~1 s with its master up, ~14 s without
    finally:
        cache.close()


def test_close_waits_for_a_lookup_asking_the_pool(mooncake_master, monkeypatch):
    """lookup asks the pool without the cache's lock: close must not close the Mooncake client under it (a call
    into a closed store crashed the process), and a lookup after close is refused."""
    cache = TieredCache(pool_config(mooncake_master, "close-race"))
    probe = chunk_keys(range(900, 903), "m", "t")  # in no tier of this instance: lookup asks the pool
    held = HeldOnce("the pool's existence check")
    monkeypatch.setattr(SharedPool, "held", held.wrap(SharedPool.held))
    looked = []
    asking = threading.Thread(target=lambda: looked.append(cache.lookup(probe)))
    asking.start()
    assert held.reached.wait(BOUND_S)
    closing = threading.Thread(target=cache.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive() and cache.closed  # closed to new calls, waiting for the one in the pool
    held.go.set()
    asking.join(BOUND_S)
    closing.join(BOUND_S)
    assert not closing.is_alive() and looked == [(0, [])]
    with pytest.raises(TransferStateError):
        cache.lookup(probe)


def test_a_clear_the_pool_cannot_take_still_empties_this_caches_tiers(mooncake_master):
    """clear(shared=True) after a weights update, the master gone: the pool's objects cannot be removed (said,
    ObjectStoreError), but this instance's tiers forget every chunk all the same (it raised first and kept them)."""
    m = mooncake_master
    cache = TieredCache(pool_config(m, "clear-down"))
    try:
        keys = chunk_keys(range(300, 304), "m", "t")
        cache.put(keys, np.stack([chunk_bytes(k, PAGE) for k in keys]))
        assert any(cache.engine.resident)
        m.kill()
        with pytest.raises(ObjectStoreError, match=r"removing the pool's objects under 'clear-down/kv/' failed: [A-Z]"):
            cache.clear(shared=True)
        assert not any(cache.engine.resident) and not cache.engine.pinned
        m.start()
    finally:
        cache.close()


def test_an_existence_check_the_master_refuses_is_a_miss_and_said(mooncake_master, monkeypatch, caplog):
    """A refused existence check (RPC_FAIL: a master gone) serves misses and is logged with Mooncake's status,
    as a late one is (it was a silent miss)."""
    cache = TieredCache(pool_config(mooncake_master, "refused"))
    try:
        probe = chunk_keys(range(910, 912), "m", "t")
        client = cache.pool.client
        monkeypatch.setattr(client, "exists", lambda keys, timeout=None: [-900] * len(keys))
        with caplog.at_level("WARNING", logger="datamover.kvcache"):
            assert cache.lookup(probe) == (0, [])
        assert "did not answer an existence check (RPC_FAIL" in caplog.text
    finally:
        cache.close()


@pytest.mark.parametrize("fault", ["rpc_fail", "timeout"])
def test_a_pool_that_does_not_answer_a_read_keeps_the_chunks_other_instances_put(mooncake_master, monkeypatch, fault):
    """Reads of chunks this instance did not put fail (the master refuses, RPC_FAIL; or no answer in time): a miss
    this time, never wrong bytes, and the pool's objects are left alone, so the next get finds them again."""
    cache = TieredCache(pool_config(mooncake_master, f"unanswered-{fault}"))
    try:
        keys = chunk_keys(range(500, 504), "m", "t")
        data = np.stack([chunk_bytes(k, PAGE) for k in keys])
        assert cache.put(keys, data) == 4
        cache.clear()  # pool kept: to this instance they are now chunks another instance put there
        assert cache.lookup(keys) == (4, ["l4_pool"] * 4)
        client = cache.pool.client

        def fail(names, *args, **kw):
            if fault == "timeout":
                raise TransferTimeout("injected: the pool did not answer in time", backend="mooncake")
            return [codes.RPC_FAIL] * len(names)

        monkeypatch.setattr(client, "get", fail)
        dst = np.full_like(data, 0xEE)
        assert cache.get(keys, dst) == 0
        assert cache.lookup(keys) == (4, ["l4_pool"] * 4)
        monkeypatch.undo()
        dst = np.full_like(data, 0xEE)
        assert cache.get(keys, dst) == 4 and np.array_equal(dst, data)
    finally:
        cache.close()


@pytest.mark.parametrize("fault", ["timeout", "rpc_fail"])
def test_a_put_whose_publish_the_pool_did_not_take_keeps_its_chunks_in_l1(mooncake_master, monkeypatch, fault):
    """The pool does not take a put's publish (its write times out, or the store answers RPC_FAIL: its master
    cannot be reached): the put's chunks stay in L1, where the put placed them; only L4's entries go (nothing was
    written there), counted as write-down failures kept.

    Before: the failed publish dropped each chunk from every tier, L1 included: the put stored none of them (and
    RPC_FAIL, not known as "unreachable", dropped them after that fix too)."""
    cache = TieredCache(pool_config(mooncake_master, f"publish-down-{fault}"))
    try:
        keys = chunk_keys(range(600, 604), "m", "t")
        data = np.stack([chunk_bytes(k, PAGE) for k in keys])

        def put(names, *args, **kw):
            if fault == "timeout":
                raise TransferTimeout("injected: the pool did not answer in time", backend="mooncake")
            return [codes.RPC_FAIL] * len(names)

        monkeypatch.setattr(cache.pool.client, "put", put)
        assert cache.put(keys, data) == 4
        assert not cache.engine.resident[cache.names.index("l4_pool")]
        assert cache.lookup(keys) == (4, ["l1_hbm"] * 4)
        dst = np.full_like(data, 0xEE)
        assert cache.get(keys, dst) == 4 and np.array_equal(dst, data)
        assert cache.stats()["write_down_failures"] == {"kept": 4, "dropped": 0}
    finally:
        cache.close()


@pytest.mark.parametrize("code", ["RPC_FAIL", "RPC_TIMEOUT"])
def test_a_read_the_store_cannot_serve_keeps_the_chunks_in_this_instances_l4_index(mooncake_master, monkeypatch, code):
    """The store answers a get of chunks this instance indexes only in L4 with RPC_FAIL (its master cannot be
    reached) or RPC_TIMEOUT: misses this time, asked once (not again chunk by chunk), and the chunks stay in L4's
    index (the pool's objects are not in doubt), so the next get reads them.

    Before: only S3's statuses counted as "the store cannot serve now": each chunk was asked for again alone, then
    dropped from this instance's L4 index as if its object were bad."""
    cache = TieredCache(pool_config(mooncake_master, f"cannot-serve-{code}"))
    try:
        keys = chunk_keys(range(700, 712), "m", "t")
        data = np.stack([chunk_bytes(k, PAGE) for k in keys])
        assert cache.put(keys, data) == 12  # every chunk published; L1 and L2 hold 4 each, the rest only L4
        j4 = cache.names.index("l4_pool")
        cold = [i for i, k in enumerate(keys) if cache.engine.where(k) == j4]
        assert len(cold) == 4
        client, asked = cache.pool.client, []
        status = getattr(codes, code)
        monkeypatch.setattr(client, "get", lambda names, *a, **kw: asked.append(len(names)) or [status] * len(names))
        wanted = [keys[i] for i in cold]
        dst = np.full((4, PAGE), 0xEE, dtype=np.uint8)
        assert cache.get(wanted, dst) == 0
        assert asked == [4]
        assert [cache.engine.where(k) for k in wanted] == [j4] * 4
        assert cache.stats()["checksum_failures"] == 0
        monkeypatch.undo()
        assert cache.get(wanted, dst) == 4 and np.array_equal(dst, data[cold])
    finally:
        cache.close()


def test_a_corrupt_pool_object_is_not_adopted_again_until_this_instance_writes_it(mooncake_master):
    """A chunk's object in the shared pool fails its CRC32C (this instance may not delete others' objects): the get
    serves it as a miss, and later lookups and gets skip it instead of adopting and reading it again each time;
    once this instance writes the chunk anew, the pool's copy is found and served again.

    Before: every lookup adopted it again and every get read it and failed its check again."""
    cache = TieredCache(pool_config(mooncake_master, "corrupt"))
    try:
        keys = chunk_keys(range(800, 802), "m", "t")
        data = np.stack([chunk_bytes(k, PAGE) for k in keys])
        assert cache.put(keys, data) == 2
        cache.clear()  # the pool keeps them: to this instance they are now chunks another instance put
        bad = keys[1]
        store, name = cache.pool.client.store, cache.pool.pool_key(bad)
        payload = data[1].tobytes()
        assert store.remove(name) == 0
        assert store.put(name, payload + struct.pack("<IIQ", MAGIC, 12345, len(payload))) == 0  # a wrong CRC32C
        dst = np.full_like(data, 0xEE)
        assert cache.get(keys, dst) == 1 and np.array_equal(dst[0], data[0])
        assert cache.stats()["checksum_failures"] == 1
        assert cache.lookup(keys)[0] == 1  # the corrupt one is not claimed again
        assert cache.get(keys, dst) == 1
        assert cache.stats()["checksum_failures"] == 1  # nor read again
        assert cache.put([bad], data[1:]) == 1  # this instance writes it anew (published to the pool)
        cache.clear()
        assert cache.lookup(keys) == (2, ["l4_pool"] * 2)
        dst = np.full_like(data, 0xEE)
        assert cache.get(keys, dst) == 2 and np.array_equal(dst, data)
    finally:
        cache.close()
