"""Trace replay in simulation mode: drive the tier engine with a request trace and count what would happen.

A Mooncake-format trace (one JSON object per request: `timestamp` in ms, `hash_ids` = the prompt's 512-token
blocks) becomes a sequence of chunk references, each replayed through a `TierStack` (`datamover.policy.engine`:
lookups tier by tier, promotion, admission, eviction and demotion). No bytes move: the result counts hits per
tier, misses, evictions, and chunks moved between each pair of tiers.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from .config import TIER_NAMES, TierConfig, with_overrides
from .cost import CostModel
from .engine import PREFILL, TierSpec, TierStack, tier_specs
from .policies import BASELINES, BeladyPolicy, Policy, PolicySettings, make_policy, next_use

MOONCAKE_BLOCK_TOKENS = 512
#: the longest trace line read (about 800,000 hash_ids of 64-bit hashes): a longer one is refused unparsed
MAX_LINE_BYTES = 16 << 20
_MASK64 = (1 << 64) - 1
DEFAULT_SWEEP = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class Trace:
    """A request trace as flat chunk references: `keys[i]` was read at `times[i]` seconds by request
    `request[i]`; `skipped` requests of the file had no hash_ids (so no reference, and no request number),
    `out_of_order` requests have an earlier timestamp than the request before them (replayed in file order), and
    `repeating` requests name a hash_id twice (each is a reference: the second finds the chunk the first used)."""

    keys: np.ndarray
    times: np.ndarray
    request: np.ndarray
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    skipped: int = 0
    out_of_order: int = 0
    repeating: int = 0

    @property
    def distinct(self) -> int:
        """Number of distinct chunks."""
        return len(np.unique(self.keys))

    @property
    def requests(self) -> int:
        """Number of requests."""
        return int(self.request[-1]) + 1 if len(self.request) else 0


def load_trace(path: str | Path, limit: int | None = None, part: str | None = None) -> Trace:
    """Read a Mooncake-format JSON-lines trace (the first `limit` requests if given): per line a `timestamp` in
    ms and `hash_ids`, integer chunk ids (ids of 64-bit unsigned hashes, 2**63 and up, are kept distinct:
    every id is taken modulo 2**64). `part` "first" or "second" keeps the requests before or from the midpoint
    of the trace's time span (a split by time). Requests are replayed in file order, their timestamps sorted or
    not (those out of order are counted in `Trace.out_of_order`); a request with empty hash_ids is skipped
    (counted in `Trace.skipped`), and a hash_id given twice in one request is two references to the chunk
    (such requests are counted in `Trace.repeating`). A malformed line is a ValueError naming the file and line (one
    longer than MAX_LINE_BYTES is refused unread), and so is a trace with no chunk reference to replay (an
    empty file or half, only empty hash_ids), saying why."""
    keys: list[np.ndarray] = []
    stamps: list[float] = []
    with open(path, "rb") as f:
        for number, line in enumerate(iter(partial(f.readline, MAX_LINE_BYTES + 1), b""), 1):
            if limit is not None and len(stamps) >= limit:
                break
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                raise ValueError(f"trace {path}, line {number}: longer than {MAX_LINE_BYTES:,} bytes, read no further")
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode())
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                ids, stamp = row["hash_ids"], row["timestamp"]
                if not isinstance(ids, list) or not all(type(i) is int for i in ids):
                    raise ValueError("hash_ids is not a list of integers")
                if type(stamp) not in (int, float) or not math.isfinite(stamp):
                    raise ValueError(f"timestamp {stamp!r:.40} is not a number of ms")
            except RecursionError:
                raise ValueError(f"trace {path}, line {number}: JSON nested too deeply") from None
            except OverflowError:  # an integer timestamp past the largest float
                raise ValueError(f"trace {path}, line {number}: timestamp is too large a number of ms") from None
            except (ValueError, KeyError, TypeError) as exc:
                reason = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
                raise ValueError(f"trace {path}, line {number}: {reason[:200]}") from None
            try:
                keys.append(np.asarray(ids, dtype=np.int64))
            except OverflowError:
                keys.append(np.asarray([i & _MASK64 for i in ids], dtype=np.uint64).view(np.int64))
            stamps.append(float(stamp) / 1000.0)
    read = len(stamps)
    if part is not None:
        if part not in ("first", "second"):
            raise ValueError(f"part {part!r} is not 'first' or 'second'")
        middle = (min(stamps) + max(stamps)) / 2.0 if stamps else 0.0
        keep = [(t < middle) == (part == "first") for t in stamps]
        keys = [k for k, y in zip(keys, keep, strict=True) if y]
        stamps = [t for t, y in zip(stamps, keep, strict=True) if y]
    counts = np.asarray([len(k) for k in keys], dtype=np.int64)
    if not counts.sum():
        raise ValueError(f"trace {path}: {_nothing_to_replay(read, len(stamps), limit, part)}")
    used = counts > 0  # a request without hash_ids references nothing: skipped, and counted
    counts = counts[used]
    request = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    flat = np.concatenate(keys)
    starts = np.asarray(stamps)[used]
    late = int(np.count_nonzero(starts[1:] < starts[:-1]))
    by_key = np.lexsort((flat, request))  # each request's ids sorted: a repeat sits next to itself
    twice = (flat[by_key][1:] == flat[by_key][:-1]) & (request[by_key][1:] == request[by_key][:-1])
    repeating = len(np.unique(request[by_key][1:][twice]))
    skipped = int(len(used) - len(counts))
    return Trace(flat, starts[request], request, skipped=skipped, out_of_order=late, repeating=repeating)


def _nothing_to_replay(read: int, kept: int, limit: int | None, part: str | None) -> str:
    """Why a trace holds no chunk reference to replay (a replay of none has no hit rate)."""
    if not read:
        return "no request to replay" + (f" (limit {limit})" if limit is not None else " (an empty file)")
    if part is not None and not kept:
        return (
            f"the {part} half by time holds no request: {read} request{'s' if read > 1 else ''}, all in the "
            "other half (one request, or every timestamp the same)"
        )
    where = "" if part is None else f" in the {part} half by time"
    return f"no chunk reference to replay: the {kept} requests{where} all have empty hash_ids"


@dataclass
class ReplayResult:
    """What one policy did on one trace and tier stack."""

    policy: str
    tiers: list[TierSpec]
    refs: int
    hits: list[int]
    misses: int
    evictions: list[int]
    moved: Counter = field(default_factory=Counter)  # (from, to) -> chunks; from is "prefill" or a tier name
    prefix_hits: int = 0  # references in the usable prefix of their request (all earlier chunks found too)
    elapsed_s: float = 0.0  # wall clock of the replay loop
    cpu_s: float = 0.0  # CPU time of the replay loop (what other processes on the machine do not inflate)

    def hit_rates(self) -> dict[str, float]:
        """Fraction of references served by each tier."""
        return {t.name: h / self.refs for t, h in zip(self.tiers, self.hits, strict=True)}

    @property
    def hit_rate(self) -> float:
        """Fraction of references served by any tier."""
        return sum(self.hits) / self.refs

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of references that were usable hits: found, and every earlier chunk of the request too."""
        return self.prefix_hits / self.refs

    @property
    def miss_rate(self) -> float:
        return self.misses / self.refs

    def effective_ns(self, cost: CostModel) -> float:
        """Effective cost per chunk access under `cost`."""
        return cost.effective_ns(self.hit_rates(), self.miss_rate)


def simulate(trace: Trace, policy: str, config: TierConfig, leaf_first: bool = True) -> ReplayResult:
    """Replay `trace` through the config's enabled tiers under `policy` (a registered name or "belady"), each
    request as `TierStack.access_request` serves it, as TieredCache's get and put do (`leaf_first=False`: in
    order, without parents)."""
    if policy == "belady":
        brain: Policy = BeladyPolicy(next_use(trace.keys))
    else:
        brain = make_policy(policy, PolicySettings.from_config(config))
    specs = tier_specs(config)
    stack = TierStack(brain, specs, config.policy.promote_on_hit, config.policy.write_mode == "write_through")
    keys, times = _shared_keys(trace.keys), trace.times.tolist()
    bounds = request_bounds(trace.request).tolist()
    access = stack.access_request
    usable = 0
    start, cpu = time.perf_counter(), time.thread_time()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        usable += access(keys[lo:hi], times[lo], lo, leaf_first)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return ReplayResult(
        policy, specs, len(trace.keys), stack.hits, stack.misses, stack.evictions, stack.moved, usable, elapsed, cpu
    )


def _shared_keys(keys: np.ndarray) -> list[int]:
    """The keys as Python ints, one object per distinct key: every dict and set of the replay then finds a key
    by identity, without comparing two equal ints (the same keys, so the same results)."""
    distinct, index = np.unique(keys, return_inverse=True)
    return list(map(distinct.tolist().__getitem__, index.tolist()))


def request_bounds(request: np.ndarray) -> np.ndarray:
    """Where each request's references start in a trace, and one past the end: requests i is [b[i], b[i+1])."""
    request = np.asarray(request)
    if not len(request):
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(np.diff(request)) + 1
    return np.concatenate(([0], starts, [len(request)])).astype(np.int64)


def parse_capacity(text: str, distinct: int) -> int:
    """A capacity in chunks from "1000" or a share of the trace's distinct chunks like "1%"."""
    value = text.strip()
    try:
        chunks = int(distinct * float(value[:-1]) / 100.0) if value.endswith("%") else int(value)
    except (ValueError, OverflowError):  # "abc", "nan%", "inf%", "1e400%"
        raise ValueError(
            f"capacity {text!r} is not a number of chunks like 1000 or a finite share of distinct chunks like 1%"
        ) from None
    if chunks < 1:
        raise ValueError(f"capacity {text!r} is less than one chunk")
    return chunks


def with_l1_capacity(config: TierConfig, chunks: int) -> TierConfig:
    """The config with L1 enabled and holding `chunks` chunks."""
    return with_overrides(config, l1_hbm={"enabled": True, "block_pool_size": chunks})


def single_tier(config: TierConfig, chunks: int) -> TierConfig:
    """The config reduced to one tier (L1) of `chunks` chunks."""
    off = {"enabled": False}
    return with_overrides(with_l1_capacity(config, chunks), l2_dram=off, l3_nvme=off, l4_pool=off)


@dataclass
class ReplayReport:
    """A replay run: the main results (the configured policy with LRU and Belady beside it) and the sweep."""

    trace: str
    refs: int
    distinct: int
    requests: int
    block_tokens: int
    page_bytes: int
    cost: CostModel
    results: list[ReplayResult]
    sweep: list[ReplayResult] = field(default_factory=list)
    plot: str | None = None
    skipped: int = 0  # requests without hash_ids (Trace.skipped)
    out_of_order: int = 0  # requests timed before the request above them (Trace.out_of_order)
    repeating: int = 0  # requests naming a hash_id twice (Trace.repeating)


def compared_policies(config: TierConfig, policies: Sequence[str] | None = None) -> list[str]:
    """The configured policy, every baseline, then Belady, without repeats (or the given list)."""
    names = list(policies) if policies else [config.policy.name, *BASELINES, "belady"]
    return list(dict.fromkeys(names))


def run_replay(
    trace_path: str | Path,
    config: TierConfig,
    *,
    policies: Sequence[str] | None = None,
    sweep: bool = False,
    sweep_fractions: Sequence[float] = DEFAULT_SWEEP,
    plot: str | Path | None = None,
    limit: int | None = None,
    part: str | None = None,
) -> ReplayReport:
    """Replay a trace under each policy on the config's tiers; with `sweep`, also vary L1's capacity (as a
    share of the trace's distinct chunks, other tiers as configured) and, with `plot`, draw the curves."""
    trace = load_trace(trace_path, limit, part)
    names = compared_policies(config, policies)
    results = [simulate(trace, name, config) for name in names]
    report = ReplayReport(
        str(trace_path),
        len(trace.keys),
        trace.distinct,
        trace.requests,
        trace.block_tokens,
        config.l1_hbm.page_size_bytes,
        CostModel.from_config(config),
        results,
        skipped=trace.skipped,
        out_of_order=trace.out_of_order,
        repeating=trace.repeating,
    )
    if sweep:
        for fraction in sweep_fractions:
            sized = with_l1_capacity(config, max(1, int(trace.distinct * fraction)))
            report.sweep += [simulate(trace, name, sized) for name in names]
        if plot is not None:
            report.plot = str(plot_sweep(report, plot))
    return report


def plot_sweep(report: ReplayReport, path: str | Path) -> Path:
    """Write a PNG: hit rate and effective cost per access against L1 capacity, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_prefix, ax_cost) = plt.subplots(1, 3, figsize=(16, 4.6))
    for name in dict.fromkeys(r.policy for r in report.sweep):
        rows = sorted((r for r in report.sweep if r.policy == name), key=lambda r: r.tiers[0].capacity)
        caps = [r.tiers[0].capacity / report.distinct * 100.0 for r in rows]
        style = {"linestyle": "--"} if name in ("lru", "belady") else {}
        ax_hit.plot(caps, [r.hit_rate * 100.0 for r in rows], marker="o", label=name, **style)
        ax_prefix.plot(caps, [r.prefix_hit_rate * 100.0 for r in rows], marker="o", label=name, **style)
        ax_cost.plot(caps, [r.effective_ns(report.cost) / 1e6 for r in rows], marker="o", label=name)
    for ax in (ax_hit, ax_prefix, ax_cost):
        ax.set_xscale("log")
        ax.set_xlabel("L1 capacity (% of distinct chunks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_hit.set_ylabel("per-block hit rate, all tiers (%)")
    ax_prefix.set_ylabel("usable-prefix hit rate (%)")
    ax_cost.set_ylabel("effective cost per chunk access (ms)")
    fig.suptitle(f"{Path(report.trace).name}: {report.refs:,} references, {report.distinct:,} distinct chunks")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _fmt_ns(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.2f} {unit}"
    return f"{ns:.0f} ns"


def _result_lines(r: ReplayResult, report: ReplayReport, bound: ReplayResult | None) -> list[str]:
    cost = r.effective_ns(report.cost)
    vs = f", {r.hit_rate / bound.hit_rate:.1%} of belady" if bound and bound.hit_rate else ""
    lines = [
        f"  {r.policy}: hit rate {r.hit_rate:.2%}{vs}, usable prefix {r.prefix_hit_rate:.2%}; "
        f"effective cost {_fmt_ns(cost)} per access, "
        f"{_fmt_ns(cost / report.block_tokens)} per token; replay {r.elapsed_s:.2f} s ({r.cpu_s:.2f} s CPU)"
    ]
    rates = r.hit_rates()
    lines.append(
        "    hits:      " + "  ".join(f"{t.name} {rates[t.name]:.2%}" for t in r.tiers) + f"  miss {r.miss_rate:.2%}"
    )
    lines.append("    evictions: " + "  ".join(f"{t.name} {e:,}" for t, e in zip(r.tiers, r.evictions, strict=True)))
    moves = sorted(r.moved.items(), key=lambda kv: ([PREFILL, *TIER_NAMES].index(kv[0][0]), kv[0][1]))
    lines.append(
        "    moved:     "
        + "  ".join(f"{a}->{b} {n:,} ({n * report.page_bytes / 2**30:.2f} GiB)" for (a, b), n in moves)
    )
    return lines


def format_report(report: ReplayReport) -> str:
    """The report as text: per policy, hit rate per tier, evictions, chunks and bytes moved, effective cost."""
    tiers = ", ".join(f"{t.name} {t.capacity:,} chunks" for t in report.results[0].tiers)
    c = report.cost
    lines = [
        f"trace {report.trace}: {report.requests:,} requests, {report.refs:,} chunk references, "
        f"{report.distinct:,} distinct (ceiling on hit rate {1 - report.distinct / report.refs:.2%})"
        + (f"; {report.skipped:,} requests without hash_ids skipped" if report.skipped else "")
        + (
            f"; {report.out_of_order:,} requests timed before the request above them (replayed in file order)"
            if report.out_of_order
            else ""
        )
        + (f"; {report.repeating:,} requests name a hash_id twice" if report.repeating else ""),
        f"tiers: {tiers}; chunk {report.page_bytes:,} bytes, {report.block_tokens} tokens",
        "cost per access: "
        + ", ".join(f"{n} {_fmt_ns(v)}" for n, v in zip(TIER_NAMES, c.tier_ns, strict=True))
        + f", miss {_fmt_ns(c.miss_ns)}",
    ]
    bound = next((r for r in report.results if r.policy == "belady"), None)
    for r in report.results:
        lines += _result_lines(r, report, bound)
    if report.sweep:
        lines.append("sweep over L1 capacity (hit rate / usable-prefix hit rate / effective cost per access):")
        names = list(dict.fromkeys(r.policy for r in report.sweep))
        lines.append(f"  {'L1 chunks':>10} {'share':>7}  " + "  ".join(f"{n:>30}" for n in names))
        caps = sorted({r.tiers[0].capacity for r in report.sweep})
        for cap in caps:
            row = {r.policy: r for r in report.sweep if r.tiers[0].capacity == cap}
            cells = "  ".join(
                f"{row[n].hit_rate:>7.2%} / {row[n].prefix_hit_rate:>7.2%} / {_fmt_ns(row[n].effective_ns(c)):>10}"
                for n in names
            )
            lines.append(f"  {cap:>10,} {cap / report.distinct:>7.2%}  {cells}")
        if report.plot:
            lines.append(f"plot: {report.plot}")
    return "\n".join(lines)
