"""Runs examples/vllm_offload.py's phases in a process of their own, for tests/integrations/test_vllm_offload.py.

    python vllm_offload_driver.py first WORKDIR OUT.json    # the example's first phase, then the control below
    python vllm_offload_driver.py restart WORKDIR OUT.json  # the example's restart phase

The control proves that the loaded KV is what the engine computes with: on a fresh engine and fresh tiers, the
blocks are stored and the prefix cache reset as before, but each load is overwritten with zeros the moment it
lands (a fault injected into the worker); the tokens must then differ from the reference.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def load_example():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[2] / "examples" / "vllm_offload.py"
    spec = importlib.util.spec_from_file_location("vllm_offload_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def zeroed_loads_control(ex, model: Path, workdir: Path) -> dict:  # type: ignore[no-untyped-def]
    import uuid

    from datamover.integrations.vllm import worker as worker_module

    run = worker_module.DatamoverOffloadingWorker._run

    def run_then_zero(self, job_id, store, keys, gpu):  # type: ignore[no-untyped-def]
        outcome = run(self, job_id, store, keys, gpu)
        if not store:
            for t in self.tensors:
                t[[int(b) for b in gpu.block_ids]] = 0
        return outcome

    engine_id = f"dm-control-{uuid.uuid4().hex[:8]}"
    llm = ex.make_llm(model, ex.transfer_config(workdir, engine_id))
    ex.generate(llm)
    ex.wait_stored(llm, engine_id, ex.expected_blocks())
    llm.reset_prefix_cache()
    worker_module.DatamoverOffloadingWorker._run = run_then_zero
    try:
        tokens, cached = ex.generate(llm)
    finally:
        worker_module.DatamoverOffloadingWorker._run = run
    ex.shutdown(llm)
    return {"tokens": tokens, "cached_tokens": cached}


def main() -> None:
    phase, workdir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ex = load_example()
    model = ex.write_tiny_llama(workdir / "model", seed=0)
    if phase == "first":
        result = ex.phase_first(model, workdir)
        result["control"] = zeroed_loads_control(ex, model, workdir / "control")
    else:
        result = ex.phase_restart(model, workdir)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
