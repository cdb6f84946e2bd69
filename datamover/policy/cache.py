"""The tiered KV cache: chunks placed by the tier policy, every byte moved by Agent transfers.

Each tier is a slab of fixed-size slots (one chunk each): L1 a GPU tensor (or, without a usable GPU, a host
DRAM arena standing in for HBM, which `notes` says), L2 a pinned host arena, L3 one file under `l3_nvme.path`
with a persistent index, L4 objects in an S3 bucket. The policy engine (the same `TierStack` the replay
simulates) decides placements, evictions, demotions and promotions; they become a plan of slot-to-slot moves,
batched into one transfer per (source, destination) pair wherever no move depends on another.

Integrity: with `crc32c_check`, the CRC32C of each chunk is computed once when it is put, stored in the L3 index,
and checked on every read from L3 or L4 (those reads land in a host staging area first); a mismatch drops the
chunk from the cache, logs the key, and counts as a miss: get() returns only the verified prefix.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ..agents import Agent, Prepared
from ..backends import backend_status
from ..descriptors import DescList, MemType, aligned_empty
from ..errors import BackendUnavailable, DatamoverError, NotRegistered, UnsupportedTransfer
from ..telemetry.spans import SpanRecorder
from .config import TIER_NAMES, TierConfig
from .keys import ChunkKey
from .policies import PolicySettings, make_policy
from .replay import PREFILL, TierStack, tier_specs

if TYPE_CHECKING:  # the telemetry extra (prometheus_client) is needed only by callers that pass metrics
    from ..telemetry.metrics import CacheMetrics

log = logging.getLogger("datamover.kvcache")

USER = -1  # a plan endpoint meaning the caller's buffer (the source of put, the destination of get)
STAGE = -2  # the host staging area
INDEX_FILE = "index.log"
DATA_FILE = "chunks.dat"


@dataclass(frozen=True)
class Move:
    """Copy chunk `key` from slot `src_slot` of `src` to slot `dst_slot` of `dst` (tier indices, USER, STAGE)."""

    key: ChunkKey
    src: int
    src_slot: int
    dst: int
    dst_slot: int


@dataclass
class _Tier:
    """One tier's storage: its memory type, the prepared slot descriptors, a host view of its slots if any."""

    name: str
    mem: MemType
    capacity: int
    prepared: Prepared | None = None  # None for OBJ (descriptors are made per batch from object keys)
    host: np.ndarray | None = None  # (capacity, page) uint8 view for host arenas
    owner: Any = None  # keeps the arena alive


class _Engine(TierStack):
    """The policy's decisions recorded as slot moves; slots are allocated and freed as chunks come and go."""

    def __init__(self, cache: TieredCache, config: TierConfig) -> None:
        policy = make_policy(config.policy.name, PolicySettings.from_config(config))
        super().__init__(
            policy, tier_specs(config), config.policy.promote_on_hit, config.policy.write_mode == "write_through"
        )
        self.cache = cache
        self.slots: list[dict[ChunkKey, int]] = [{} for _ in self.specs]
        self.free: list[list[int]] = [list(range(t.capacity - 1, -1, -1)) for t in self.specs]
        self.plan: list[Move] = []
        self.user_index: dict[ChunkKey, int] = {}
        self.origin: dict[tuple[int, ChunkKey], tuple[int, int]] = {}  # put from the caller in this plan

    def _placed(self, source: str, j: int, key: ChunkKey) -> None:
        slot = self.free[j].pop()
        self.slots[j][key] = slot
        if source == PREFILL:
            src = (USER, self.user_index[key])
        else:  # a chunk copied from the caller earlier in this plan is copied from the caller again
            t = self.names.index(source)
            src = self.origin.get((t, key), (t, self.slots[t][key]))
        if src[0] == USER:
            self.origin[j, key] = src
        self.plan.append(Move(key, src[0], src[1], j, slot))

    def _removed(self, j: int, key: ChunkKey) -> None:
        slot = self.slots[j].pop(key)
        self.free[j].append(slot)
        self.cache._removed(j, key, slot)

    def take_plan(self) -> list[Move]:
        plan, self.plan = self.plan, []
        self.origin.clear()
        return plan


class TieredCache:
    """A KV cache over the enabled tiers of `config`; keys are ChunkKeys, values chunks of page_size_bytes.

    lookup / get / put / prefetch / pin / unpin / drain are thread-safe (one operation at a time).
    """

    def __init__(
        self,
        config: TierConfig,
        agent: Agent | None = None,
        metrics: CacheMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.page = config.l1_hbm.page_size_bytes
        on_gpu = config.l1_hbm.enabled and config.l1_hbm.device != "dram" and self._gpu_reason() is None
        config.check_fits(gpu_bytes=self._gpu_bytes() if on_gpu else None)
        self.clock = clock
        self.metrics = metrics
        self.spans = SpanRecorder.from_config(config.observability)
        self.notes: list[str] = []
        self._own_agent = agent is None
        self.agent = agent or Agent("kvcache", {"backends": self._backend_params()})
        self._lock = threading.RLock()
        self._pins: Counter = Counter()
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="dm-kv-prefetch")
        self.crc: dict[ChunkKey, int] = {}
        self.hits = Counter()
        self.misses = 0
        self.checksum_failures = 0
        self._invalid: set[ChunkKey] = set()
        self._index_file = None
        self._pending_log: list[list] = []
        self._gone: set[ChunkKey] = set()
        try:
            self.tiers = [self._make_tier(name) for name in config.enabled_tiers()]
            self.engine = _Engine(self, config)
            self.names = self.engine.names
            stage_pages = max(1, min(config.l2_dram.swap_threshold_pages, 4096))
            self._stage = self._host_tier("stage", stage_pages)
            remote = (MemType.FILE, MemType.OBJ)
            self._check_crc = config.l3_nvme.crc32c_check and any(t.mem in remote for t in self.tiers)
            if "l3_nvme" in self.names:
                self._load_l3_index()
        except BaseException:  # a tier that cannot be built: release what was
            self._prefetcher.shutdown()
            if self._own_agent:
                self.agent.close()
            raise

    # -- setup ---------------------------------------------------------------
    def _backend_params(self) -> dict[str, dict]:
        l4 = self.config.l4_pool
        params: dict[str, dict] = {"memcpy": {}, "posix": {}}
        if backend_status("cuda")[0]:
            params["cuda"] = {}
        if l4.enabled:
            params["s3"] = {"endpoint_url": l4.endpoint or None}
        return params

    def _gpu_reason(self) -> str | None:
        """None if L1 can live on a GPU here, else why not."""
        ok, reason = backend_status("cuda")
        if not ok:
            return reason
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        return None if torch.cuda.is_available() else "torch sees no CUDA device"

    @staticmethod
    def _gpu_bytes() -> int:
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def _host_tier(self, name: str, capacity: int, pinned: bool = False) -> _Tier:
        arena = None
        if pinned and self._gpu_reason() is None:
            import torch

            arena = torch.empty(capacity * self.page, dtype=torch.uint8, pin_memory=True)
            host = arena.numpy()
        else:
            host = aligned_empty(capacity * self.page)
        self.agent.register_memory(host)
        prepared = self.agent.prepare(DescList.blocks(host, self.page))
        return _Tier(name, MemType.DRAM, capacity, prepared, host.reshape(capacity, self.page), arena or host)

    def _make_tier(self, name: str) -> _Tier:
        cap = self.config.capacity_chunks(name)
        if name == "l1_hbm":
            why = self._gpu_reason() if self.config.l1_hbm.device != "dram" else "l1_hbm.device is dram"
            if why is None:
                import torch

                arena = torch.empty(cap * self.page, dtype=torch.uint8, device="cuda")
                self.agent.register_memory(arena)
                prepared = self.agent.prepare(DescList.blocks(arena, self.page))
                self.notes.append(f"l1_hbm: {cap} chunks on {torch.cuda.get_device_name()}")
                return _Tier(name, MemType.VRAM, cap, prepared, None, arena)
            if self.config.l1_hbm.device == "cuda":
                raise BackendUnavailable(
                    f"l1_hbm.device is cuda but L1 cannot live on a GPU here: {why}", backend="cuda"
                )
            self.notes.append(f"l1_hbm: a host DRAM arena of {cap} chunks stands in for HBM ({why})")
            return self._host_tier(name, cap)
        if name == "l2_dram":
            return self._host_tier(name, cap, pinned=True)
        if name == "l3_nvme":
            directory = Path(self.config.l3_nvme.path)
            directory.mkdir(parents=True, exist_ok=True)
            reg = self.agent.register_file(directory / DATA_FILE, size=cap * self.page, direct=True)
            offsets = np.arange(cap, dtype=np.int64) * self.page
            prepared = self.agent.prepare(DescList.file(reg, offsets, self.page))
            return _Tier(name, MemType.FILE, cap, prepared, None, reg)
        l4 = self.config.l4_pool
        reg = self.agent.register_objects(l4.bucket, prefix="kv/")
        return _Tier(name, MemType.OBJ, cap, None, None, reg)

    # -- the L3 index: an append-only log of (slot, crc, key) puts and (slot) deletes -------------------------
    def _load_l3_index(self) -> None:
        j = self.names.index("l3_nvme")
        path = Path(self.config.l3_nvme.path) / INDEX_FILE
        entries: dict[int, tuple[ChunkKey, int]] = {}
        slot_of: dict[ChunkKey, int] = {}
        if path.exists():
            with open(path, "rb") as f:
                try:
                    for record in msgpack.Unpacker(f, raw=False):  # a torn last record ends the stream
                        if record[0] == "put" and record[1] < self.tiers[j].capacity:
                            key = ChunkKey(*record[3])
                            entries.pop(slot_of.get(key, -1), None)  # a key lives in one slot: the latest
                            entries[record[1]] = (key, record[2])
                            slot_of[key] = record[1]
                        elif record[0] == "del":
                            entries.pop(record[1], None)
                except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
                    log.warning("l3_nvme: index %s unreadable past a damaged record (%s); the rest is kept", path, exc)
        now = self.clock()
        eng = self.engine
        for slot, (key, crc) in entries.items():
            eng.resident[j].add(key)
            eng.orders[j].insert(key, now)
            eng.slots[j][key] = slot
            self.crc[key] = crc
        taken = set(entries)
        eng.free[j] = [s for s in eng.free[j] if s not in taken]
        self._rewrite_index(entries)
        if entries:
            self.notes.append(f"l3_nvme: {len(entries)} chunks found again under {self.config.l3_nvme.path}")

    def _rewrite_index(self, entries: dict[int, tuple[ChunkKey, int]]) -> None:
        path = Path(self.config.l3_nvme.path) / INDEX_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for slot, (key, crc) in entries.items():
                f.write(msgpack.packb(["put", slot, crc, list(key)]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if self._index_file is not None:
            self._index_file.close()
        self._index_file = open(path, "ab")

    def _sync_log(self) -> None:
        """Append the pending index records and make them (and the chunk data) durable per fsync_mode."""
        if not self._pending_log:
            return
        f = self._index_file
        f.write(b"".join(msgpack.packb(r) for r in self._pending_log))
        f.flush()
        self._pending_log.clear()
        mode = self.config.l3_nvme.fsync_mode
        if mode != "none":
            data = os.open(Path(self.config.l3_nvme.path) / DATA_FILE, os.O_RDONLY)
            try:
                sync = os.fsync if mode == "fsync" else os.fdatasync
                sync(data)
                sync(f.fileno())
            finally:
                os.close(data)

    def _removed(self, j: int, key: ChunkKey, slot: int) -> None:
        """The engine freed `key`'s slot in tier j."""
        if self.names[j] == "l3_nvme":
            self._pending_log.append(["del", slot])
        self._gone.add(key)  # its CRC goes once the operation ends with the chunk in no tier

    # -- moving bytes ----------------------------------------------------------
    def _endpoint(self, t: int, user: Prepared | None) -> tuple[MemType, Prepared | None]:
        if t == USER:
            return user.descs.mem_type, user  # type: ignore[union-attr]
        if t == STAGE:
            return MemType.DRAM, self._stage.prepared
        tier = self.tiers[t]
        return tier.mem, tier.prepared

    def _objects(self, keys: Sequence[ChunkKey], replica: int) -> Prepared:
        reg = self.tiers[self.names.index("l4_pool")].owner
        names = [f"kv/{k.digest()}.{replica}" for k in keys]
        return self.agent.prepare(DescList.objects(reg, np.full(len(names), self.page), keys=names))

    def _transfer(self, src: int, si: np.ndarray, dst: int, di: np.ndarray, user: Prepared | None) -> str:
        """Rows si of src to rows di of dst in one agent transfer (memory and file sides); returns the backend."""
        smem, sprep = self._endpoint(src, user)
        dmem, dprep = self._endpoint(dst, user)
        if smem in (MemType.FILE, MemType.OBJ):
            xfer = self.agent.make_transfer("READ", dprep, di, sprep, si)
        else:
            try:
                xfer = self.agent.make_transfer("WRITE", sprep, si, dprep, di)
            except UnsupportedTransfer:
                if dmem in (MemType.FILE, MemType.OBJ):
                    raise
                xfer = self.agent.make_transfer("READ", dprep, di, sprep, si)
        with xfer:
            xfer.post().wait()
            return xfer.backend.name

    def _write_obj(self, src: int, si: np.ndarray, keys: Sequence[ChunkKey], user: Prepared | None) -> str:
        """Rows si of src (host memory) to the chunks' objects, replica_count copies each."""
        sprep = self._endpoint(src, user)[1]
        for r in range(self.config.l4_pool.replica_count):
            with self.agent.make_transfer("WRITE", sprep, si, self._objects(keys, r), None) as xfer:
                xfer.post().wait()
        return "s3"

    def _read_obj(self, keys: Sequence[ChunkKey], rows: np.ndarray) -> np.ndarray:
        """Read chunks of L4 into staging rows; returns which rows arrived (a failed replica tries the next)."""
        ok = np.zeros(len(keys), dtype=bool)
        for i, key in enumerate(keys):
            for r in range(self.config.l4_pool.replica_count):
                try:
                    objects = self._objects([key], r)
                    with self.agent.make_transfer("READ", self._stage.prepared, rows[i : i + 1], objects, None) as x:
                        x.post().wait()
                    ok[i] = True
                    break
                except DatamoverError as exc:
                    log.warning("l4_pool: replica %d of %s unreadable: %s", r, key, exc)
        return ok

    def _account(self, src: int, dst: int, batch: list[Move], seconds: float, backend: str) -> None:
        """Metrics and spans for one executed batch (the logical hop, whatever staging it took)."""
        a = "caller" if src == USER else self.names[src]
        b = "caller" if dst == USER else self.names[dst]
        if self.metrics is not None:
            self.metrics.record_move(a, b, backend, len(batch), len(batch) * self.page, seconds)
        if self.spans is not None:
            kind = "miss" if src == USER else "hit" if dst == USER or dst < src else "evict"
            per = seconds * 1e6 / max(len(batch), 1)
            tokens = self.config.l3_nvme.chunk_size_tokens
            spans = []
            for m in batch:
                pos = m.src_slot if src == USER else m.dst_slot if dst == USER else None
                span = {
                    "layer_id": m.key.layer,
                    "head_id": None,
                    "from_tier": a,
                    "to_tier": b,
                    "token_range": None if pos is None else (pos * tokens, (pos + 1) * tokens),
                    "size_bytes": self.page,
                    "latency_us": per,
                    "prefix_hash": m.key.prefix_hash,
                    "hit_or_miss": kind,
                }
                spans.append(span)
            self.spans.record(spans)

    def _verify(self, keys: Sequence[ChunkKey], rows: np.ndarray) -> np.ndarray:
        """Which staged rows match their chunk's CRC32C (all, when checking is off)."""
        if not self._check_crc:
            return np.ones(len(keys), dtype=bool)
        import crc32c

        view = self._stage.host
        good = np.array([crc32c.crc32c(view[r]) == self.crc.get(k) for k, r in zip(keys, rows, strict=True)])
        for i in np.flatnonzero(~good):
            log.error("CRC32C mismatch for chunk %s: dropped, served as a miss", keys[i])
        return good

    def _invalidate(self, key: ChunkKey) -> None:
        """Drop a chunk whose bytes cannot be trusted from every tier."""
        self._invalid.add(key)
        self.checksum_failures += 1
        if self.metrics is not None:
            self.metrics.checksum_failures.labels("l3_nvme").inc()
        for j, resident in enumerate(self.engine.resident):
            if key in resident:
                self.engine.drop(j, key)

    def _run_group(self, src: int, dst: int, moves: list[Move], user: Prepared | None) -> None:
        """Execute moves of one (src, dst) pair in batches the staging area holds. Reads from L3/L4, and writes
        from GPU memory to them, go through host staging; what is read is verified before it goes on."""
        smem, dmem = self._endpoint(src, user)[0], self._endpoint(dst, user)[0]
        remote = (MemType.FILE, MemType.OBJ)
        direct = smem not in remote and (dmem not in remote or smem == MemType.DRAM)
        step = len(moves) if direct else self._stage.capacity
        for lo in range(0, len(moves), step):
            batch = moves[lo : lo + step]
            start = time.perf_counter()
            si = np.fromiter((m.src_slot for m in batch), dtype=np.int64, count=len(batch))
            di = np.fromiter((m.dst_slot for m in batch), dtype=np.int64, count=len(batch))
            if direct:
                write = self._write_obj if dmem == MemType.OBJ else None
                backend = (
                    write(src, si, [m.key for m in batch], user) if write else self._transfer(src, si, dst, di, user)
                )
                self._account(src, dst, batch, time.perf_counter() - start, backend)
                continue
            rows = np.arange(len(batch), dtype=np.int64)
            keys = [m.key for m in batch]
            if smem == MemType.OBJ:
                good = self._read_obj(keys, rows)
            else:
                self._transfer(src, si, STAGE, rows, user)
                good = np.ones(len(batch), dtype=bool)
            if smem in remote:
                good &= self._verify(keys, rows)
            for i in np.flatnonzero(~good):
                self._invalidate(keys[i])
            keep = np.flatnonzero(good)
            if not len(keep):
                continue
            kept = [batch[i] for i in keep]
            if dmem == MemType.OBJ:
                backend = self._write_obj(STAGE, rows[keep], [m.key for m in kept], user)
            else:
                backend = self._transfer(STAGE, rows[keep], dst, di[keep], user)
            self._account(src, dst, kept, time.perf_counter() - start, backend)

    def _execute(self, plan: list[Move], user: Prepared | None) -> None:
        """Run a plan level by level: a move's level is one more than that of any earlier move whose slot it
        reads, writes or overwrites, so moves of one level are independent and each (source, destination)
        pair of a level is one batch."""
        written: dict[tuple[int, int], int] = {}
        read: dict[tuple[int, int], int] = {}
        levels: list[dict[tuple[int, int], list[Move]]] = []
        for m in plan:
            r, w = (m.src, m.src_slot), (m.dst, m.dst_slot)
            level = max(written.get(r, -1), written.get(w, -1), read.get(w, -1)) + 1
            read[r] = max(read.get(r, -1), level)
            written[w] = level
            if level == len(levels):
                levels.append(defaultdict(list))
            levels[level][m.src, m.dst].append(m)
        l3 = self.names.index("l3_nvme") if "l3_nvme" in self.names else None
        for groups in levels:
            for (src, dst), moves in groups.items():
                live = [m for m in moves if m.key not in self._invalid]
                if not live:
                    continue
                self._run_group(src, dst, live, user)
                if dst == l3:
                    self._pending_log += [
                        ["put", m.dst_slot, self.crc.get(m.key, 0), list(m.key)]
                        for m in live
                        if m.key not in self._invalid
                    ]
        if l3 is not None:
            self._sync_log()
        where = self.engine.where
        for key in self._gone:
            if where(key) < 0:
                self.crc.pop(key, None)
        self._gone.clear()

    # -- user buffers ------------------------------------------------------------
    def _user(self, buf: Any, n: int) -> tuple[Prepared, Any]:
        """The caller's buffer cut into n chunks, prepared (registered for this call if it was not)."""
        descs = DescList.from_buffers(buf) if isinstance(buf, list | tuple) else DescList.blocks(buf, self.page)
        if len(descs) < n or (descs.length[:n] != self.page).any():
            raise ValueError(f"buffer holds {len(descs)} chunk(s) of {self.page} bytes; {n} needed")
        try:
            return self.agent.prepare(descs), None
        except NotRegistered:
            reg = self.agent.register_memory(list(buf) if isinstance(buf, list | tuple) else buf)
            return self.agent.prepare(descs), reg

    def _release(self, reg: Any) -> None:
        if reg is not None:
            self.agent.deregister_memory(reg)

    def _crc_of(self, buf: Any, n: int) -> list[int]:
        import crc32c

        parts = buf if isinstance(buf, list | tuple) else [buf]
        host = []
        for p in parts:
            if type(p).__module__.startswith("torch"):
                p = p.detach().cpu().numpy()
            host.append(np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8))
        flat = host[0] if len(host) == 1 else np.concatenate(host)
        return [crc32c.crc32c(flat[i * self.page : (i + 1) * self.page]) for i in range(n)]

    # -- the API ------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> tuple[int, list[str]]:
        """Length of the longest cached prefix of `keys`, and the tier holding each of those chunks."""
        with self._lock:
            tiers = []
            for key in keys:
                j = self.engine.where(key)
                if j < 0:
                    break
                tiers.append(self.names[j])
            return len(tiers), tiers

    def get(self, keys: Sequence[ChunkKey], dst: Any) -> int:
        """Copy the longest cached prefix of `keys` into `dst` (chunk i at offset i*page, or the i-th buffer of
        a list), promoting as the policy decides. Returns how many chunks were delivered, all verified; the
        rest are misses for the caller to recompute (and put)."""
        with self._lock:
            n, tiers = self.lookup(keys)
            prefix = list(keys[:n])
            user, reg = self._user(dst, n) if n else (None, None)
            eng = self.engine
            before = list(eng.evictions)
            self.pin(prefix)  # in flight: promoting one chunk of the prefix must not evict another
            try:
                now = self.clock()
                for key in prefix:
                    eng.policy.observe(key, now)
                    eng.hit(eng.where(key), key, now)
                self._execute(eng.take_plan(), None)
                plan = []
                for i, key in enumerate(prefix):
                    j = eng.where(key)
                    if j < 0:  # dropped while promoting: its bytes failed their CRC32C
                        break
                    plan.append(Move(key, j, eng.slots[j][key], USER, i))
                self._execute(plan, user)
                delivered = next((i for i, k in enumerate(prefix) if k in self._invalid or eng.where(k) < 0), n)
            finally:
                self.unpin(prefix)
                self._invalid.clear()
                self._release(reg)
            served = Counter(tiers[:delivered])
            self.hits.update(served)
            self.misses += len(keys) - delivered
            if self.metrics is not None:
                for name, count in served.items():
                    self.metrics.hits.labels(name).inc(count)
                self.metrics.misses.inc(len(keys) - delivered)
            self._op_done(before)
            return delivered

    def put(self, keys: Sequence[ChunkKey], src: Any) -> int:
        """Store chunks (chunk i of `src` under keys[i]); chunks already cached only count as used. Returns how
        many were newly stored in some tier."""
        if not keys:
            return 0
        with self._lock:
            user, reg = self._user(src, len(keys))
            eng = self.engine
            before = list(eng.evictions)
            try:
                fresh = dict(zip(keys, self._crc_of(src, len(keys)), strict=True)) if self._check_crc else {}
                eng.user_index = {k: i for i, k in enumerate(keys)}
                now = self.clock()
                stored = 0
                for key in keys:
                    eng.policy.observe(key, now)
                    j = eng.where(key)
                    if j >= 0:
                        eng.orders[j].touch(key, now)
                    else:
                        stored += eng.place(0, key, now, -1, PREFILL)
                # after planning: placing one chunk may have dropped another of these keys (and its old CRC)
                self.crc.update((k, c) for k, c in fresh.items() if eng.where(k) >= 0)
                self._execute(eng.take_plan(), user)
            finally:
                eng.user_index = {}
                self._invalid.clear()
                self._release(reg)
            self._op_done(before)
            return stored

    def _op_done(self, evictions_before: list[int]) -> None:
        """Eviction counters and occupancy gauges after an operation."""
        if self.metrics is None:
            return
        eng = self.engine
        for j, name in enumerate(self.names):
            if eng.evictions[j] > evictions_before[j]:
                self.metrics.evictions.labels(name).inc(eng.evictions[j] - evictions_before[j])
            self.metrics.resident.labels(name).set(len(eng.resident[j]))

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future:
        """Start promoting the cached prefix of `keys` to L1 in the background; the future gives how many moved."""
        return self._prefetcher.submit(self._promote, list(keys))

    def _promote(self, keys: list[ChunkKey]) -> int:
        with self._lock:
            n, tiers = self.lookup(keys)
            now = self.clock()
            lower = [(k, t) for k, t in zip(keys[:n], tiers, strict=True) if t != self.names[0]]
            self.pin(keys[:n])
            before = list(self.engine.evictions)
            try:
                moved = sum(self.engine.place(0, k, now, -1, t) for k, t in lower)
                self._execute(self.engine.take_plan(), None)
                self._op_done(before)
            finally:
                self.unpin(keys[:n])
                self._invalid.clear()
            return moved

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Keep chunks from being evicted (nested: each pin needs an unpin)."""
        with self._lock:
            self._pins.update(keys)
            self.engine.pinned.update(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one pin of each chunk."""
        with self._lock:
            self._pins.subtract(keys)
            for key in keys:
                if self._pins[key] <= 0:
                    del self._pins[key]
                    self.engine.pinned.discard(key)

    def drain(self, tier: str) -> int:
        """Move every chunk held only by `tier` to the tiers below, close `tier` to new chunks and empty it
        (before shutting an instance down). Returns how many chunks were moved; chunks that fit nowhere below
        are dropped and logged."""
        with self._lock:
            eng = self.engine
            j = self.names.index(tier)
            below = range(j + 1, len(self.names))
            if not below:
                raise ValueError(f"no enabled tier below {tier} to drain to")
            eng.closed.add(j)
            now = self.clock()
            moved = 0
            for key in list(eng.resident[j]):
                if not any(key in eng.resident[t] for t in below):
                    if any(eng.place(t, key, now, -1, tier) for t in below):
                        moved += 1
                    else:
                        log.warning("drain %s: no room below for %s; dropped", tier, key)
                eng.orders[j].remove(key)
                eng.resident[j].remove(key)
            self._execute(eng.take_plan(), None)
            for key in list(eng.slots[j]):
                eng._removed(j, key)
            if "l3_nvme" in self.names:
                self._sync_log()
            self._invalid.clear()
            return moved

    def stats(self) -> dict[str, Any]:
        """Hits per tier, misses, evictions, chunks moved between tiers, checksum failures, resident chunks."""
        with self._lock:
            eng = self.engine
            lookups = sum(self.hits.values()) + self.misses
            return {
                "lookups": lookups,
                "hits": {name: self.hits[name] for name in self.names},
                "hit_rates": {name: self.hits[name] / lookups if lookups else 0.0 for name in self.names},
                "misses": self.misses,
                "evictions": dict(zip(self.names, eng.evictions, strict=True)),
                "moved_chunks": {f"{a}->{b}": n for (a, b), n in eng.moved.items()},
                "resident": {name: len(r) for name, r in zip(self.names, eng.resident, strict=True)},
                "checksum_failures": self.checksum_failures,
                "notes": list(self.notes),
            }

    def close(self) -> None:
        """Finish background work, compact the L3 index, release memory and files."""
        self._prefetcher.shutdown(wait=True)
        with self._lock:
            if "l3_nvme" in self.names:
                j = self.names.index("l3_nvme")
                live = {slot: (key, self.crc.get(key, 0)) for key, slot in self.engine.slots[j].items()}
                self._rewrite_index(live)
                self._index_file.close()  # type: ignore[union-attr]
            if self.spans is not None:
                self.spans.close()
            if self._own_agent:
                self.agent.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["TIER_NAMES", "Move", "TieredCache"]
