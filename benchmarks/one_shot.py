#!/usr/bin/env python
"""One-shot ``Agent.transfer`` against prepare-once-post-many, DRAM -> DRAM in one process (memcpy).

Three ways to move the same ``--rows`` x ``--block`` rows (sources contiguous, destinations scattered),
alternated in rounds so that load on the machine falls on all three alike:

- prepared: ``make_transfer`` once, then ``post().wait()`` each time;
- one-shot: ``agent.transfer(op, src, dst).wait()`` with the same two DescLists each time;
- one-shot, fresh lists: both DescLists built anew (``DescList.from_columns``) before each call, with the
  same rows each time (as a loop that rebuilds its lists does);
- one-shot, new rows: built anew, each call with other destination rows (cycling through more destination
  permutations than ``Agent.transfer`` remembers), so nothing of an earlier call can be reused.

Prints the median wall and CPU (this thread) time per transfer and the ratios to prepared.

    python benchmarks/one_shot.py [--rows 32] [--block 32K] [--rounds 10] [--per-round 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from datamover import Agent, DescList, aligned_empty
from datamover.units import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--block", default="32K")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=200)
    args = ap.parse_args()
    n, block = args.rows, parse_size(args.block)
    with Agent("one-shot", {"backends": {"memcpy": {}}}) as agent:
        src, dst = aligned_empty(2 * n * block), aligned_empty(2 * n * block)
        agent.register_memory(src)
        agent.register_memory(dst)
        saddr = src.ctypes.data + np.arange(n, dtype=np.int64) * block
        daddr = dst.ctypes.data + np.random.default_rng(1).permutation(2 * n)[:n].astype(np.int64) * block
        s, d = DescList.from_columns(saddr, block), DescList.from_columns(daddr, block)
        rng = np.random.default_rng(2)
        others = [dst.ctypes.data + rng.permutation(2 * n)[:n].astype(np.int64) * block for _ in range(257)]
        turn = iter(range(1 << 62))
        x = agent.make_transfer("WRITE", agent.prepare(s), None, agent.prepare(d), None)
        ways = {
            "prepared": lambda: x.post().wait(),
            "one-shot": lambda: agent.transfer("WRITE", s, d).wait(),
            "one-shot, fresh lists": lambda: agent.transfer(
                "WRITE", DescList.from_columns(saddr, block), DescList.from_columns(daddr, block)
            ).wait(),
            "one-shot, new rows": lambda: agent.transfer(
                "WRITE", DescList.from_columns(saddr, block), DescList.from_columns(others[next(turn) % 257], block)
            ).wait(),
        }
        wall: dict[str, list[float]] = {k: [] for k in ways}
        cpu: dict[str, list[float]] = {k: [] for k in ways}
        for fn in ways.values():
            for _ in range(args.per_round):
                fn()
        for _ in range(args.rounds):
            for name, fn in ways.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(args.per_round):
                    fn()
                wall[name].append((time.perf_counter() - t0) / args.per_round * 1e6)
                cpu[name].append((time.thread_time() - c0) / args.per_round * 1e6)
    base_wall, base_cpu = np.median(wall["prepared"]), np.median(cpu["prepared"])
    print(f"{n} x {args.block} DRAM -> DRAM, {args.rounds} rounds of {args.per_round}")
    print(f"{'way':<24}{'wall us':>10}{'cpu us':>10}{'wall/prepared':>15}{'cpu/prepared':>14}")
    for name in ways:
        w, c = np.median(wall[name]), np.median(cpu[name])
        print(f"{name:<24}{w:>10.1f}{c:>10.1f}{w / base_wall:>15.2f}{c / base_cpu:>14.2f}")


if __name__ == "__main__":
    main()
