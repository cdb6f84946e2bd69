"""The mooncake gap tool: raw, ours and the store call inside ours timed in the same rounds on a real pool, for
staged and two-buffer objects, every status and every byte read checked."""

from __future__ import annotations

import json

import pytest

from datamover.bench.mooncake_gap import main, measure, parse_cases
from datamover.testing.mooncake import mooncake_available

needs_mooncake = pytest.mark.skipif(not mooncake_available()[0], reason=mooncake_available()[1])


def test_cases_parse_and_bad_ones_are_refused():
    assert parse_cases("64K:16, 1M:1") == [(64 << 10, 16), (1 << 20, 1)]
    for bad in ("64K", "64K:0", "64K:x", "", "0:4"):
        with pytest.raises(ValueError):
            parse_cases(bad)
    with pytest.raises(SystemExit):  # before anything starts
        main(["--cases", "64K"])


def _sane(row, rounds):
    assert row.rounds == rounds
    assert 0 < row.store_us <= row.ours_us, "the store call inside ours was not timed, or timed outside it"
    assert row.work_us > 0 and row.raw_us > 0
    assert row.ratio > 0 and row.format > 0
    assert row.ratio_lo is not None and row.ratio_lo <= row.ratio_hi
    assert row.format_lo is not None and row.format_lo <= row.format_hi
    assert row.halves_us is not None and row.halves_us > 0


@needs_mooncake
def test_staged_rows_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert main(["--cases", "64K:4", "--rounds", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["block"], r["batch"]) for r in rows] == [("WRITE", 64 << 10, 4), ("READ", 64 << 10, 4)]
    for r in rows:
        assert r["staged"] is True
        assert 0 < r["store_us"] <= r["ours_us"] and r["rounds"] == 6
    printed = capsys.readouterr().out
    assert printed.count("staged") == 2 and "ours/raw" in printed


@needs_mooncake
def test_two_buffer_rows():
    rows = measure([(64 << 10, 2)], ("WRITE", "READ"), rounds=5, params={"transfer_mode": "zero_copy"})
    assert [(r.op, r.staged) for r in rows] == [("WRITE", False), ("READ", False)]
    for r in rows:
        _sane(r, 5)
