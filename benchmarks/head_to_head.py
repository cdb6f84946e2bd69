#!/usr/bin/env python
"""Run the head-to-head benchmarks behind BENCHMARKS.md and render their tables as Markdown.

Every run is an ordinary `datamover bench` command (printed, and recorded
beside its results), so any row can be reproduced by hand. Results go to
OUT/<name>.{json,csv,png,txt}; OUT/tables.md holds the Markdown, with plot
links relative to the current directory (run it from the repository root).

    python benchmarks/head_to_head.py [--out benchmarks/results] [--only posix,ucx] [--render-only] [-- ARGS]

Runs whose backend is not usable here (no UCX peer, no S3 server, no NIXL)
are reported as skipped with the reason `datamover bench` gives.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from datamover.bench.output import markdown_table, read_json
from datamover.bench.runner import verdict_summary

BEGIN, END = "<!-- tables:begin (benchmarks/head_to_head.py --update) -->", "<!-- tables:end -->"
#: every run: a second per case and side, up to 100 alternated rounds, every byte checked
SWEEP = ["--min-time", "1.0", "--max-iters", "100", "--check", "--quiet"]
#: name -> (title, `datamover bench` arguments)
RUNS: dict[str, tuple[str, str]] = {
    "posix": (
        "DRAM <-> FILE: our posix (O_DIRECT, native AIO) vs NIXL POSIX (libaio), same fd, cold cache for reads",
        # the disk's stalls come seconds apart: 300 rounds let both libraries meet them, 60 often let only one
        "--backend posix --vs nixl --block-sizes 4K,64K,256K,1M,4M,16M --batch-sizes 16,256,4096 "
        "--min-time 3 --max-iters 300",
    ),
    "posix-threads": (
        "DRAM <-> FILE before native AIO: our posix on its thread pool (posix.aio=false) vs NIXL POSIX",
        "--backend posix --vs nixl --param posix.aio=false --block-sizes 4K,64K,1M,16M --batch-sizes 16,256",
    ),
    "memcpy": (
        "DRAM -> DRAM in one process: our memcpy vs NIXL UCX in loopback",
        "--backend memcpy --vs nixl --block-sizes 4K,64K,1M,16M --batch-sizes 16,256,4096",
    ),
    "ucx": (
        "DRAM -> remote DRAM, two processes over loopback: our ucx (direct cma: process_vm_writev/readv, IOV_MAX "
        "rows per call) vs NIXL UCX (UCP put/get over cma)",
        "--backend ucx --vs nixl --block-sizes 4K,64K,1M,4M,16M --batch-sizes 16,256,4096",
    ),
    "ucx-nocma": (
        "DRAM -> remote DRAM over UCX without cma for either library (ours with direct_cma off: UCP put/get emulated "
        "over shared memory), NIXL's peer then polling",
        "--backend ucx --vs nixl --ucx-tls ^cma --param ucx.direct_cma=false --block-sizes 64K,1M,4M,16M "
        "--batch-sizes 16,256",
    ),
    "s3": (
        "DRAM <-> OBJ on the local S3 server (moto): our s3 vs NIXL OBJ",
        "--backend s3 --vs nixl --block-sizes 64K,1M,8M --batch-sizes 1,8 --max-iters 6",
    ),
    "model-70b-tp8": (
        "Llama-3.1-70B, 8k-token request, TP=8, one block per layer and K/V of a 16-token page (offload and PD paths)",
        "--model llama-3.1-70b --isl 8192 --page-tokens 16 --tp 8 --layout layer --vs nixl --max-bytes 64M",
    ),
    "model-8b-block": (
        "Llama-3.1-8B, 4k-token request, TP=1, one block per 256-token chunk of all layers (offload and PD paths)",
        "--model llama-3.1-8b --isl 4096 --page-tokens 256 --tp 1 --layout block --vs nixl --max-bytes 64M",
    ),
}


def run(name: str, out: str, extra: list[str]) -> dict:
    title, args = RUNS[name]
    base = os.path.join(out, name)
    cmd = ["datamover", "bench", *SWEEP, *shlex.split(args), *extra]  # later flags win
    cmd += ["--json", base + ".json", "--csv", base + ".csv", "--plot", base + ".png"]
    shown = " ".join(shlex.quote(c) for c in cmd)
    print(f"== {name}: {shown}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(base + ".txt", "w") as f:
        f.write(f"$ {shown}\n{proc.stdout}{proc.stderr}")
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    meta = {"name": name, "title": title, "command": shown, "rc": proc.returncode, "seconds": round(time.time() - t0)}
    with open(base + ".cmd.json", "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def render(out: str, names: list[str]) -> str:
    parts = []
    for name in names:
        base = os.path.join(out, name)
        if not os.path.exists(base + ".cmd.json"):
            continue
        with open(base + ".cmd.json") as f:
            meta = json.load(f)
        parts.append(f"### {meta['title']}\n\n```\n{meta['command']}\n```\n")
        if not os.path.exists(base + ".json"):
            with open(base + ".txt") as f:
                reason = f.read().strip().splitlines()[-1]
            parts.append(f"Not run here: `{reason}`\n")
            continue
        results, payload = read_json(base + ".json")
        m = payload["machine"]
        heads = payload.get("headers", {})
        parts.append(
            f"Measured {m['time']} on {m['cpus']} x {m['cpu_model']}, load average "
            f"{m.get('load_avg')} at the start and {m.get('load_avg_end')} at the end.\n"
        )
        for key, head in heads.items():
            parts.append(f"- {key}: " + ", ".join(f"{k}={v}" for k, v in head.items()))
        labels = sorted({r.label for r in results if r.label})
        if labels:
            parts.append(f"- sized from: {', '.join(labels)}")
        parts.append("\n" + markdown_table(results) + "\n")
        summary = verdict_summary(results)
        if summary:
            parts.append(summary[0].upper() + summary[1:] + ".\n")
        parts.append(f"![{name}]({os.path.relpath(base + '.png')})\n")
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="where results go (default benchmarks/results)")
    ap.add_argument("--only", help=f"comma-separated runs (default all: {', '.join(RUNS)})")
    ap.add_argument("--render-only", action="store_true", help="only rebuild tables.md from earlier results")
    ap.add_argument("--update", metavar="MD", help="also replace the tables between the markers in this file")
    ap.add_argument("extra", nargs="*", help="more `datamover bench` arguments, after --")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    os.makedirs(args.out, exist_ok=True)
    if not args.render_only:
        for name in names:
            run(name, args.out, args.extra)
    tables = render(args.out, names)
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(tables)
    print(f"tables: {os.path.join(args.out, 'tables.md')}")
    if args.update:
        with open(args.update) as f:
            text = f.read()
        head, sep, rest = text.partition(BEGIN)
        _, sep2, tail = rest.partition(END)
        if not (sep and sep2):
            raise SystemExit(f"{args.update}: no {BEGIN} ... {END} markers")
        with open(args.update, "w") as f:
            f.write(f"{head}{BEGIN}\n{tables}\n{END}{tail}")
        print(f"updated {args.update}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
