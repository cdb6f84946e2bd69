"""The scheduler side of the vLLM offloading spec: vLLM's OffloadingManager answered by the workers' TieredCaches.

The tier policy, not this manager, decides what stays: a block is offloaded exactly when every worker's cache
holds all of its pages, so the manager keeps no index of its own that could disagree with the tiers (an evicted
block is a miss, a block found on NVMe after a restart is a hit). Loads pin their blocks until they complete.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Sequence

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .service import CacheClient, ServiceError
from .worker import DatamoverChunks

log = logging.getLogger("datamover.integrations.vllm")

_SOURCE = {"l1_hbm": CacheHitSource.DEVICE, "l2_dram": CacheHitSource.HOST, "l3_nvme": CacheHitSource.DISK}


class DatamoverOffloadingManager(OffloadingManager):
    """Asks each worker's cache service whether blocks are held, and pins them for loads."""

    def __init__(self, clients: Sequence[CacheClient]) -> None:
        self.clients = list(clients)
        self.reset_failed = False  # the last reset_cache could not clear every worker
        self._sources: OrderedDict[OffloadKey, str] = OrderedDict()  # tier of recent hits, for hit-source metrics

    def _ask(self, verb: str, keys: list[OffloadKey]) -> list[list] | None:
        try:
            return [c.call(verb, keys) for c in self.clients]
        except ServiceError as exc:
            log.warning("datamover offloading: %s", exc)
            return None

    def _held(self, keys: list[OffloadKey]) -> list[str | None]:
        """The farthest tier holding each key on every worker, or None where some worker lacks it."""
        answers = self._ask("lookup", keys)
        if answers is None:
            return [None] * len(keys)
        held: list[str | None] = []
        for i in range(len(keys)):
            tiers = [a[i] for a in answers]
            held.append(None if None in tiers else max(tiers))
        return held

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        tier = self._held([key])[0]
        if tier is None:
            return LookupResult.MISS
        self._sources[key] = tier
        while len(self._sources) > 4096:
            self._sources.popitem(last=False)
        return LookupResult.HIT

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return _SOURCE.get(self._sources.get(key, ""), CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> DatamoverChunks:
        keys = list(keys)
        self._ask("pin", keys)  # unreachable workers: the load itself fails and its blocks are recomputed
        return DatamoverChunks(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._ask("unpin", list(keys))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        answers = self._ask("lookup", keys)
        if answers is None:
            return None
        fresh = [k for i, k in enumerate(keys) if any(a[i] is None for a in answers)]
        return PrepareStoreOutput(keys_to_store=fresh, store_spec=DatamoverChunks(fresh), evicted_keys=[])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache(reset_connector=True) and pause_generation(clear_cache=True), after a weights
        update: every worker's tiers forget every chunk (and their pins: loads in flight are dropped by vLLM, and
        never completed), so no block computed before is loaded again. A worker that cannot be reached leaves
        `reset_failed` set, which DatamoverOffloadingConnector.reset_cache reports to vLLM as a failed reset."""
        self._sources.clear()
        try:
            forgotten = [c.call("clear", []) for c in self.clients]
        except ServiceError as exc:
            self.reset_failed = True
            log.error("datamover offloading: reset_cache could not clear every worker's tiers: %s", exc)
            return
        self.reset_failed = False
        log.info("datamover offloading: reset_cache forgot %s chunks (per worker)", forgotten)

    def shutdown(self) -> None:
        for c in self.clients:
            c.close()


__all__ = ["DatamoverOffloadingManager"]
