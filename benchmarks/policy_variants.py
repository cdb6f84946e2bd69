"""Judge variants of the default policy the way issue 18 does, over several samples of the shadows' keys.

    python benchmarks/policy_variants.py --sets dev,held,trace --trace ../shared/traces/conversation_trace.jsonl \
        --variant '{}' --variant '{"SHADOW_SHARE": 0.25}' --hashes 3

A variant is a JSON object of `datamover.policy.adaptive` module constants set before the replays (for
research only; the policy itself has no such knobs). Sets: `dev` (generated seeds 101-103) and `held`
(201-203), seven shapes of 3,000 requests each; `trace` (each --trace file's halves and the whole); `outside`
(each --outside file whole: traces held out, never used to choose anything). A point (workload, capacity,
metric) is a miss when the default is under 0.99x the best baseline or not above LRU. The baselines are
replayed once per workload and cached in --cache.

`--hashes N` replays each variant with N multipliers of the shadows' sampling hash (the first is the policy's
own): the same share of the keys, another sample of them. The verdict count of one replay moves by several
points from one sample to the next, so a variant is only better when it is better for every sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import datamover.policy.adaptive as adaptive
from datamover.policy.config import TierConfig
from datamover.policy.policies import BASELINES
from datamover.policy.replay import DEFAULT_SWEEP, Trace, load_trace, simulate, single_tier
from datamover.policy.tracegen import generate, write_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_eval import meets_bar  # the bar policy_eval.py judges by, in this same folder

SHAPES = ("chat", "rag", "bursty", "scan", "prompts", "mixed", "agent")
SEEDS = {"dev": (101, 102, 103), "held": (201, 202, 203)}
REQUESTS = 3000
HASHES = (adaptive._GOLDEN, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's odd multipliers
# the module's constants as shipped: every job starts from them (a pool worker keeps the last job's settings)
DEFAULTS = {k: v for k, v in vars(adaptive).items() if k.isupper()}  # _GOLDEN and _MASK too


def workloads(sets: list[str], traces: list[str], outside: list[str]) -> list[tuple[str, str, Any]]:
    """(set, label, how to load it) for every workload of the chosen sets."""
    out: list[tuple[str, str, Any]] = []
    for name in sets:
        if name in SEEDS:
            out += [(name, f"{shape} {seed}", (shape, seed)) for seed in SEEDS[name] for shape in SHAPES]
        elif name == "trace":
            for file in traces:
                stem = Path(file).name
                out += [(name, f"{stem} {part or 'whole'}", (file, part)) for part in ("first", "second", None)]
        elif name == "outside":
            out += [(name, Path(file).name, (file, None)) for file in outside]
        else:
            raise SystemExit(f"unknown set {name!r}: dev, held, trace or outside")
    return out


def load(spec: tuple, tmp: str) -> Trace:
    first, second = spec
    if isinstance(second, int):
        path = Path(tmp) / f"{first}-{second}.jsonl"
        if not path.exists():
            write_trace(generate(first, REQUESTS, second), str(path))
        return load_trace(path)
    return load_trace(first, part=second)


def replay(job: tuple) -> tuple[str, dict[str, list[float]]]:
    """Every sweep capacity of one workload under the named policies, with `variant` applied first."""
    label, spec, names, variant, tmp = job
    for key, value in {**DEFAULTS, **variant}.items():
        setattr(adaptive, key, tuple(value) if isinstance(value, list) else value)
    trace = load(spec, tmp)
    out = {}
    for frac in DEFAULT_SWEEP:
        config = single_tier(TierConfig(), max(1, int(trace.distinct * frac)))
        for name in names:
            r = simulate(trace, name, config)
            out[f"{frac} {name}"] = [r.hit_rate, r.prefix_hit_rate]
    return label, out


def judge(default: dict, base: dict) -> tuple[int, list[int], float]:
    """(misses, misses by capacity, mean ratio to the best baseline) over a set's workloads."""
    misses, by_size, ratios = 0, [0] * len(DEFAULT_SWEEP), []
    for label, res in default.items():
        for k, frac in enumerate(DEFAULT_SWEEP):
            for m in (0, 1):
                d = res[f"{frac} default"][m]
                best = max(base[label][f"{frac} {n}"][m] for n in BASELINES)
                ratios.append(d / best if best else 1.0)
                if not meets_bar(d, best, base[label][f"{frac} lru"][m]):
                    misses += 1
                    by_size[k] += 1
    return misses, by_size, sum(ratios) / max(1, len(ratios))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="dev,held", help="comma-separated: dev, held, trace, outside")
    p.add_argument("--trace", action="append", default=[], help="a trace file of the `trace` set (repeatable)")
    p.add_argument("--outside", action="append", default=[], help="a held-out trace file (repeatable)")
    p.add_argument("--variant", action="append", help="JSON object of adaptive.py constants (repeatable)")
    p.add_argument("--hashes", type=int, default=1, help=f"sampling hash multipliers per variant (1-{len(HASHES)})")
    p.add_argument(
        "--cache",
        default=str(Path(tempfile.gettempdir()) / "datamover-policy-variants"),
        help="directory for generated traces and the baselines' results (reused by later runs)",
    )
    p.add_argument("--procs", type=int, default=2)
    args = p.parse_args(argv)
    variants = [json.loads(v) for v in args.variant or ["{}"]]
    for variant in variants:
        unknown = sorted(set(variant) - set(DEFAULTS))
        if unknown:
            raise SystemExit(f"not constants of datamover.policy.adaptive: {', '.join(unknown)}")
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache)
    jobs = workloads(args.sets.split(","), args.trace, args.outside)
    base_file = cache / "baselines.json"
    base = json.loads(base_file.read_text()) if base_file.exists() else {}
    todo = [(label, spec, list(BASELINES), {}, tmp) for _, label, spec in jobs if label not in base]
    with Pool(args.procs) as pool:
        base.update(pool.map(replay, todo, chunksize=1))
        base_file.write_text(json.dumps(base))
        for variant in variants:
            for h in HASHES[: max(1, min(args.hashes, len(HASHES)))]:
                v = {**variant, "_GOLDEN": h}
                got = dict(pool.map(replay, [(lb, spec, ["default"], v, tmp) for _, lb, spec in jobs], chunksize=1))
                for name in dict.fromkeys(s for s, _, _ in jobs):
                    mine = {lb: got[lb] for s, lb, _ in jobs if s == name}
                    misses, by_size, mean = judge(mine, base)
                    points = 2 * len(DEFAULT_SWEEP) * len(mine)
                    print(
                        f"{json.dumps(variant)} hash {h:#x} {name}: {misses} misses of {points} "
                        f"(by capacity {' / '.join(map(str, by_size))}), mean ratio to the best baseline {mean:.4f}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
