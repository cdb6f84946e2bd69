"""Benchmark output: JSON and CSV round-trips, the plot, and the sampling order of the runner."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from datamover.bench import output
from datamover.bench.runner import Result, format_vs_table, machine_info, paired_ratio_ci, sample_case, verdict
from datamover.bench.workload import Case


def _results() -> list[Result]:
    plain = Result("posix", "WRITE", 65536, 64, 65536 * 64, 12, 1.234567891234, 10.5, 20.25, 3000.125, 4000.0,
                   1.1, 1.12233445566, "os.pwritev loop", True)  # fmt: skip
    vs = Result("memcpy", "WRITE", 4096, 4096, 4096 * 4096, 7, 5.5, 1.0, 2.0, 3.0, 4.0, None, None, "", None,
                label="llama-3.1-8b isl=64", vs="nixl", vs_gbps=1.5, vs_post_p99_us=9.75, vs_xfer_avg_us=8.5,
                vs_xfer_p99_us=11.0, vs_ratio=5.5 / 1.5, vs_checked=False, vs_error=None)  # fmt: skip
    return [plain, vs]


def _payload(results):
    return output.report(results, machine_info(), {"op": None, "func": print, "min_time": 0.1}, {"posix": {}}, [])


def test_csv_round_trip(tmp_path) -> None:
    results = _results()
    path = tmp_path / "r.csv"
    output.write_csv(str(path), _payload(results))
    back, meta = output.read_csv(str(path))
    assert back == results
    assert meta["machine"]["cpus"] >= 1
    assert "numpy" in meta["machine"]["versions"]
    assert meta["settings"] == {"op": None, "min_time": 0.1}  # callables dropped


def test_json_round_trip(tmp_path) -> None:
    results = _results()
    path = tmp_path / "r.json"
    output.write_json(str(path), _payload(results))
    back, payload = output.read_json(str(path))
    assert back == results
    assert payload["machine"]["python"]


def test_plot_writes_a_png(tmp_path) -> None:
    path = tmp_path / "p.png"
    r = _results()
    output.plot(str(path), [r[0], Result(**(r[0].row() | {"block": 1 << 20, "op": "READ"})), r[1]], title="t")
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 500 and height > 300


def test_sample_case_alternates_and_flips_order() -> None:
    calls: list[str] = []

    def side(name, value):
        def fn():
            calls.append(name)
            return value

        return fn

    case = Case("WRITE", 4096, 1, side("ours", (0.0, 1.0)), side("raw", 1.0), lambda: True,
                before_each=lambda: calls.append("-"))  # fmt: skip
    s = sample_case(case, min_time=0.0, max_iters=4, min_iters=4, vs=side("vs", (0.0, 2.0)))
    runs = [c for c in calls if c != "-"]
    assert runs[:3] == ["ours", "raw", "vs"]  # warm-up
    assert runs[3:6] == ["ours", "raw", "vs"] and runs[6:9] == ["vs", "raw", "ours"]
    assert calls.count("-") == len(runs)  # cold state before every side
    assert len(s.totals) == len(s.raws) == len(s.vs_totals) == 4


def test_markdown_table_has_one_row_per_result() -> None:
    r = _results()
    md = output.markdown_table(r)
    lines = md.splitlines()
    assert lines[0].startswith("| backend | op | block | batch | ours GB/s | NIXL GB/s | ours/NIXL | 95% CI | at p50 |")
    assert len(lines) == 2 + len(r)
    assert "| memcpy | WRITE | 4 KiB | 4096 | 5.50 | 1.50 | 3.67 | - | - | 0.00 | 0.01 | - | -/FAIL |" in lines
    r[1].vs_ratio_lo, r[1].vs_ratio_hi = 3.5, 3.8
    assert "| 3.67 | 3.50-3.80 | - |" in output.markdown_table(r)
    plain = output.markdown_table(r[:1]).splitlines()
    assert plain[0] == "| backend | op | block | batch | GB/s | raw GB/s | ours/raw | p99 ms | check |"
    assert plain[2] == "| posix | WRITE | 64 KiB | 64 | 1.23 | 1.10 | 1.12 | 4.00 | ok |"


def test_paired_ratio_interval_brackets_the_ratio_and_narrows_with_pairing() -> None:
    rng = np.random.default_rng(1)
    drift = rng.uniform(0.5, 2.0, 40)  # the machine slows both sides of a round alike
    ours = drift * rng.normal(1.0, 0.01, 40)
    theirs = 1.1 * drift * rng.normal(1.0, 0.01, 40)
    lo, hi = paired_ratio_ci(list(ours), list(theirs))
    assert lo < theirs.sum() / ours.sum() < hi
    assert 1.0 < lo and hi - lo < 0.02  # unpaired resampling of this much drift would span 1.0
    assert paired_ratio_ci([1.0] * 4, [1.0] * 4) == (None, None)


def test_verdict_reads_the_interval_and_the_table_counts_it() -> None:
    base = _results()[1]
    rows = []
    for lo, hi in ((1.02, 1.3), (0.95, 1.04), (0.7, 0.9), (None, None)):
        rows.append(Result(**(base.row() | {"vs_ratio_lo": lo, "vs_ratio_hi": hi})))
    assert [verdict(r) for r in rows] == ["ahead", "tie", "behind", "-"]
    text = format_vs_table(rows)
    assert "0.95-1.04" in text
    assert "1 ahead, 1 tied (the interval spans 1.0), 1 behind" in text


def test_a_write_cut_short_leaves_the_earlier_file_whole_and_no_temporary(tmp_path, monkeypatch) -> None:
    """Stopped (SIGTERM, Ctrl-C) or failing while the report is written: before, ``path`` was truncated first and
    left half-written, the earlier run's file lost with it."""
    path = tmp_path / "r.json"
    output.write_json(str(path), _payload(_results()))
    before = path.read_bytes()

    def cut(payload, f, **kwargs):
        f.write('{"machine": {"cpus"')
        raise KeyboardInterrupt

    monkeypatch.setattr(output.json, "dump", cut)
    with pytest.raises(KeyboardInterrupt):
        output.write_json(str(path), _payload(_results()))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_csv_and_plot_replace_their_files_whole(tmp_path, monkeypatch) -> None:
    path, png = tmp_path / "r.csv", tmp_path / "r.png"
    path.write_text("earlier\n")
    png.write_bytes(b"earlier")
    monkeypatch.setattr(output, "to_csv", lambda payload: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        output.write_csv(str(path), _payload(_results()))
    assert path.read_text() == "earlier\n"
    import matplotlib.figure

    def cut(self, f, **kwargs):
        f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut)
    with pytest.raises(OSError, match="disk full"):
        output.plot(str(png), _results())
    assert png.read_bytes() == b"earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.png"]


def test_a_new_report_gets_the_mode_open_would_give(tmp_path) -> None:
    path = tmp_path / "r.json"
    output.write_json(str(path), _payload(_results()))
    mask = os.umask(0o022)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_output_in_a_missing_directory_is_refused_before_the_sweep(flag, tmp_path, capsys) -> None:
    """Before: the whole sweep ran, then writing failed and every result was lost."""
    from datamover.cli import main

    nowhere = str(tmp_path / "missing" / "out")
    assert main(["bench", "--backend", "memcpy", "--quiet", flag, nowhere]) == 2
    out, err = capsys.readouterr()
    assert err == f"datamover bench: {flag} {nowhere}: its directory is missing or not writable\n"
    assert "memcpy" not in out
