"""examples/offload_pipeline.py with --mooncake: two instances on one real Mooncake pool share chunks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from datamover.testing.mooncake import mooncake_available

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offload_pipeline.py"


def test_two_instances_share_a_pool(tmp_path):
    """Requests alternate between two instances; every second request repeats the previous one's prompt, so the
    other instance computed it: the cross-instance hit rate is printed and above zero, and every byte checks."""
    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(reason)
    trace = tmp_path / "trace.jsonl"
    with trace.open("w") as f:
        for r in range(12):
            prompt = list(range(100 * (r // 2), 100 * (r // 2) + 8))
            f.write(json.dumps({"timestamp": r * 10, "input_length": 4096, "output_length": 8, "hash_ids": prompt}))
            f.write("\n")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--mooncake", "--trace", str(trace), "--requests", "12"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rate = re.search(r"cross-instance hit rate: ([\d.]+)% \(([\d,]+) chunks", out.stdout)
    assert rate, out.stdout
    assert int(rate.group(2).replace(",", "")) == 6 * 8, out.stdout  # each repeated prompt, all 8 chunks
    assert "every hit checked: 0 wrong chunks" in out.stdout
