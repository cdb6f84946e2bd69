"""The tiered KV cache: the API (lookup / get / put / prefetch / pin / unpin / drain / stats / close).

The pieces, each in its own module: the slabs that hold each tier's chunks (`slabs.py`), the tier engine that
decides placements, evictions, demotions and promotions (`engine.py`, the same `TierStack` the replay
simulates) with its decisions recorded as slot-to-slot moves (`plan.py`), what the tiers hold kept true as plans
run (`contents.py`), the executor that moves the bytes by Agent transfers (`mover.py`), the persistent L3 index
(`l3_index.py`), the private L4 bucket on S3 (deletes of evicted chunks, its index across restarts and crashes:
`bucket.py`), the caller's buffers as chunks (`user_chunks.py`), the requests the policy sees (`requests.py`)
and the counts and metrics (`counters.py`).

Sharing: with `l4_pool.backend: mooncake`, L4 is a Mooncake Store pool other instances use too (`pool.py`):
`lookup` extends the prefix this instance holds with the chunks the pool holds (one batched existence check),
`get` adopts those into its L4 index and fetches them (promoting them as the policy decides), `put` also
writes new chunks to the pool (`publish_on_put`), and `drain("l4_pool")` copies every chunk only this
instance's memory holds to other members before it leaves, while lookups go on.

Integrity: with `crc32c_check`, the CRC32C of each chunk is computed once when it is put, stored in the L3 index,
and checked on every read from L3 or L4 (those reads land in a host staging area first); a mismatch drops the
chunk from the cache, logs the key, and counts as a miss: get() returns only the verified prefix. A read from L4
that the store did not answer (a timeout, no connection), or from L3 that timed out, is a miss for that operation
too, but its chunk stays in L4 (L3), whose copy is not in doubt (only the slots it was being copied into are
dropped), for a later get to read. A write down to L4 that the store did not answer keeps its chunk in a tier
above where the plan allows, else drops it, counted in `stats()["write_down_failures"]` (`write_down.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..agents import Agent
from ..errors import InvalidParameter, TransferStateError
from ..telemetry.metrics import CacheMetrics
from ..telemetry.spans import SpanRecorder
from .config import TIER_NAMES, TierConfig, checked_config
from .contents import TierContents
from .counters import Counters
from .engine import PREFILL
from .keys import ChunkKey
from .l3_index import INDEX_FILE, lock_directory
from .plan import USER, Move
from .policies import check_policy_name
from .pool import SharedPool
from .requests import Requests
from .slabs import DATA_FILE, Slab, backend_params, gpu_bytes, gpu_reason, host_slab, make_slab
from .user_chunks import chunk_crcs, prepare_user, release_user

log = logging.getLogger("datamover.kvcache")


class TieredCache:
    """A KV cache over the enabled tiers of `config`; keys are ChunkKeys, values chunks of page_size_bytes.

    lookup / get / put / prefetch / pin / unpin / drain are thread-safe (one operation at a time).
    """

    def __init__(
        self,
        config: TierConfig | dict[str, Any] | None,
        agent: Agent | None = None,
        metrics: CacheMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # checked as a file is: a TierConfig built in code, or a mapping, fails here naming the field
        self.config = config = checked_config(config)
        check_policy_name(config)
        self.page = config.l1_hbm.page_size_bytes
        on_gpu = config.l1_hbm.enabled and config.l1_hbm.device != "dram" and self._gpu_reason() is None
        config.check_fits(gpu_bytes=self._gpu_bytes() if on_gpu else None)
        self.clock = clock
        self.metrics = metrics
        self.spans: SpanRecorder | None = None
        self.notes: list[str] = []
        self._l3_lock: int | None = None
        self._closed = False
        self._own_agent = agent is None
        self.agent = agent or Agent("kvcache", {"backends": backend_params(config)})
        self._lock = threading.RLock()
        self._pin_lock = threading.Lock()  # pins alone (taken inside _lock, never the other way round)
        self._pins: Counter = Counter()
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="dm-kv-prefetch")
        self.counters = Counters(metrics)
        self.pool: SharedPool | None = None
        self.contents: TierContents | None = None
        self.tiers: list[Slab] = []
        self._stage: Slab | None = None
        l3_bytes = 0
        try:
            self.spans = SpanRecorder.from_config(config.observability)
            if config.l3_nvme.enabled:  # before anything under it is read or sized
                self._l3_lock = lock_directory(config.l3_nvme.path)
                data_file = Path(config.l3_nvme.path) / DATA_FILE
                l3_bytes = data_file.stat().st_size if data_file.exists() else 0  # the data file as found
            for name in config.enabled_tiers():  # one by one: if one cannot be made, those before are given back
                self.tiers.append(make_slab(self.agent, config, name, self.notes))
            stage_pages = max(1, min(config.l2_dram.swap_threshold_pages, 4096))
            self._stage = stage = host_slab(self.agent, "stage", stage_pages, self.page)
            if config.l4_pool.enabled and config.l4_pool.backend == "mooncake":
                self.pool = SharedPool(self.agent, config.l4_pool)
                self.notes.append(f"l4_pool: Mooncake Store pool, this instance is segment {self.pool.hostname}")
            self.contents = contents = TierContents(
                self.agent, config, self.tiers, stage, self.counters, clock, self.notes, metrics, self.spans, self.pool
            )
            self.engine, self.names, self.crc = contents.engine, contents.names, contents.crc
            self.mover = contents.mover
            self._invalid, self._check_crc = contents.invalid, contents.check_crc
            self._requests = Requests(self.engine)  # the request a get opened, whose put may follow
            if "l3_nvme" in self.names:
                contents.load_l3_index(l3_bytes)
            if config.l4_pool.enabled and self.pool is None:
                contents.load_bucket_index()
        except BaseException:  # a tier that cannot be built: release what was
            self._prefetcher.shutdown()
            self._release()
            raise

    # -- setup ---------------------------------------------------------------
    hits = property(lambda self: self.counters.hits, doc="Chunks delivered by get, per tier (a Counter).")
    misses = property(lambda self: self.counters.misses, doc="Chunks asked of get and not delivered.")
    checksum_failures = property(lambda self: self.counters.checksum_failures, doc="Chunks that failed CRC32C.")
    _gpu_reason = staticmethod(gpu_reason)
    _gpu_bytes = staticmethod(gpu_bytes)
    index = property(lambda self: self.contents.index if self.contents else None, doc="The L3 index, if any.")
    bucket = property(lambda self: self.contents.bucket if self.contents else None, doc="A private L4 bucket.")

    # -- the API ------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> tuple[int, list[str]]:
        """Length of the longest cached prefix of `keys`, and the tier holding each of those chunks. With a shared
        pool, the prefix goes on through the chunks the pool holds (put there by any instance).

        It does not wait for the cache's lock, which a get or put holds while its bytes move (an engine's scheduler
        asks this for every block): the answer is of the moment, and a get that follows finds out for itself."""
        self._check_open()
        eng, names = self.engine, self.names
        tiers = []
        for key in keys:
            j = eng.where(key)
            if j < 0:
                break
            tiers.append(names[j])
        if self.pool is not None and len(tiers) < len(keys):
            rest = keys[len(tiers) :]
            with self.pool.calls():
                held = self.pool.held(rest)
            for key in rest[:held]:
                j = eng.where(key)
                tiers.append(names[j] if j >= 0 else "l4_pool")
        return len(tiers), tiers

    def get(self, keys: Sequence[ChunkKey], dst: Any) -> int:
        """Copy the longest cached prefix of `keys` into `dst` (chunk i at offset i*page, the i-th buffer of a
        list, or the i-th row of a DescList in memory registered with `agent`), promoting as the policy decides.
        Returns how many chunks were delivered, all verified; the rest are misses for the caller to recompute
        (and put)."""
        with self._lock:
            self._check_open()
            n, tiers = self.lookup(keys)
            prefix = list(keys[:n])
            user, reg = prepare_user(self.agent, dst, n, self.page) if n else (None, None)
            eng = self.engine
            before = list(eng.evictions)
            self.pin(prefix)  # in flight: promoting one chunk of the prefix must not evict another
            try:
                now = self.clock()
                first = self._requests.begin(keys, now, n)  # a request left open by an earlier get is done
                if self.pool is not None:
                    eng.adopt_shared(self.names.index("l4_pool"), prefix, now)
                for i, key, j in self._requests.observed(prefix, None, now, first):
                    if j >= 0:
                        eng.hit(j, key, now, first + i)
                self.contents.execute(eng.take_plan(), None)
                plan = []
                for i, key in enumerate(prefix):
                    j = eng.where(key)
                    if j < 0:  # dropped while promoting: its bytes failed their CRC32C
                        break
                    plan.append(Move(key, j, eng.slots[j][key], USER, i))
                self.contents.execute(plan, user)
                delivered = next((i for i, k in enumerate(prefix) if k in self._invalid or eng.where(k) < 0), n)
            finally:
                self.unpin(prefix)
                self._invalid.clear()
                release_user(self.agent, reg)
            self.counters.served(tiers, len(keys), delivered)
            self.counters.op_done(eng, self.names, before)
            return delivered

    def put(self, keys: Sequence[ChunkKey], src: Any) -> int:
        """Store chunks (chunk i of `src`, laid out as for get, under keys[i]); chunks already cached only count
        as used. Returns how many were newly stored in some tier. A put of the chunks that end the keys of the
        last get, after the prefix it delivered, ends that request for the policy, as a request ends in the
        replay; any other put is a request of its own."""
        with self._lock:
            self._check_open()
            if not keys:
                return 0
            _check_keys(keys)
            user, reg = prepare_user(self.agent, src, len(keys), self.page)
            eng = self.engine
            before = list(eng.evictions)
            now = self.clock()
            try:
                fresh = dict(zip(keys, chunk_crcs(src, len(keys), self.page), strict=True)) if self._check_crc else {}
                eng.user_index = {k: i for i, k in enumerate(keys)}
                first, parent = self._requests.continued(keys, now)
                placed = []
                for i, key, j in self._requests.observed(keys, parent, now, first):
                    if j >= 0:
                        eng.orders[j].touch(key, now, first + i)
                    elif eng.place(0, key, now, first + i, PREFILL):
                        placed.append(key)
                if self.pool is not None and self.config.l4_pool.publish_on_put:
                    j4 = self.names.index("l4_pool")
                    for i, key in enumerate(keys):  # other instances find it in the pool at once, not when demoted
                        if key not in eng.resident[j4]:
                            eng.place(j4, key, now, first + i, PREFILL)
                # after planning: placing one chunk may have dropped another of these keys (and its old CRC); a
                # chunk already cached keeps its bytes, and so its CRC (a recompute need not be bit-identical)
                self.crc.update((k, fresh[k]) for k in placed if k in fresh and eng.where(k) >= 0)
                self.contents.execute(eng.take_plan(), user)
                stored = sum(1 for k in placed if k not in self._invalid and eng.where(k) >= 0)
            finally:
                eng.user_index = {}
                self._invalid.clear()
                release_user(self.agent, reg)
                self._requests.served()
            self.counters.op_done(eng, self.names, before)
            return stored

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future:
        """Start promoting the cached prefix of `keys` to L1 in the background; the future gives how many moved."""
        with self._lock:
            self._check_open()
            try:
                return self._prefetcher.submit(self._promote, list(keys))
            except RuntimeError:  # close() has shut the prefetcher down and is about to mark the cache closed
                raise TransferStateError("TieredCache is closing") from None

    def _promote(self, keys: list[ChunkKey]) -> int:
        with self._lock:
            if self._closed:
                return 0
            n, tiers = self.lookup(keys)
            now = self.clock()
            if self.pool is not None:  # chunks other instances put: into this instance's L4 index first
                self.engine.adopt_shared(self.names.index("l4_pool"), keys[:n], now)
                tiers = [self.names[self.engine.where(k)] if self.engine.where(k) >= 0 else "" for k in keys[:n]]
            lower = [(k, t) for k, t in zip(keys[:n], tiers, strict=True) if t and t != self.names[0]]
            self.pin(keys[:n])
            before = list(self.engine.evictions)
            try:
                placed = [k for k, t in lower if self.engine.place(0, k, now, -1, t)]
                self.contents.execute(self.engine.take_plan(), None)
                # a promotion whose copy failed dropped its chunk: only those now in L1 were moved
                moved = sum(1 for k in placed if k not in self._invalid and k in self.engine.resident[0])
                self.counters.op_done(self.engine, self.names, before)
            finally:
                self.unpin(keys[:n])
                self._invalid.clear()
            return moved

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Keep chunks from being evicted by the operations that start from now on (nested: each pin needs an
        unpin). Like lookup it does not wait for a get or put whose bytes are moving (an engine pins a request's
        hits from its scheduler): a chunk that operation already chose to evict goes anyway, and is a miss."""
        with self._pin_lock:
            self._check_open()
            self._pins.update(keys)
            self.engine.pinned.update(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one pin of each chunk."""
        with self._pin_lock:
            self._check_open()
            self._pins.subtract(keys)
            for key in keys:
                if self._pins[key] <= 0:
                    del self._pins[key]
                    self.engine.pinned.discard(key)

    def drain(self, tier: str) -> int:
        """Move every chunk held only by `tier` to the tiers below, close `tier` to new chunks and empty it
        (before shutting an instance down). Returns how many chunks were moved; chunks that fit nowhere below
        are dropped and logged."""
        if tier == "l4_pool" and self.pool is not None:
            return self._drain_pool()
        with self._lock:
            self._check_open()
            j = self.names.index(tier)
            if j + 1 == len(self.names):
                raise ValueError(f"no enabled tier below {tier} to drain to")
            moved = self.contents.drain(j)
            self._invalid.clear()
            return moved

    def _drain_pool(self) -> int:
        """Before this instance leaves a shared pool: write every chunk it holds that the pool lacks, then copy
        every chunk whose only replicas are in this instance's memory to other members. Lookups and gets go on
        meanwhile (the copies run without the cache's lock). Returns how many chunks were copied."""
        assert self.pool is not None
        with self._lock:
            self._check_open()
            eng = self.engine
            j4 = self.names.index("l4_pool")
            now = self.clock()
            known = set().union(*eng.resident)
            local = [k for k in known if k not in eng.resident[j4]]
            if local:
                self.pin(local)
                try:
                    for key in local:
                        eng.place(j4, key, now, -1, self.names[eng.where(key)])
                    self.contents.execute(eng.take_plan(), None)
                finally:
                    self.unpin(local)
                    self._invalid.clear()
            known = set(eng.resident[j4])
        with self.pool.calls():
            result = self.pool.drain(sorted(known, key=lambda k: k.digest()))
        self.notes.append(
            f"l4_pool drain: {result['unique']} of {result['candidates']} chunks only here, {result['copied']} "
            f"copied to other members, {result['failed']} failed"
        )
        if result["failed"]:
            log.warning("l4_pool drain: %d chunk(s) could not be copied off this instance", result["failed"])
        return result["copied"]

    def clear(self, shared: bool = False) -> int:
        """Forget every chunk (an engine's clear, a weights update): every tier emptied, pins included; the L3
        index records it, and a private L4 bucket's objects are deleted. A shared pool's objects are kept (other
        instances use them), unless `shared`: then every object of the pool's bucket goes too, every instance's
        (as SGLang's own Mooncake store clears), so no chunk from before can be found there again. Returns how
        many chunks this cache forgot. This cache's tiers are emptied even when the pool cannot be: its error
        (an ObjectStoreError) is raised after."""
        with self._lock:
            self._check_open()
            with self._pin_lock:
                self._pins.clear()
                self.engine.pinned.clear()
            forgotten = self.contents.forget_all()
            if shared and self.pool is not None:
                removed = self.pool.clear()
                log.warning(
                    "clear: %d object(s) of the shared pool %s removed (every instance's)", removed, self.pool.prefix
                )
            return forgotten

    def stats(self) -> dict[str, Any]:
        """Hits per tier, misses, evictions, chunks moved between tiers, checksum failures, chunks whose move
        failed (per "from->to", the caller being "caller"; dropped, but for those `write_down_failures` counts:
        of writes to L4 the store did not answer, the chunks kept in a tier above and those dropped), resident
        chunks."""
        with self._lock:
            eng = self.engine
            return {
                **self.counters.lookups(self.names),
                "evictions": dict(zip(self.names, eng.evictions, strict=True)),
                "moved_chunks": {f"{a}->{b}": n for (a, b), n in eng.moved.items()},
                "resident": {name: len(r) for name, r in zip(self.names, eng.resident, strict=True)},
                "checksum_failures": self.counters.checksum_failures,
                "move_failures": dict(self.mover.failures),
                "write_down_failures": (
                    downs.counts() if (downs := self.contents.write_downs) is not None else {"kept": 0, "dropped": 0}
                ),
                "l4_pool_lookups": self.pool.latency() if self.pool is not None else None,
                "l4_bucket": self.bucket.stats() if self.bucket is not None else None,
                "notes": list(self.notes),
            }

    @property
    def closed(self) -> bool:
        """Whether `close` was called (every call but `stats` and `close` then raises TransferStateError)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransferStateError("TieredCache is closed: its tiers' memory and files are released")

    def close(self) -> None:
        """Finish background work, compact the L3 index, release memory and files (once; later calls do nothing,
        and every other call but `stats` raises TransferStateError)."""
        self._prefetcher.shutdown(wait=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.pool is not None:  # its client closes with the agent: calls made without the lock end first
                self.pool.close_calls(self.agent.config.timeout_s)
            try:
                self.contents.close()
            finally:
                self._release()

    def _release(self) -> None:
        """Give back what the cache took (at close, or when it fails to start): the span file, the L3 index log
        (closed without writing: `close` wrote it), the regions (the whole Agent when it is the cache's own, else
        each slab's, so the caller's Agent goes on without them), the L3 directory's lock. Every step runs,
        whatever an earlier one raised (that error goes on after)."""
        with contextlib.ExitStack() as steps:  # run last registered first
            steps.callback(self._unlock)
            if self._own_agent:
                steps.callback(self.agent.close)
            else:
                for slab in [*self.tiers, *([self._stage] if self._stage is not None else [])]:
                    steps.callback(slab.release, self.agent)
            if self.index is not None:
                steps.callback(self.index.release)
            if self.spans is not None:
                steps.callback(self.spans.close)

    def _unlock(self) -> None:
        if self._l3_lock is not None:
            os.close(self._l3_lock)
            self._l3_lock = None

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_keys(keys: Sequence[ChunkKey]) -> None:
    """Refuse keys the L3 and L4 indexes cannot record, before a byte moves: fields of other types (a numpy
    integer compares equal to an int but is not stored as one) and a prefix hash wider than 64 bits (a whole
    SHA-256, say, must be folded to 64 first)."""
    for i, key in enumerate(keys):
        if type(key) is not ChunkKey:
            raise InvalidParameter(f"keys[{i}] {key!r:.80} is not a ChunkKey")
        prefix, model, tokenizer, layer = key
        if type(prefix) is not int or type(model) is not str or type(tokenizer) is not str:
            raise InvalidParameter(
                f"keys[{i}] {key!r:.120}: prefix_hash must be an int and the versions str, got "
                f"{type(prefix).__name__}, {type(model).__name__}, {type(tokenizer).__name__} (convert with int())"
            )
        if layer is not None and type(layer) is not int:
            raise InvalidParameter(f"keys[{i}] {key!r:.120}: layer must be an int or None, got {type(layer).__name__}")
        if not -(1 << 63) <= prefix < 1 << 64:
            raise InvalidParameter(f"keys[{i}] {key}: prefix_hash does not fit 64 bits (fold it, e.g. modulo 2**64)")


__all__ = ["DATA_FILE", "INDEX_FILE", "TIER_NAMES", "USER", "Move", "TieredCache"]
