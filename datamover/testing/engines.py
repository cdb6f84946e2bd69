"""A tiny Llama that real engines load on a CPU: a config.json and seeded random weights (no download).

vLLM's `load_format="dummy"` fills weights with values so small that every output looks alike; these weights
(normal, std 0.05 as in a freshly initialised model) make greedy tokens depend on every token of the prompt, so a
test can tell KV that was really used from KV that was not. Another seed gives a model of the same shape whose KV
differs: what a "prefill weights changed" control needs.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def write_tiny_llama(directory: str | Path, seed: int = 0, std: float = 0.05) -> Path:
    """Write config.json and model.safetensors of TINY_LLAMA with weights drawn from `seed`; returns the dir."""
    import torch
    from safetensors.torch import save_file

    c = TINY_LLAMA
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c))
    h, ff, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
    g = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=g) * std for name, shape in shapes.items()}
    tensors["model.embed_tokens.weight"] *= 20  # embeddings of unit scale, as RMSNorm expects
    for i in range(c["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    save_file(tensors, str(out / "model.safetensors"))
    return out


__all__ = ["TINY_LLAMA", "write_tiny_llama"]
