"""A private L4 bucket holds what the L4 index holds, and is found again after a restart (real moto S3 server)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover import Agent
from datamover.errors import ConfigError, InvalidParameter
from datamover.policy import bucket as bucket_module
from datamover.policy.bucket import INDEX_FORMAT, INDEX_NAME, PrivateBucket, parse_index
from datamover.policy.cache import TieredCache
from datamover.policy.keys import ChunkKey, chunk_keys
from datamover.telemetry.metrics import CacheMetrics
from datamover.testing.s3server import S3Server

from .test_cache import GB, PAGE, check_consistent, check_get, chunks, tiers
from .test_cache_resources import open_under

BUCKET = "kv-private"
INDEX_OBJECT = "kv/" + INDEX_NAME


@pytest.fixture(scope="module")
def server():
    ok, why = S3Server.available()
    if not ok:
        pytest.skip(why)
    with S3Server(bucket=BUCKET) as srv:
        yield srv


@pytest.fixture
def s3(server):
    """The bucket, emptied before each test."""
    client = server.client()
    for obj in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    return server


def objects(srv: S3Server) -> list[str]:
    return sorted(o["Key"] for o in srv.client().list_objects_v2(Bucket=BUCKET).get("Contents", []))


def open_cache(
    srv: S3Server,
    tmp_path,
    l4: int = 4,
    replicas: int = 2,
    page: int = PAGE,
    prefix: str = "kv/",
    metrics: CacheMetrics | None = None,
    l1: int = 2,
    l3: int | None = None,
    **sections: dict[str, Any],
) -> TieredCache:
    agent = Agent("kv-bucket", {"backends": {"memcpy": {}, "posix": {}, "s3": srv.config()}})
    config = tiers(
        tmp_path,
        l1=l1,
        l2=0,
        l3=l3,
        l1_hbm={"page_size_bytes": page, **sections.pop("l1_hbm", {})},
        l4_pool={
            "enabled": True,
            "bucket": BUCKET,
            "capacity_gb": l4 * page / GB,
            "replica_count": replicas,
            "prefix": prefix,
        },
        **sections,
    )
    cache = TieredCache(config, agent=agent, metrics=metrics)
    cache.own_test_agent = agent
    return cache


def close(cache: TieredCache) -> None:
    cache.close()
    cache.own_test_agent.close()


def chunk_objects(keys, replicas: int = 2, prefix: str = "kv/") -> list[str]:
    return sorted(f"{prefix}{k.digest()}.{r}" for k in keys for r in range(replicas))


def one_run(srv: S3Server, tmp_path, keys, **kw) -> list[ChunkKey]:
    """A cache that puts `keys` and closes; the chunks its L4 held, sorted."""
    cache = open_cache(srv, tmp_path, **kw)
    try:
        cache.put(keys, chunks(keys))
        return sorted(cache.engine.resident[cache.names.index("l4_pool")])
    finally:
        close(cache)


def test_evicted_chunks_objects_are_deleted(s3, tmp_path):
    cache = open_cache(s3, tmp_path, l4=4)
    try:
        keys = chunk_keys(range(20), "m", "t")
        for i in range(0, 20, 2):
            cache.put(keys[i : i + 2], chunks(keys[i : i + 2]))
        l4 = cache.engine.resident[cache.names.index("l4_pool")]
        assert len(l4) == 4 and cache.stats()["evictions"]["l4_pool"] > 0
        assert objects(s3) == sorted([*chunk_objects(l4), INDEX_OBJECT])  # every replica L4 dropped is gone
        assert check_get(cache, keys[-2:]) == 2
        check_consistent(cache)
    finally:
        close(cache)


def test_restart_finds_the_bucket_again(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    held = one_run(s3, tmp_path, keys, l4=8)
    assert INDEX_OBJECT in objects(s3)
    cache = open_cache(s3, tmp_path, l4=8)
    try:
        assert any("found again" in n for n in cache.notes)
        assert sorted(cache.engine.resident[cache.names.index("l4_pool")]) == held
        assert cache.lookup(held) == (len(held), ["l4_pool"] * len(held))
        before = cache.stats()["checksum_failures"]
        assert check_get(cache, held) == len(held)  # byte-exact: verified against each object's CRC32C
        assert cache.stats()["checksum_failures"] == before
        check_consistent(cache)
    finally:
        close(cache)


def test_instances_on_one_bucket_under_their_own_prefixes_never_touch_each_other(s3, tmp_path):
    keys = chunk_keys(range(12), "m", "t")  # the same chunks in both: same digests, other prefixes
    a = open_cache(s3, tmp_path / "a", l4=3, replicas=1, prefix="kv/a/")
    b = open_cache(s3, tmp_path / "b", l4=3, replicas=1, prefix="kv/b/")
    try:
        for k in keys:
            a.put([k], chunks([k]))
        b.put(keys[:4], chunks(keys[:4]))
        held = {name: set(c.engine.resident[c.names.index("l4_pool")]) for name, c in (("a", a), ("b", b))}
        mine = [*chunk_objects(held["a"], 1, "kv/a/"), *chunk_objects(held["b"], 1, "kv/b/")]
        assert objects(s3) == sorted([*mine, "kv/a/" + INDEX_NAME, "kv/b/" + INDEX_NAME])
    finally:
        close(a)
        close(b)
    b = open_cache(s3, tmp_path / "b", l4=3, replicas=1, prefix="kv/b/")
    try:
        assert set(b.engine.resident[b.names.index("l4_pool")]) == held["b"]  # its own index, not a's
    finally:
        close(b)


def test_an_object_gone_since_the_index_reads_as_a_miss(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    held = one_run(s3, tmp_path, keys, l4=8, replicas=1)
    s3.client().delete_object(Bucket=BUCKET, Key=f"kv/{held[0].digest()}.0")  # a crashed run evicted it
    metrics = CacheMetrics()
    cache = open_cache(s3, tmp_path, l4=8, replicas=1, metrics=metrics)
    try:
        assert check_get(cache, [held[0]]) == 0
        assert check_get(cache, held[1:]) == len(held) - 1
        assert cache.lookup([held[0]])[0] == 0
        assert cache.stats()["checksum_failures"] == 0  # gone (say, expired by a lifecycle rule), not corrupt
        corrupt = f"kv/{held[1].digest()}.0"
        body = bytearray(s3.client().get_object(Bucket=BUCKET, Key=corrupt)["Body"].read())
        body[7] ^= 1
        meta = s3.client().head_object(Bucket=BUCKET, Key=corrupt)["Metadata"]
        s3.client().put_object(Bucket=BUCKET, Key=corrupt, Body=bytes(body), Metadata=meta)  # one bit flipped
        cache.put(held[2:], chunks(held[2:]))  # L1 holds other chunks: the next get reads held[1] from L4
        assert check_get(cache, [held[1]]) == 0
        assert cache.stats()["checksum_failures"] == 1
        assert metrics.checksum_failures.labels("l4_pool")._value.get() == 1  # the tier it was read from
        assert metrics.checksum_failures.labels("l3_nvme")._value.get() == 0
    finally:
        close(cache)


def test_another_chunk_size_is_not_adopted_and_its_objects_go(s3, tmp_path, caplog):
    keys = chunk_keys(range(6), "m", "t")
    one_run(s3, tmp_path, keys, l4=8)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    cache = open_cache(s3, tmp_path, l4=8, page=2 * PAGE)
    try:
        assert cache.lookup(keys)[0] == 0
        assert "4096-byte chunks" in caplog.text
        assert objects(s3) == [INDEX_OBJECT]  # the other layout's chunks: deleted, never served
    finally:
        close(cache)
    assert objects(s3) == [INDEX_OBJECT]


def test_keys_whose_fields_join_to_the_same_text_keep_their_own_bytes_across_a_restart(s3, tmp_path):
    a, b = ChunkKey(42, "m|x", "t"), ChunkKey(42, "m", "x|t")  # one object name once: b's bytes served for a
    cache = open_cache(s3, tmp_path, l4=4, replicas=1)
    try:
        cache.put([a], np.full(PAGE, 0xAA, np.uint8))
        cache.put([b], np.full(PAGE, 0xBB, np.uint8))
        cache.put(chunk_keys([1, 2], "m", "t"), chunks(chunk_keys([1, 2], "m", "t")))  # a and b go to L4
        assert {a, b} <= cache.engine.resident[cache.names.index("l4_pool")]
    finally:
        close(cache)
    cache = open_cache(s3, tmp_path, l4=4, replicas=1)
    try:
        for key, byte in ((a, 0xAA), (b, 0xBB)):
            dst = np.zeros(PAGE, np.uint8)
            assert cache.get([key], dst) == 1
            assert (dst == byte).all(), key
    finally:
        close(cache)


def rewrite_index(srv: S3Server, **changes) -> None:
    """Replace the index object by the one found with `changes` made to it (as msgpack's dict)."""
    index = msgpack.unpackb(srv.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
    srv.client().put_object(Bucket=BUCKET, Key=INDEX_OBJECT, Body=msgpack.packb({**index, **changes}))


def test_an_index_with_keys_that_are_not_chunk_keys_keeps_the_others_and_deletes_the_orphans(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    held = one_run(s3, tmp_path, keys, l4=8, replicas=1)
    stray = "kv/" + "0" * 32 + ".0"  # the object of the key that cannot be read back
    s3.client().put_object(Bucket=BUCKET, Key=stray, Body=bytes(PAGE))
    rewrite_index(s3, keys=[[7, b"m", "t"], *(list(k) for k in held)], clean=True)
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:  # (the whole index was discarded once, and every chunk deleted as an orphan)
        assert sorted(cache.engine.resident[cache.names.index("l4_pool")]) == held
        assert objects(s3) == sorted([*chunk_objects(held, 1), INDEX_OBJECT])
        assert check_get(cache, held) == len(held)
    finally:
        close(cache)


def test_a_clean_index_of_the_old_digest_is_not_used_and_its_objects_go(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    one_run(s3, tmp_path, keys, l4=8, replicas=1)
    rewrite_index(s3, format="datamover-l4-index/1", clean=True)  # its objects' names are not this digest's
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:
        assert cache.lookup(keys)[0] == 0
        assert objects(s3) == [INDEX_OBJECT]
    finally:
        close(cache)


def test_a_smaller_bucket_keeps_the_newest_and_fewer_replicas_delete_the_rest(s3, tmp_path):
    keys = chunk_keys(range(12), "m", "t")
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)
    try:
        for k in keys:
            cache.put([k], chunks([k]))
        order = list(cache.engine.slots[cache.names.index("l4_pool")])
    finally:
        close(cache)
    cache = open_cache(s3, tmp_path, l4=3, replicas=1)
    try:
        kept = order[-3:]
        assert cache.engine.resident[cache.names.index("l4_pool")] == set(kept)
        assert objects(s3) == sorted([*chunk_objects(kept, 1), INDEX_OBJECT])
        assert check_get(cache, kept[:1]) == 1
    finally:
        close(cache)


@pytest.mark.parametrize(
    "body",
    [b"\x00garbage", msgpack.packb({"format": "other"}), msgpack.packb({"format": INDEX_FORMAT, "chunk_bytes": 4096})],
)
def test_a_damaged_index_is_a_cold_start(s3, tmp_path, caplog, body):
    s3.client().put_object(Bucket=BUCKET, Key=INDEX_OBJECT, Body=body)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    cache = open_cache(s3, tmp_path)
    try:
        assert cache.engine.resident[cache.names.index("l4_pool")] == set()
        assert "not used" in caplog.text
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys, chunks(keys))
        assert check_get(cache, keys) == 4
    finally:
        close(cache)


def test_an_index_too_large_for_the_capacity_is_not_read(s3, tmp_path, caplog):
    key = [1, "m" * 5000, "t"]
    body = msgpack.packb({"format": INDEX_FORMAT, "chunk_bytes": PAGE, "replicas": 1, "keys": [key] * 8})
    s3.client().put_object(Bucket=BUCKET, Key=INDEX_OBJECT, Body=body)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    cache = open_cache(s3, tmp_path, l4=4)
    try:
        assert "over the" in caplog.text and not cache.engine.resident[cache.names.index("l4_pool")]
    finally:
        close(cache)


def test_deletes_the_store_does_not_take_wait_and_go_later(s3, tmp_path, caplog):
    cache = open_cache(s3, tmp_path, l4=2, replicas=1)
    bucket = cache.bucket
    now = [0.0]
    bucket.clock = lambda: now[0]
    calls = []
    real = bucket.client.delete_objects

    def unreachable(**kw):
        calls.append(kw)
        raise OSError("injected: store unreachable")

    try:
        bucket.client.delete_objects = unreachable  # the fault, where the bucket calls the store
        caplog.set_level(logging.WARNING, "datamover.kvcache")
        keys = chunk_keys(range(12), "m", "t")
        cache.put(keys[:6], chunks(keys[:6]))
        assert len(calls) == 1 and "tried again in 30 s" in caplog.text
        cache.put(keys[6:10], chunks(keys[6:10]))
        assert len(calls) == 1  # within the wait: no call, the cache goes on at full speed
        assert cache.stats()["l4_bucket"]["deletes_waiting"] > 0
        assert check_get(cache, keys[8:10]) == 2
        bucket.client.delete_objects = real  # the store is back
        now[0] = 31.0
        cache.put(keys[10:], chunks(keys[10:]))
        l4 = cache.engine.resident[cache.names.index("l4_pool")]
        assert objects(s3) == sorted([*chunk_objects(l4, 1), INDEX_OBJECT])  # waiting deletes went, none held
        assert bucket.delete_failures == 0
    finally:
        close(cache)


def test_a_delete_the_store_refuses_is_counted_and_not_repeated(s3, tmp_path, caplog):
    cache = open_cache(s3, tmp_path, l4=2, replicas=1)
    refused = []

    def refuse(Bucket, Delete):
        refused.extend(o["Key"] for o in Delete["Objects"])
        return {"Errors": [{"Key": o["Key"], "Code": "AccessDenied", "Message": "injected"} for o in Delete["Objects"]]}

    try:
        cache.bucket.client.delete_objects = refuse
        caplog.set_level(logging.WARNING, "datamover.kvcache")
        keys = chunk_keys(range(6), "m", "t")
        cache.put(keys, chunks(keys))
        assert refused and cache.stats()["l4_bucket"]["objects_not_deleted"] == len(refused)
        assert "not deleted" in caplog.text
        cache.put(keys[:1], chunks(keys[:1]))
        assert len(refused) == len(set(refused))  # refused names are not asked for again
    finally:
        close(cache)


def test_a_store_that_hangs_costs_a_bounded_wait(s3, tmp_path):
    from datamover.policy.bucket import PrivateBucket

    cache = open_cache(s3, tmp_path, l4=2, replicas=1)
    try:
        bucket = PrivateBucket(cache.agent, cache.config.l4_pool, PAGE, 2, timeout_s=1.0)
        s3.pause()  # the server stops answering (SIGSTOP): a call without a deadline waits 60 s per try
        try:
            t0 = time.monotonic()
            assert bucket.delete(chunk_keys(range(3), "m", "t")) == 3
            assert time.monotonic() - t0 < 8
            assert bucket.delete([]) == 0 and len(bucket._pending) == 3  # waiting for the retry
        finally:
            s3.resume()
    finally:
        close(cache)


fields = st.lists(
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.none(), st.binary(max_size=4), st.floats()),
    max_size=5,
)


def index_body(fmt=INDEX_FORMAT, chunk_bytes=PAGE, replicas=1, keys=(), clean=True, owner="h pid 1") -> bytes:
    doc = {"format": fmt, "chunk_bytes": chunk_bytes, "replicas": replicas, "clean": clean, "owner": owner}
    return msgpack.packb({**doc, "keys": keys if isinstance(keys, int) else list(keys)})


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.builds(
            index_body,
            st.sampled_from([INDEX_FORMAT, "x"]),
            st.one_of(st.integers(-5, 1 << 40), st.text(max_size=3), st.none()),
            st.one_of(st.integers(-5, 2000), st.none()),
            st.one_of(st.lists(fields, max_size=4), st.integers(-5, 5)),
            st.one_of(st.booleans(), st.none(), st.integers(0, 1)),
            st.one_of(st.text(max_size=300), st.none()),
        ),
    )
)
def test_parse_index_takes_only_well_formed_indexes(data):
    try:
        index = parse_index(data)
    except ValueError:
        return
    assert index.chunk_bytes > 0 and 1 <= index.replicas <= 1024
    assert type(index.clean) is bool and len(index.owner) <= 256
    assert all(isinstance(k, ChunkKey) and type(k.prefix_hash) is int for k in index.keys)


def test_round_trip_of_the_index_format():
    keys = [ChunkKey(2**63 + 5, "m", "t"), ChunkKey(-1, "m2", "t2", 3)]
    body = index_body(replicas=2, keys=[list(k) for k in keys], clean=False)
    assert parse_index(body) == (keys, PAGE, 2, False, "h pid 1", 0)
    assert parse_index(index_body(chunk_bytes=1)) == ([], 1, 1, True, "h pid 1", 0)


def test_keys_that_are_not_chunk_keys_are_skipped_not_the_index():
    good = [ChunkKey(1, "m", "t"), ChunkKey(2, "m", "t", 0)]
    body = index_body(keys=[list(good[0]), [1.5, "m", "t"], [3, b"m", "t"], list(good[1])])
    assert parse_index(body) == (good, PAGE, 1, True, "h pid 1", 2)


def test_an_index_of_the_old_digest_is_not_used():
    with pytest.raises(ValueError, match="datamover-l4-index/1 index"):
        parse_index(index_body(fmt="datamover-l4-index/1", keys=[[1, "m", "t"]]))


def test_a_key_msgpack_cannot_hold_is_left_out_of_the_index_written_and_it_is_not_clean(s3, tmp_path):
    cache = open_cache(s3, tmp_path)
    try:
        keys = [ChunkKey(1, "m", "t"), ChunkKey(1 << 70, "m", "t"), ChunkKey(2, "m", "t")]
        index = parse_index(cache.bucket._index_body(keys, clean=True))
        assert index.keys == [keys[0], keys[2]] and not index.clean
        assert parse_index(cache.bucket._index_body(keys[:1], clean=True)).clean
    finally:
        close(cache)


def test_a_key_the_indexes_cannot_record_is_refused_before_a_byte_moves(tmp_path):
    with TieredCache(tiers(tmp_path)) as cache:
        keys = [ChunkKey(1, "m", "t"), ChunkKey(2**64, "m", "t")]
        with pytest.raises(InvalidParameter, match=r"keys\[1\].*64 bits"):
            cache.put(keys, chunks(keys))
        assert cache.lookup(keys[:1])[0] == 0
        assert cache.put(keys[:1], chunks(keys[:1])) == 1  # the L3 index still records what comes after


def crash_child(args: dict) -> None:
    """In a child process: open a cache on the prefix, put chunks, and die without closing (os._exit)."""
    from datamover.testing.s3server import S3Server

    srv = S3Server.__new__(S3Server)  # only its config(): the server runs in the parent's test
    srv.port, srv.host, srv.region = args["port"], "127.0.0.1", "us-east-1"
    srv.access_key = srv.secret_key = "testing"
    if args.get("checkpoint"):
        bucket_module.INDEX_INTERVAL_S = 0.0  # an index after every operation that changes L4
    cache = open_cache(srv, Path(args["tmp"]), l4=args["l4"], replicas=1)
    for h in args["puts"]:
        key = chunk_keys([h], "m", "t")
        cache.put(key, np.random.default_rng(h).integers(0, 256, PAGE, dtype=np.uint8))
        if cache.bucket._saving is not None:
            cache.bucket._saving.result()  # that checkpoint is in the store before the next put
    held = sorted(k.digest() for k in cache.engine.resident[cache.names.index("l4_pool")])
    print(json.dumps(held), flush=True)
    os._exit(0)


def crash(srv: S3Server, tmp_path, puts: list[int], l4: int, checkpoint: bool = False) -> list[str]:
    """Run `crash_child`; the digests of the chunks its L4 held when it died."""
    args = {"port": srv.port, "tmp": str(tmp_path / "child"), "l4": l4, "puts": puts, "checkpoint": checkpoint}
    script = "import json, sys; from tests.policy.test_bucket import crash_child; crash_child(json.loads(sys.argv[1]))"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd=root, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(proc.stdout.decode().splitlines()[-1])


def test_after_a_crash_what_the_dead_run_wrote_is_deleted(s3, tmp_path, caplog):
    crash(s3, tmp_path, list(range(12)), l4=8)
    assert len(objects(s3)) > 1  # its chunks and its index (marked in use)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:
        assert "was not closed by the cache that used it" in caplog.text and " pid " in caplog.text
        assert "two caches share this prefix" in caplog.text  # its index is seconds old: it may still run
        assert not cache.engine.resident[cache.names.index("l4_pool")]
        assert objects(s3) == [INDEX_OBJECT]  # no key of them is known: none could ever be found again
    finally:
        close(cache)


def test_after_a_crash_the_index_keeps_only_chunks_still_there(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    held = set(one_run(s3, tmp_path, keys, l4=8, replicas=1))
    # a smaller L4: adopts 3 of `held` (deletes one), evicts more while it writes others, and dies
    crash(s3, tmp_path, list(range(100, 103)), l4=3)
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:
        found = set(cache.engine.resident[cache.names.index("l4_pool")])
        assert found and found < held  # what the dead run evicted (and deleted) is not claimed
        assert objects(s3) == sorted([*chunk_objects(found, 1), INDEX_OBJECT])
        assert check_get(cache, sorted(found)) == len(found)  # byte-exact
    finally:
        close(cache)


def test_a_prefix_that_cannot_be_listed_keeps_the_index_as_it_is(s3, tmp_path, caplog):
    keys = chunk_keys(range(6), "m", "t")
    held = set(one_run(s3, tmp_path, keys, l4=8, replicas=1))
    body = s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read()
    index = msgpack.unpackb(body)
    s3.client().put_object(Bucket=BUCKET, Key=INDEX_OBJECT, Body=msgpack.packb({**index, "clean": False}))
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    real = PrivateBucket._list

    def unlistable(self):
        self.client.get_paginator = lambda name: (_ for _ in ()).throw(OSError("injected: listing refused"))
        return real(self)

    PrivateBucket._list = unlistable
    try:
        cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    finally:
        PrivateBucket._list = real
    try:
        assert "cannot be listed" in caplog.text
        assert set(cache.engine.resident[cache.names.index("l4_pool")]) == held  # reads of them are verified
    finally:
        close(cache)


def test_a_crash_keeps_what_the_last_checkpoint_names(s3, tmp_path):
    held = crash(s3, tmp_path, list(range(12)), l4=6, checkpoint=True)
    assert len(held) == 6
    cache = open_cache(s3, tmp_path, l4=6, replicas=1)
    try:
        found = cache.engine.resident[cache.names.index("l4_pool")]
        assert sorted(k.digest() for k in found) == held
        assert objects(s3) == sorted([*chunk_objects(found, 1), INDEX_OBJECT])
        for key in found:  # the dead run's bytes, verified against each object's CRC32C
            dst = np.zeros(PAGE, np.uint8)
            assert cache.get([key], dst) == 1
            assert (dst == np.random.default_rng(key.prefix_hash).integers(0, 256, PAGE, dtype=np.uint8)).all()
    finally:
        close(cache)


def test_the_index_is_written_while_l4_changes_not_only_at_close(s3, tmp_path):
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    bucket = cache.bucket
    now = [0.0]
    bucket.clock = lambda: now[0]
    saves = []
    real = bucket.client.put_object

    def counting(**kw):
        saves.append(kw["Key"])
        return real(**kw)

    bucket.client.put_object = counting
    try:
        keys = chunk_keys(range(12), "m", "t")
        cache.put(keys[:3], chunks(keys[:3]))  # the interval starts
        now[0] = bucket_module.INDEX_INTERVAL_S + 1
        cache.put(keys[3:6], chunks(keys[3:6]))
        bucket._saving.result()
        assert saves == [INDEX_OBJECT]
        index = parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
        assert set(index.keys) == cache.engine.resident[cache.names.index("l4_pool")] and not index.clean
        now[0] += 1
        cache.put(keys[6:9], chunks(keys[6:9]))  # L4 changes, but within the interval: no index
        assert saves == [INDEX_OBJECT]
        now[0] += bucket_module.INDEX_INTERVAL_S
        cache.put(keys[9:], chunks(keys[9:]))
        bucket._saving.result()
        assert saves == [INDEX_OBJECT] * 2
    finally:
        del bucket.client.put_object
        close(cache)
    assert parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read()).clean


def test_a_cache_whose_prefix_another_took_leaves_its_objects_alone(s3, tmp_path, caplog, monkeypatch):
    a = open_cache(s3, tmp_path / "a", l4=2, replicas=1)
    b = None
    try:
        now = [0.0]
        a.bucket.clock = lambda: now[0]
        keys = chunk_keys(range(8), "m", "t")
        a.put(keys[:4], chunks(keys[:4]))
        caplog.set_level(logging.WARNING, "datamover.kvcache")
        with monkeypatch.context() as m:  # another host: its index is other bytes than a's, with another ETag
            m.setattr(bucket_module.socket, "gethostname", lambda: "host-b")
            b = open_cache(s3, tmp_path / "b", l4=8, replicas=1)  # the same prefix: it cleans up and takes it
        assert "two caches share this prefix" in caplog.text
        b.put(keys[4:], chunks(keys[4:]))
        b_held = set(b.engine.resident[b.names.index("l4_pool")])
        now[0] = bucket_module.INDEX_INTERVAL_S + 1
        a.put(keys[:2], chunks(keys[:2]))  # a's checkpoint finds b's index: a lost the prefix
        a.bucket._saving.result()
        assert a.bucket.lost and "another cache replaced the index" in caplog.text
        before = objects(s3)
        a.put(chunk_keys(range(100, 104), "m", "t"), chunks(chunk_keys(range(100, 104), "m", "t")))
        assert set(before) <= set(objects(s3))  # a's evictions delete nothing of b's any more
        close(a)
        index = parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
        assert not index.clean  # a's close left b's index alone
        close(b)
        b = None
        index = parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
        assert index.clean and set(index.keys) == b_held
    finally:
        if b is not None:
            close(b)


def test_two_caches_starting_on_one_prefix_at_once_one_is_refused(s3, tmp_path):

    real = PrivateBucket._read_index

    def read_then_another_starts(self):
        index = real(self)
        s3.client().put_object(Bucket=BUCKET, Key=INDEX_OBJECT, Body=index_body(clean=False))
        return index

    PrivateBucket._read_index = read_then_another_starts
    try:
        with pytest.raises(ConfigError, match="taken by another cache") as err:
            open_cache(s3, tmp_path, l4=4, replicas=1)
        assert err.value.path == "kv_cache_tiered.l4_pool.prefix"
    finally:
        PrivateBucket._read_index = real


def test_a_store_without_conditional_writes_gets_plain_ones(s3, tmp_path, caplog, monkeypatch):
    from botocore.exceptions import ClientError

    from datamover.backends.s3.backend import S3Backend

    made = S3Backend.bounded_client

    def without_conditions(self, *args, **kw):
        client = made(self, *args, **kw)
        put = client.put_object

        def refuse(**params):
            if "IfMatch" in params or "IfNoneMatch" in params:
                error = {"Error": {"Code": "NotImplemented", "Message": "injected"}}
                raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject")
            return put(**params)

        client.put_object = refuse
        return client

    monkeypatch.setattr(S3Backend, "bounded_client", without_conditions)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    keys = chunk_keys(range(6), "m", "t")
    held = one_run(s3, tmp_path, keys, l4=8, replicas=1)
    assert "takes no conditional writes" in caplog.text
    assert sorted(parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read()).keys) == held


def test_an_index_deleted_under_a_running_cache_is_written_anew(s3, tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:
        cache.put(keys, chunks(keys))
        held = sorted(cache.engine.resident[cache.names.index("l4_pool")])
        s3.client().delete_object(Bucket=BUCKET, Key=INDEX_OBJECT)  # say, by a lifecycle rule
    finally:
        close(cache)
    index = parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
    assert index.clean and sorted(index.keys) == held


def test_a_store_silent_at_start_costs_one_bounded_wait_and_a_cold_l4(s3, tmp_path, monkeypatch, caplog):
    keys = chunk_keys(range(6), "m", "t")
    one_run(s3, tmp_path, keys, l4=8, replicas=1)  # an index from an earlier run
    monkeypatch.setattr(bucket_module, "CALL_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, "datamover.kvcache")
    s3.pause()  # SIGSTOP: no answer at all
    try:
        t0 = time.monotonic()
        cache = open_cache(s3, tmp_path, l4=8, replicas=1)
        assert time.monotonic() - t0 < 8  # one bounded read of the index, no listing, no write
    finally:
        s3.resume()
    try:
        assert "did not answer at start" in caplog.text
        assert not cache.engine.resident[cache.names.index("l4_pool")]
        more = chunk_keys(range(10, 14), "m", "t")
        cache.put(more, chunks(more))
        held = sorted(cache.engine.resident[cache.names.index("l4_pool")])
    finally:
        close(cache)
    index = parse_index(s3.client().get_object(Bucket=BUCKET, Key=INDEX_OBJECT)["Body"].read())
    assert not index.clean and sorted(index.keys) == held  # replaced the earlier index, but not clean:
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)  # the earlier run's chunks are cleaned up at this start
    try:
        assert sorted(cache.engine.resident[cache.names.index("l4_pool")]) == held
        assert objects(s3) == sorted([*chunk_objects(held, 1), INDEX_OBJECT])
    finally:
        close(cache)


def test_clear_forgets_every_chunk_in_every_tier_and_deletes_the_bucket_objects(s3, tmp_path):
    keys = chunk_keys(range(8), "m", "t")
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)
    try:
        cache.put(keys, chunks(keys))
        cache.pin(keys[:1])
        assert cache.engine.resident[cache.names.index("l4_pool")]
        assert cache.clear() == 8
        assert cache.lookup(keys) == (0, [])
        assert objects(s3) == [INDEX_OBJECT]  # every replica of every chunk
        assert cache.put(keys[:2], chunks(keys[:2])) == 2 and check_get(cache, keys[:2]) == 2  # usable again
    finally:
        close(cache)
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)
    try:  # the restart finds only what came after the clear
        assert set(cache.engine.resident[cache.names.index("l4_pool")]) <= set(keys[:2])
    finally:
        close(cache)


def test_a_store_that_hangs_during_a_get_costs_one_wait_not_one_per_chunk_and_replica(s3, tmp_path, monkeypatch):
    """The batch read of L4 chunks times out: the store is not asked again for each chunk and replica (each ask
    would wait out a deadline of its own while the cache's lock is held); those chunks are misses."""
    from datamover.policy.mover import Mover

    params = {**s3.config(), "read_timeout": 0.5, "max_attempts": 1}
    agent = Agent("kv-hang", {"timeout_s": 1.0, "backends": {"memcpy": {}, "posix": {}, "s3": params}})
    l4 = {"enabled": True, "bucket": BUCKET, "capacity_gb": 4 * PAGE / GB, "replica_count": 2, "prefix": "kv/"}
    keys = chunk_keys(range(4), "m", "t")
    asked = []
    real = Mover._objects
    monkeypatch.setattr(Mover, "_objects", lambda self, k, r: asked.append(len(k)) or real(self, k, r))
    try:
        with TieredCache(tiers(tmp_path, l1=2, l2=0, l3=None, l4_pool=l4), agent=agent) as cache:
            cache.put(keys, chunks(keys))
            j4 = cache.names.index("l4_pool")
            in_l4 = [i for i, k in enumerate(keys) if cache.engine.where(k) == j4]
            assert in_l4 == [2, 3]  # the request's last two went down to L4
            s3.pause()
            try:
                asked.clear()
                assert check_get(cache, keys) == 2  # the two in L1; the two in L4 are misses
                assert asked == [2]  # the one batch read, no chunk by chunk and replica by replica
            finally:
                s3.resume()
    finally:
        agent.close()


def test_a_bucket_that_does_not_exist_is_a_config_error_at_start(s3, tmp_path):
    """L4 on a bucket the store does not have ran with every L4 read and write failing (logged), a 0% tier."""
    agent = Agent("kv-nobucket", {"backends": {"memcpy": {}, "posix": {}, "s3": s3.config()}})
    l4 = {"enabled": True, "bucket": "no-such-bucket", "capacity_gb": 4 * PAGE / GB, "replica_count": 1}
    try:
        with pytest.raises(ConfigError, match=r"l4_pool\.bucket: bucket 'no-such-bucket' does not exist"):
            TieredCache(tiers(tmp_path, l1=2, l2=0, l3=None, l4_pool=l4), agent=agent)
        # with L3 and spans too: the refused cache leaves no file open (its L3 index log, data file, span file)
        # and none of its regions on the caller's agent
        spans = {"spans": True, "span_path": str(tmp_path / "spans.jsonl")}
        with pytest.raises(ConfigError, match="no-such-bucket"):
            TieredCache(tiers(tmp_path, l1=2, l2=0, l3=4, l4_pool=l4, observability=spans), agent=agent)
        assert agent.registrations == {}
        assert open_under(tmp_path) == []
    finally:
        agent.close()


@pytest.fixture
def outage(monkeypatch):
    """Make the S3 backend's GETs (or the calls named in ``ops``: "GET", "PUT") fail as a store that does not answer
    does (``kind`` set), or answer again (``kind`` None)."""
    import botocore.exceptions as bx

    from datamover.backends.s3.backend import S3Backend

    real = {"GET": S3Backend.get, "PUT": S3Backend.put}
    faults = {
        "timeout": lambda: bx.ReadTimeoutError(endpoint_url="http://injected"),
        "refused": lambda: bx.EndpointConnectionError(endpoint_url="http://injected"),
        "slowdown": lambda: bx.ClientError(
            {
                "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                "ResponseMetadata": {"HTTPStatusCode": 503},
            },
            "GetObject",
        ),
        "forbidden": lambda: bx.ClientError(
            {
                "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                "ResponseMetadata": {"HTTPStatusCode": 403},
            },
            "PutObject",
        ),
    }

    class Outage:
        kind: str | None = None
        ops = frozenset({"GET"})
        only: Callable[[Any, int], bool] = staticmethod(lambda req, row: True)  # which calls (request, row) fail
        asked = 0

        def call(self, what, backend, req, row, *args, **kw):
            if self.kind is None or what not in self.ops or not self.only(req, row):
                return real[what](backend, req, row, *args, **kw)
            self.asked += 1
            raise backend.error(faults[self.kind](), req, row, what)

    out = Outage()
    monkeypatch.setattr(S3Backend, "get", lambda backend, *a, **kw: out.call("GET", backend, *a, **kw))
    monkeypatch.setattr(S3Backend, "put", lambda backend, *a, **kw: out.call("PUT", backend, *a, **kw))
    return out


@pytest.mark.parametrize("kind", ["timeout", "refused", "slowdown"])
@pytest.mark.parametrize("promote", [True, False], ids=["promoted", "to-caller"])
def test_a_read_the_store_did_not_answer_is_a_miss_and_the_chunk_stays_in_l4(s3, tmp_path, outage, kind, promote):
    """L4 unreachable for a while: a get reading chunks of L4 misses them, never serves the slot they were being
    promoted into, and keeps them in L4 (index and objects), so the next get once the store answers finds them.

    Before: the failed read dropped each chunk from every tier, L4 included, and its objects were deleted: a
    minute's outage wiped every chunk looked up in it from the persistent bucket."""
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)
    try:
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys, chunks(keys))
        j4 = cache.names.index("l4_pool")
        cold = [k for k in keys if cache.engine.where(k) == j4]
        assert cold == keys[2:]  # the request's last two went down to L4; L1 holds the first two
        # promoted: L1 holds chunks no get pins, so the two are promoted into it (L4 -> L1 -> caller); to-caller:
        # the whole request is pinned, L1 has no room, and L4 is read straight into the caller's buffer
        asked = cold if promote else keys
        outage.kind = kind
        assert check_get(cache, asked) == (0 if promote else 2)
        assert outage.asked >= 1
        assert cache.lookup(cold) == (2, ["l4_pool"] * 2)  # still in L4, not in the slot it never reached
        assert all(k not in cache.engine.resident[0] for k in cold)
        assert set(chunk_objects(cold)) <= set(objects(s3))  # its objects not deleted
        assert cache.stats()["checksum_failures"] == 0
        check_consistent(cache)
        outage.kind = None  # the store answers again
        hits = cache.hits["l4_pool"]
        assert check_get(cache, asked) == len(asked)  # byte-exact, verified
        assert cache.hits["l4_pool"] == hits + 2
        check_consistent(cache)
    finally:
        outage.kind = None
        close(cache)
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)  # and after a restart, in the index it wrote
    try:
        assert check_get(cache, cold) == 2
    finally:
        close(cache)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_read_of_a_missing_or_corrupt_object_still_drops_the_chunk_from_l4(s3, tmp_path, damage):
    """The store answered: the object is gone (404 on every replica) or its bytes fail their CRC32C. That chunk is
    dropped from L4 and its objects deleted; the chunk read with it is served."""
    cache = open_cache(s3, tmp_path, l4=8, replicas=1)
    try:
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys, chunks(keys))
        bad, good = keys[2], keys[3]
        assert cache.lookup([bad, good]) == (2, ["l4_pool"] * 2)
        name = f"kv/{bad.digest()}.0"
        if damage == "missing":
            s3.client().delete_object(Bucket=BUCKET, Key=name)
        else:
            body = bytearray(s3.client().get_object(Bucket=BUCKET, Key=name)["Body"].read())
            body[7] ^= 1
            meta = s3.client().head_object(Bucket=BUCKET, Key=name)["Metadata"]
            s3.client().put_object(Bucket=BUCKET, Key=name, Body=bytes(body), Metadata=meta)
        assert check_get(cache, [good, bad]) == 1
        assert cache.lookup([bad])[0] == 0 and cache.engine.where(bad) < 0
        assert name not in objects(s3)
        assert cache.stats()["checksum_failures"] == (1 if damage == "corrupt" else 0)
        check_consistent(cache)
    finally:
        close(cache)


def test_chunks_read_one_by_one_after_the_store_stops_answering_stay_and_those_it_said_are_gone_go(
    s3, tmp_path, outage
):
    """The batch read fails on a chunk whose objects are gone (404): the chunks are read one by one, and the store
    stops answering on the next one. The gone chunk is dropped; the one the store did not answer for stays."""
    cache = open_cache(s3, tmp_path, l4=8, replicas=2)
    try:
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys, chunks(keys))
        gone, unanswered = keys[2], keys[3]
        assert cache.lookup([gone, unanswered]) == (2, ["l4_pool"] * 2)
        for r in range(2):
            s3.client().delete_object(Bucket=BUCKET, Key=f"kv/{gone.digest()}.{r}")
        outage.kind = "timeout"  # only the one-object reads of the other chunk: the batch fails with the 404
        outage.only = lambda req, row: len(req.plan.key) == 1 and unanswered.digest() in req.plan.key[row]
        assert check_get(cache, keys) == 2
        assert outage.asked == 1  # its first replica: the store is not asked again for the second
        assert cache.engine.where(gone) < 0 and cache.lookup([unanswered]) == (1, ["l4_pool"])
        assert set(chunk_objects([unanswered])) <= set(objects(s3))
        check_consistent(cache)
        outage.kind = None
        assert check_get(cache, [unanswered]) == 1
    finally:
        outage.kind = None
        close(cache)


@pytest.mark.parametrize("kind", ["timeout", "refused", "slowdown", "forbidden"])
def test_a_failed_write_down_keeps_the_chunks_whose_slots_the_plan_left_free(s3, tmp_path, outage, kind):
    """L4 unreachable (or refusing the writes: 403) while L1 evicts a batch (a full L1 of 4 down to 2): the 3 chunks
    demoted to L4 are not lost silently. The 2 whose L1 slots the plan left free stay there, readable; the one
    whose slot the new chunk took is dropped and counted, and no lookup claims it. Once the store answers,
    demotions reach L4 again.

    Before: a failed write down dropped every chunk of the batch from every tier, uncounted (a refused one, until
    session 30, still did)."""
    cache = open_cache(s3, tmp_path, l1=4, l4=8, replicas=1, l1_hbm={"low_watermark": 0.5})
    try:
        keys = chunk_keys(range(6), "m", "t")
        cache.put(keys[:4], chunks(keys[:4]))
        outage.kind, outage.ops = kind, frozenset({"PUT"})
        assert cache.put(keys[4:5], chunks(keys[4:5])) == 1
        assert outage.asked >= 1
        j4 = cache.names.index("l4_pool")
        assert not cache.engine.resident[j4]
        held = [k for k in keys[:4] if cache.engine.where(k) == 0]
        lost = [k for k in keys[:4] if cache.engine.where(k) < 0]
        assert len(held) == 3 and len(lost) == 1  # the one L1 kept, and 2 of the 3 it evicted
        assert cache.stats()["write_down_failures"] == {"kept": 2, "dropped": 1}
        assert all(check_get(cache, [k]) == 1 for k in held)  # byte-exact
        assert cache.lookup(lost) == (0, [])
        assert set(objects(s3)) <= {INDEX_OBJECT}
        check_consistent(cache)
        outage.kind = None  # the store answers again: the next batch reaches L4
        assert cache.put(keys[5:], chunks(keys[5:])) == 1
        down = sorted(cache.engine.resident[j4])
        assert len(down) == 3 and check_get(cache, down) == 3
        assert cache.stats()["write_down_failures"] == {"kept": 2, "dropped": 1}
        check_consistent(cache)
    finally:
        outage.kind = None
        close(cache)


def test_a_chunk_whose_slot_the_plan_reused_is_copied_to_a_free_slot_the_plan_left_alone(s3, tmp_path, outage):
    """L1 (4 slots) evicts at 3 chunks down to 2, to an L4 that does not answer: of its 2 victims, one stays at its
    slot and the other, whose slot the new chunk takes, is copied first into the slot no chunk used: every byte of
    all four is delivered."""
    watermarks = {"high_watermark": 0.75, "low_watermark": 0.5}
    cache = open_cache(s3, tmp_path, l1=4, l4=8, replicas=1, l1_hbm=watermarks)
    try:
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys[:3], chunks(keys[:3]))  # L1 at its high watermark
        outage.kind, outage.ops = "refused", frozenset({"PUT"})
        assert cache.put(keys[3:], chunks(keys[3:])) == 1
        assert outage.asked >= 1
        assert [cache.engine.where(k) for k in keys] == [0] * 4
        assert cache.stats()["write_down_failures"] == {"kept": 2, "dropped": 0}
        assert check_get(cache, keys) == 4
        check_consistent(cache)
    finally:
        outage.kind = None
        close(cache)


def test_chunks_kept_in_l3_after_a_failed_write_down_are_in_its_index_after_a_restart(s3, tmp_path, outage):
    """L3 evicts a batch (4 down to 2) to an L4 that does not answer: the 2 chunks whose L3 slots the plan left
    free stay in L3, and the L3 index says so (it had recorded their slots freed), so a restart finds them."""
    keys = chunk_keys(range(6), "m", "t")
    cache = open_cache(s3, tmp_path, l1=1, l3=4, l4=8, replicas=1, l3_nvme={"low_watermark": 0.5})
    try:
        for k in keys[:5]:  # one at a time: each demotes the one before from L1 to L3, which ends full
            cache.put([k], chunks([k]))
        j3 = cache.names.index("l3_nvme")
        assert sorted(cache.engine.resident[j3]) == sorted(keys[:4])
        outage.kind, outage.ops = "refused", frozenset({"PUT"})
        cache.put(keys[5:], chunks(keys[5:]))  # keys[4] to L3, which evicts 3 to L4
        outage.kind = None
        in_l3 = sorted(cache.engine.resident[j3])
        assert len(in_l3) == 4 and keys[4] in in_l3
        assert cache.stats()["write_down_failures"] == {"kept": 2, "dropped": 1}
        check_consistent(cache)
    finally:
        outage.kind = None
        close(cache)
    cache = open_cache(s3, tmp_path, l1=1, l3=4, l4=8, replicas=1, l3_nvme={"low_watermark": 0.5})
    try:
        assert sorted(cache.engine.resident[cache.names.index("l3_nvme")]) == in_l3
        assert check_get(cache, in_l3) == 4  # byte-exact, verified against the CRC32Cs the index kept
    finally:
        close(cache)
