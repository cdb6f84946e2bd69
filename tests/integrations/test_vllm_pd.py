"""vLLM prefill/decode over vLLM's own NixlConnector, NIXL resolved to datamover: examples/vllm_pd.py, checked.

One run of the example (three engine processes: decode, prefill, prefill with other weights) serves every test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.engine_support import require

require("vllm")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_pd.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm-pd")
    out = workdir / "pd.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(workdir), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(workdir.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}{logs}"
    return json.loads(out.read_text())


def test_decode_with_prefills_kv_gives_a_single_instances_tokens(run: dict) -> None:
    assert run["pd"] == run["single"]
    params = run["prefill_params"]
    assert all(p["do_remote_prefill"] and p["remote_block_ids"] for p in params)  # decode was told to pull


def test_prefill_with_other_weights_changes_decodes_tokens(run: dict) -> None:
    assert run["other_weights"] != run["single"]  # the pulled KV is what decode attended to


def test_a_killed_prefill_ends_in_vllms_failure_path_not_a_hang(run: dict) -> None:
    killed = run["killed_prefill"]
    assert killed["seconds"] < 120
    # recompute (kv_load_failure_policy "recompute"): decode's own weights, so a single instance's tokens
    assert killed["tokens"] == run["single"] and killed["finish_reasons"] == ["length", "length"]
