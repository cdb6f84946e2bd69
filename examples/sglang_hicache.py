"""SGLang HiCache on datamover: the storage backend SGLang loads by module path, driven as SGLang drives it.

    python examples/sglang_hicache.py [--workdir /tmp/dm-sglang]

A real server takes the same configuration on its command line:

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '<the EXTRA_CONFIG below, as JSON>'

Here SGLang's own StorageBackendFactory creates the backend from that configuration and a host KV pool of
SGLang's page_first layout is handed to it (SGLang's host pool classes import torchvision, which the CPU torch
here cannot load); pages then go through the zero-copy v1 calls SGLang's cache controller makes: batch_set_v1 on
write-back, batch_exists for the prefetch hit length, batch_get_v1 into other host slots. It prints the hit
length, checks every byte, and prints the tier table (TieredCache.stats()).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from datamover.testing.engines import PageFirstHostPool


def extra_config(workdir: Path) -> dict:
    return {
        "backend_name": "datamover",
        "module_path": "datamover.integrations.sglang",
        "class_name": "DatamoverHiCacheStorage",
        "interface_v1": 1,
        "kv_cache_tiered": {
            "l2_dram": {"pinned_pool_gb": 0.001},  # 256 chunks of 4 KiB: the rest goes down to NVMe
            "l3_nvme": {"enabled": True, "path": str(workdir / "l3"), "capacity_gb": 0.01, "fsync_mode": "none"},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dm-sglang"))
    parser.add_argument("--pages", type=int, default=192)
    args = parser.parse_args()
    extra = extra_config(args.workdir)
    print("--hicache-storage-backend-extra-config", json.dumps(extra))
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny", extra_config=extra,
    )  # fmt: skip
    pool = PageFirstHostPool(2 * args.pages)
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    try:
        pool.kv_buffer.normal_()
        keys = [f"{i:064x}" for i in range(1, args.pages + 1)]
        src = list(range(args.pages))
        written = storage.batch_set_v1(keys, pool.indices(src))
        print(f"batch_set_v1: {sum(written)} of {len(keys)} pages stored")
        print(f"batch_exists: hit prefix {storage.batch_exists([*keys, 'f' * 64])} pages")
        dst = list(range(args.pages, 2 * args.pages))
        loaded = storage.batch_get_v1(keys, pool.indices(dst))
        exact = all(torch.equal(pool.page(s), pool.page(d)) for s, d in zip(src, dst))
        print(f"batch_get_v1: {sum(loaded)} pages loaded, byte-exact: {exact}")
        stats = storage.tier_stats()
        print("tier table (TieredCache.stats()):")
        for name in stats["hits"]:
            print(f"  {name:8} hits {stats['hits'][name]:>5}  resident {stats['resident'][name]:>5}")
        print(f"  moved {stats['moved_chunks']}, checksum failures {stats['checksum_failures']}")
        if not (all(written) and all(loaded) and exact):
            raise SystemExit("round trip failed")
    finally:
        storage.close()


if __name__ == "__main__":
    main()
