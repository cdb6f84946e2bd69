"""The cost model and chunk keys."""

from __future__ import annotations

import pytest

from datamover.policy.config import TierConfig, with_overrides
from datamover.policy.cost import CostModel
from datamover.policy.keys import ChunkKey, chunk_keys


def test_effective_cost_formula():
    cost = CostModel.from_config(TierConfig())
    assert cost.tier_ns == (100.0, 100_000.0, 1_000_000.0, 30_000_000.0)
    c = cost.effective_ns({"l1_hbm": 0.5, "l2_dram": 0.2, "l3_nvme": 0.1, "l4_pool": 0.1}, 0.1)
    assert c == pytest.approx(100 * 0.5 + 1e5 * 0.2 + 1e6 * 0.1 + 3e7 * 0.1 + 5e7 * 0.1)
    assert cost.effective_ns([1.0], 0.0) == pytest.approx(100.0)
    custom = CostModel.from_config(with_overrides(TierConfig(), cost={"miss_ns": 1e9}))
    assert custom.effective_ns({"l1_hbm": 0.0}, 1.0) == 1e9


def test_effective_cost_rejects_inconsistent_rates():
    cost = CostModel()
    with pytest.raises(ValueError, match="add up"):
        cost.effective_ns({"l1_hbm": 0.5}, 0.1)
    with pytest.raises(KeyError):
        cost.effective_ns({"l9": 0.5}, 0.5)


def test_chunk_keys_carry_versions():
    a = chunk_keys([1, 2], "m1", "t1")
    assert a == [ChunkKey(1, "m1", "t1"), ChunkKey(2, "m1", "t1")]
    assert ChunkKey(1, "m1", "t1") != ChunkKey(1, "m2", "t1") != ChunkKey(1, "m1", "t2")
    assert ChunkKey(1, "m1", "t1", layer=3) != ChunkKey(1, "m1", "t1")


def test_digest_is_stable_and_distinct():
    keys = [ChunkKey(h, m, t, layer) for h in (0, 1) for m in ("m1", "m2") for t in ("t1", "t2") for layer in (None, 0)]
    digests = {k.digest() for k in keys}
    assert len(digests) == len(keys)
    assert ChunkKey(7, "m", "t").digest() == "9354d818132f5121209b430d26076d13"  # the same in every process
