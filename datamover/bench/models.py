"""Model shapes and the KV-cache blocks they imply: block size and count for a request of N tokens.

A request of ``isl`` tokens is cut into pages of ``page_tokens`` tokens.
With tensor parallelism ``tp`` each rank holds ``kv_heads / tp`` KV heads
(at least one: heads are replicated when ``tp`` exceeds them), and the
numbers below are one rank's. Two layouts:

- ``block``: one descriptor per page holding every layer's K and V
  (offload chunks, LMCache-style): ``layers * 2 * heads * head_dim * dtype * page_tokens`` bytes.
- ``layer``: one descriptor per (layer, K or V, page), the paged layout of
  vLLM's KV cache that a layer-wise PD connector moves:
  ``heads * head_dim * dtype * page_tokens`` bytes, ``layers * 2 * pages`` of them.

MLA models (DeepSeek-V3) cache one latent vector per token and layer
(``kv_lora_rank + rope_dim`` values), not split by TP and with no separate K
and V, so the layer layout has ``layers * pages`` descriptors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ModelShapeError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
LAYOUTS = ("block", "layer")


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache: layers, KV heads, head dim, dtype (MLA: latent width)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    mla_dim: int = 0  # kv_lora_rank + rope dim for MLA models; 0 for MHA/GQA

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ModelShapeError(f"{self.name}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        for what in ("layers", "kv_heads", "head_dim") if not self.mla_dim else ("layers",):
            if int(getattr(self, what)) < 1:
                raise ModelShapeError(f"{self.name}: {what} must be >= 1, got {getattr(self, what)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def heads_per_rank(self, tp: int) -> int:
        return max(1, self.kv_heads // tp)

    def bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes one token adds to one rank's cache, all layers."""
        if self.mla_dim:
            return self.layers * self.mla_dim * self.dtype_bytes
        return self.layers * 2 * self.heads_per_rank(tp) * self.head_dim * self.dtype_bytes


#: a few common models (from their published configs)
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128),
        ModelShape("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128),
        ModelShape("llama-3.1-405b", layers=126, kv_heads=8, head_dim=128),
        ModelShape("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        ModelShape("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128),
        ModelShape("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        ModelShape("mixtral-8x7b", layers=32, kv_heads=8, head_dim=128),
        ModelShape("deepseek-v3", layers=61, kv_heads=1, head_dim=576, mla_dim=512 + 64),
    )
}
ALIASES = {"70b": "llama-3.1-70b", "8b": "llama-3.1-8b", "405b": "llama-3.1-405b"}


@dataclass(frozen=True)
class KVPlan:
    """The blocks one request's KV cache is moved as, on one TP rank."""

    model: ModelShape
    isl: int
    page_tokens: int
    tp: int
    layout: str
    block_bytes: int
    blocks: int

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.blocks

    @property
    def pages(self) -> int:
        return math.ceil(self.isl / self.page_tokens)

    def label(self) -> str:
        return f"{self.model.name} isl={self.isl} page={self.page_tokens} tp={self.tp} layout={self.layout}"

    def describe(self) -> str:
        per_tok = self.model.bytes_per_token(self.tp)
        return (
            f"{self.label()}: {per_tok} B/token/rank, {self.pages} pages -> {self.blocks} blocks of "
            f"{self.block_bytes} B = {self.total_bytes / (1 << 20):.1f} MiB per request per rank"
        )


def kv_plan(model: ModelShape, isl: int, page_tokens: int = 16, tp: int = 1, layout: str = "layer") -> KVPlan:
    """Block size and count for one request of ``isl`` tokens (the last page is counted whole)."""
    if layout not in LAYOUTS:
        raise ModelShapeError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for what, v in (("isl", isl), ("page_tokens", page_tokens), ("tp", tp)):
        if v < 1:
            raise ModelShapeError(f"{what} must be >= 1, got {v}")
    pages = math.ceil(isl / page_tokens)
    per_layer_token = model.bytes_per_token(tp) // model.layers  # K and V together (MLA: the latent)
    if layout == "block":
        return KVPlan(model, isl, page_tokens, tp, layout, per_layer_token * model.layers * page_tokens, pages)
    halves = 1 if model.mla_dim else 2
    block = per_layer_token // halves * page_tokens
    return KVPlan(model, isl, page_tokens, tp, layout, block, model.layers * halves * pages)


def load_model(spec: str) -> ModelShape:
    """A built-in model by name (or alias), or a YAML/JSON file: our keys or a Hugging Face config.json."""
    key = spec.strip().lower()
    if key in MODELS or key in ALIASES:
        return MODELS[ALIASES.get(key, key)]
    if not os.path.exists(spec):
        raise ModelShapeError(f"unknown model {spec!r}: not a file, and not one of {', '.join([*MODELS, *ALIASES])}")
    import yaml  # JSON is YAML too

    with open(spec) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ModelShapeError(f"{spec}: expected a mapping of model fields")
    return shape_from_mapping(data, default_name=os.path.splitext(os.path.basename(spec))[0])


def shape_from_mapping(d: dict[str, Any], default_name: str = "model") -> ModelShape:
    """Accepts ``layers/kv_heads/head_dim/dtype`` or Hugging Face names (num_hidden_layers, ...)."""

    def pick(*names: str, default: Any = None) -> Any:
        for n in names:
            if d.get(n) is not None:
                return d[n]
        return default

    layers = pick("layers", "num_hidden_layers", "n_layers", "num_layers")
    if layers is None:
        raise ModelShapeError(f"{default_name}: no layer count (layers or num_hidden_layers)")
    dtype = str(pick("dtype", "torch_dtype", default="bf16")).lower()
    name = str(pick("name", "_name_or_path", default=default_name))
    mla = pick("kv_lora_rank")
    if mla is not None or pick("mla_dim") is not None:
        dim = int(pick("mla_dim", default=0)) or int(mla) + int(pick("qk_rope_head_dim", "rope_dim", default=0))
        return ModelShape(name, int(layers), 1, dim, dtype, mla_dim=dim)
    heads = pick("num_attention_heads", "n_heads")
    kv_heads = pick("kv_heads", "num_key_value_heads", "n_kv_heads", default=heads)
    head_dim = pick("head_dim")
    if head_dim is None and pick("hidden_size") is not None and heads:
        head_dim = int(pick("hidden_size")) // int(heads)
    if kv_heads is None or head_dim is None:
        raise ModelShapeError(f"{default_name}: need kv_heads (num_key_value_heads) and head_dim (or hidden_size)")
    return ModelShape(name, int(layers), int(kv_heads), int(head_dim), dtype)
