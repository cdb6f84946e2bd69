"""What engine tests run on here: a tiny Llama for vLLM (no download), and a host KV pool shaped as SGLang's.

vLLM's `load_format="dummy"` fills weights with values so small that every output looks alike; these weights
(normal, std 0.05 as in a freshly initialised model) make greedy tokens depend on every token of the prompt, so a
test can tell KV that was really used from KV that was not. Another seed gives a model of the same shape whose KV
differs: what a "prefill weights changed" control needs.

SGLang's own host pools import torchvision (which breaks the CPU torch here), so `PageFirstHostPool` offers the
same `get_page_buffer_meta` over a buffer of the same layout, for driving a HiCache storage as SGLang does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


# SGLang host pool geometry: one K (or V) entry of a page is 16*2*2*32*2 bytes = 4 KiB (bfloat16)
PAGE, LAYERS, HEADS, DIM = 16, 2, 2, 32


class PageFirstHostPool:
    """A host KV pool laid out as SGLang's MHA pool with layout "page_first": kv_buffer (2, size, layers, heads,
    dim); get_page_buffer_meta gives a K then a V pointer per page, as SGLang's does."""

    def __init__(self, pages: int) -> None:
        import torch

        self.page_size = PAGE
        self.size = pages * PAGE
        self.layout = "page_first"
        self.dtype = torch.bfloat16
        self.kv_buffer = torch.zeros((2, self.size, LAYERS, HEADS, DIM), dtype=self.dtype)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.size * LAYERS * HEADS * DIM * item
        ptrs = []
        for i in indices.tolist()[:: self.page_size]:
            k = base + i * LAYERS * HEADS * DIM * item
            ptrs += [k, k + v_offset]
        return ptrs, [LAYERS * item * self.page_size * HEADS * DIM] * len(ptrs)

    def page(self, p: int) -> Any:
        """Bytes of page p (K and V) as one uint8 tensor, for comparisons."""
        import torch

        rows = slice(p * PAGE, (p + 1) * PAGE)
        return self.kv_buffer[:, rows].contiguous().view(torch.uint8).reshape(-1)

    def indices(self, pages: list[int]) -> Any:
        import torch

        return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


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


__all__ = ["DIM", "HEADS", "LAYERS", "PAGE", "TINY_LLAMA", "PageFirstHostPool", "write_tiny_llama"]
