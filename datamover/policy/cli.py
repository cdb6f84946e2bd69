"""`datamover replay`: replay a request trace through the tier policy and print the cost dashboard."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from .config import ConfigError, load_config
from .data_replay import run_with_data
from .policies import check_policy_name, policy_names
from .replay import (
    DEFAULT_SWEEP,
    ReplayReport,
    format_report,
    load_trace,
    parse_capacity,
    run_replay,
    single_tier,
    with_l1_capacity,
)
from .tracegen import positive


def add_replay_parser(sub: argparse._SubParsersAction) -> None:
    """Add `replay` to a subcommand parser (datamover/cli.py wires it in)."""
    p = sub.add_parser("replay", help="replay a Mooncake-format trace through the tier policy (simulation)")
    p.add_argument("trace", help="JSON-lines trace: one {timestamp, hash_ids, ...} object per request")
    p.add_argument("--config", help="tier config YAML (default: the documented defaults)")
    p.add_argument(
        "--policy",
        action="append",
        help="policy to replay, repeatable (default: the configured policy, every baseline: lru, lfu, arc, "
        "s3fifo, wtinylfu, lecar, and belady); 'belady' is the offline optimum",
    )
    p.add_argument("--l1-capacity", help="override L1 capacity: chunks, or a share of distinct chunks like 1%%")
    p.add_argument("--single-tier", action="store_true", help="replay L1 alone (other tiers disabled)")
    p.add_argument("--limit", type=positive(int), help="replay only the first N requests (N > 0)")
    p.add_argument(
        "--part", choices=("first", "second"), help="replay only the first or second half of the trace, by time"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also vary L1 capacity over "
        + ", ".join(f"{f:.1%}".replace("%", "%%") for f in DEFAULT_SWEEP)
        + " of distinct chunks",
    )
    p.add_argument("--plot", help="with --sweep: write hit rate and effective cost against capacity to this PNG")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument(
        "--with-data",
        action="store_true",
        help="also move real bytes: the first --requests requests "
        "through a TieredCache on the configured tiers (4 KiB chunks), checking every hit's content",
    )
    p.add_argument(
        "--requests", type=positive(int), default=1000, help="requests replayed by --with-data (> 0, default 1000)"
    )
    p.set_defaults(func=cmd_replay)


def report_dict(report: ReplayReport) -> dict:
    """The report as plain data (tier hit rates, evictions, moves in chunks and bytes, costs)."""

    def result(r):
        return {
            "policy": r.policy,
            "tiers": [asdict(t) for t in r.tiers],
            "refs": r.refs,
            "hit_rate": r.hit_rate,
            "prefix_hit_rate": r.prefix_hit_rate,
            "hit_rates": r.hit_rates(),
            "miss_rate": r.miss_rate,
            "evictions": {t.name: e for t, e in zip(r.tiers, r.evictions, strict=True)},
            "moved_chunks": {f"{a}->{b}": n for (a, b), n in r.moved.items()},
            "moved_bytes": {f"{a}->{b}": n * report.page_bytes for (a, b), n in r.moved.items()},
            "effective_ns_per_access": r.effective_ns(report.cost),
            "effective_ns_per_token": r.effective_ns(report.cost) / report.block_tokens,
            "replay_s": r.elapsed_s,
            "replay_cpu_s": r.cpu_s,
        }

    return {
        "trace": report.trace,
        "requests": report.requests,
        "requests_without_hash_ids": report.skipped,
        "requests_out_of_time_order": report.out_of_order,
        "requests_repeating_a_hash_id": report.repeating,
        "refs": report.refs,
        "distinct": report.distinct,
        "page_bytes": report.page_bytes,
        "cost_ns": {"tiers": list(report.cost.tier_ns), "miss": report.cost.miss_ns},
        "results": [result(r) for r in report.results],
        "sweep": [result(r) for r in report.sweep],
        "plot": report.plot,
    }


def cmd_replay(args: argparse.Namespace) -> int:
    """Run the replay the arguments describe and print the report."""
    try:
        config = load_config(args.config)
        if not args.policy:  # the configured policy runs
            check_policy_name(config)
        for name in args.policy or []:
            if name != "belady" and name not in policy_names():
                raise SystemExit(
                    f"datamover replay: unknown policy {name!r}; known: belady, " + ", ".join(policy_names())
                )
        if args.l1_capacity or args.single_tier:
            distinct = load_trace(args.trace, args.limit, args.part).distinct
            chunks = parse_capacity(args.l1_capacity, distinct) if args.l1_capacity else config.l1_hbm.block_pool_size
            config = single_tier(config, chunks) if args.single_tier else with_l1_capacity(config, chunks)
    except (ConfigError, ValueError) as exc:
        print(f"datamover replay: {exc}", file=sys.stderr)
        return 2
    if args.plot and not args.sweep:
        print("datamover replay: --plot needs --sweep", file=sys.stderr)
        return 2
    if args.plot and not os.access(os.path.dirname(os.path.abspath(args.plot)), os.W_OK):
        print(f"datamover replay: --plot {args.plot}: its directory is missing or not writable", file=sys.stderr)
        return 2  # said before the sweep runs, not after
    try:
        report = run_replay(
            args.trace, config, policies=args.policy, sweep=args.sweep, plot=args.plot, limit=args.limit, part=args.part
        )
        head = load_trace(args.trace, args.requests) if args.with_data else None
    except ValueError as exc:  # a malformed or empty trace (its file and line named)
        print(f"datamover replay: {exc}", file=sys.stderr)
        return 2
    data = run_with_data(head, config, args.requests) if head is not None else None
    if args.json:
        out = report_dict(report)
        if data is not None:
            out["with_data"] = asdict(data)
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        if data is not None:
            print(data.format())
    return 1 if data is not None and (data.wrong_chunks or data.stats["checksum_failures"]) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m datamover.policy.cli TRACE [...]`: the replay command on its own."""
    parser = argparse.ArgumentParser(prog="datamover", description=__doc__)
    add_replay_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["replay", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
