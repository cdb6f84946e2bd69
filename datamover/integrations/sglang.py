"""SGLang HiCache storage on datamover: a `HiCacheStorage` whose pages live in a `TieredCache`.

SGLang loads it as a dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "datamover",
        "module_path": "datamover.integrations.sglang", "class_name": "DatamoverHiCacheStorage",
        "interface_v1": 1, "kv_cache_tiered": {"l2_dram": {"pinned_pool_gb": 4}, "l3_nvme": {"enabled": true}}}'

With `interface_v1` SGLang calls the zero-copy `batch_get_v1`/`batch_set_v1`: the host pool's
`get_page_buffer_meta` gives one (pointer, size) entry per K/V part of a page, each entry is one datamover chunk,
and the cache moves bytes straight between the host pool and its tiers. Without it, the v0 calls move flat page
tensors. A page is reported present or loaded only when every one of its entries is; a failed or partial load
reports that page and the rest of the batch as failed, so SGLang recomputes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from ..descriptors import DescList
from ..descriptors.buffers import host_view
from ..errors import DatamoverError
from ..policy import ChunkKey, TieredCache
from .tiers import build_config, key_hash, namespace, per_rank

log = logging.getLogger("datamover.integrations.sglang")

ENGINE = "sglang"


class DatamoverHiCacheStorage(HiCacheStorage):
    """SGLang's storage tier (its "L3") backed by datamover's TieredCache (DRAM, NVMe, a pool)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        extra = dict((storage_config.extra_config if storage_config else None) or {})
        self._tiers = extra.get("kv_cache_tiered", extra.get("tier_config"))
        self._v1 = bool(extra.get("interface_v1", 0))
        cfg = storage_config
        mla = bool(getattr(cfg, "is_mla_model", False))
        self._tp_rank = getattr(cfg, "tp_rank", 0)
        self._parts = {
            "model": getattr(cfg, "model_name", None) or "",
            # MLA's latent KV is the same on every TP rank: SGLang lets one rank write it and every rank read it,
            # so the keys must not name the rank (they name the DCP shard, below)
            "tp": "all" if mla else f"{self._tp_rank}of{getattr(cfg, 'tp_size', 1)}",
            "pp": f"{getattr(cfg, 'pp_rank', 0)}of{getattr(cfg, 'pp_size', 1)}",
            "mla": mla,
            "dcp": f"{getattr(cfg, 'dcp_rank', 0)}of{getattr(cfg, 'dcp_size', 1)}",
            # a context-parallel rank holds its own slice of every page: other bytes under the same page hash
            "cp": f"{getattr(cfg, 'attn_cp_rank', 0)}of{getattr(cfg, 'attn_cp_size', 1)}",
        }
        self._dp = int(getattr(cfg, "dp_rank", 0) or 0)  # data-parallel replicas: the same chunks, own L3 files
        self._lock = threading.Lock()
        self.cache: TieredCache | None = None
        self.mem_pool_host: Any = None
        self._entries_per_page = 0  # K/V parts per page in get_page_buffer_meta (v1)
        self._registered: Any = None
        self._v0_dtype: Any = None

    # -- setup -------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: its page layout fixes the chunk size (one K/V entry of one page)."""
        import torch

        super().register_mem_pool_host(mem_pool_host)
        page = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        if not ptrs or len(set(sizes)) != 1:
            raise ValueError(f"sglang host pool pages have entries of sizes {sorted(set(sizes))}; expected one size")
        self._entries_per_page = len(ptrs)
        layout = getattr(mem_pool_host, "layout", "")
        dtype = str(getattr(mem_pool_host, "dtype", ""))
        self._open(int(sizes[0]), layout=layout, dtype=dtype)
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if buffer is not None and self.cache is not None:
            try:  # once, so that each v1 call only prepares descriptors inside it
                self._registered = self.cache.agent.register_memory(buffer)
            except DatamoverError as exc:
                log.info("sglang host pool not registered up front (%s); each call registers its pages", exc)

    def _open(self, chunk_bytes: int, **parts: Any) -> TieredCache:
        with self._lock:
            if self.cache is not None:
                if self.cache.page != chunk_bytes:
                    raise ValueError(f"datamover cache chunks are {self.cache.page} bytes; this page has {chunk_bytes}")
                return self.cache
            self.cache = self._build(chunk_bytes, **parts)
            return self.cache

    def _build(self, chunk_bytes: int, **parts: Any) -> TieredCache:
        """A new TieredCache for chunks of `chunk_bytes` (its L3 and L4 this rank's own); the lock is held."""
        self._parts.update(parts, chunk=chunk_bytes)
        config = build_config(self._tiers, chunk_bytes, ENGINE)
        p = self._parts  # every rank an L3 directory and L4 prefix of its own, MLA too
        rank = f"{ENGINE}-dp{self._dp}-tp{self._tp_rank}-pp{p['pp']}-cp{p['cp']}-{key_hash(self._ns('')):016x}"
        config = per_rank(config, rank)
        cache = TieredCache(config)
        cfg = self.storage_config
        shared = config.l4_pool.enabled and config.l4_pool.backend == "mooncake"
        if self._parts["mla"] and getattr(cfg, "tp_size", 1) > 1 and not shared:
            log.warning(
                "datamover sglang storage: an MLA model with tp_size %d writes from one rank only (SGLang's "
                "rule) and every rank must find what it wrote, which only a shared pool holds "
                "(l4_pool.backend: mooncake); without one the other ranks find nothing, and so neither does "
                "the group's prefetch", cfg.tp_size,
            )  # fmt: skip
        return cache

    def _ns(self, iface: str) -> str:
        return namespace(ENGINE, iface=iface, **self._parts)

    def _keys(self, keys: Sequence[str], iface: str, per: int) -> list[ChunkKey]:
        ns = self._ns(iface)
        return [ChunkKey(key_hash(k), ns, "", j) for k in keys for j in range(per)]

    # -- zero-copy v1 -------------------------------------------------------------
    def _views(self, keys: Sequence[str], host_indices: Any) -> list[Any]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self._entries_per_page:
            raise ValueError(
                f"{len(keys)} keys but {len(ptrs)} buffer entries ({self._entries_per_page} per page expected)"
            )
        if self._registered is not None:  # inside the registered host pool: one DescList, no Python per entry
            return DescList.from_columns(np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
        return [host_view(int(p), int(n)) for p, n in zip(ptrs, sizes)]

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load pages straight into the host pool at host_indices; True for each page of the loaded prefix."""
        if not keys:
            return []
        per = self._entries_per_page
        try:
            delivered = self.cache.get(self._keys(keys, "v1", per), self._views(keys, host_indices))
        except (DatamoverError, ValueError, OSError) as exc:
            log.warning("datamover: loading %d pages failed (%s); SGLang recomputes them", len(keys), exc)
            return [False] * len(keys)
        pages = delivered // per
        return [True] * pages + [False] * (len(keys) - pages)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store pages straight from the host pool; True for each page now held by some tier."""
        if not keys:
            return []
        per = self._entries_per_page
        chunk_keys = self._keys(keys, "v1", per)
        try:
            self.cache.put(chunk_keys, self._views(keys, host_indices))
        except (DatamoverError, ValueError, OSError) as exc:
            log.warning("datamover: storing %d pages failed (%s)", len(keys), exc)
            return [False] * len(keys)
        return [self.cache.lookup(chunk_keys[i * per : (i + 1) * per])[0] == per for i in range(len(keys))]

    # -- v0: flat page tensors -------------------------------------------------------
    def _page_keys(self, key: str, nbytes: int) -> list[ChunkKey]:
        cache = self.cache or self._open(nbytes, layout="flat")
        if nbytes % cache.page:
            raise ValueError(f"a page of {nbytes} bytes is not a whole number of {cache.page}-byte chunks")
        return self._keys([key], "v0", nbytes // cache.page)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page tensor under key."""
        if value is None:
            return False
        try:
            flat = value.reshape(-1)
            self._v0_dtype = flat.dtype
            chunk_keys = self._page_keys(key, flat.numel() * flat.element_size())
            self.cache.put(chunk_keys, flat)
            return self.cache.lookup(chunk_keys)[0] == len(chunk_keys)
        except (DatamoverError, ValueError, OSError) as exc:
            log.warning("datamover: storing page %s failed (%s)", key, exc)
            return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat page tensors; True only if every page is stored."""
        if values is None or len(values) != len(keys):
            return False
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The flat page stored under key (written into target_location when given), or None."""
        import torch

        if self.cache is None:
            return None
        if target_location is None:
            try:
                per = self._present_chunks(key)
            except DatamoverError:  # closed
                return None
            if not per:
                return None
            target = torch.empty(per * self.cache.page, dtype=torch.uint8)
            if self._v0_dtype is not None:
                target = target.view(self._v0_dtype)
        else:
            target = target_location
        flat = target.reshape(-1)
        try:
            chunk_keys = self._page_keys(key, flat.numel() * flat.element_size())
            if self.cache.get(chunk_keys, flat) < len(chunk_keys):
                return None
        except (DatamoverError, ValueError, OSError) as exc:
            log.warning("datamover: loading page %s failed (%s)", key, exc)
            return None
        return target

    def _present_chunks(self, key: str) -> int:
        """How many chunks a v0 page stored under key has (0 if it is not fully present)."""
        ns = self._ns("v0")
        n = 0
        while self.cache.lookup([ChunkKey(key_hash(key), ns, "", n)])[0]:
            n += 1
        return n

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Pages for keys in order; None from the first missing page on (prefix semantics)."""
        out: list[Any] = []
        for i, key in enumerate(keys):
            page = self.get(key, target_locations[i] if target_locations is not None else None)
            if page is None:
                return out + [None] * (len(keys) - i)
            out.append(page)
        return out

    # -- existence -----------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of keys are fully held (the hit prefix length, in pages)."""
        if self.cache is None or not keys:
            return 0
        try:
            if self._v1:
                per = self._entries_per_page
            else:
                per = self._present_chunks(keys[0])
                if not per:
                    return 0
            return self.cache.lookup(self._keys(keys, "v1" if self._v1 else "v0", per))[0] // per
        except DatamoverError as exc:  # a closed cache holds nothing
            log.info("datamover: existence check of %d pages failed (%s)", len(keys), exc)
            return 0

    # -- housekeeping -----------------------------------------------------------------
    def clear(self) -> None:
        """Forget every page (TieredCache.clear: every tier, L3's index, a private L4 bucket's objects, and a shared
        pool's objects, every instance's, as SGLang's own Mooncake store's clear removes them all: a clear follows
        a weights update, after which no page from before may be found). A closed storage stays closed."""
        with self._lock:
            if self.cache is not None and not self.cache.closed:
                self.cache.clear(shared=True)

    def tier_stats(self) -> dict[str, Any]:
        """TieredCache.stats() of this storage (empty before the first page)."""
        return self.cache.stats() if self.cache is not None else {}

    def close(self) -> None:
        """Close the cache; later calls meet it closed (TransferStateError), so they read as misses."""
        with self._lock:
            if self.cache is not None:
                self.cache.close()


__all__ = ["DatamoverHiCacheStorage"]
