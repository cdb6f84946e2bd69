"""A decode loop over a tiered KV cache: prefix lookup, prefetch, prefill of the misses, pinning while decoding.

    python examples/offload_pipeline.py [--trace PATH] [--requests 500] [--config tiers.yaml]
                                        [--s3-endpoint URL --bucket NAME]
                                        [--mooncake [--master HOST:PORT --metadata URL] --instances 2]

Replays the first requests of the shared Mooncake trace. For each request it looks up the longest cached prefix,
starts prefetching the next request's prefix in the background, gets the cached chunks (real bytes, through
Agent transfers), "prefills" the missing chunks and puts them, then pins the request's chunks for its decode
steps. Tiers: L1 (GPU, or a DRAM arena standing in for it), L2 DRAM, L3 files in a temporary directory, and L4
S3 when an endpoint is given. At the end it drains L1 as an instance would before shutdown, and prints the
per-tier hit rates and the cost dashboard.

With --mooncake, L4 is a Mooncake Store pool shared by --instances caches (default 2; a local mooncake_master is
started on loopback unless --master names one). Requests go to the instances in turn, as a router spreads them;
each instance lends memory to the pool, finds the chunks the others computed there, and the run prints the
cross-instance hit rate (chunks an instance got from the pool that another instance computed) and the pool
lookups' p50/p99. With --retire the last instance drains what only it holds to the rest of the pool.
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
    parser.add_argument("--mooncake", action="store_true", help="L4 on a Mooncake Store pool shared by the instances")
    parser.add_argument("--master", help="mooncake_master host:port (default: start one on loopback)")
    parser.add_argument("--metadata", default="", help="the pool's metadata service (default: P2PHANDSHAKE)")
    parser.add_argument("--instances", type=int, default=None, help="cache instances (default 2 with --mooncake)")
    parser.add_argument(
        "--retire",
        action="store_true",
        help="with --mooncake, the last instance drains what only it holds to the rest of the pool before it leaves "
        "(Mooncake copy tasks: about 16 chunks a second)",
    )
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        parser.error(f"no trace at {args.trace}: pass --trace PATH (a Mooncake-format .jsonl, or datamover tracegen)")
    n_inst = args.instances or (2 if args.mooncake else 1)
    master = None
    if args.mooncake and not args.master:
        from datamover.testing.mooncake import MooncakeMaster

        master = MooncakeMaster().start()
        args.master, args.metadata = master.master_addr, master.metadata_url
    try:
        run(args, n_inst)
    finally:
        if master is not None:
            master.close()


def run(args: argparse.Namespace, n_inst: int) -> None:
    l3_dirs = [tempfile.mkdtemp(prefix="offload-l3-") for _ in range(n_inst)]
    configs = []
    for l3_dir in l3_dirs:
        sections = {
            "l1_hbm": {"page_size_bytes": PAGE, "block_pool_size": 512},
            "l2_dram": {"pinned_pool_gb": 2048 * PAGE / GIB},
            "l3_nvme": {"enabled": True, "path": l3_dir, "capacity_gb": 8192 * PAGE / GIB, "fsync_mode": "none"},
        }
        if args.mooncake:
            sections["l4_pool"] = {
                "enabled": True,
                "backend": "mooncake",
                "master_server_addr": args.master,
                "metadata_service_url": args.metadata,
                "bucket": args.bucket,
                "segment_gb": 16384 * PAGE / GIB,  # what each instance lends to the pool
                "capacity_gb": 65536 * PAGE / GIB,
                "p99_latency_budget_ms": 1.0,
            }
        elif args.s3_endpoint:
            sections["l4_pool"] = {
                "enabled": True,
                "endpoint": args.s3_endpoint,
                "bucket": args.bucket,
                "capacity_gb": 65536 * PAGE / GIB,
            }
        configs.append(with_overrides(load_config(args.config), **sections))
    config = configs[0]

    trace = load_trace(args.trace, args.requests)
    bounds = np.r_[np.flatnonzero(np.r_[True, np.diff(trace.request) != 0]), len(trace.keys)]
    requests = [
        (float(trace.times[a]), chunk_keys(trace.keys[a:b].tolist(), "llama-3-8b@2026-01", "tok@3"))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    now = [0.0]
    wrong = cross = 0
    computed_by: dict = {}  # chunk key -> the instance that prefilled it first
    held: list[set] = [set() for _ in range(n_inst)]  # chunks each instance has had (computed or fetched)
    start = time.perf_counter()
    caches = []
    try:
        for cfg in configs:
            caches.append(TieredCache(cfg, clock=lambda: now[0]))
        pending: list = [None] * n_inst
        for r, (stamp, keys) in enumerate(requests):
            now[0] = stamp
            me = r % n_inst
            cache = caches[me]
            if pending[me] is not None:
                pending[me].result()  # the prefetch this instance started for this request
                pending[me] = None
            if r + n_inst < len(requests) or r + 1 < len(requests):
                nxt = (r + 1) % n_inst
                if pending[nxt] is None:
                    pending[nxt] = caches[nxt].prefetch(requests[r + 1][1])
            if n_inst > 1:
                cache.lookup(keys)  # what a scheduler asks the pool before it admits the request
            kv = np.zeros((len(keys), PAGE), dtype=np.uint8)  # this request's KV blocks
            hit = cache.get(keys, kv)
            # a chunk another instance computed reaches this one only through the pool (by this get, or by the
            # prefetch that raced the other instance's put): counted once per instance, whichever path won
            cross += sum(1 for k in keys[:hit] if computed_by.get(k, me) != me and k not in held[me])
            held[me].update(keys)
            expected = np.zeros((hit, PAGE), dtype=np.uint8)
            prefill(keys[:hit], expected)
            wrong += int((kv[:hit] != expected).any(axis=1).sum())
            prefill(keys[hit:], kv[hit:])
            cache.put(keys[hit:], kv[hit:])
            for k in keys[hit:]:
                computed_by.setdefault(k, me)
            cache.pin(keys)  # decode steps read these chunks: they must not move meanwhile
            cache.unpin(keys)
        for p in pending:
            if p is not None:
                p.result()
        all_stats = [c.stats() for c in caches]
        drained = [c.drain(c.names[0]) for c in caches]
        t_drain = time.perf_counter()
        pool_drained = caches[-1].drain("l4_pool") if args.mooncake and args.retire else None
        t_drain = time.perf_counter() - t_drain
    finally:
        for c in caches:
            c.close()
    elapsed = time.perf_counter() - start
    for d in l3_dirs:
        shutil.rmtree(d)

    stats = {
        "lookups": sum(s["lookups"] for s in all_stats),
        "misses": sum(s["misses"] for s in all_stats),
        "hits": {t: sum(s["hits"][t] for s in all_stats) for t in all_stats[0]["hits"]},
        "moved_chunks": {},
        "checksum_failures": sum(s["checksum_failures"] for s in all_stats),
        "notes": [n for s in all_stats for n in s["notes"]],
    }
    for s in all_stats:
        for pair, n in s["moved_chunks"].items():
            stats["moved_chunks"][pair] = stats["moved_chunks"].get(pair, 0) + n
    lookups = stats["lookups"]
    rates = {t: h / lookups for t, h in stats["hits"].items()}
    cost = CostModel.from_config(config)
    effective = cost.effective_ns(rates, stats["misses"] / lookups)
    print(
        f"{len(requests)} requests over {n_inst} instance(s), {lookups:,} chunk lookups of {PAGE // 1024} KiB "
        f"in {elapsed:.1f} s"
    )
    for note in dict.fromkeys(stats["notes"]):
        print(f"  {note}")
    print(
        "hit rate per tier: "
        + "  ".join(f"{t} {h:.1%}" for t, h in rates.items())
        + f"  miss {stats['misses'] / lookups:.1%}"
    )
    if n_inst > 1:
        print(f"cross-instance hit rate: {cross / lookups:.1%} ({cross:,} chunks computed by another instance)")
    for i, s in enumerate(all_stats):
        lat = s.get("l4_pool_lookups")
        if lat and lat.get("lookups"):
            budget = lat.get("budget_ms")
            verdict = "" if not budget else f" ({'within' if lat['within_budget'] else 'over'} {budget:g} ms)"
            print(
                f"  instance {i}: {lat['lookups']:,} pool lookups, p50 {lat['p50_us']:.0f} us, "
                f"p99 {lat['p99_us']:.0f} us{verdict}"
            )
    print(f"every hit checked: {wrong} wrong chunks; CRC32C failures {stats['checksum_failures']}")
    print("moved chunks: " + ", ".join(f"{pair} {n:,}" for pair, n in stats["moved_chunks"].items()))
    print(f"drained {sum(drained):,} chunks held only by {config.enabled_tiers()[0]} before shutdown")
    if pool_drained is not None:
        print(
            f"retiring instance {n_inst - 1}: {pool_drained:,} chunks held only in its memory copied to the rest of "
            f"the pool in {t_drain:.1f} s"
        )
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
