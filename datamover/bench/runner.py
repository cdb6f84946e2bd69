"""The sweep: time every (backend, op, block, batch) case, ours and raw alternately, and report."""

from __future__ import annotations

import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from ..errors import BackendUnavailable, ConfigError, DatamoverError, InvalidParameter, NixlError, UnknownBackend
from ..units import MiB, size_text
from .workload import Case, Workload, workload_class


@dataclass
class Result:
    backend: str
    op: str
    block: int
    batch: int
    bytes: int
    iters: int
    gbps: float
    post_avg_us: float
    post_p99_us: float
    xfer_avg_us: float
    xfer_p99_us: float
    raw_gbps: float | None
    ratio: float | None
    raw: str
    checked: bool | None
    label: str = ""  # e.g. the model shape a case was sized from
    vs: str | None = None  # the other library, when compared (--vs nixl)
    vs_gbps: float | None = None
    vs_post_p99_us: float | None = None
    vs_xfer_avg_us: float | None = None
    vs_xfer_p99_us: float | None = None
    vs_ratio: float | None = None  # ours / theirs, in GB/s
    vs_checked: bool | None = None
    vs_error: str | None = None
    xfer_p50_us: float | None = None
    vs_xfer_p50_us: float | None = None
    cpu_us_per_desc: float | None = None  # this process's CPU, all threads, per descriptor (not a remote peer's)
    vs_cpu_us_per_desc: float | None = None
    vs_ratio_p50: float | None = None  # ours / theirs at the median transfer: robust to a noisy machine
    vs_ratio_lo: float | None = None  # 95% confidence interval of vs_ratio (paired bootstrap over rounds)
    vs_ratio_hi: float | None = None
    ratio_lo: float | None = None  # 95% confidence interval of ratio (ours over raw; paired bootstrap over rounds)
    ratio_hi: float | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Samples:
    """Seconds per run of one case: ours (post, total), the raw library, and the compared library."""

    posts: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    raws: list[float] = field(default_factory=list)
    vs_posts: list[float] = field(default_factory=list)
    vs_totals: list[float] = field(default_factory=list)
    cpu: float = 0.0  # this process's CPU seconds (all threads) spent in ours, summed over the samples
    vs_cpu: float = 0.0


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def time_case(case: Case, *, min_time: float, max_iters: int, min_iters: int = 3) -> tuple[list, list, list]:
    """Alternate ours and raw until ``min_time`` seconds each (or ``max_iters``); returns samples."""
    s = sample_case(case, min_time=min_time, max_iters=max_iters, min_iters=min_iters)
    return s.posts, s.totals, s.raws


def sample_case(
    case: Case,
    *,
    min_time: float,
    max_iters: int,
    min_iters: int = 3,
    vs: Callable[[], tuple[float, float]] | None = None,
    vs_enter: Callable[[], None] | None = None,
    vs_leave: Callable[[], None] | None = None,
) -> Samples:
    """Alternate ours, raw and ``vs`` (another library's run of the same case) until ``min_time`` seconds each.

    Every side is preceded by ``case.before_each`` (e.g. a cold page cache),
    warmed up once, and the order flips each round so that neither library
    always runs right after the other. ``vs_enter`` / ``vs_leave`` bracket each
    ``vs`` run outside its CPU count (e.g. waking the other library's peer).
    """
    sides: list[tuple[str, Callable]] = [("ours", case.ours)]
    if case.raw is not None:
        sides.append(("raw", case.raw))
    if vs is not None:
        sides.append(("vs", vs))
    enter, leave = vs_enter or (lambda: None), vs_leave or (lambda: None)
    for name, fn in sides:  # warm up: first-touch, connections, caches
        case.before_each()
        if name == "vs":
            enter()
        fn()
        if name == "vs":
            leave()
    s = Samples()
    start = time.perf_counter()
    rounds = 0
    while rounds < max_iters and (rounds < min_iters or time.perf_counter() - start < len(sides) * min_time):
        for name, fn in sides if rounds % 2 == 0 else sides[::-1]:
            case.before_each()
            if name == "vs":
                enter()
            c0 = _cpu_seconds()
            out = fn()
            cpu = _cpu_seconds() - c0
            if name == "vs":
                leave()
            if name == "ours":
                s.posts.append(out[0])
                s.totals.append(out[1])
                s.cpu += cpu
            elif name == "raw":
                s.raws.append(out)
            else:
                s.vs_posts.append(out[0])
                s.vs_totals.append(out[1])
                s.vs_cpu += cpu
        rounds += 1
    return s


def run_sweep(
    backends: list[str],
    ops: list[str] | None,
    blocks: list[int],
    batches: list[int],
    *,
    max_bytes: int = 256 * MiB,
    min_time: float = 0.3,
    max_iters: int = 50,
    check: bool = False,
    options: dict[str, Any] | None = None,
    progress: bool = True,
    headers: dict[str, dict] | None = None,
    points: dict[str, list[tuple[int, int]]] | None = None,
    labels: dict[str, str] | None = None,
    vs: str | None = None,
    vs_settings: Any = None,
    failures: list[dict[str, Any]] | None = None,
) -> list[Result]:
    """Run the sweep over every backend given; cases larger than ``max_bytes`` are skipped.

    ``points`` replaces the block x batch grid per backend with exact
    (block, batch) pairs (model-shaped runs); ``labels`` tags each backend's
    rows. ``vs="nixl"`` also runs every case through NIXL on the same memory
    (``vs_settings``: a NixlSettings), alternating with ours. With a
    ``failures`` list, a backend whose workload cannot start (its service, its
    peer process) or whose case fails is appended there (``failure``) and the
    sweep goes on with the next backend; without one, the error is raised.
    Errors in the caller's input (a bad parameter) are always raised.
    """
    grid = [(bl, ba) for bl in blocks for ba in batches if bl * ba <= max_bytes]
    plan = {b: [pt for pt in (points or {}).get(b, grid) if pt[0] * pt[1] <= max_bytes] for b in backends}
    if vs not in (None, "nixl"):
        raise ValueError(f"can only compare with 'nixl', not {vs!r}")
    total = 0
    for b in backends:
        cls_ops = workload_class(b).ops
        total += len([o for o in (ops or cls_ops) if o in cls_ops]) * len(plan[b])
    bar = _progress(total, progress)
    results: list[Result] = []
    try:
        for backend in backends:
            cls_ops = workload_class(backend).ops
            cases = [(op, bl, ba) for op in ops or cls_ops if op in cls_ops for bl, ba in plan[backend]]
            if not cases:
                continue
            try:
                workload: Workload = workload_class(backend)(
                    max(bl * ba for bl, ba in plan[backend]), (options or {}).get(backend, {})
                )
            except _INPUT_ERRORS:
                raise
            except Exception as exc:
                if failures is None:
                    raise
                failures.append(failure(backend, None, exc, len(cases)))
                bar.update(len(cases))
                continue
            other, missing = None, None
            try:
                if vs == "nixl":
                    from .nixl import nixl_side

                    try:
                        other = nixl_side(backend, workload, vs_settings)
                    except (BackendUnavailable, NixlError) as exc:  # NIXL or its peer process did not start
                        missing = str(exc)
                if headers is not None:
                    headers[backend] = workload.header()
                    if other is not None:
                        headers[f"{backend} vs nixl"] = other.header()
                    elif missing:
                        headers[f"{backend} vs nixl"] = {"skipped": missing}
                for i, (op, block, batch) in enumerate(cases):
                    bar.set_description(f"{backend} {op} {size_text(block)} x {batch}")
                    try:
                        r = _measure(workload, backend, op, block, batch, min_time, max_iters, check, other)
                    except _INPUT_ERRORS:
                        raise
                    except Exception as exc:
                        if failures is None:
                            raise
                        # its service or peer is likely gone: the backend's other cases would fail the same way
                        failures.append(failure(backend, (op, block, batch), exc, len(cases) - i - 1))
                        bar.update(len(cases) - i)
                        break
                    r.label = (labels or {}).get(backend, "")
                    if missing:
                        r.vs, r.vs_error = "nixl", missing
                    results.append(r)
                    bar.update(1)
            finally:
                try:
                    if other is not None:
                        other.close()
                finally:
                    workload.close()  # its services, even when NIXL's side failed to close
    finally:
        bar.close()
    return results


#: errors in what the caller asked for, raised as they are (the CLI prints them as one line, exit code 2)
_INPUT_ERRORS = (InvalidParameter, ConfigError, UnknownBackend)


def failure(backend: str, case: tuple[str, int, int] | None, exc: BaseException, not_run: int) -> dict[str, Any]:
    """What a failed backend or case leaves in the report: where, the error in one line, and how many cases of the
    backend were not run because of it (``case`` None: its workload did not start)."""
    from ..testing.services import ServiceError

    text = str(exc) if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"  # it names the service
    error = " ".join(text.split())
    out: dict[str, Any] = {"backend": backend, "op": None, "block": None, "batch": None}
    if case is not None:
        out["op"], out["block"], out["batch"] = case
    return out | {"error": error, "not_run": not_run}


def failure_text(f: dict[str, Any]) -> str:
    """One line for a ``failure``: which backend or case, why, and what was not run."""
    if f["op"] is None:
        return f"{f['backend']}: did not start: {f['error']}; its {f['not_run']} case(s) were not run"
    where = f"{f['backend']} {f['op']} {size_text(f['block'])} x {f['batch']}"
    rest = f"; its {f['not_run']} later case(s) were not run" if f["not_run"] else ""
    return f"{where} failed: {f['error']}{rest}"


def _measure(workload, backend, op, block, batch, min_time, max_iters, check, other=None) -> Result:
    case = workload.case(op, block, batch)
    vs_case, vs_error = None, None
    try:
        if other is not None:
            try:
                vs_case = other.case(case)
            except DatamoverError as exc:
                vs_error = str(exc)
        try:
            s = sample_case(
                case, min_time=min_time, max_iters=max_iters, vs=vs_case.run if vs_case else None,
                vs_enter=vs_case.enter if vs_case else None, vs_leave=vs_case.leave if vs_case else None,
            )  # fmt: skip
        except DatamoverError as exc:
            if vs_case is None:
                raise
            # NIXL failed mid-run: measure ours alone and say why the comparison is missing
            vs_error, vs_case = f"{type(exc).__name__}: {exc}", None
            s = sample_case(case, min_time=min_time, max_iters=max_iters)
        checked = vs_checked = None
        if check:
            if vs_case is not None:
                vs_checked = vs_case.verify()
                vs_case.zero_target()
                case.ours()  # so that our check sees our bytes, not NIXL's
            checked = case.verify()
    finally:
        try:
            if vs_case is not None:
                vs_case.close()
        finally:
            case.close()
    nbytes = block * batch
    gbps = nbytes * len(s.totals) / sum(s.totals) / 1e9
    raw_gbps = nbytes * len(s.raws) / sum(s.raws) / 1e9 if s.raws else None
    r = Result(
        backend=backend, op=op, block=block, batch=batch, bytes=nbytes, iters=len(s.totals), gbps=gbps,
        post_avg_us=float(np.mean(s.posts) * 1e6), post_p99_us=float(np.percentile(s.posts, 99) * 1e6),
        xfer_avg_us=float(np.mean(s.totals) * 1e6), xfer_p99_us=float(np.percentile(s.totals, 99) * 1e6),
        raw_gbps=raw_gbps, ratio=(gbps / raw_gbps) if raw_gbps else None, raw=case.raw_name, checked=checked,
    )  # fmt: skip
    r.xfer_p50_us = float(np.median(s.totals) * 1e6)
    if s.raws:
        r.ratio_lo, r.ratio_hi = paired_ratio_ci(s.totals, s.raws)
    r.cpu_us_per_desc = s.cpu * 1e6 / (len(s.totals) * batch)
    if other is not None:
        r.vs, r.vs_error, r.vs_checked = "nixl", vs_error, vs_checked
        if s.vs_totals:
            r.vs_gbps = nbytes * len(s.vs_totals) / sum(s.vs_totals) / 1e9
            r.vs_post_p99_us = float(np.percentile(s.vs_posts, 99) * 1e6)
            r.vs_xfer_avg_us = float(np.mean(s.vs_totals) * 1e6)
            r.vs_xfer_p99_us = float(np.percentile(s.vs_totals, 99) * 1e6)
            r.vs_ratio = gbps / r.vs_gbps
            r.vs_xfer_p50_us = float(np.median(s.vs_totals) * 1e6)
            r.vs_cpu_us_per_desc = s.vs_cpu * 1e6 / (len(s.vs_totals) * batch)
            r.vs_ratio_p50 = r.vs_xfer_p50_us / r.xfer_p50_us
            r.vs_ratio_lo, r.vs_ratio_hi = paired_ratio_ci(s.totals, s.vs_totals)
    return r


def paired_ratio_ci(
    ours: list[float], theirs: list[float], level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float | None, float | None]:
    """Confidence interval of sum(theirs) / sum(ours), i.e. our GB/s over theirs, by a paired bootstrap.

    Sample i of each side ran in the same round (``sample_case`` alternates
    them), so rounds are resampled as pairs: drift that slows both sides of a
    round does not widen the interval, a stall that hits one side does.
    (None, None) with fewer than 5 rounds.
    """
    n = min(len(ours), len(theirs))
    if n < 5:
        return None, None
    a, b = np.asarray(ours[:n]), np.asarray(theirs[:n])
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ratios = b[idx].sum(axis=1) / a[idx].sum(axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def verdict(r: Result) -> str:
    """'ahead', 'tie' or 'behind' the compared library: the ratio's interval lies above 1, spans it, or lies below."""
    if r.vs_ratio_lo is None or r.vs_ratio_hi is None:
        return "-"
    if r.vs_ratio_lo > 1.0:
        return "ahead"
    return "behind" if r.vs_ratio_hi < 1.0 else "tie"


class _NoBar:
    def update(self, n: float = 1) -> None: ...

    def set_description(self, text: str) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False, unit="case")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: host, CPU, memory, kernel, and library versions."""
    import os

    info = {
        "datamover": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_gib": _mem_gib(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    info["versions"] = library_versions()
    return info


def library_versions() -> dict[str, str]:
    """Versions of the libraries underneath every backend and of NIXL, where installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("numpy", "msgpack", "ucxx-cu12", "libucx-cu12", "boto3", "moto", "torch", "nixl", "nixl-cu12"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return round(kib / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        return None


def _fmt(x: float | None, spec: str, width: int) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if spec == ".2f" and abs(x) < 0.1:  # slow tiers (objects over HTTP) still get two significant digits
        spec = ".4f" if abs(x) < 0.01 else ".3f"
    return f"{x:{width}{spec}}"


def format_table(results: list[Result]) -> str:
    """A fixed-width table: one line per case, ours beside raw (and beside NIXL when compared)."""
    if any(r.vs for r in results):
        return format_vs_table(results)
    head = (
        f"{'backend':<8} {'op':<5} {'block':>9} {'batch':>6} {'GB/s':>7} {'raw GB/s':>9} {'ratio':>6} "
        f"{'post avg us':>11} {'post p99 us':>11} {'xfer avg us':>11} {'xfer p99 us':>11} {'check':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        chk = {True: "ok", False: "FAIL", None: "-"}[r.checked]
        lines.append(
            f"{r.backend:<8} {r.op:<5} {size_text(r.block):>9} {r.batch:>6} {_fmt(r.gbps, '.2f', 7)} "
            f"{_fmt(r.raw_gbps, '.2f', 9)} {_fmt(r.ratio, '.2f', 6)} {r.post_avg_us:11.1f} {r.post_p99_us:11.1f} "
            f"{r.xfer_avg_us:11.1f} {r.xfer_p99_us:11.1f} {chk:>5}"
        )
    return "\n".join(lines)


def _cpu_pair(r: Result) -> str:
    if r.cpu_us_per_desc is None or r.vs_cpu_us_per_desc is None:
        return "-"
    return f"{r.cpu_us_per_desc:.1f}/{r.vs_cpu_us_per_desc:.1f}"


def format_vs_table(results: list[Result]) -> str:
    """Ours beside NIXL: both GB/s, both p99 post-to-done latencies, the ratio, and both byte checks."""
    head = (
        f"{'backend':<8} {'op':<5} {'block':>9} {'batch':>6} {'ours GB/s':>9} {'nixl GB/s':>9} {'ours/nixl':>9} "
        f"{'95% CI':>11} {'p50 ratio':>9} {'ours p99 us':>11} {'nixl p99 us':>11} {'cpu us/desc':>13} "
        f"{'raw GB/s':>8} {'check':>9}"
    )
    lines = [head, "-" * len(head)]
    notes = []
    for r in results:
        mark = {True: "ok", False: "FAIL", None: "-"}
        chk = f"{mark[r.checked]}/{mark[r.vs_checked]}"
        ratio = _fmt(r.vs_ratio, ".2f", 9)
        if r.vs_error:
            notes.append(f"  {r.backend} {r.op} {size_text(r.block)} x {r.batch}: nixl: {r.vs_error}")
            ratio = f"{'n/a':>9}"
        lines.append(
            f"{r.backend:<8} {r.op:<5} {size_text(r.block):>9} {r.batch:>6} {_fmt(r.gbps, '.2f', 9)} "
            f"{_fmt(r.vs_gbps, '.2f', 9)} {ratio} {ratio_ci(r):>11} {_fmt(r.vs_ratio_p50, '.2f', 9)} "
            f"{r.xfer_p99_us:11.1f} {_fmt(r.vs_xfer_p99_us, '.1f', 11)} {_cpu_pair(r):>13} "
            f"{_fmt(r.raw_gbps, '.2f', 8)} {chk:>9}"
        )
    summary = verdict_summary(results)
    if summary:
        lines += ["", summary]
    if notes:
        lines += ["", "NIXL did not run these cases:", *dict.fromkeys(notes)]
    return "\n".join(lines)


def ratio_ci(r: Result) -> str:
    """The ratio's 95% interval as 'lo-hi', or '-' when there were too few rounds."""
    if r.vs_ratio_lo is None or r.vs_ratio_hi is None:
        return "-"
    return f"{r.vs_ratio_lo:.2f}-{r.vs_ratio_hi:.2f}"


def verdict_summary(results: list[Result]) -> str:
    """One line counting rows whose 95% interval lies above 1 (ahead), spans it (tie) or lies below (behind)."""
    counts = {"ahead": 0, "tie": 0, "behind": 0}
    for r in results:
        v = verdict(r)
        if v in counts:
            counts[v] += 1
    if not any(counts.values()):
        return ""
    return (
        f"ours vs nixl, by the 95% interval of the GB/s ratio: {counts['ahead']} ahead, {counts['tie']} tied "
        f"(the interval spans 1.0), {counts['behind']} behind"
    )
