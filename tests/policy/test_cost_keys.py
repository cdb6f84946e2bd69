"""The cost model and chunk keys."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    assert ChunkKey(7, "m", "t").digest() == "ab4583b0d9570a3b26d3210fd5f4e004"  # the same in every process


def test_fields_that_join_to_the_same_text_have_different_digests():
    """Fields joined by '|' named one L4 object for these two keys (one chunk's bytes served for the other)."""
    assert ChunkKey(42, "m|x", "t").digest() != ChunkKey(42, "m", "x|t").digest()
    assert ChunkKey(1, "m", "t", None).digest() != ChunkKey(1, "m", "tNone").digest()


_text = st.text(alphabet="|:1m\u00e9", max_size=4)
_key = st.builds(ChunkKey, st.integers(-20, 20), _text, _text, st.none() | st.integers(-2, 12))


@given(_key, _key)
def test_different_keys_have_different_digests(a, b):
    assert (a.digest() == b.digest()) == (a == b)
