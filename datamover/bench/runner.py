"""The sweep: time every (backend, op, block, batch) case, ours and raw alternately, and report."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .. import __version__
from .workload import Case, Workload, workload_class

KiB, MiB = 1 << 10, 1 << 20


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

    def row(self) -> dict[str, Any]:
        return asdict(self)


def parse_size(text: str) -> int:
    """'4K', '64KiB', '1M', '16MiB', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def time_case(case: Case, *, min_time: float, max_iters: int, min_iters: int = 3) -> tuple[list, list, list]:
    """Alternate ours and raw until ``min_time`` seconds each (or ``max_iters``); returns samples."""
    case.before_each()
    case.ours()  # warm up: first-touch, connections, caches
    if case.raw is not None:
        case.before_each()
        case.raw()
    posts, totals, raws = [], [], []
    start = time.perf_counter()
    while len(totals) < max_iters and (len(totals) < min_iters or time.perf_counter() - start < 2 * min_time):
        case.before_each()
        p, t = case.ours()
        posts.append(p)
        totals.append(t)
        if case.raw is not None:
            case.before_each()
            raws.append(case.raw())
    return posts, totals, raws


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
) -> list[Result]:
    """Run the sweep over every backend given; cases larger than ``max_bytes`` are skipped."""
    results: list[Result] = []
    plan = [(b, bl, ba) for b in backends for bl in blocks for ba in batches if bl * ba <= max_bytes]
    bar = _progress(len(plan), progress)
    for backend in backends:
        sizes = [bl * ba for bl in blocks for ba in batches if bl * ba <= max_bytes]
        if not sizes:
            continue
        workload: Workload = workload_class(backend)(max(sizes), (options or {}).get(backend, {}))
        try:
            if headers is not None:
                headers[backend] = workload.header()
            for op in ops or workload.ops:
                if op not in workload.ops:
                    continue
                for block in blocks:
                    for batch in batches:
                        if block * batch > max_bytes:
                            continue
                        bar.set_description(f"{backend} {op} {human(block)} x {batch}")
                        results.append(_measure(workload, backend, op, block, batch, min_time, max_iters, check))
                        bar.update(1 / len(workload.ops) if not ops else 1 / max(1, len(ops)))
        finally:
            workload.close()
    bar.close()
    return results


def _measure(workload, backend, op, block, batch, min_time, max_iters, check) -> Result:
    case = workload.case(op, block, batch)
    try:
        posts, totals, raws = time_case(case, min_time=min_time, max_iters=max_iters)
        checked = case.verify() if check else None
    finally:
        case.close()
    nbytes = block * batch
    gbps = nbytes * len(totals) / sum(totals) / 1e9
    raw_gbps = nbytes * len(raws) / sum(raws) / 1e9 if raws else None
    return Result(
        backend=backend, op=op, block=block, batch=batch, bytes=nbytes, iters=len(totals), gbps=gbps,
        post_avg_us=float(np.mean(posts) * 1e6), post_p99_us=float(np.percentile(posts, 99) * 1e6),
        xfer_avg_us=float(np.mean(totals) * 1e6), xfer_p99_us=float(np.percentile(totals, 99) * 1e6),
        raw_gbps=raw_gbps, ratio=(gbps / raw_gbps) if raw_gbps else None, raw=case.raw_name, checked=checked,
    )  # fmt: skip


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
    """What the numbers were measured on."""
    import os

    return {
        "datamover": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_table(results: list[Result]) -> str:
    """A fixed-width table: one line per case, ours beside raw."""
    head = (
        f"{'backend':<8} {'op':<5} {'block':>9} {'batch':>6} {'GB/s':>7} {'raw GB/s':>9} {'ratio':>6} "
        f"{'post avg us':>11} {'post p99 us':>11} {'xfer avg us':>11} {'xfer p99 us':>11} {'check':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        raw = f"{r.raw_gbps:9.2f}" if r.raw_gbps is not None else f"{'-':>9}"
        ratio = f"{r.ratio:6.2f}" if r.ratio is not None else f"{'-':>6}"
        chk = {True: "ok", False: "FAIL", None: "-"}[r.checked]
        lines.append(
            f"{r.backend:<8} {r.op:<5} {human(r.block):>9} {r.batch:>6} {r.gbps:7.2f} {raw} {ratio} "
            f"{r.post_avg_us:11.1f} {r.post_p99_us:11.1f} {r.xfer_avg_us:11.1f} {r.xfer_p99_us:11.1f} {chk:>5}"
        )
    return "\n".join(lines)
