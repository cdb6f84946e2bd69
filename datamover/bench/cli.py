"""`datamover bench`: the throughput sweep from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from ..backends import backend_status
from .runner import format_table, machine_info, parse_size, run_sweep
from .workload import WORKLOADS

DEFAULT_BLOCKS = "4K,64K,1M,16M,64M"
DEFAULT_BATCHES = "1,64,4096"


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="throughput sweep: block size x batch, ours beside the raw library")
    p.add_argument(
        "--backend",
        default="all",
        help="comma-separated backends, or 'all' for every usable one with a workload (default)",
    )
    p.add_argument("--op", default=None, help="WRITE, READ or both (default: what each backend supports)")
    p.add_argument("--block-sizes", default=DEFAULT_BLOCKS, help=f"comma-separated sizes (default {DEFAULT_BLOCKS})")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCHES, help=f"comma-separated (default {DEFAULT_BATCHES})")
    p.add_argument("--max-bytes", default="256M", help="skip cases moving more than this per transfer")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per case and side")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--check", action="store_true", help="verify every byte after the timed runs")
    p.add_argument("--json", metavar="PATH", help="write results, machine and settings as JSON")
    p.add_argument("--dir", help="directory for benchmark files (posix); default the temp dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def selected_backends(spec: str) -> tuple[list[str], list[str]]:
    """(backends to run, skipped with reasons) for a --backend value."""
    names = list(WORKLOADS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    run, skipped = [], []
    for name in names:
        if name not in WORKLOADS:
            raise SystemExit(f"datamover bench: no workload for backend {name!r}; known: {', '.join(WORKLOADS)}")
        ok, reason = backend_status(name)
        if ok:
            run.append(name)
        else:
            skipped.append(f"{name}: {reason}")
    return run, skipped


def cmd_bench(args: argparse.Namespace) -> int:
    backends, skipped = selected_backends(args.backend)
    if not backends:
        print("no usable backend to benchmark:\n  " + "\n  ".join(skipped), file=sys.stderr)
        return 1
    blocks = [parse_size(s) for s in args.block_sizes.split(",")]
    batches = [int(s) for s in args.batch_sizes.split(",")]
    ops = [o.strip().upper() for o in args.op.split(",")] if args.op else None
    options = {"posix": {"dir": args.dir}} if args.dir else {}
    headers: dict[str, dict] = {}
    info = machine_info()
    print(f"datamover bench on {info['platform']}, {info['cpus']} CPUs, python {info['python']}")
    for line in skipped:
        print(f"  skipped {line}")
    results = run_sweep(
        backends,
        ops,
        blocks,
        batches,
        max_bytes=parse_size(args.max_bytes),
        min_time=args.min_time,
        max_iters=args.max_iters,
        check=args.check,
        options=options,
        progress=not args.quiet,
        headers=headers,
    )
    for name, head in headers.items():
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in head.items()))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "settings": vars(args) | {"func": None},
                    "headers": headers,
                    "skipped": skipped,
                    "results": [r.row() for r in results],
                },
                f,
                indent=2,
                default=str,
            )
    if args.check and any(r.checked is False for r in results):
        print("byte check FAILED", file=sys.stderr)
        return 2
    return 0
