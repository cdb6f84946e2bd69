"""datamover inside vLLM: KV offloading to datamover's tiers, and prefill/decode over NIXL's connector on datamover.

Offloading (vLLM's OffloadingConnector with this package's spec)::

    kv_transfer_config = {
        "kv_connector": "DatamoverOffloadingConnector",            # not vLLM's "OffloadingConnector": it asserts
                                                                    # every load succeeded (a miss ends the worker)
        "kv_connector_module_path": "datamover.integrations.vllm",  # (drop it with OffloadingConnector)
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "DatamoverOffloadingSpec",
            "spec_module_path": "datamover.integrations.vllm",
            "kv_cache_tiered": {"l2_dram": {"pinned_pool_gb": 4}, "l3_nvme": {"enabled": True, "path": "/nvme/kv"}},
        },
    }

`cache_stats(engine_id)` returns a running engine's tier table (TieredCache.stats()) and worker counters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .service import CacheClient, socket_path

if TYPE_CHECKING:
    from .connector import DatamoverOffloadingConnector
    from .spec import DatamoverOffloadingSpec
    from .worker import DatamoverChunks, DatamoverOffloadingWorker

# imported (and vLLM with them) on first use: vLLM itself looks them up by name in this module, and the cache
# service's client (cache_stats, .service) needs no vLLM in the process that asks
_LAZY = {
    "DatamoverOffloadingConnector": ".connector",
    "DatamoverOffloadingSpec": ".spec",
    "DatamoverChunks": ".worker",
    "DatamoverOffloadingWorker": ".worker",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def cache_stats(engine_id: str, rank: int = 0, timeout_s: float = 10.0) -> dict[str, Any]:
    """{"tiers": TieredCache.stats(), "worker": counters} of the offloading worker of `rank` of engine `engine_id`
    (set `engine_id` in the KV transfer config to know it), asked over its cache service from any process."""
    client = CacheClient(socket_path(engine_id, rank), timeout_s)
    try:
        return client.call("stats")
    finally:
        client.close()


__all__ = [
    "DatamoverChunks",
    "DatamoverOffloadingConnector",
    "DatamoverOffloadingSpec",
    "DatamoverOffloadingWorker",
    "cache_stats",
]
