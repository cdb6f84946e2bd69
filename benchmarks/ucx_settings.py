"""Time one ucx shape across two test hosts under several initiator settings, alternated in one process.

Process-to-process spread across test hosts is larger than most setting effects (the same shape's mean moves
10-20% between runs), so each setting gets blocks of transfers in turn against the same target. Needs root
(test hosts). Example (BENCHMARKS.md, the READ pause):

    python benchmarks/ucx_settings.py READ 4K 256 '{}' '{"far_read_pause_us": 0}' --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=["READ", "WRITE"])
    ap.add_argument("block", help="block size, e.g. 4K")
    ap.add_argument("batch", type=int)
    ap.add_argument("settings", nargs="+", help="JSON objects of ucx backend params for the initiator, e.g. '{}'")
    ap.add_argument("--rounds", type=int, default=10, help="rounds; each gives every setting --block-of transfers")
    ap.add_argument("--block-of", type=int, default=10, help="transfers per setting per round")
    ap.add_argument("--target", default="{}", help="JSON ucx params for the target (fixed)")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp,self")

    from datamover.bench.ucx import UcxWorkload
    from datamover.testing.hosts import TestHosts
    from datamover.units import parse_size

    variants = [json.loads(s) for s in args.settings]
    with TestHosts(2, cpus="split") as hosts:
        os.environ["UCX_NET_DEVICES"] = hosts[0].ifname
        hosts[0].pin_here()
        block = parse_size(args.block)
        target = {"direct_cma": False, **json.loads(args.target)}
        w = UcxWorkload(max(block * args.batch, 1 << 20), {"ucx": target, "test_hosts": hosts})
        try:
            params = w.agent.backend("ucx").params
            base = dict(params)
            case = w.case(args.op, block, args.batch)
            for _ in range(20):  # warm: connections, rkeys, the target's far_ settings
                case.ours()
            times: list[list[float]] = [[] for _ in variants]
            before = w.target_progress()
            for _ in range(args.rounds):
                for i, v in enumerate(variants):
                    params.update(base)
                    params.update(v)
                    times[i] += [case.ours()[1] for _ in range(args.block_of)]
            after = w.target_progress()
            n = args.rounds * args.block_of * len(variants)
            counts = {k: round((after[k] - before[k]) / n, 1) for k in ("wakeups", "bursts", "progressed", "polls")}
            print(f"{args.op} {args.block} x {args.batch}, target's progress per transfer: {counts}")
            for v, t in zip(variants, times):
                p50, mean = statistics.median(t) * 1e6, statistics.mean(t) * 1e6
                print(f"  {json.dumps(v):40} p50 {p50:9.0f} us  mean {mean:9.0f} us")
            case.close()
        finally:
            w.close()


if __name__ == "__main__":
    main()
