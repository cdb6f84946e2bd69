"""What the cache's tiers hold, kept true with their bytes: the engine's placements and slots (`SlotEngine`), the
persistent records of L3 (`L3Index`) and of a private L4 bucket (`PrivateBucket`), and each chunk's CRC32C.

Every change of what a tier holds goes through here: plans run through the mover, chunks whose bytes cannot be
trusted are dropped (`invalidate`), and after each plan the L3 index is made durable, the objects of chunks a
private L4 dropped are deleted, and the CRC32Cs of chunks no tier holds are forgotten. `TieredCache` decides
what to do (its API, locks, pins and the requests the policy sees); this carries it out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..agents import Agent, Prepared
from ..telemetry.metrics import CacheMetrics
from ..telemetry.spans import SpanRecorder
from .bucket import PrivateBucket
from .config import TierConfig
from .counters import Counters
from .keys import ChunkKey
from .l3_index import L3Index
from .mover import Mover
from .plan import Move, SlotEngine
from .pool import SharedPool
from .slabs import Slab
from .write_down import WriteDownFailures

log = logging.getLogger("datamover.kvcache")


class TierContents:
    """The chunks each tier holds and their records, changed only by plans run here and by `invalidate`."""

    def __init__(
        self,
        agent: Agent,
        config: TierConfig,
        tiers: list[Slab],
        stage: Slab,
        counters: Counters,
        clock: Callable[[], float],
        notes: list[str],
        metrics: CacheMetrics | None = None,
        spans: SpanRecorder | None = None,
        pool: SharedPool | None = None,
    ) -> None:
        self.agent = agent
        self.config = config
        self.page = config.l1_hbm.page_size_bytes
        self.tiers = tiers
        self.counters = counters
        self.clock = clock
        self.notes = notes
        self.crc: dict[ChunkKey, int] = {}
        self.index: L3Index | None = None
        self.bucket: PrivateBucket | None = None
        self._gone: set[ChunkKey] = set()  # chunks a tier dropped in this operation: their CRCs go after it
        self._l4_gone: set[ChunkKey] = set()  # chunks L4 dropped in this operation: their objects go after it
        self.engine = SlotEngine(config, self.removed)
        self.names = self.engine.names
        self.write_downs = WriteDownFailures(self.engine, clock) if "l4_pool" in self.names else None
        self.mover = Mover(
            agent, config, tiers, stage, self.crc, self.invalidate, metrics, spans, pool, self.write_downs
        )
        self.invalid = self.mover.invalid  # chunks dropped during the current operation (the caller clears it)
        self.check_crc = self.mover.check_crc

    def load_l3_index(self, data_bytes: int) -> None:
        """Find again the chunks the L3 index says its data file (`data_bytes` long as found) holds."""
        j = self.names.index("l3_nvme")
        l3 = self.config.l3_nvme
        self.index = L3Index(l3.path, self.tiers[j].capacity, l3.fsync_mode, self.page)
        entries = self.index.load(data_bytes)
        if self.check_crc:  # chunks written without crc32c_check have no CRC32C to be verified against
            unchecked = [slot for slot, (_, crc) in entries.items() if crc is None]
            for slot in unchecked:
                del entries[slot]
            if unchecked:
                self.notes.append(f"l3_nvme: {len(unchecked)} chunks written without crc32c_check not used")
        self.engine.adopt(j, {key: slot for slot, (key, _) in entries.items()}, self.clock())
        self.crc.update((key, crc) for key, crc in entries.values() if crc is not None)
        if entries:
            self.notes.append(f"l3_nvme: {len(entries)} chunks found again under {l3.path}")

    def load_bucket_index(self) -> None:
        """Find again the chunks a private L4 bucket held when the last cache on it closed."""
        j = self.names.index("l4_pool")
        self.bucket = PrivateBucket(self.agent, self.config.l4_pool, self.page, self.tiers[j].capacity)
        keys = self.bucket.load()
        self.engine.adopt(j, {key: slot for slot, key in enumerate(keys)}, self.clock())
        if keys:
            self.notes.append(f"l4_pool: {len(keys)} chunks found again in s3://{self.bucket.bucket}")

    def removed(self, j: int, key: ChunkKey, slot: int) -> None:
        """The engine freed `key`'s slot in tier j."""
        if self.index is not None and self.names[j] == "l3_nvme":
            self.index.freed(slot)
        elif self.bucket is not None and self.names[j] == "l4_pool":
            self._l4_gone.add(key)
        self._gone.add(key)  # its CRC goes once the operation ends with the chunk in no tier

    def invalidate(
        self, key: ChunkKey, checksum: bool = True, tier: str | None = None, keep: int | None = None
    ) -> None:
        """Drop a chunk whose bytes cannot be trusted from every tier (``checksum``: they failed their CRC32C when
        read from ``tier``; else a move of it failed), but tier ``keep``: the one it was being read from when the
        store did not answer, whose copy is not in doubt (it is a miss for this operation only, and found there
        again later). Either way it is undelivered for the rest of the operation (`invalid`)."""
        self.invalid.add(key)
        if checksum:
            self.counters.checksum_failed(tier or "unknown")
        for j, resident in enumerate(self.engine.resident):
            if key in resident and j != keep:
                self.engine.drop(j, key)

    def execute(self, plan: list[Move], user: Prepared | None) -> None:
        """Run a plan (see `Mover.run`), make the L3 index durable, forget the CRCs of chunks no tier holds."""
        try:
            if self.index is not None and not self.check_crc:
                self.index.sync()  # slots freed on record before new chunks overwrite them: unchecked reads trust it
            self.mover.run(plan, user, self.index)
            if self.index is not None:
                self.index.sync()
        finally:
            if self.bucket is not None:
                self._after_plan_in_bucket(self.bucket, plan)
        where = self.engine.where
        for key in self._gone:
            if where(key) < 0:
                self.crc.pop(key, None)
        self._gone.clear()

    def _after_plan_in_bucket(self, bucket: PrivateBucket, plan: list[Move]) -> None:
        """Delete the objects of the chunks L4 dropped (after the plan: it may have read them, or written one of
        them again), and write L4's index now and then, so a crash loses little."""
        j4 = self.names.index("l4_pool")
        if self._l4_gone or any(m.dst == j4 for m in plan):
            bucket.changed = True
        if self._l4_gone or bucket.waiting:
            gone, self._l4_gone = self._l4_gone, set()
            bucket.delete(gone, keep=self.engine.resident[j4])
        bucket.checkpoint(lambda: list(self.engine.slots[j4]))

    def drain(self, j: int) -> int:
        """Move every chunk held only by tier j to the tiers below, close j to new chunks and empty it. Returns how
        many reached a tier below; chunks that fit nowhere below, or whose copy failed, are dropped (logged)."""
        eng, tier = self.engine, self.names[j]
        below = range(j + 1, len(self.names))
        eng.closed.add(j)
        now = self.clock()
        placed = []
        for key in list(eng.resident[j]):
            if not any(key in eng.resident[t] for t in below):
                if any(eng.place(t, key, now, -1, tier) for t in below):
                    placed.append(key)
                else:
                    log.warning("drain %s: no room below for %s; dropped", tier, key)
            eng.orders[j].remove(key)  # its slot stays taken until the copies out of it have run
            eng.resident[j].remove(key)
        self.execute(eng.take_plan(), None)
        moved = sum(1 for key in placed if key not in self.invalid and eng.where(key) >= 0)
        eng.release_slots(j)
        if self.index is not None:
            self.index.sync()
        return moved

    def forget_all(self) -> int:
        """Drop every chunk from every tier (their records say so); how many distinct chunks were held."""
        eng = self.engine
        held = len(set().union(*eng.resident))
        for j, resident in enumerate(eng.resident):
            for key in list(resident):
                eng.drop(j, key)
        self.execute([], None)
        return held

    def close(self) -> None:
        """Write what the persistent tiers hold for the next start (the L3 index compacted, a private L4's index)."""
        if self.index is not None:
            j = self.names.index("l3_nvme")
            self.index.close({slot: (key, self.crc.get(key)) for key, slot in self.engine.slots[j].items()})
        if self.bucket is not None:
            self.bucket.close(list(self.engine.slots[self.names.index("l4_pool")]))
