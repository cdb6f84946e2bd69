"""The vLLM offloading spec on datamover: `spec_name: DatamoverOffloadingSpec` in vLLM's OffloadingConnector."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from .manager import DatamoverOffloadingManager
from .service import CacheClient, socket_path
from .worker import DatamoverOffloadingWorker


class DatamoverOffloadingSpec(OffloadingSpec):
    """vLLM's offloading spec whose manager asks datamover's TieredCache and whose worker moves KV blocks into it.

    kv_connector_extra_config keys (besides vLLM's own spec_name / spec_module_path):
      kv_cache_tiered: the tier section (a mapping, or the path of a YAML file) - DRAM, NVMe, a pool, the policy;
      service_timeout_s: how long the scheduler waits for a worker's answer (default 10).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "datamover offloading moves one vLLM block per chunk; leave block_size / blocks_per_chunk "
                "out of kv_connector_extra_config"
            )
        extra = dict(self.extra_config)
        self.tiers: Any = extra.get("kv_cache_tiered", extra.get("tier_config"))
        self.service_timeout_s = float(extra.get("service_timeout_s", 10.0))
        self._manager: DatamoverOffloadingManager | None = None
        self._worker: DatamoverOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            world = self.config.parallel.world_size
            paths = [socket_path(self.config.engine_id, rank) for rank in range(world)]
            self._manager = DatamoverOffloadingManager([CacheClient(p, self.service_timeout_s) for p in paths])
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = DatamoverOffloadingWorker(self, kv_caches)
        return self._worker


__all__ = ["DatamoverOffloadingSpec"]
