"""Model-shape arithmetic: KV block size and count, checked against hand-computed values."""

from __future__ import annotations

import json

import pytest

from datamover.bench.models import MODELS, ModelShape, ModelShapeError, kv_plan, load_model, shape_from_mapping


def test_70b_layer_layout_tp1() -> None:
    # 8 KV heads x 128 dims x 2 bytes x 16 tokens = 32 KiB per K (or V) page per layer
    p = kv_plan(MODELS["llama-3.1-70b"], isl=1000, page_tokens=16, tp=1, layout="layer")
    assert p.block_bytes == 32768
    assert p.pages == 63  # ceil(1000 / 16)
    assert p.blocks == 80 * 2 * 63
    assert p.total_bytes == 32768 * 10080


def test_70b_block_layout_is_one_page_of_all_layers() -> None:
    p = kv_plan(MODELS["llama-3.1-70b"], isl=8192, page_tokens=16, tp=1, layout="block")
    assert p.block_bytes == 80 * 2 * 8 * 128 * 2 * 16 == 5 << 20
    assert p.blocks == 512
    # 320 KiB of KV per token, the well-known figure for Llama-70B in bf16
    assert MODELS["llama-3.1-70b"].bytes_per_token() == 327680
    assert p.total_bytes == 8192 * 327680


def test_tp_splits_kv_heads_and_replicates_past_them() -> None:
    m = MODELS["llama-3.1-8b"]
    assert kv_plan(m, 64, 16, tp=8, layout="layer").block_bytes == 1 * 128 * 2 * 16  # one head per rank
    assert kv_plan(m, 64, 16, tp=2, layout="layer").block_bytes == 4 * 128 * 2 * 16
    assert kv_plan(m, 64, 16, tp=16, layout="layer").block_bytes == 4096  # 8 heads over 16 ranks: replicated
    assert kv_plan(m, 64, 16, tp=8, layout="layer").blocks == 32 * 2 * 4


def test_mla_caches_one_latent_per_token_and_layer() -> None:
    m = MODELS["deepseek-v3"]
    assert m.bytes_per_token(tp=8) == 61 * 576 * 2  # not split by TP
    p = kv_plan(m, 128, 64, tp=1, layout="layer")
    assert p.block_bytes == 576 * 2 * 64
    assert p.blocks == 61 * 2  # 2 pages, no separate K and V
    assert kv_plan(m, 128, 64, tp=1, layout="block").block_bytes == 61 * 576 * 2 * 64


def test_hf_config_and_yaml_file(tmp_path) -> None:
    cfg = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype_bytes) == (28, 4, 128, 2)
    assert m.bytes_per_token() == MODELS["qwen2.5-7b"].bytes_per_token()
    y = tmp_path / "tiny.yaml"
    y.write_text("name: tiny\nlayers: 2\nkv_heads: 2\nhead_dim: 64\ndtype: fp8\n")
    t = load_model(str(y))
    assert kv_plan(t, 10, 4, 1, "layer").block_bytes == 2 * 64 * 1 * 4
    assert kv_plan(t, 10, 4, 1, "layer").blocks == 2 * 2 * 3


def test_aliases_and_errors(tmp_path) -> None:
    assert load_model("70B") is MODELS["llama-3.1-70b"]
    with pytest.raises(ModelShapeError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ModelShapeError, match="layout"):
        kv_plan(MODELS["mistral-7b"], 16, 16, 1, "token")
    with pytest.raises(ModelShapeError, match="isl"):
        kv_plan(MODELS["mistral-7b"], 0, 16, 1, "layer")
    with pytest.raises(ModelShapeError, match="dtype"):
        ModelShape("x", 1, 1, 1, "fp4")
    with pytest.raises(ModelShapeError, match="head_dim"):
        shape_from_mapping({"layers": 4, "kv_heads": 2})
