"""The tiered cache moves real bytes: every delivered chunk is the one put, across tiers, restarts and faults."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datamover import Agent
from datamover.backends import backend_status
from datamover.errors import BackendUnavailable, InvalidParameter, TransferIOError, TransferStateError
from datamover.policy.cache import DATA_FILE, TieredCache
from datamover.policy.config import ConfigError, TierConfig, with_overrides
from datamover.policy.keys import ChunkKey, chunk_keys
from datamover.policy.l3_index import L3Index
from datamover.policy.mover import Mover
from datamover.telemetry.metrics import CacheMetrics
from datamover.testing.s3server import S3Server
from tests.policy.full_disk import FullDisk

PAGE = 4096
GB = 1 << 30


def torch_cuda() -> bool:
    """Whether L1 can live on a GPU here (the cuda backend and torch both see one)."""
    if not backend_status("cuda")[0]:
        return False
    import torch

    return torch.cuda.is_available()


def tiers(tmp: Path, l1: int = 3, l2: int = 5, l3: int | None = 8, **sections) -> TierConfig:
    """A small stack: l1/l2/l3 capacities in chunks of 4 KiB, no cooldown (so tests choose what moves)."""
    config = {
        "l1_hbm": {"block_pool_size": l1, "page_size_bytes": PAGE, "device": "dram"},
        "l2_dram": {"enabled": l2 > 0, "pinned_pool_gb": max(l2, 1) * PAGE / GB, "hysteresis_cooldown_s": 0.0},
        "l3_nvme": {
            "enabled": l3 is not None,
            "path": str(tmp / "l3"),
            "capacity_gb": (l3 or 1) * PAGE / GB,
            "fsync_mode": "fdatasync",
        },
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return with_overrides(TierConfig(), **config)


def content(key: ChunkKey) -> np.ndarray:
    """Bytes that identify a chunk: any misplaced or stale chunk shows."""
    seed = abs(hash((key.prefix_hash, key.model_version, key.tokenizer_version))) % (1 << 32)
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def chunks(keys) -> np.ndarray:
    return np.concatenate([content(k) for k in keys]) if keys else np.zeros(0, np.uint8)


def check_get(cache: TieredCache, keys) -> int:
    dst = np.zeros(len(keys) * PAGE, np.uint8)
    n = cache.get(keys, dst)
    for i, key in enumerate(keys[:n]):
        assert (dst[i * PAGE : (i + 1) * PAGE] == content(key)).all(), f"wrong bytes for {key}"
    return n


def check_consistent(cache: TieredCache) -> None:
    """Every tier's residents, policy order and slots agree, and no slot is lost or shared."""
    eng = cache.engine
    for j, spec in enumerate(eng.specs):
        assert len(eng.orders[j]) == len(eng.resident[j]) == len(eng.slots[j])
        assert set(eng.slots[j]) == eng.resident[j]
        assert len(set(eng.slots[j].values())) == len(eng.slots[j])
        assert sorted([*eng.free[j], *eng.slots[j].values()]) == list(range(spec.capacity))


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "prefetch"]),
        st.lists(st.integers(0, 25), min_size=1, max_size=6),
        st.sampled_from([0.0, 0.5, 3.0, 50.0, 1000.0]),  # seconds since the previous operation
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=ops,
    write_through=st.booleans(),
    policy=st.sampled_from(["default", "lru"]),
    cooldown=st.sampled_from([0.0, 5.0]),
)
def test_random_operations_deliver_exactly_what_was_put(tmp_path_factory, ops, write_through, policy, cooldown):
    tmp = tmp_path_factory.mktemp("cache")
    mode = "write_through" if write_through else "write_back"
    config = tiers(tmp, policy={"write_mode": mode, "name": policy}, l2_dram={"hysteresis_cooldown_s": cooldown})
    now = [0.0]
    with TieredCache(config, clock=lambda: now[0]) as cache:
        for op, ids, step in ops:
            check_consistent(cache)
            now[0] += step
            keys = chunk_keys(dict.fromkeys(ids), "m1", "t1")
            if op == "put":
                cache.put(keys, chunks(keys))
            elif op == "get":
                expected, _ = cache.lookup(keys)
                assert check_get(cache, keys) == expected
            else:
                cache.prefetch(keys).result()
            assert cache.stats()["checksum_failures"] == 0
        check_consistent(cache)
        resident = cache.stats()["resident"]
        assert resident["l1_hbm"] <= 3 and resident["l2_dram"] <= 5 and resident["l3_nvme"] <= 8


# Sequences that once lost a chunk's CRC: a chunk demoted from L1 was dropped from L3 in the same operation
# (so it sat in no tier for a moment) and its CRC went with it; the next L3 read of it failed.
REGRESSIONS = [
    (
        "write_through",
        [
            ("put", [1]),
            ("put", [24]),
            ("put", [10, 7]),
            ("put", [8, 5, 10, 12]),
            ("put", [14, 15, 1]),
            ("get", [12]),
            ("get", [7, 8, 5, 10]),
            ("prefetch", [1, 15]),
        ],
    ),
    (
        "write_back",
        [
            ("put", [22, 12, 15]),
            ("put", [16, 9, 18, 7, 22]),
            ("put", [2, 13, 8, 3]),
            ("put", [4, 0, 11]),
            ("prefetch", [12, 7, 15, 1]),
            ("put", [18, 24, 6, 21, 16]),
            ("get", [0, 4]),
            ("get", [12, 5, 17]),
        ],
    ),
]


@pytest.mark.parametrize(("mode", "sequence"), REGRESSIONS)
def test_chunk_dropped_mid_demotion_keeps_its_crc(tmp_path, mode, sequence):
    config = tiers(tmp_path, policy={"name": "lru", "write_mode": mode})
    with TieredCache(config) as cache:
        for op, ids in sequence:
            keys = chunk_keys(ids, "m", "t")
            if op == "put":
                cache.put(keys, chunks(keys))
            elif op == "get":
                check_get(cache, keys)
            else:
                cache.prefetch(keys).result()
        assert cache.checksum_failures == 0
        check_consistent(cache)


def test_seeded_operation_mixes(tmp_path):
    """Longer seeded runs (60 operations, clock jumps, every policy and write mode): bytes and CRCs stay right."""
    for seed in range(8):
        rng = np.random.default_rng(seed)
        now = [0.0]
        config = tiers(
            tmp_path / str(seed),
            policy={"name": ["default", "lru"][seed % 2], "write_mode": ["write_back", "write_through"][seed // 2 % 2]},
            l2_dram={"hysteresis_cooldown_s": float(rng.choice([0.0, 5.0]))},
        )
        with TieredCache(config, clock=lambda now=now: now[0]) as cache:
            for _ in range(60):
                now[0] += float(rng.choice([0, 0.5, 3, 50, 1000]))
                keys = chunk_keys(dict.fromkeys(rng.integers(0, 25, rng.integers(1, 6)).tolist()), "m", "t")
                op = rng.choice(["put", "get", "prefetch"])
                if op == "put":
                    cache.put(keys, chunks(keys))
                elif op == "get":
                    check_get(cache, keys)
                else:
                    cache.prefetch(keys).result()
                assert cache.checksum_failures == 0, seed
            check_consistent(cache)


def test_tiers_fill_in_order_and_promote_on_hit(tmp_path):
    with TieredCache(tiers(tmp_path)) as cache:
        keys = chunk_keys(range(10), "m", "t")
        assert cache.put(keys, chunks(keys)) == 10
        n, where = cache.lookup(keys)
        assert n == 10 and where.count("l1_hbm") == 3 and where.count("l2_dram") == 5 and where.count("l3_nvme") == 2
        assert "stands in for HBM" in cache.notes[0]
        old = [k for k, t in zip(keys, where, strict=True) if t == "l3_nvme"]
        assert check_get(cache, old) == 2
        assert cache.lookup(old)[1] == ["l1_hbm", "l1_hbm"]  # promoted
        assert cache.stats()["hits"]["l3_nvme"] == 2


def test_l3_survives_a_restart(tmp_path):
    keys = chunk_keys(range(12), "m", "t")
    with TieredCache(tiers(tmp_path, l1=2, l2=2, l3=20)) as cache:
        cache.put(keys, chunks(keys))
        on_l3 = [k for k, t in zip(keys, cache.lookup(keys)[1], strict=True) if t == "l3_nvme"]
    assert len(on_l3) == 8
    with TieredCache(tiers(tmp_path, l1=2, l2=2, l3=20)) as cache:
        assert cache.lookup(on_l3) == (8, ["l3_nvme"] * 8)
        assert "found again" in cache.notes[-1]
        assert check_get(cache, on_l3) == 8


def test_corrupt_chunk_is_a_miss_never_wrong_bytes(tmp_path, caplog):
    keys = chunk_keys(range(6), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=10)) as cache:
        cache.put(keys, chunks(keys))  # last chunk first: keys[0] is the one in L1 (lost at restart)
        other = chunk_keys([99], "m", "t")
        cache.put(other, chunks(other))  # which it leaves for L3, as the others did
        slot = cache.engine.slots[1][keys[2]]
    with open(tmp_path / "l3" / DATA_FILE, "r+b") as f:  # flip a byte of chunk 2 on "disk"
        f.seek(slot * PAGE + 100)
        byte = f.read(1)
        f.seek(slot * PAGE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=10)) as cache:
        assert cache.lookup(keys)[0] == 6
        assert check_get(cache, keys) == 2  # chunks 0 and 1; chunk 2 failed its CRC32C
        assert cache.stats()["checksum_failures"] == 1
        assert cache.lookup([keys[2]])[0] == 0  # dropped: next time it is recomputed
        assert str(keys[2]) in caplog.text


def test_other_model_or_tokenizer_version_never_hits(tmp_path):
    with TieredCache(tiers(tmp_path)) as cache:
        keys = chunk_keys(range(4), "llama@1", "tok@1")
        cache.put(keys, chunks(keys))
        assert cache.lookup(chunk_keys(range(4), "llama@2", "tok@1"))[0] == 0
        assert check_get(cache, chunk_keys(range(4), "llama@1", "tok@2")) == 0
        assert check_get(cache, keys) == 4


def test_pinned_chunks_stay(tmp_path):
    with TieredCache(tiers(tmp_path, l1=3, l2=0, l3=None)) as cache:
        hot = chunk_keys([1, 2], "m", "t")
        cache.put(hot, chunks(hot))
        cache.pin(hot)
        cold = chunk_keys(range(10, 30), "m", "t")
        cache.put(cold, chunks(cold))
        assert cache.lookup(hot)[0] == 2
        cache.unpin(hot)
        cache.put(cold, chunks(cold))
        more = chunk_keys(range(40, 60), "m", "t")
        cache.put(more, chunks(more))
        assert cache.lookup(hot)[0] == 0


def test_drain_moves_every_unique_chunk_down(tmp_path):
    with TieredCache(tiers(tmp_path, l1=4, l2=8, l3=None)) as cache:
        keys = chunk_keys(range(6), "m", "t")
        cache.put(keys, chunks(keys))
        assert cache.drain("l1_hbm") == 4
        assert cache.lookup(keys) == (6, ["l2_dram"] * 6)
        assert check_get(cache, keys) == 6
        new = chunk_keys([99], "m", "t")
        cache.put(new, chunks(new))
        assert cache.lookup(new)[1] == ["l2_dram"]  # a drained tier takes no new chunks
        with pytest.raises(ValueError, match="no enabled tier below"):
            cache.drain("l2_dram")


def test_prefetch_promotes_in_the_background(tmp_path):
    with TieredCache(tiers(tmp_path, l1=2, l2=2, l3=10)) as cache:
        keys = chunk_keys(range(8), "m", "t")
        cache.put(keys, chunks(keys))  # last chunk first: the first two end in L1, the last two in L3
        cold = keys[6:]
        assert cache.lookup(cold)[1] == ["l3_nvme", "l3_nvme"]
        assert cache.prefetch(cold).result(timeout=10) == 2
        assert cache.lookup(cold)[1] == ["l1_hbm", "l1_hbm"]
        assert check_get(cache, cold) == 2


def test_spans_and_metrics(tmp_path):
    spans = tmp_path / "spans.jsonl"
    config = tiers(
        tmp_path,
        l1=2,
        l2=4,
        l3=None,
        policy={"name": "lru"},  # LRU admits everything: the second put demotes
        observability={
            "spans": True,
            "span_path": str(spans),
            "span_fields": ["from_tier", "to_tier", "prefix_hash", "hit_or_miss", "token_range"],
        },
    )
    metrics = CacheMetrics()
    with TieredCache(config, metrics=metrics) as cache:
        keys = chunk_keys(range(4), "m", "t")
        cache.put(keys, chunks(keys))
        assert check_get(cache, keys + chunk_keys([77], "m", "t")) == 4
        more = chunk_keys(range(4, 8), "m", "t")
        cache.put(more, chunks(more))  # demotes the chunks put before from L1 to L2
    rows = [json.loads(line) for line in spans.read_text().splitlines()]
    assert all(set(r) == {"from_tier", "to_tier", "prefix_hash", "hit_or_miss", "token_range"} for r in rows)
    puts = [r for r in rows if r["from_tier"] == "caller"]  # chunks demoted in the same put come from the caller
    assert sorted(r["prefix_hash"] for r in puts if r["to_tier"] == "l1_hbm") == list(range(8))
    assert {r["hit_or_miss"] for r in puts} == {"miss"}
    # chunk 3 of 16 tokens, copied from the caller to L1 and, demoted in the same put, to L2
    assert [r["token_range"] for r in puts if r["prefix_hash"] == 3] == [[48, 64], [48, 64]]
    assert {"evict", "hit"} <= {r["hit_or_miss"] for r in rows}
    text = metrics.render().decode()
    assert "datamover_cache_misses_total 1.0" in text
    assert 'datamover_cache_hits_total{tier="l2_dram"} 2.0' in text
    assert 'datamover_tier_resident_chunks{tier="l1_hbm"} 2.0' in text
    assert 'datamover_cache_evictions_total{tier="l1_hbm"}' in text


@pytest.mark.skipif(not S3Server.available()[0], reason=S3Server.available()[1])
def test_l4_object_pool_round_trip(tmp_path):
    with S3Server(bucket="kv-cache") as srv:
        agent = Agent("kv-test", {"backends": {"memcpy": {}, "posix": {}, "s3": srv.config()}})
        config = tiers(
            tmp_path,
            l1=2,
            l2=0,
            l3=None,
            l4_pool={"enabled": True, "bucket": "kv-cache", "capacity_gb": 16 * PAGE / GB, "replica_count": 2},
        )
        with TieredCache(config, agent=agent) as cache:
            keys = chunk_keys(range(6), "m", "t")
            cache.put(keys, chunks(keys))
            assert cache.lookup(keys)[1].count("l4_pool") == 4
            listed = srv.client().list_objects_v2(Bucket="kv-cache")["Contents"]
            listed = [o for o in listed if o["Key"] != "kv/datamover-l4-index"]
            assert len(listed) == 8  # 4 chunks x 2 replicas
            first = next(o["Key"] for o in listed if o["Key"].endswith(".0"))
            srv.client().delete_object(Bucket="kv-cache", Key=first)  # a lost replica: the other one serves
            assert check_get(cache, keys) == 6
        agent.close()


def test_capacity_that_does_not_fit_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        TieredCache(tiers(tmp_path, l3=None, l2_dram={"pinned_pool_gb": 1e7}))
    assert err.value.path == "kv_cache_tiered.l2_dram.pinned_pool_gb"


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA GPU with the cuda backend usable")
def test_l1_on_the_gpu(tmp_path):
    with TieredCache(tiers(tmp_path, l1_hbm={"device": "cuda"})) as cache:
        assert cache.tiers[0].mem.name == "VRAM" and "stands in" not in " ".join(cache.notes)
        keys = chunk_keys(range(12), "m", "t")
        cache.put(keys, chunks(keys))
        assert cache.lookup(keys)[1].count("l1_hbm") == 3
        assert check_get(cache, keys) == 12
        assert check_get(cache, keys[:3]) == 3


@pytest.mark.skipif(torch_cuda(), reason="checks the refusal on a machine without a GPU")
def test_l1_on_cuda_without_a_gpu_says_why(tmp_path):
    with pytest.raises(BackendUnavailable, match="cannot live on a GPU here"):
        TieredCache(tiers(tmp_path, l1_hbm={"device": "cuda"}))


def test_lists_of_buffers_and_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    with TieredCache(tiers(tmp_path)) as cache:
        keys = chunk_keys(range(5), "m", "t")
        src = [torch.from_numpy(content(k).copy()) for k in keys]  # one CPU tensor per chunk
        assert cache.put(keys, src) == 5
        out = [bytearray(PAGE) for _ in keys]
        assert cache.get(keys, out) == 5
        assert all(bytes(o) == content(k).tobytes() for o, k in zip(out, keys, strict=True))
        with pytest.raises(ValueError, match="chunk"):
            cache.get(keys, np.zeros(PAGE, np.uint8))  # room for one chunk, five asked


def test_concurrent_callers_see_consistent_chunks(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with TieredCache(tiers(tmp_path)) as cache:

        def worker(seed: int) -> int:
            rng = np.random.default_rng(seed)
            delivered = 0
            for _ in range(30):
                keys = chunk_keys(dict.fromkeys(rng.integers(0, 25, 4).tolist()), "m", "t")
                if rng.random() < 0.5:
                    cache.put(keys, chunks(keys))
                else:
                    delivered += check_get(cache, keys)
                    cache.prefetch(keys)
            return delivered

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(worker, range(4)))
        assert sum(results) > 0
        assert cache.stats()["checksum_failures"] == 0


def test_l3_written_with_another_chunk_size_is_not_served_even_unchecked(tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=10)) as cache:
        cache.put(keys, chunks(keys))
    config = with_overrides(
        tiers(tmp_path, l1=1, l2=0, l3=10, l3_nvme={"crc32c_check": False, "capacity_gb": 20 * PAGE / GB}),
        l1_hbm={"page_size_bytes": 2 * PAGE},
    )
    with TieredCache(config) as cache:  # the same file read as 2-page chunks would be other bytes
        assert cache.lookup(keys[1:])[0] == 0


def test_l3_chunks_past_the_end_of_a_cut_data_file_are_not_served_even_unchecked(tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    config = tiers(tmp_path, l1=1, l2=0, l3=10, l3_nvme={"crc32c_check": False})
    with TieredCache(config) as cache:
        cache.put(keys, chunks(keys))  # L1 keeps keys[0]; L3 the other five, in its first five slots
        slots = {k: cache.engine.slots[cache.names.index("l3_nvme")][k] for k in keys[1:]}
    kept = [k for k in keys[1:] if slots[k] < 2]
    os.truncate(tmp_path / "l3" / DATA_FILE, 2 * PAGE)  # the file loses all but its first two slots
    with TieredCache(config) as cache:
        assert {k for k in keys[1:] if cache.lookup([k])[0]} == set(kept)
        for k in kept:
            assert check_get(cache, [k]) == 1


def test_an_index_log_that_cannot_be_written_fails_no_put_and_close_writes_what_is_true(tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    config = tiers(tmp_path, l1=1, l2=0, l3=10)
    with TieredCache(config) as cache:
        cache.index._file = FullDisk(cache.index._file)
        cache.put(keys, chunks(keys))  # the chunks reach L3; their records cannot: no error for the caller
        assert not (tmp_path / "l3" / "index.log").exists()  # removed: a log cut short would mislead a restart
        assert check_get(cache, keys) == 6
    with TieredCache(config) as cache:  # close could write the index again: the chunks L3 holds are found
        assert cache.lookup(keys[1:])[0] == 5
        assert check_get(cache, keys[1:]) == 5


def test_an_index_that_cannot_be_written_at_close_leaves_a_cold_start(tmp_path, monkeypatch):
    keys = chunk_keys(range(6), "m", "t")
    config = tiers(tmp_path, l1=1, l2=0, l3=10, l3_nvme={"crc32c_check": False})
    with TieredCache(config) as cache:
        cache.put(keys, chunks(keys))
        cache.index._file = FullDisk(cache.index._file)
        cache.put(keys[:1], chunks(keys[:1]))
        monkeypatch.setattr(L3Index, "rewrite", lambda self, entries: FullDisk(None).write(b""))
    monkeypatch.undo()  # close() returned, the agent closed: nothing raised
    with TieredCache(config) as cache:
        assert cache.lookup(keys[1:])[0] == 0


CRASH_AFTER_DATA = """
import os, sys
import numpy as np
from datamover.policy import TieredCache
from datamover.policy.config import TierConfig, with_overrides
from datamover.policy.keys import chunk_keys
from datamover.policy.mover import Mover

config = with_overrides(TierConfig(), **{sections!r})
run = Mover.run
def crash(self, plan, user, index):  # the process dies once the chunk data is written, before its record
    run(self, plan, user, index)
    if any(m.key.prefix_hash == 9 for m in plan):
        os._exit(0)
Mover.run = crash
def put(*ids):  # each chunk's bytes are its prefix hash
    cache.put(chunk_keys(ids, "m", "t"), np.repeat(np.array(ids, np.uint8), {page}))

cache = TieredCache(config)
put(1, 2)  # L1 keeps 1, L3 (two slots) 2
put(3, 4)  # L3 holds two of 1, 2, 3
put(9)  # a slot of L3 is reused
"""


def test_a_crash_between_a_slots_new_data_and_its_record_never_serves_the_old_key_unchecked(tmp_path):
    sections = {
        "l1_hbm": {"block_pool_size": 1, "page_size_bytes": PAGE, "device": "dram"},
        "l2_dram": {"enabled": False},
        "l3_nvme": {
            "enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 2 * PAGE / GB, "fsync_mode": "none",
            "crc32c_check": False,
        },
    }  # fmt: skip
    subprocess.run(
        [sys.executable, "-c", CRASH_AFTER_DATA.format(sections=sections, page=PAGE)], check=True, timeout=120
    )
    config = with_overrides(TierConfig(), **sections)
    with TieredCache(config) as cache:
        for key in chunk_keys([1, 2, 3, 4, 9], "m", "t"):
            if cache.lookup([key])[0]:
                dst = np.zeros(PAGE, np.uint8)
                assert cache.get([key], dst) == 1
                assert (dst == key.prefix_hash).all(), key


def test_l3_index_with_a_torn_tail_keeps_what_it_can(tmp_path):
    keys = chunk_keys(range(6), "m", "t")
    config = tiers(tmp_path, l1=1, l2=0, l3=10)
    with TieredCache(config) as cache:
        cache.put(keys, chunks(keys))  # last chunk first: L1 keeps keys[0] and demotes the other five
    index = tmp_path / "l3" / "index.log"
    with open(index, "ab") as f:
        f.write(b"\x94\xa3put\x07")  # a record cut off by a crash
    with TieredCache(config) as cache:
        assert cache.lookup(keys[1:])[0] == 5  # the five chunks L1 had demoted
        assert check_get(cache, keys[1:]) == 5
        check_consistent(cache)


def test_two_caches_never_share_an_l3_directory(tmp_path):
    config = tiers(tmp_path, l1=1, l2=0, l3=4)
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(config) as cache:
        cache.put(keys, chunks(keys))
        with pytest.raises(ConfigError, match=rf"l3_nvme.path: .* in use by another cache \(pid {os.getpid()}\)"):
            TieredCache(config)
        doc = {
            "kv_cache_tiered": {
                "l1_hbm": {"block_pool_size": 1, "page_size_bytes": PAGE, "device": "dram"},
                "l3_nvme": {"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 4 * PAGE / GB},
            }
        }
        script = f"from datamover.policy import TieredCache\nTieredCache({doc!r})"
        other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and "in use by another cache" in other.stderr
        assert check_get(cache, keys) == 3  # the refused caches touched nothing
    with TieredCache(config) as cache:  # closed: the directory is free again, and warm
        assert cache.lookup(keys[1:])[0] == 2


def test_a_closed_cache_refuses_every_call_but_stats_and_close(tmp_path):
    keys = chunk_keys(range(3), "m", "t")
    cache = TieredCache(tiers(tmp_path, l1=2, l2=2, l3=4))
    cache.put(keys, chunks(keys))
    cache.close()
    cache.close()  # once is enough; again does nothing
    calls = {
        "lookup": lambda: cache.lookup(keys),
        "get": lambda: cache.get(keys, np.zeros(3 * PAGE, np.uint8)),
        "put": lambda: cache.put(keys, chunks(keys)),
        "prefetch": lambda: cache.prefetch(keys),
        "pin": lambda: cache.pin(keys),
        "unpin": lambda: cache.unpin(keys),
        "drain": lambda: cache.drain("l2_dram"),
    }
    for name, call in calls.items():
        with pytest.raises(TransferStateError, match="TieredCache is closed"):
            call()
            pytest.fail(f"{name} on a closed cache")
    assert cache.stats()["resident"]["l1_hbm"] == 2


def test_clear_forgets_every_chunk_and_the_l3_index_says_so(tmp_path):
    keys = chunk_keys(range(12), "m", "t")
    with TieredCache(tiers(tmp_path)) as cache:
        cache.put(keys, chunks(keys))
        j3 = cache.names.index("l3_nvme")
        held = set().union(*cache.engine.resident)
        assert cache.engine.resident[j3]  # L3 holds chunks a restart would find again
        assert cache.clear() == len(held)
        assert cache.lookup(keys) == (0, []) and not any(cache.engine.resident)
        check_consistent(cache)
        assert cache.put(keys[:3], chunks(keys[:3])) == 3 and check_get(cache, keys[:3]) == 3
    with TieredCache(tiers(tmp_path)) as cache:  # a restart finds only what came after the clear
        assert set(cache.engine.resident[cache.names.index("l3_nvme")]) <= set(keys[:3])


@pytest.mark.parametrize(
    "key",
    [
        ChunkKey(np.uint64(7), "m", "t"),  # equal to, and hashing as, ChunkKey(7, ...): msgpack cannot store it
        ChunkKey(True, "m", "t"),
        ChunkKey(7, "m", None),
        ChunkKey(7, "m", "t", np.int32(3)),
        (7, "m", "t"),
    ],
    ids=["numpy-hash", "bool-hash", "none-tokenizer", "numpy-layer", "plain-tuple"],
)
def test_keys_the_indexes_cannot_record_are_refused_and_the_cache_goes_on(tmp_path, key):
    good = chunk_keys(range(4), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=1, l3=4)) as cache:
        with pytest.raises(InvalidParameter, match=r"keys\[0\]"):
            cache.put([key], np.zeros(PAGE, np.uint8))
        assert cache.put(good, chunks(good)) == 4  # L3 and its index took the later chunks
        assert check_get(cache, good) == 4
        on_disk = set(cache.engine.resident[cache.names.index("l3_nvme")])
    assert on_disk
    with TieredCache(tiers(tmp_path, l1=1, l2=1, l3=4)) as cache:
        assert set(cache.engine.resident[cache.names.index("l3_nvme")]) == on_disk


def test_a_put_of_a_cached_chunk_keeps_its_bytes_and_their_crc(tmp_path, caplog):
    """A recompute of a cached prefix need not be bit-identical: the put counts as a use, it rewrites nothing,
    and the chunk still reads back verified (its CRC32C was replaced with the new bytes' before)."""
    key = chunk_keys([1], "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=1, l3=4)) as cache:
        assert cache.put(key, chunks(key)) == 1
        filler = chunk_keys(range(10, 13), "m", "t")
        cache.put(filler, chunks(filler))  # the chunk goes down to L3
        assert cache.lookup(key)[1] == ["l3_nvme"]
        assert cache.put(key, np.full(PAGE, 0xEE, np.uint8)) == 0
        assert check_get(cache, key) == 1
        assert cache.stats()["checksum_failures"] == 0
    assert "CRC32C mismatch" not in caplog.text


def test_put_counts_only_the_chunks_it_stored(tmp_path, monkeypatch):
    real, calls = Mover._transfer, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise TransferIOError("injected: pwritev failed", errno=errno.EIO)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Mover, "_transfer", failing)
    keys = chunk_keys([1, 2], "m", "t")
    with TieredCache(tiers(tmp_path, l1=4, l2=0, l3=4)) as cache:
        assert cache.put(keys, chunks(keys)) == 0  # the one write failed: nothing is held
        assert cache.lookup(keys)[0] == 0
        assert cache.put(keys, chunks(keys)) == 2


def test_a_prefetch_racing_close_is_refused_typed(tmp_path, monkeypatch):
    cache = TieredCache(tiers(tmp_path, l1=2, l2=2, l3=4))
    keys = chunk_keys(range(3), "m", "t")
    cache.put(keys, chunks(keys))
    shutdown = cache._prefetcher.shutdown

    def shut_then_prefetch(wait=True, **kwargs):
        shutdown(wait=wait, **kwargs)
        with pytest.raises(TransferStateError, match="TieredCache is closing"):
            cache.prefetch(keys)  # after the prefetcher stopped, before the cache says it is closed

    monkeypatch.setattr(cache._prefetcher, "shutdown", shut_then_prefetch)
    cache.close()
    assert cache.closed


def test_chunks_written_without_checksums_are_not_served_once_checking_is_on(tmp_path, caplog):
    """A run with crc32c_check off records no CRC32C; a later run with it on cannot verify those chunks: it does
    not use them (it reported every one as corrupt, each an ERROR and a checksum failure)."""
    keys = chunk_keys(range(4), "m", "t")
    unchecked = tiers(tmp_path, l1=1, l2=0, l3=8, l3_nvme={"crc32c_check": False})
    with TieredCache(unchecked) as cache:
        cache.put(keys, chunks(keys))
        on_disk = set(cache.engine.resident[cache.names.index("l3_nvme")])
    assert on_disk
    with TieredCache(unchecked) as cache:  # still unchecked: found again and served
        assert set(cache.engine.resident[cache.names.index("l3_nvme")]) == on_disk
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=8)) as cache:
        assert not cache.engine.resident[cache.names.index("l3_nvme")]
        assert f"l3_nvme: {len(on_disk)} chunks written without crc32c_check not used" in cache.stats()["notes"]
        assert check_get(cache, keys) == 0 and cache.stats()["checksum_failures"] == 0
        cache.put(keys, chunks(keys))
        assert check_get(cache, keys) == 4
    assert "CRC32C mismatch" not in caplog.text


@pytest.mark.parametrize("where", ["missing/dir/spans.jsonl", "."])
def test_a_span_file_that_cannot_be_opened_is_named(tmp_path, where):
    """Was a bare FileNotFoundError / IsADirectoryError from the exporter's open()."""
    span_path = str(tmp_path / where)
    with pytest.raises(ConfigError, match="cannot append spans to") as err:
        TieredCache(tiers(tmp_path, l3=None, observability={"spans": True, "span_path": span_path}))
    assert err.value.path == "kv_cache_tiered.observability.span_path"


def test_a_policy_name_nothing_is_registered_as_is_named(tmp_path, capsys):
    """Was a KeyError traceback from deep inside the cache's engine, and from datamover replay."""
    from datamover.policy.cli import main as replay_main
    from datamover.policy.policies import LRUPolicy, register_policy

    config = tiers(tmp_path, l3=None, policy={"name": "mine"})  # a plug-in name: the config takes it
    with pytest.raises(ConfigError, match="no policy is registered as 'mine'; registered: adaptive") as err:
        TieredCache(config)
    assert err.value.path == "kv_cache_tiered.policy.name"
    file = tmp_path / "tiers.yaml"
    file.write_text("kv_cache_tiered:\n  policy: {name: mine}\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n')
    assert replay_main([str(trace), "--config", str(file)]) == 2
    assert "kv_cache_tiered.policy.name: no policy is registered as 'mine'" in capsys.readouterr().err
    assert replay_main([str(trace), "--config", str(file), "--policy", "lru"]) == 0  # the configured one not run
    register_policy("mine", lambda settings: LRUPolicy())  # registered after the config was made: taken
    try:
        TieredCache(config).close()
    finally:
        from datamover.policy import policies

        policies._REGISTRY.pop("mine")
