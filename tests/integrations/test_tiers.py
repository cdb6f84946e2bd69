"""What the engine adapters share: each rank's own L3 directory and private L4 prefix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from datamover.errors import ConfigError
from datamover.integrations.tiers import build_config, per_rank


def test_each_rank_gets_its_own_l3_directory_and_l4_prefix(tmp_path: Path) -> None:
    section = {
        "l3_nvme": {"enabled": True, "path": str(tmp_path), "capacity_gb": 0.01},
        "l4_pool": {"enabled": True, "bucket": "b", "capacity_gb": 0.01},
    }
    config = build_config(section, 4096, "test")
    a, b = per_rank(config, "rank0-x"), per_rank(config, "rank1-x")
    assert (a.l3_nvme.path, b.l3_nvme.path) == (str(tmp_path / "rank0-x"), str(tmp_path / "rank1-x"))
    assert (a.l4_pool.prefix, b.l4_pool.prefix) == ("kv/rank0-x/", "kv/rank1-x/")
    assert a.l4_pool.bucket == b.l4_pool.bucket == "b"


def test_a_shared_pool_and_disabled_tiers_are_left_alone(tmp_path: Path) -> None:
    section = {"l4_pool": {"enabled": True, "backend": "mooncake", "capacity_gb": 0.01}}
    config = build_config(section, 4096, "test")
    assert per_rank(config, "rank0") == config  # the pool's keys are shared; L3 is off


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"42\n", "expected a mapping with a kv_cache_tiered key, got int"),  # a TypeError
        (b"kv_cache_tiered\n", "expected a mapping with a kv_cache_tiered key, got str"),  # searched as a string
        (b"l2_dram: {pinned_pool_gb: \xff}\n", "not UTF-8 text"),  # a UnicodeDecodeError
        (b"l2_dram: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "YAML nested too deeply"),  # a RecursionError
        (b"l3_nvme: {path: 2001-02-30}\n", "a value YAML cannot build"),  # a bare ValueError
        (b"l2_dram: {pinned_pool_gb: 1}\nl2_dram: {pinned_pool_gb: 2}\n", "'l2_dram' is given twice"),  # the last
    ],
)
def test_an_engine_config_file_is_read_as_datamover_replay_reads_one(tmp_path: Path, text: bytes, said: str) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=re.escape(said)) as err:
        build_config(str(path), 65536, "vllm")
    assert err.value.path.startswith(str(path))
