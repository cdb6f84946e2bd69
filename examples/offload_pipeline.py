"""A decode loop over a tiered KV cache: prefix lookup, prefetch, prefill of the misses, pinning while decoding.

    python examples/offload_pipeline.py [--trace PATH] [--requests 500] [--config tiers.yaml]
                                        [--s3-endpoint URL --bucket NAME]

Replays the first requests of the shared Mooncake trace. For each request it looks up the longest cached prefix,
starts prefetching the next request's prefix in the background, gets the cached chunks (real bytes, through
Agent transfers), "prefills" the missing chunks and puts them, then pins the request's chunks for its decode
steps. Tiers: L1 (GPU, or a DRAM arena standing in for it), L2 DRAM, L3 files in a temporary directory, and L4
S3 when an endpoint is given. At the end it drains L1 as an instance would before shutdown, and prints the
per-tier hit rates and the cost dashboard.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from datamover.policy.cache import TieredCache
from datamover.policy.config import GIB, TIER_NAMES, load_config, with_overrides
from datamover.policy.cost import CostModel
from datamover.policy.keys import chunk_keys
from datamover.policy.replay import load_trace

PAGE = 16 << 10  # 16 KiB chunks keep the example quick; the config's capacities (in chunks) are kept
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def prefill(keys, out: np.ndarray) -> None:
    """Stand-in for the model's prefill: each chunk's bytes are derived from its key, so hits can be checked."""
    for i, key in enumerate(keys):
        out[i] = np.frombuffer(bytes.fromhex(key.digest()) * (PAGE // 16), dtype=np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--config", help="tier config YAML (default: small tiers sized for this example)")
    parser.add_argument("--s3-endpoint", help="enable L4 on this S3-compatible endpoint")
    parser.add_argument("--bucket", default="datamover-kv")
    args = parser.parse_args()

    l3_dir = tempfile.mkdtemp(prefix="offload-l3-")
    sections = {
        "l1_hbm": {"page_size_bytes": PAGE, "block_pool_size": 512},
        "l2_dram": {"pinned_pool_gb": 2048 * PAGE / GIB},
        "l3_nvme": {"enabled": True, "path": l3_dir, "capacity_gb": 8192 * PAGE / GIB, "fsync_mode": "none"},
    }
    if args.s3_endpoint:
        sections["l4_pool"] = {
            "enabled": True,
            "endpoint": args.s3_endpoint,
            "bucket": args.bucket,
            "capacity_gb": 65536 * PAGE / GIB,
        }
    config = with_overrides(load_config(args.config), **sections)

    trace = load_trace(args.trace, args.requests)
    bounds = np.r_[np.flatnonzero(np.r_[True, np.diff(trace.request) != 0]), len(trace.keys)]
    requests = [
        (float(trace.times[a]), chunk_keys(trace.keys[a:b].tolist(), "llama-3-8b@2026-01", "tok@3"))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    now = [0.0]
    wrong = 0
    start = time.perf_counter()
    with TieredCache(config, clock=lambda: now[0]) as cache:
        pending = None
        for r, (stamp, keys) in enumerate(requests):
            now[0] = stamp
            if pending is not None:
                pending.result()  # the prefetch started during the previous request
            if r + 1 < len(requests):
                pending = cache.prefetch(requests[r + 1][1])
            kv = np.zeros((len(keys), PAGE), dtype=np.uint8)  # this request's KV blocks
            hit = cache.get(keys, kv)
            expected = np.zeros((hit, PAGE), dtype=np.uint8)
            prefill(keys[:hit], expected)
            wrong += int((kv[:hit] != expected).any(axis=1).sum())
            prefill(keys[hit:], kv[hit:])
            cache.put(keys[hit:], kv[hit:])
            cache.pin(keys)  # decode steps read these chunks: they must not move meanwhile
            cache.unpin(keys)
        if pending is not None:
            pending.result()
        stats = cache.stats()
        drained = cache.drain(cache.names[0])
    elapsed = time.perf_counter() - start
    shutil.rmtree(l3_dir)

    lookups = stats["lookups"]
    rates = {t: h / lookups for t, h in stats["hits"].items()}
    cost = CostModel.from_config(config)
    effective = cost.effective_ns(rates, stats["misses"] / lookups)
    print(f"{len(requests)} requests, {lookups:,} chunk lookups of {PAGE // 1024} KiB in {elapsed:.1f} s")
    for note in stats["notes"]:
        print(f"  {note}")
    print(
        "hit rate per tier: "
        + "  ".join(f"{t} {h:.1%}" for t, h in rates.items())
        + f"  miss {stats['misses'] / lookups:.1%}"
    )
    print(f"every hit checked: {wrong} wrong chunks; CRC32C failures {stats['checksum_failures']}")
    print("moved chunks: " + ", ".join(f"{pair} {n:,}" for pair, n in stats["moved_chunks"].items()))
    print(f"drained {drained:,} chunks held only by {config.enabled_tiers()[0]} before shutdown")
    print("cost dashboard (per chunk access):")
    for name in config.enabled_tiers():
        print(f"  {name:<8} {cost.tier_ns[TIER_NAMES.index(name)] / 1e3:>10.1f} us x {rates[name]:6.1%}")
    print(f"  {'miss':<8} {cost.miss_ns / 1e3:>10.1f} us x {stats['misses'] / lookups:6.1%}")
    print(
        f"  effective {effective / 1e6:.2f} ms per access, {effective / 512 / 1e3:.1f} us per token (512-token blocks)"
    )
    if wrong:
        raise SystemExit("wrong bytes delivered")


if __name__ == "__main__":
    main()
