"""SGLang HiCache on datamover: loaded through SGLang's own StorageBackendFactory, v0 and v1 byte-exact."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.integrations.engine_support import require

require("sglang")
torch = pytest.importorskip("torch")

from datamover.testing.engines import DIM, HEADS, LAYERS, PAGE, PageFirstHostPool  # noqa: E402

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from datamover.integrations.sglang import DatamoverHiCacheStorage

# SGLang (and the adapter, which imports it) are imported by the tests as they run, not while pytest collects


def storage_config(tmp_path: Path, interface_v1: int, **tiers: object) -> HiCacheStorageConfig:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra = {
        "backend_name": "datamover",
        "module_path": "datamover.integrations.sglang",
        "class_name": "DatamoverHiCacheStorage",
        "interface_v1": interface_v1,
        "kv_cache_tiered": tiers or {"l2_dram": {"pinned_pool_gb": 0.01}},
    }
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny-llama",
        extra_config=extra,
    )


def attach(config: HiCacheStorageConfig, pool: PageFirstHostPool) -> DatamoverHiCacheStorage:
    """What SGLang's cache controller does: create the dynamic backend, then hand it the host pool."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage


def fill(pool: PageFirstHostPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g))


def keys(n: int, tag: str = "") -> list[str]:
    return [f"{tag}{i:064x}" for i in range(1, n + 1)]


def test_factory_loads_the_backend_by_module_path(tmp_path: Path) -> None:
    from datamover.integrations.sglang import DatamoverHiCacheStorage

    pool = PageFirstHostPool(4)
    storage = attach(storage_config(tmp_path, 1), pool)
    try:
        assert type(storage) is DatamoverHiCacheStorage
        assert storage._entries_per_page == 2  # a K and a V entry per page: each a 4 KiB chunk
        assert storage.cache.page == LAYERS * PAGE * HEADS * DIM * 2
    finally:
        storage.close()


def test_v1_round_trip_is_byte_exact_and_batch_exists_gives_the_hit_prefix(tmp_path: Path) -> None:
    pool = PageFirstHostPool(16)
    fill(pool, 1)
    storage = attach(storage_config(tmp_path, 1), pool)
    try:
        ks = keys(8)
        assert storage.batch_exists(ks) == 0
        src = [0, 1, 2, 3, 4]
        expected = [pool.page(p).clone() for p in src]
        assert storage.batch_set_v1(ks[:5], pool.indices(src)) == [True] * 5
        assert storage.batch_exists(ks) == 5  # pages 6..8 were never stored
        assert storage.batch_exists(ks[:3]) == 3
        assert storage.batch_exists([ks[0], keys(1, "x")[0], ks[2]]) == 1  # a gap ends the prefix
        assert storage.exists(ks[4]) and not storage.exists(ks[5])

        dst = [9, 12, 10, 15, 11]  # other host slots, out of order
        pool.kv_buffer[:, pool.indices(dst)] = 0
        assert storage.batch_get_v1(ks[:5], pool.indices(dst)) == [True] * 5
        for want, p in zip(expected, dst):
            assert torch.equal(pool.page(p), want)
        # pages past the prefix report False; what was found before them still loads
        assert storage.batch_get_v1(ks[3:7], pool.indices([5, 6, 7, 8])) == [True, True, False, False]
        assert torch.equal(pool.page(5), expected[3]) and torch.equal(pool.page(6), expected[4])
        stats = storage.tier_stats()
        assert stats["hits"]["l2_dram"] == 2 * 7 and stats["resident"]["l2_dram"] == 10
    finally:
        storage.close()


def test_v0_round_trip_is_byte_exact(tmp_path: Path) -> None:
    storage = attach(storage_config(tmp_path, 0), PageFirstHostPool(4))
    try:
        g = torch.Generator().manual_seed(2)
        pages = [torch.randn(2 * LAYERS * PAGE * HEADS * DIM, generator=g).to(torch.bfloat16) for _ in range(3)]
        ks = keys(3, "v0-")
        assert storage.set(ks[0], pages[0])
        assert storage.batch_set(ks[1:], pages[1:])
        assert storage.batch_exists(ks + keys(1, "miss-")) == 3
        got = storage.get(ks[0], torch.zeros_like(pages[0]))
        assert got is not None and torch.equal(got.view(torch.int16), pages[0].view(torch.int16))
        outs = storage.batch_get(ks + keys(1, "miss-"), [torch.zeros_like(pages[0]) for _ in range(4)])
        assert outs[3] is None
        for out, page in zip(outs[:3], pages):
            assert torch.equal(out.view(torch.int16), page.view(torch.int16))
        fresh = storage.get(ks[2])  # no target: a new tensor of the stored dtype
        assert fresh.dtype == torch.bfloat16 and torch.equal(fresh.view(torch.int16), pages[2].view(torch.int16))
        assert storage.get(keys(1, "miss-")[0]) is None
    finally:
        storage.close()


def test_a_corrupt_page_on_nvme_fails_that_page_and_those_after_it(tmp_path: Path) -> None:
    """L3 only: a chunk whose CRC32C no longer matches is a miss, so SGLang recomputes it (never wrong KV)."""
    tiers = {
        "l2_dram": {"enabled": False},
        "l3_nvme": {"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 0.01, "fsync_mode": "none"},
    }
    pool = PageFirstHostPool(8)
    fill(pool, 3)
    storage = attach(storage_config(tmp_path, 1, **tiers), pool)
    try:
        ks = keys(4)
        assert storage.batch_set_v1(ks, pool.indices([0, 1, 2, 3])) == [True] * 4
        l3 = Path(storage.cache.config.l3_nvme.path)
        slot = storage.cache.engine.slots[0][storage._keys([ks[2]], "v1", 2)[1]]  # page 3's V entry
        with open(l3 / "chunks.dat", "r+b") as f:
            f.seek(slot * storage.cache.page + 100)
            f.write(b"\xff" * 8)
        good = [pool.page(p).clone() for p in (0, 1)]
        assert storage.batch_get_v1(ks, pool.indices([4, 5, 6, 7])) == [True, True, False, False]
        assert torch.equal(pool.page(4), good[0]) and torch.equal(pool.page(5), good[1])
        assert storage.tier_stats()["checksum_failures"] == 1
    finally:
        storage.close()


def test_data_and_context_parallel_ranks_get_l3_directories_of_their_own(tmp_path: Path) -> None:
    """Replicas (dp) hold the same chunks, context-parallel ranks (cp) other slices of each page: none may share
    an L3 directory (a second cache on one is refused), and cp ranks never share chunk keys."""
    from dataclasses import replace

    tiers = {"l3_nvme": {"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 0.01, "fsync_mode": "none"}}
    base = storage_config(tmp_path, 1, **tiers)
    configs = [base, replace(base, dp_rank=1), replace(base, attn_cp_rank=1, attn_cp_size=2)]
    storages = []
    try:
        for config in configs:  # all open side by side
            pool = PageFirstHostPool(2)
            fill(pool, 5)
            storages.append(attach(config, pool))
        paths = {s.cache.config.l3_nvme.path for s in storages}
        assert len(paths) == 3 and all(Path(p).parent == tmp_path / "l3" for p in paths)
        first = [s._keys(keys(1), "v1", 1)[0] for s in storages]
        assert first[0] == first[1] != first[2]  # dp replicas share keys; a cp rank's differ
    finally:
        for storage in storages:
            storage.close()


def test_mla_ranks_share_keys_as_sglang_writes_from_one_rank(tmp_path: Path, caplog) -> None:
    """MLA's KV is replicated over TP and SGLang backs it up from one rank only (backup_skip elsewhere): the
    other ranks must look up the same keys; each rank still has an L3 directory of its own."""
    from dataclasses import replace

    tiers = {"l3_nvme": {"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 0.01, "fsync_mode": "none"}}
    base = replace(storage_config(tmp_path, 1, **tiers), tp_size=2)
    for mla in (True, False):
        storages = []
        try:
            for rank in (0, 1):
                pool = PageFirstHostPool(2)
                fill(pool, 6)
                storages.append(attach(replace(base, tp_rank=rank, is_mla_model=mla), pool))
            assert len({s.cache.config.l3_nvme.path for s in storages}) == 2
            same = storages[0]._keys(keys(1), "v1", 1) == storages[1]._keys(keys(1), "v1", 1)
            assert same == mla
        finally:
            for storage in storages:
                storage.close()
    assert "writes from one rank only" in caplog.text  # no shared pool: the other rank will find nothing


def pool_tiers(bucket: str, master) -> dict:  # type: ignore[no-untyped-def]
    """Tier sections with L4 on a real Mooncake Store pool (`master`: the mooncake_master fixture) under `bucket`."""
    return {
        "l2_dram": {"pinned_pool_gb": 0.01},
        "l4_pool": {
            "enabled": True, "backend": "mooncake", "bucket": bucket, "master_server_addr": master.master_addr,
            "metadata_service_url": master.metadata_url, "segment_gb": 16 / 1024,
        },
    }  # fmt: skip


def test_an_mla_rank_that_never_writes_loads_the_writers_pages_from_a_shared_pool(tmp_path, mooncake_master):
    """Two TP ranks of an MLA model on one real Mooncake Store pool: rank 0 backs pages up (SGLang's writer),
    rank 1 (backup_skip) finds them all and loads them byte for byte."""
    from dataclasses import replace

    tiers = pool_tiers(f"mla-{tmp_path.name}", mooncake_master)
    base = replace(storage_config(tmp_path, 1, **tiers), tp_size=2, is_mla_model=True)
    pools = [PageFirstHostPool(8), PageFirstHostPool(8)]
    fill(pools[0], 7)
    storages = []
    try:
        for rank in (0, 1):
            storages.append(attach(replace(base, tp_rank=rank), pools[rank]))
        ks = keys(4, "mla-")
        assert storages[0].batch_set_v1(ks, pools[0].indices([0, 1, 2, 3])) == [True] * 4
        assert storages[1].batch_exists(ks) == 4
        assert storages[1].batch_get_v1(ks, pools[1].indices([4, 5, 6, 7])) == [True] * 4
        for p in range(4):
            assert torch.equal(pools[1].page(4 + p), pools[0].page(p))
    finally:
        for storage in storages:
            storage.close()


def test_after_close_every_call_is_a_miss_not_an_exception(tmp_path: Path) -> None:
    """SGLang's threads may still call the storage while it shuts down: each call reads as a miss."""
    pool = PageFirstHostPool(4)
    fill(pool, 8)
    storage = attach(storage_config(tmp_path, 1), pool)
    ks = keys(2)
    assert storage.batch_set_v1(ks, pool.indices([0, 1])) == [True, True]
    storage.close()
    assert storage.batch_exists(ks) == 0
    assert storage.batch_get_v1(ks, pool.indices([2, 3])) == [False, False]
    assert storage.batch_set_v1(ks, pool.indices([0, 1])) == [False, False]
    assert storage.get(ks[0]) is None and storage.set(ks[0], pool.page(0)) is False
    storage.close()


def test_clear_forgets_every_page(tmp_path: Path) -> None:
    tiers = {"l3_nvme": {"enabled": True, "path": str(tmp_path / "l3"), "capacity_gb": 0.01, "fsync_mode": "none"}}
    pool = PageFirstHostPool(4)
    fill(pool, 4)
    storage = attach(storage_config(tmp_path, 1, **tiers), pool)
    try:
        ks = keys(2)
        assert storage.batch_set_v1(ks, pool.indices([0, 1])) == [True, True]
        storage.clear()
        assert storage.batch_exists(ks) == 0
        assert storage.batch_set_v1(ks, pool.indices([0, 1])) == [True, True]  # usable again
        assert np.array_equal(storage.batch_get_v1(ks, pool.indices([2, 3])), [True, True])
    finally:
        storage.close()


def test_clear_on_a_shared_pool_leaves_no_page_there_either(tmp_path, mooncake_master):
    """SGLang's own Mooncake store removes every object on clear (a weights update comes before it): pages the
    pool held are not found again through it, by this rank or another instance on the pool."""
    tiers = pool_tiers(f"clr-{tmp_path.name}", mooncake_master)
    pools = [PageFirstHostPool(8), PageFirstHostPool(8)]
    fill(pools[0], 3)
    storages = [attach(storage_config(tmp_path / str(i), 1, **tiers), pools[i]) for i in (0, 1)]
    try:
        ks = keys(4, "clr-")
        assert storages[0].batch_set_v1(ks, pools[0].indices([0, 1, 2, 3])) == [True] * 4
        assert storages[1].batch_exists(ks) == 4  # the other instance finds them in the pool
        storages[0].clear()
        for storage in storages:
            assert storage.batch_exists(ks) == 0
            assert not any(storage.batch_get_v1(ks, pools[1].indices([4, 5, 6, 7])))
    finally:
        for storage in storages:
            storage.close()


def test_the_example_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "sglang_hicache.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--workdir", str(tmp_path), "--pages", "96"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "96 pages loaded, byte-exact: True" in proc.stdout and "l3_nvme" in proc.stdout


def test_ranks_on_one_private_bucket_keep_their_own_pages_across_a_restart(tmp_path: Path, monkeypatch) -> None:
    """L4 on a real S3 server (moto), two TP ranks on one bucket: each rank's pages live under a prefix of its
    own, and a rank restarted finds its pages again in the bucket, byte for byte."""
    from dataclasses import replace

    from datamover.testing.s3server import S3Server

    ok, why = S3Server.available()
    if not ok:
        pytest.skip(why)
    with S3Server(bucket="hicache") as srv:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
        monkeypatch.setenv("AWS_DEFAULT_REGION", srv.region)
        chunk_gb = 4096 / (1 << 30)  # one K or V entry of a page
        tiers = {
            "l2_dram": {"pinned_pool_gb": 2 * chunk_gb},
            "l4_pool": {
                "enabled": True,
                "bucket": "hicache",
                "endpoint": srv.endpoint_url,
                "capacity_gb": 64 * chunk_gb,
            },
            "policy": {"write_mode": "write_through"},  # every page reaches the bucket, not only those L2 evicts
        }
        base = replace(storage_config(tmp_path, 1, **tiers), tp_size=2)
        pools = [PageFirstHostPool(8), PageFirstHostPool(8)]
        fill(pools[0], 11)
        fill(pools[1], 12)
        ks = keys(4, "s3-")
        storages = [attach(replace(base, tp_rank=rank), pools[rank]) for rank in (0, 1)]
        try:
            for rank in (0, 1):
                assert storages[rank].batch_set_v1(ks, pools[rank].indices([0, 1, 2, 3])) == [True] * 4
            prefixes = {s.cache.config.l4_pool.prefix for s in storages}
            assert len(prefixes) == 2 and all(p.startswith("kv/sglang-dp0-tp") for p in prefixes)
        finally:
            for storage in storages:
                storage.close()
        listed = [o["Key"] for o in srv.client().list_objects_v2(Bucket="hicache").get("Contents", [])]
        assert {k.split("/")[1] for k in listed} == {p.split("/")[1] for p in prefixes}
        restarted = attach(replace(base, tp_rank=1), pools[1])
        try:
            assert any("found again" in n for n in restarted.cache.notes)
            assert restarted.batch_exists(ks) == 4
            assert restarted.batch_get_v1(ks, pools[1].indices([4, 5, 6, 7])) == [True] * 4
            for p in range(4):
                assert torch.equal(pools[1].page(4 + p), pools[1].page(p))  # rank 1's own pages, not rank 0's
            restarted.clear()  # SGLang's clear: the bucket's pages of this rank go too
            assert restarted.batch_exists(ks) == 0
            mine = restarted.cache.config.l4_pool.prefix
            listed = [o["Key"] for o in srv.client().list_objects_v2(Bucket="hicache").get("Contents", [])]
            assert [k for k in listed if k.startswith(mine)] == [mine + "datamover-l4-index"]
            assert any(not k.startswith(mine) for k in listed)  # rank 0's pages are kept
        finally:
            restarted.close()
