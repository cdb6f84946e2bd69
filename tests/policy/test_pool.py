"""The shared L4 pool: TieredCache instances in separate processes on one real Mooncake Store.

Each instance is its own process (``CacheInstance``) lending memory to the pool; chunk bytes are derived from
their keys, so every instance checks every byte of what it gets, whoever computed it.
"""

from __future__ import annotations

import pytest

from datamover.errors import ConfigError
from datamover.policy.config import TierConfig, with_overrides
from datamover.policy.keys import chunk_keys
from datamover.policy.pool import CORRUPT_MAX, CorruptObjects
from datamover.testing.mooncake import CacheInstance

MiB = 1 << 20


# -- config: the seed's l4_pool fields, honoured or refused with the reason -----------------------------
SEED_L4 = {
    "enabled": True,
    "backend": "mooncake",
    "metadata_service_url": "etcd://meta.internal:2379",
    "placement_locality": True,
    "replica_count": 2,
    "cross_region": False,
    "p99_latency_budget_ms": 1.0,
}


def l4(**fields):
    return with_overrides(TierConfig(), l4_pool=fields).l4_pool


def test_seed_l4_pool_is_accepted():
    cfg = l4(**SEED_L4)
    assert (cfg.backend, cfg.metadata_service_url, cfg.placement_locality) == (
        "mooncake",
        "etcd://meta.internal:2379",
        True,
    )
    assert cfg.replica_count == 2 and cfg.p99_latency_budget_ms == 1.0


@pytest.mark.parametrize(
    "fields, key, words",
    [
        ({**SEED_L4, "cross_region": True}, "l4_pool.cross_region", "one cluster"),
        ({"backend": "s3", "cross_region": True}, "l4_pool.cross_region", "cross-region replication"),
        (
            {"backend": "s3", "metadata_service_url": "etcd://x:2379"},
            "l4_pool.metadata_service_url",
            "only the mooncake",
        ),
        ({"backend": "s3", "placement_locality": True}, "l4_pool.placement_locality", "only the mooncake"),
        ({"backend": "s3", "p99_latency_budget_ms": 1.0}, "l4_pool.p99_latency_budget_ms", "only the mooncake"),
        ({"backend": "mooncake", "endpoint": "http://x"}, "l4_pool.endpoint", "master_server_addr"),
        ({"backend": "mooncake", "metadata_service_url": "meta:2379"}, "l4_pool.metadata_service_url", "not a URL"),
        ({"backend": "redis"}, "l4_pool.backend", ""),
    ],
)
def test_l4_fields_refused_with_reason(fields, key, words):
    with pytest.raises(ConfigError) as info:
        l4(**fields)
    assert key in str(info.value) and words in str(info.value)


def test_the_corrupt_objects_an_instance_remembers_are_bounded_the_oldest_forgotten_first():
    seen = CorruptObjects(limit=3)
    keys = chunk_keys(range(5), "m", "t")
    for key in keys[:3]:
        seen.add(key)
    seen.add(keys[0])  # failed again: now the newest
    seen.add(keys[3])
    assert len(seen) == 3 and keys[1] not in seen
    assert all(k in seen for k in (keys[0], keys[2], keys[3]))
    seen.discard([keys[2], keys[4]])
    assert len(seen) == 2 and keys[2] not in seen
    assert CorruptObjects().limit == CORRUPT_MAX


# -- instances sharing one pool ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def instances(mooncake_master):
    """Three instances for the module (starting one takes seconds): A keeps its chunks in its own memory
    (placement_locality), B lends memory, C lends none; the drain test retires A, so it runs last."""
    ready = CacheInstance.start_each(mooncake_master, [{"placement_locality": True}, {}, {"segment_bytes": 0}])
    yield ready
    CacheInstance.close_all(ready)


def test_three_instances_share_a_prefix(instances):
    """A computes chunks 0-7 of a prompt, B finds them in the pool, gets them and computes 8-15; C, which computed
    nothing, gets all 16 from the pool, every byte checked. Another model's keys never match."""
    a, b, c = instances
    prompt = list(range(1000, 1016))
    assert a.call("put", hashes=prompt[:8])["stored"] == 8
    found = b.call("lookup", hashes=prompt)
    assert found["n"] == 8 and set(found["tiers"]) == {"l4_pool"}
    got = b.call("get", hashes=prompt)
    assert got["delivered"] == 8 and got["wrong"] == []
    assert b.call("put", hashes=prompt[8:])["stored"] == 8

    assert c.call("lookup", hashes=prompt)["n"] == 16
    got = c.call("get", hashes=prompt)
    assert got["delivered"] == 16 and got["wrong"] == [], "a chunk from the pool was not byte for byte"
    stats = c.call("stats")
    assert stats["hits"]["l4_pool"] == 16 and stats["l4_pool_lookups"]["lookups"] >= 2
    # now in C's own tiers: a second get needs no pool read
    assert c.call("lookup", hashes=prompt)["tiers"][0] in ("l1_hbm", "l2_dram")

    assert c.call("lookup", hashes=prompt, model="model@2")["n"] == 0, "another model's chunks matched"
    assert c.call("lookup", hashes=prompt, tokenizer="tok@2")["n"] == 0, "another tokenizer's chunks matched"


def test_drained_instance_leaves_no_chunk_unreachable(instances):
    """A (its chunks in its own memory: placement_locality) drains before leaving, serving lookups meanwhile;
    after it leaves, C finds and gets every chunk A computed. Chunks A put after the drain go with A: without
    the drain they would be gone, which is what the drain is for."""
    a, b, c = instances
    prompt = list(range(2000, 2024))
    late = list(range(3000, 3004))
    try:
        assert a.call("put", hashes=prompt)["stored"] == 24
        drained = a.call("drain", hashes=prompt)
        assert drained["copied"] >= 24, drained  # and any chunk of other instances the master placed in A's memory
        assert drained["lookups_during"] >= 1 and drained["min_prefix_during"] == 24, "lookups failed mid-drain"
        assert a.call("put", hashes=late)["stored"] == 4  # after the drain: only in A's memory
        assert c.call("lookup", hashes=late)["n"] == 4
    finally:
        a.close()  # A leaves the pool: its memory, and every replica in it, is gone
    assert c.call("lookup", hashes=prompt)["n"] == 24
    got = c.call("get", hashes=prompt)
    assert got["delivered"] == 24 and got["wrong"] == []
    assert c.call("get", hashes=late)["delivered"] == 0, "chunks only A held outlived A (the test proves nothing)"
    assert b.call("lookup", hashes=prompt)["n"] == 24
