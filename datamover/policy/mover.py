"""Running a cache plan: every byte moved by Agent transfers, one transfer per (source, destination) batch.

Reads from L3/L4, and writes from GPU memory to them, go through the host staging slab; with CRC32C checking
on, what is read from L3/L4 is verified in staging before it goes on, and a chunk that fails is handed to
`invalidate` (the cache drops it from every tier and serves it as a miss). A batch that fails is dropped the
same way, but for a write to L4 that failed on the store's side: its chunks are kept where `write_down.py` finds them a
place. Each batch is counted in the metrics and, when spans are on, recorded as one span per chunk.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ..agents import Agent, Prepared
from ..backends.mooncake import codes
from ..descriptors import DescList, MemType
from ..errors import ChecksumMismatch, DatamoverError, ObjectStoreError, TransferTimeout, UnsupportedTransfer
from ..telemetry.metrics import CacheMetrics
from ..telemetry.spans import SpanRecorder
from .bucket import chunk_object
from .config import TierConfig
from .keys import ChunkKey
from .l3_index import L3Index
from .plan import STAGE, USER, Move, levels
from .pool import SharedPool
from .slabs import Slab
from .write_down import WriteDownFailures

log = logging.getLogger("datamover.kvcache")

REMOTE = (MemType.FILE, MemType.OBJ)


class Mover:
    """Executes plans over the cache's slabs (`tiers`, in engine order) and its staging slab."""

    def __init__(
        self,
        agent: Agent,
        config: TierConfig,
        tiers: list[Slab],
        stage: Slab,
        crc: dict[ChunkKey, int],
        invalidate: Callable[..., None],
        metrics: CacheMetrics | None = None,
        spans: SpanRecorder | None = None,
        pool: SharedPool | None = None,
        write_downs: WriteDownFailures | None = None,
    ) -> None:
        self.agent = agent
        # L4 is a Mooncake pool: one object per chunk (replicas are the store's), verified by the backend
        self.pool = pool
        self.shared = pool is not None
        self.l4_backend = "mooncake" if self.shared else "s3"  # the backend that moves L4's objects
        self.config = config
        self.page = config.l1_hbm.page_size_bytes
        self.tiers = tiers
        self.names = [t.name for t in tiers]
        self.stage = stage
        self.crc = crc
        self.invalidate = invalidate
        self.invalid: set[ChunkKey] = set()  # chunks dropped during the current operation
        self.metrics = metrics
        self.spans = spans
        self.check_crc = config.l3_nvme.crc32c_check and any(t.mem in REMOTE for t in tiers)
        self.failures: Counter[str] = Counter()  # chunks whose move failed, per "from->to"
        self.write_downs = write_downs  # where the chunks of a write to L4 that failed on the store's side go
        self.l4 = self.names.index("l4_pool") if "l4_pool" in self.names else None
        self.spans_failing = False  # the last span export failed (warned once, until one succeeds again)

    def _endpoint(self, t: int, user: Prepared | None) -> tuple[MemType, Prepared | None]:
        if t == USER:
            return user.descs.mem_type, user  # type: ignore[union-attr]
        if t == STAGE:
            return MemType.DRAM, self.stage.prepared
        tier = self.tiers[t]
        return tier.mem, tier.prepared

    def _objects(self, keys: Sequence[ChunkKey], replica: int) -> Prepared:
        reg = self.tiers[self.names.index("l4_pool")].owner
        prefix = self.config.l4_pool.prefix
        names = [f"kv/{k.digest()}" if self.shared else chunk_object(prefix, k, replica) for k in keys]
        return self.agent.prepare(DescList.objects(reg, np.full(len(names), self.page), keys=names))

    def _transfer(self, src: int, si: np.ndarray, dst: int, di: np.ndarray, user: Prepared | None) -> str:
        """Rows si of src to rows di of dst in one agent transfer (memory and file sides); returns the backend."""
        smem, sprep = self._endpoint(src, user)
        dmem, dprep = self._endpoint(dst, user)
        if smem in REMOTE:
            xfer = self.agent.make_transfer("READ", dprep, di, sprep, si)
        else:
            try:
                xfer = self.agent.make_transfer("WRITE", sprep, si, dprep, di)
            except UnsupportedTransfer:
                if dmem in REMOTE:
                    raise
                xfer = self.agent.make_transfer("READ", dprep, di, sprep, si)
        with xfer:
            xfer.post().wait()
            return xfer.backend.name

    def _write_obj(self, src: int, si: np.ndarray, keys: Sequence[ChunkKey], user: Prepared | None) -> str:
        """Rows si of src (host memory) to the chunks' objects, replica_count copies each."""
        sprep = self._endpoint(src, user)[1]
        if self.pool is not None:  # one object; the pool keeps replica_count replicas of it
            self.pool.rewriting(keys)
            with self.agent.make_transfer("WRITE", sprep, si, self._objects(keys, 0), None) as xfer:
                xfer.post().wait()
            return self.l4_backend
        for r in range(self.config.l4_pool.replica_count):
            with self.agent.make_transfer("WRITE", sprep, si, self._objects(keys, r), None) as xfer:
                xfer.post().wait()
        return self.l4_backend

    def _read_obj(self, keys: Sequence[ChunkKey], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read chunks of L4 into staging rows (a failed replica tries the next); returns which rows arrived, which
        did not because a replica's bytes failed the backend's CRC32C, and which were not read because the store
        did not answer (their objects are not in doubt: the chunks stay in L4). The others could not be read."""
        ok = np.zeros(len(keys), dtype=bool)
        corrupt = np.zeros(len(keys), dtype=bool)
        try:  # the whole batch in one transfer (the backend's requests run concurrently); if a chunk fails, each
            # is read alone, replica by replica, to find which
            with self.agent.make_transfer("READ", self.stage.prepared, rows, self._objects(keys, 0), None) as x:
                x.post().wait()
            return np.ones(len(keys), dtype=bool), corrupt, ok
        except DatamoverError as exc:
            if _unreachable(exc):
                log.warning("l4_pool: a batch of %d chunks failed (%s): served as misses", len(keys), exc)
                return ok, corrupt, np.ones(len(keys), dtype=bool)
            log.info("l4_pool: a batch of %d chunks failed (%s); reading them one by one", len(keys), exc)
        for i, key in enumerate(keys):
            for r in range(1 if self.shared else self.config.l4_pool.replica_count):
                try:
                    objects = self._objects([key], r)
                    with self.agent.make_transfer("READ", self.stage.prepared, rows[i : i + 1], objects, None) as x:
                        x.post().wait()
                    ok[i] = True
                    break
                except DatamoverError as exc:
                    corrupt[i] |= isinstance(exc, ChecksumMismatch)
                    log.warning("l4_pool: replica %d of %s unreadable: %s", r, key, exc)
                    if _unreachable(exc):  # the store cannot serve now (each try would wait or be refused): misses
                        unanswered = np.arange(len(keys)) >= i  # this chunk and those not tried yet
                        unanswered[i] = not corrupt[i]  # (one of its replicas corrupt: dropped)
                        return ok, corrupt & ~ok, unanswered
        return ok, corrupt & ~ok, np.zeros(len(keys), dtype=bool)

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
            self._record(spans)

    def _record(self, spans: list[dict]) -> None:
        """Export spans; an exporter that fails (a full disk under the span file) loses them, warned once until
        one export succeeds again, and never stops a plan: its batch already moved, and the moves after it are
        counted as done by the engine."""
        assert self.spans is not None
        try:
            self.spans.record(spans)
        except Exception as exc:
            if not self.spans_failing:
                log.warning("spans could not be exported (%s): dropped until an export succeeds", exc)
            self.spans_failing = True
        else:
            self.spans_failing = False

    def _verify(self, keys: Sequence[ChunkKey], rows: np.ndarray, learn: bool = False) -> np.ndarray:
        """Which staged rows match their chunk's CRC32C (all, when checking is off). With ``learn`` (rows read
        from L4, whose backend checked each chunk against the CRC32C its writer stored), a chunk this cache did
        not put (another instance did, or an earlier run) gets its CRC32C from the verified bytes."""
        if not self.check_crc:
            return np.ones(len(keys), dtype=bool)
        import crc32c

        view = self.stage.host
        if learn:
            for k, r in zip(keys, rows, strict=True):
                if k not in self.crc:
                    self.crc[k] = crc32c.crc32c(view[r])
        good = np.array([crc32c.crc32c(view[r]) == self.crc.get(k) for k, r in zip(keys, rows, strict=True)])
        for i in np.flatnonzero(~good):
            log.error("CRC32C mismatch for chunk %s: dropped, served as a miss", keys[i])
        return good

    def _stage_in(
        self, src: int, smem: MemType, si: np.ndarray, dst: int, rows: np.ndarray, user: Prepared | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows si of src (not objects) into staging rows; returns which arrived, and which were not read because
        a read of L3 timed out (the file's bytes are not in doubt: those chunks stay there, misses for now). Such a
        timeout on the way down to L4 goes up to `run`, which keeps those chunks where the plan allows."""
        try:
            self._transfer(src, si, STAGE, rows, user)
        except TransferTimeout as exc:
            if smem != MemType.FILE or dst == self.l4:
                raise
            log.warning("%s: reading %d chunk(s) timed out (%s): misses, kept there", self.names[src], len(si), exc)
            return np.zeros(len(si), dtype=bool), np.ones(len(si), dtype=bool)
        return np.ones(len(si), dtype=bool), np.zeros(len(si), dtype=bool)

    def _run_group(self, src: int, dst: int, moves: list[Move], user: Prepared | None) -> None:
        """Execute moves of one (src, dst) pair in batches the staging area holds. Reads from L3/L4, and writes
        from GPU memory to them, go through host staging; what is read is verified before it goes on."""
        smem, dmem = self._endpoint(src, user)[0], self._endpoint(dst, user)[0]
        direct = smem not in REMOTE and (dmem not in REMOTE or smem == MemType.DRAM)
        step = len(moves) if direct else self.stage.capacity
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
            corrupt = np.zeros(len(batch), dtype=bool)
            intact = np.zeros(len(batch), dtype=bool)  # not read: the store did not answer, or L3 timed out
            if smem == MemType.OBJ:
                good, corrupt, intact = self._read_obj(keys, rows)
                if self.pool is not None:  # the object itself failed the backend's check: others' too
                    for i in np.flatnonzero(corrupt):
                        self.pool.failed_check(keys[i])
            else:
                good, intact = self._stage_in(src, smem, si, dst, rows, user)
            if smem in REMOTE and good.any():  # only rows that arrived are checked: the others hold nothing
                arrived = np.flatnonzero(good)
                failed = ~self._verify([keys[i] for i in arrived], rows[arrived], learn=smem == MemType.OBJ)
                corrupt[arrived[failed]] = True
                good[arrived[failed]] = False
            for i in np.flatnonzero(~good):  # a chunk that could not be read (its object gone) is no CRC failure;
                # one the store (or L3) did not answer for stays where it was read from (a miss now, found later)
                stays = src if intact[i] else None
                self.invalidate(keys[i], checksum=bool(corrupt[i]), tier=self.names[src], keep=stays)
                if not corrupt[i]:
                    self.failures[f"{self.names[src]}->{'caller' if dst == USER else self.names[dst]}"] += 1
            keep = np.flatnonzero(good)
            if not len(keep):
                continue
            kept = [batch[i] for i in keep]
            if dmem == MemType.OBJ:
                backend = self._write_obj(STAGE, rows[keep], [m.key for m in kept], user)
            else:
                backend = self._transfer(STAGE, rows[keep], dst, di[keep], user)
            self._account(src, dst, kept, time.perf_counter() - start, backend)

    def run(self, plan: list[Move], user: Prepared | None, index: L3Index | None = None) -> None:
        """Run a plan level by level, each (source, destination) pair of a level as one batch; chunks stored in
        L3 are recorded in `index` (the caller syncs it)."""
        by_level = levels(plan)
        for depth, groups in enumerate(by_level):
            for (src, dst), moves in groups.items():
                live = [m for m in moves if m.key not in self.invalid]
                if not live:
                    continue
                try:
                    self._run_group(src, dst, live, user)
                except Exception as exc:
                    # the plan goes on (the engine already counts every move of it as done): what this group
                    # moved cannot be trusted where the engine now places it, so it is dropped, served as a miss
                    # (a write to L4 that failed on the store's side keeps its chunks where it can, `write_down.py`).
                    # An error that is not a DatamoverError (a bug below, a MemoryError) too: stopping here would
                    # leave every later move of the plan counted as done and never run (chunks on others' bytes)
                    a, b = ("caller" if t in (USER, STAGE) else self.names[t] for t in (src, dst))
                    typed = isinstance(exc, DatamoverError)
                    self.failures[f"{a}->{b}"] += len(live)
                    if self.metrics is not None:
                        backend = getattr(exc, "backend", None) or "unknown"
                        self.metrics.errors.labels(a, b, backend, type(exc).__name__).inc(len(live))
                    if dst == self.l4 and self.write_downs is not None and typed and self._source_intact(exc):
                        self._write_down_failed(live, plan, by_level[depth + 1 :], index, exc)
                        continue
                    log.log(
                        logging.WARNING if typed else logging.ERROR,
                        "moving %d chunk(s) %s -> %s failed, dropped (first %s): %s: %s",
                        len(live), a, b, live[0].key, type(exc).__name__, exc, exc_info=not typed,
                    )  # fmt: skip
                    for m in live:
                        self.invalidate(m.key, checksum=False)
                    continue
                self._recorded(dst, live, index)

    def _source_intact(self, exc: DatamoverError) -> bool:
        """Whether a failed write to L4 leaves the bytes it was written from beyond doubt: the store did not answer
        (or the read from L3 timed out), or L4's own backend refused the write (a 4xx, a Mooncake status)."""
        return _unreachable(exc) or exc.backend == self.l4_backend

    def _recorded(self, dst: int, moves: list[Move], index: L3Index | None) -> None:
        """Record in the L3 index the chunks `moves` stored in tier `dst`, if it is L3."""
        if index is not None and dst >= 0 and self.names[dst] == "l3_nvme":
            for m in moves:
                if m.key not in self.invalid:
                    index.stored(m.dst_slot, self.crc.get(m.key), m.key)

    def _write_down_failed(
        self,
        moves: list[Move],
        plan: list[Move],
        after: list[dict[tuple[int, int], list[Move]]],
        index: L3Index | None,
        exc: DatamoverError,
    ) -> None:
        """The store did not take `moves` (writes to L4; `after`: the plan's levels still to run): each chunk is
        kept where `write_downs` finds it a place (copied there now if that is not the slot it was read from;
        after one such copy fails no other is tried), else dropped for the rest of the operation."""
        keeper = self.write_downs
        assert keeper is not None
        later = {(m.dst, m.dst_slot) for groups in after for batch in groups.values() for m in batch}
        busy = {end for m in plan for end in ((m.src, m.src_slot), (m.dst, m.dst_slot))}
        copying = True
        for m in moves:
            if m.key in self.invalid:  # failed its CRC32C on the way: already dropped
                continue
            to = keeper.place(m, later, busy)
            if to is None:
                continue
            placed = Move(m.key, m.src, m.src_slot, to[0], to[1])
            if to != (m.src, m.src_slot):
                ok = copying and self._copy(placed)
                keeper.copied(m.key, to[0], ok)
                copying = ok
                if not ok:
                    continue
            self._recorded(to[0], [placed], index)
        kept = [m.key for m in moves if keeper.engine.where(m.key) >= 0]
        self.invalid.update(m.key for m in moves if keeper.engine.where(m.key) < 0)
        log.warning(
            "l4_pool: the store did not take %d chunk(s) (first %s): %s: %s; %d kept in the tiers above, %d dropped",
            len(moves), moves[0].key, type(exc).__name__, exc, len(kept), len(moves) - len(kept),
        )  # fmt: skip

    def _copy(self, move: Move) -> bool:
        """Run one move outside the plan (a chunk kept after its write to L4 failed); whether it arrived intact."""
        try:
            self._run_group(move.src, move.dst, [move], None)
        except Exception as exc:
            log.warning("keeping %s in %s failed: %s: %s", move.key, self.names[move.dst], type(exc).__name__, exc)
            return False
        return move.key not in self.invalid


def _unreachable(exc: DatamoverError) -> bool:
    """Whether ``exc`` says the store could not serve now (a timeout, a dropped connection; from S3 no HTTP answer
    or a 5xx such as 503 SlowDown; from Mooncake a status of `codes.UNREACHABLE`, such as RPC_FAIL: its master
    not reached), rather than that this one object is missing or damaged: no other object or replica would
    answer sooner, and the object itself is not in doubt."""
    if isinstance(exc, (TransferTimeout, ConnectionError)):
        return True
    if not isinstance(exc, ObjectStoreError):
        return False
    if exc.backend == "mooncake":
        return codes.unreachable(exc.code)
    return exc.backend == "s3" and (exc.status is None or 500 <= exc.status <= 599)
