"""The worker side of the vLLM offloading spec: a TieredCache fed from and into the engine's own KV blocks.

One offloaded chunk is one vLLM block of one KV cache group: the block's page in each of the group's KV tensors
(one per layer). Each page is one datamover chunk (a ChunkKey whose `layer` is the page's index in the group), so
a block moves as a list of pages straight between the engine's KV cache and the tiers, by Agent transfers
(memcpy on CPU, cuda on a GPU, posix to NVMe, a pool below); nothing is staged in between. On CPU the pages are
one DescList computed in numpy from each tensor's base and block stride.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    OffloadKey,
    TransferResult,
    get_offload_group_idx,
)

from ...descriptors import DescList
from ...errors import DatamoverError
from ...policy import ChunkKey, TieredCache
from ..tiers import build_config, key_hash, namespace, per_rank
from .service import CacheService, check_keys, socket_path

log = logging.getLogger("datamover.integrations.vllm")

ENGINE = "vllm"


class DatamoverChunks(LoadStoreSpec):
    """The chunks of one load or store job: vLLM's offload keys, in the order of the job's GPU blocks."""

    def __init__(self, keys: list[OffloadKey]) -> None:
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"DatamoverChunks({len(self.keys)} keys)"


@dataclass
class _Outcome:
    job_id: int
    success: bool
    nbytes: int
    seconds: float
    bad_blocks: list[int] = field(default_factory=list)


class DatamoverOffloadingWorker(OffloadingWorker):
    """Runs the jobs of vLLM's offloading connector against a TieredCache, one at a time, off the engine's thread.

    A load that fails, or delivers only part of its chunks, is never reported as loaded. DatamoverOffloadingConnector
    sets `report_load_errors`: with one KV cache group the blocks it did not fill go to vLLM as invalid blocks
    (vLLM recomputes them), with several (block ids are not unique across groups) the job's request goes to vLLM
    as a failed receive (`failed_jobs`; vLLM recomputes the request). Without it (vLLM's own OffloadingConnector)
    the job is reported failed, which that connector refuses loudly.
    """

    def __init__(self, spec: Any, kv_caches: CanonicalKVCaches) -> None:
        config = spec.config
        self.report_load_errors = False
        self.report_block_errors = False  # with report_load_errors: as blocks (one group), else as failed jobs
        self.failed_jobs: set[int] = set()
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self._groups: dict[int, list[int]] = {}  # KV cache group id -> its tensors, one page (chunk) each
        sizes: set[int] = set()
        for position, group in enumerate(config.groups):
            refs = kv_caches.group_data_refs[position]
            self._groups[group.group_id] = list(dict.fromkeys(r.tensor_idx for r in refs))
            sizes.update(r.page_size_bytes for r in refs)
        if len(sizes) != 1:
            raise ValueError(f"datamover offloading needs one page size across KV tensors; vLLM has {sorted(sizes)}")
        self.chunk = sizes.pop()
        self._order = [g.group_id for g in config.groups]
        self.namespace = namespace(
            ENGINE,
            model=config.model.name,
            dtype=config.model.dtype,
            tokens=",".join(str(g.tokens_per_block) for g in config.groups),
            layout=config.kv_cache_layout,
            rank=f"{config.parallel.rank}of{config.parallel.world_size}",
            chunk=self.chunk,
        )
        tiers = build_config(spec.tiers, self.chunk, ENGINE)
        # one L3 directory and one L4 prefix per rank and configuration: ranks never share an index
        sub = f"{ENGINE}-rank{config.parallel.rank}-dp{config.parallel.data_parallel_index}"
        sub += f"-{key_hash(self.namespace):016x}"
        tiers = per_rank(tiers, sub)
        self.cache = TieredCache(tiers)
        registered = self._register_kv_caches()
        self._host = registered and all(t.device.type == "cpu" for t in self.tensors)
        self._base = np.array([t.data_ptr() for t in self.tensors], dtype=np.int64)
        self._stride = np.array([t.stride(0) * t.element_size() for t in self.tensors], dtype=np.int64)
        self.counters: Counter = Counter()
        self._jobs: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dm-vllm-offload")
        self.invalid_block_ids: set[int] = set()
        self.service = CacheService(socket_path(config.engine_id, config.parallel.rank), self._handle)
        log.info(
            "datamover offloading: %d KV tensors, %d-byte chunks, tiers %s; serving %s",
            len(self.tensors),
            self.chunk,
            self.cache.names,
            self.service.path,
        )

    def _register_kv_caches(self) -> bool:
        """Register each KV storage once, whole, so that every job only prepares descriptors inside it; False
        if some storage could not be (its jobs then register their pages as they go)."""
        import torch

        seen: set[int] = set()
        ok = True
        for t in self.tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            whole = torch.tensor([], dtype=torch.int8, device=t.device).set_(storage)
            try:
                self.cache.agent.register_memory(whole)
            except DatamoverError as exc:
                log.warning("datamover offloading: KV storage not registered up front (%s); jobs register it", exc)
                ok = False
        return ok

    # -- keys and views ------------------------------------------------------------------
    def _chunk_keys(self, key: OffloadKey) -> list[ChunkKey]:
        h = key_hash(key)
        return [ChunkKey(h, self.namespace, "", j) for j in range(len(self._groups[get_offload_group_idx(key)]))]

    def _layout(self, keys: list[OffloadKey], gpu: GPULoadStoreSpec) -> tuple[list[ChunkKey], Any, list[int]]:
        """The chunk keys of a job, their pages in vLLM's KV cache (a DescList of host memory, or page views of
        device tensors), and the GPU block each belongs to."""
        blocks = [int(b) for b in gpu.block_ids]
        if len(blocks) != len(keys):
            raise ValueError(f"{len(keys)} offload keys for {len(blocks)} GPU blocks (one block per chunk expected)")
        groups = [get_offload_group_idx(k) for k in keys]
        if groups != [g for g, n in zip(self._order, gpu.group_sizes) for _ in range(n)]:
            raise ValueError("offload keys are not in the order of the job's KV cache groups")
        chunk_keys: list[ChunkKey] = []
        owners: list[int] = []
        tensor_of: list[int] = []
        for key, group, block in zip(keys, groups, blocks):
            tensors = self._groups[group]
            chunk_keys += self._chunk_keys(key)
            owners += [block] * len(tensors)
            tensor_of += tensors
        if self._host:  # one descriptor per page, computed in numpy: page = base + block * block stride
            t = np.asarray(tensor_of, dtype=np.int64)
            addr = self._base[t] + np.asarray(owners, dtype=np.int64) * self._stride[t]
            return chunk_keys, DescList.from_columns(addr, self.chunk), owners
        views = [self.tensors[ti][block, : self.chunk] for ti, block in zip(tensor_of, owners)]
        return chunk_keys, views, owners

    # -- jobs -------------------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, True, dst_spec, src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, False, src_spec, dst_spec)

    def _submit(self, job_id: int, store: bool, chunks: LoadStoreSpec, gpu: GPULoadStoreSpec) -> bool:
        if not isinstance(chunks, DatamoverChunks):
            raise TypeError(f"datamover offloading got a {type(chunks).__name__}, not DatamoverChunks")
        with self._lock:
            self._jobs[job_id] = self._pool.submit(self._run, job_id, store, chunks.keys, gpu)
        return True

    def _run(self, job_id: int, store: bool, keys: list[OffloadKey], gpu: GPULoadStoreSpec) -> _Outcome:
        start = time.perf_counter()
        blocks = [int(b) for b in gpu.block_ids]
        try:
            chunk_keys, views, owners = self._layout(keys, gpu)
            if store:
                self.cache.put(chunk_keys, views)
                self.counters["blocks_stored"] += len(keys)
                return _Outcome(job_id, True, len(chunk_keys) * self.chunk, time.perf_counter() - start)
            delivered = self.cache.get(chunk_keys, views)
        except Exception as exc:  # a job never raises into vLLM: a failed store is a future miss, a load recomputes
            log.warning("datamover offloading: %s job %d failed: %s", "store" if store else "load", job_id, exc)
            self.counters["stores_failed" if store else "loads_failed"] += 1
            # a store that failed is still finished: its chunks are simply not in the cache (a future miss)
            return _Outcome(job_id, store, 0, time.perf_counter() - start, [] if store else blocks)
        loaded = len(dict.fromkeys(owners[:delivered]))
        if delivered < len(chunk_keys):  # the block holding the first missing page, and all after it, are bad
            bad = list(dict.fromkeys(owners[delivered:]))
            loaded = len(blocks) - len(bad)
            self.counters["loads_failed"] += 1
            log.warning("datamover offloading: load job %d delivered %d of %d blocks", job_id, loaded, len(blocks))
        else:
            bad = []
        self.counters["blocks_loaded"] += loaded
        return _Outcome(job_id, not bad, delivered * self.chunk, time.perf_counter() - start, bad)

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done = [j for j, f in self._jobs.items() if f.done()]
            outcomes = [self._jobs.pop(j).result() for j in done]
        results = []
        for o in outcomes:
            success = o.success
            if o.bad_blocks and self.report_load_errors:
                with self._lock:  # finished; vLLM recomputes its bad blocks, or its request
                    if self.report_block_errors:
                        self.invalid_block_ids.update(o.bad_blocks)
                    else:
                        self.failed_jobs.add(o.job_id)
                success = True
            results.append(TransferResult(o.job_id, success, o.nbytes, o.seconds))
        return results

    def take_failed_jobs(self) -> set[int]:
        """Load jobs that failed since the last call, for a connector that reports their requests as failed."""
        with self._lock:
            failed, self.failed_jobs = self.failed_jobs, set()
        return failed

    def take_invalid_block_ids(self) -> set[int]:
        """GPU blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            bad, self.invalid_block_ids = self.invalid_block_ids, set()
        return bad

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futures = [self._jobs[j] for j in job_ids if j in self._jobs]
        for f in futures:
            f.exception()

    # -- the manager's questions ----------------------------------------------------------------
    def _handle(self, verb: str, args: list) -> Any:
        if verb == "stats":
            return {"tiers": self.cache.stats(), "worker": dict(self.counters)}
        if verb == "clear":  # vLLM's reset_cache (a weights update): no block from before may be found again
            return self.cache.clear(shared=True)
        keys = check_keys(args[0] if args else None)
        if verb == "lookup":
            out = []
            for key in keys:
                chunk_keys = self._chunk_keys(key) if get_offload_group_idx(key) in self._groups else []
                n, tiers = self.cache.lookup(chunk_keys)
                held = bool(chunk_keys) and n == len(chunk_keys)
                out.append(max(tiers, key=self.cache.names.index) if held else None)  # the farthest tier
            self.counters["lookups"] += len(keys)
            self.counters["lookup_hits"] += sum(t is not None for t in out)
            return out
        chunk_keys = [c for k in keys if get_offload_group_idx(k) in self._groups for c in self._chunk_keys(k)]
        if verb == "pin":
            self.cache.pin(chunk_keys)
        else:
            self.cache.unpin(chunk_keys)
        return len(keys)

    def shutdown(self) -> None:
        self.service.close()
        self._pool.shutdown(wait=True)
        self.cache.close()


__all__ = ["DatamoverChunks", "DatamoverOffloadingWorker"]
