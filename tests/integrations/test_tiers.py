"""What the engine adapters share: each rank's own L3 directory and private L4 prefix."""

from __future__ import annotations

from pathlib import Path

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
