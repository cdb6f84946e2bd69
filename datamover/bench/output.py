"""Benchmark results on disk: JSON and CSV (with machine, versions and settings), and a GB/s plot."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from typing import IO, Any

from ..units import size_text
from .runner import Result, ratio_ci

RESULT_FIELDS = [f.name for f in fields(Result)]


def _clean(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if not callable(v)}


def report(
    results: list[Result],
    machine: dict,
    settings: dict,
    headers: dict,
    skipped: list[str],
    failed: list[dict] | None = None,
) -> dict:
    """Everything one run produced, as one JSON-able mapping (with the load average at the end of the run);
    ``failed``: the backends and cases that failed (``runner.failure``), so a row missing from the results is
    never silently missing."""
    end = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "machine": machine | {"load_avg_end": end},
        "settings": _clean(settings),
        "headers": headers,
        "skipped": skipped,
        "failed": list(failed or []),
        "results": [r.row() for r in results],
    }


@contextlib.contextmanager
def replaced(path: str, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """A new file beside ``path`` that takes its place only once completely written (``os.replace``): a run stopped
    or failing while it writes leaves ``path`` as it was, never half-written, and no temporary file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open(path, "w") would have made
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def writable(path: str) -> bool:
    """Whether an output file can be made at ``path`` (its directory exists and is writable): checked before a
    sweep, so that a typo does not throw away every result at its end."""
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK) and not os.path.isdir(path)


def write_json(path: str, payload: dict) -> None:
    """The report as JSON, replacing ``path`` atomically."""
    with replaced(path) as f:
        json.dump(payload, f, indent=2, default=str)


def read_json(path: str) -> tuple[list[Result], dict]:
    """Results and the rest of the report from a file written by ``write_json``."""
    with open(path) as f:
        payload = json.load(f)
    known = set(RESULT_FIELDS)  # fields a newer datamover added are ignored
    return [Result(**{k: v for k, v in row.items() if k in known}) for row in payload["results"]], payload


def write_csv(path: str, payload: dict) -> None:
    """One row per case; machine, versions and settings go first as ``# key: json`` comment lines. Replaces
    ``path`` atomically."""
    with replaced(path, newline="") as f:
        f.write(to_csv(payload))


def to_csv(payload: dict) -> str:
    out = io.StringIO()
    for key in ("machine", "settings", "headers", "skipped", "failed"):
        out.write(f"# {key}: {json.dumps(payload.get(key), default=str, sort_keys=True)}\n")
    w = csv.DictWriter(out, fieldnames=RESULT_FIELDS, lineterminator="\n")
    w.writeheader()
    for row in payload["results"]:
        w.writerow({k: "" if row.get(k) is None else row[k] for k in RESULT_FIELDS})
    return out.getvalue()


def read_csv(path: str) -> tuple[list[Result], dict]:
    """Results (typed as written) and the commented metadata from a file written by ``write_csv``."""
    meta: dict[str, Any] = {}
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    body = []
    for line in lines:
        if line.startswith("# ") and ": " in line and not body:
            key, _, value = line[2:].partition(": ")
            meta[key] = json.loads(value)
        else:
            body.append(line)
    types = {f.name: f.type for f in fields(Result)}
    results = []
    for row in csv.DictReader(body):
        results.append(Result(**{k: _parse(types[k], v) for k, v in row.items() if k in types}))
    return results, meta


def _parse(type_name: str, text: str) -> Any:
    if text == "":
        return "" if type_name == "str" else None
    if type_name.startswith("int"):
        return int(text)
    if type_name.startswith("float"):
        return float(text)
    if type_name.startswith("bool"):
        return text == "True"
    return text


def plot(path: str, results: list[Result], title: str = "") -> None:
    """GB/s against block size: one line per (backend, op, batch), and per library when compared with NIXL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str, int], list[Result]] = {}
    for r in results:
        series.setdefault((r.backend, r.op, r.batch), []).append(r)
    ops = sorted({r.op for r in results})
    fig, axes = plt.subplots(1, len(ops), figsize=(6.5 * len(ops), 4.5), squeeze=False, sharey=True)
    for ax, op in zip(axes[0], ops):
        for (backend, sop, batch), rows in sorted(series.items()):
            if sop != op:
                continue
            rows = sorted(rows, key=lambda r: r.block)
            x = [r.block for r in rows]
            (line,) = ax.plot(x, [r.gbps for r in rows], marker="o", label=f"datamover {backend} x{batch}")
            vs = [(r.block, r.vs_gbps) for r in rows if r.vs_gbps is not None]
            if vs:
                label = f"nixl ({backend} pair) x{batch}"
                ax.plot(*zip(*vs), marker="s", linestyle="--", color=line.get_color(), label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.block for r in results if r.op == op})
        ax.set_xticks(ticks, [size_text(t).replace(" ", "") for t in ticks], rotation=45)
        ax.set_xlabel("block size")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("GB/s")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        with replaced(path, "wb") as f:
            fig.savefig(f, dpi=120, format=os.path.splitext(path)[1][1:].lower() or "png")
    finally:
        plt.close(fig)


def markdown_table(results: list[Result]) -> str:
    """A Markdown table of the results: ours beside NIXL when compared, else ours beside the raw library."""
    vs = any(r.vs for r in results)

    def g(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"

    def ms(us: float | None) -> str:
        return "-" if us is None else f"{us / 1000:.2f}"

    mark = {True: "ok", False: "FAIL", None: "-"}
    if vs:
        head = "| backend | op | block | batch | ours GB/s | NIXL GB/s | ours/NIXL | 95% CI | at p50 "
        head += "| ours p99 ms | NIXL p99 ms | CPU us/desc ours/NIXL | check |"
    else:
        head = "| backend | op | block | batch | GB/s | raw GB/s | ours/raw | p99 ms | check |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        cells = [r.backend, r.op, size_text(r.block), str(r.batch), g(r.gbps)]
        if vs:
            ratio = "n/a" if r.vs_error else g(r.vs_ratio)
            check = f"{mark[r.checked]}/{mark[r.vs_checked]}"
            cpu = "-" if r.vs_cpu_us_per_desc is None else f"{r.cpu_us_per_desc:.1f}/{r.vs_cpu_us_per_desc:.1f}"
            cells += [g(r.vs_gbps), ratio, ratio_ci(r), g(r.vs_ratio_p50), ms(r.xfer_p99_us), ms(r.vs_xfer_p99_us)]
            cells += [cpu, check]
        else:
            cells += [g(r.raw_gbps), g(r.ratio), ms(r.xfer_p99_us), mark[r.checked]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
