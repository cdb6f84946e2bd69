"""Faults in the middle of a cache operation's plan, injected at known points: every chunk the cache delivers
afterwards is the one put (a miss where it cannot be), and what the operation reports is what it did."""

from __future__ import annotations

import errno
import logging

from datamover.backends.base import Completion, Op
from datamover.backends.posix.backend import PosixBackend
from datamover.errors import TransferIOError, TransferTimeout
from datamover.policy.cache import DATA_FILE, TieredCache
from datamover.policy.keys import chunk_keys
from datamover.policy.mover import Mover
from tests.policy.full_disk import FullDisk
from tests.policy.test_cache import PAGE, check_consistent, check_get, chunks, tiers


def test_a_span_file_on_a_full_disk_costs_spans_not_chunks(tmp_path, caplog):
    """Was: the span export's OSError (ENOSPC) escaped the first batch of a put's plan, after the engine had
    counted every move of it as done; the rest of the plan never ran, so the put's chunks were resident in L1
    slots that still held the chunks demoted from them, and a get delivered those bytes as the new chunks'."""
    spans = tmp_path / "spans.jsonl"
    config = tiers(
        tmp_path, l1=3, l2=5, l3=8, policy={"name": "lru"}, observability={"spans": True, "span_path": str(spans)}
    )
    first, second = chunk_keys(range(3), "m", "t"), chunk_keys(range(3, 6), "m", "t")
    with TieredCache(config) as cache:
        cache.put(first, chunks(first))  # L1 full
        exporter = cache.spans.exporter
        exporter._file = FullDisk(exporter._file)
        with caplog.at_level(logging.WARNING, logger="datamover.kvcache"):
            assert cache.put(second, chunks(second)) == 3  # demotes `first` to L2, then copies `second` to L1
        assert "spans" in caplog.text and "No space left on device" in caplog.text
        assert check_get(cache, second) == 3
        assert check_get(cache, first) == 3
        check_consistent(cache)
        assert cache.stats()["checksum_failures"] == 0


def test_an_untyped_error_from_a_backend_drops_its_chunks_and_the_plan_goes_on(tmp_path, monkeypatch, caplog):
    """Was: only DatamoverErrors were caught around each batch; anything else from below (here the posix
    backend's plan running out of memory) escaped the plan midway, the moves after it never ran, and the next
    get delivered, from L1, the bytes of the chunk demoted out of that slot as another chunk's."""
    real, calls = PosixBackend.plan, []

    def plan(self, req):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("injected: planning the batch")
        return real(self, req)

    monkeypatch.setattr(PosixBackend, "plan", plan)
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=4, policy={"name": "lru"})) as cache:
        with caplog.at_level(logging.WARNING, logger="datamover.kvcache"):
            stored = cache.put(keys, chunks(keys))  # the one L3 batch fails: its two chunks are not stored
        assert calls and stored == 1
        assert "MemoryError" in caplog.text and "injected" in caplog.text
        for key in keys:
            assert check_get(cache, [key]) == (1 if cache.engine.where(key) >= 0 else 0)
        check_consistent(cache)


def failing_once(monkeypatch, src: str, dst: str) -> list[int]:
    """Make the mover's first transfer from tier `src` to tier `dst` fail as an I/O error would; the list
    counts the transfers that failed."""
    real, calls = Mover._transfer, []

    def transfer(self, s, si, d, di, user):
        if not calls and (self.names[s], self.names[d]) == (src, dst):
            calls.append(1)
            raise TransferIOError("injected: the copy failed", errno=errno.EIO, backend="memcpy")
        return real(self, s, si, d, di, user)

    monkeypatch.setattr(Mover, "_transfer", transfer)
    return calls


def test_drain_counts_only_the_chunks_that_reached_a_tier_below(tmp_path, monkeypatch):
    """Was: drain returned how many chunks it had planned to move: a copy down that failed (its chunks dropped,
    in no tier) still counted as moved, so an instance shutting down was told its chunks were kept."""
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(tiers(tmp_path, l1=3, l2=5, l3=8)) as cache:
        cache.put(keys, chunks(keys))  # all three in L1 only
        assert cache.lookup(keys)[1] == ["l1_hbm"] * 3
        calls = failing_once(monkeypatch, "l1_hbm", "l2_dram")
        assert cache.drain("l1_hbm") == 0  # the one copy L1 -> L2 failed
        assert calls and cache.lookup(keys)[0] == 0
        check_consistent(cache)
        more = chunk_keys(range(3, 6), "m", "t")
        cache.put(more, chunks(more))  # L1 is closed: they go below
        assert cache.drain("l2_dram") == 3  # and these reach L3
        assert check_get(cache, more) == 3


def test_a_prefetch_counts_only_the_chunks_it_promoted(tmp_path, monkeypatch):
    """Was: the prefetch's future gave how many promotions were planned: a promotion whose copy failed (the
    chunk dropped from every tier) still counted as moved to L1."""
    keys = chunk_keys(range(6), "m", "t")
    with TieredCache(tiers(tmp_path, l1=3, l2=5, l3=8, policy={"name": "lru"})) as cache:
        cache.put(keys, chunks(keys))
        lower = [k for k, t in zip(keys, cache.lookup(keys)[1], strict=True) if t == "l2_dram"]
        assert len(lower) == 3
        calls = failing_once(monkeypatch, "l2_dram", "l1_hbm")
        moved = cache.prefetch(lower).result(timeout=60)
        assert calls  # one batch of copies L2 -> L1 failed: its chunks are in no tier now
        in_l1 = [k for k in lower if cache.engine.where(k) == 0]
        assert moved == len(in_l1) < len(lower)
        assert all(cache.engine.where(k) < 0 for k in lower if k not in in_l1)
        check_consistent(cache)
        assert all(check_get(cache, [k]) == 1 for k in in_l1)


def test_failed_moves_are_counted_in_stats(tmp_path, monkeypatch):
    """Was: a move that failed was logged, and counted only in a CacheMetrics when the cache had one: stats()
    of a cache without metrics whose copies down all failed (its chunks dropped) showed nothing of it."""
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(tiers(tmp_path, l1=3, l2=5, l3=8)) as cache:
        assert cache.stats()["move_failures"] == {}
        cache.put(keys, chunks(keys))
        failing_once(monkeypatch, "l1_hbm", "l2_dram")
        cache.drain("l1_hbm")
        assert cache.stats()["move_failures"] == {"l1_hbm->l2_dram": 3}


def test_an_l3_read_that_timed_out_is_a_miss_and_the_chunk_stays_in_l3(tmp_path, monkeypatch):
    """The posix backend's read of L3 chunks times out (a stalled disk): the get serves them as misses, and they
    stay in L3 and its index (the file's bytes are not in doubt), so the next get, and a restart, find them.

    Before: the timeout dropped each chunk from L3 and recorded its slot freed, as a failed CRC32C does."""
    real, timed_out, armed = PosixBackend.post, [], False

    def post(self, req):
        if req.op is not Op.READ or not armed:
            return real(self, req)
        timed_out.append(len(req.local))
        done = Completion(1)
        done.finish_part(TransferTimeout("injected: the disk did not answer in time", backend="posix"))
        return done

    monkeypatch.setattr(PosixBackend, "post", post)
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=4, policy={"name": "lru"})) as cache:
        cache.put(keys, chunks(keys))
        j3 = cache.names.index("l3_nvme")
        cold = [k for k in keys if cache.engine.where(k) == j3]
        assert len(cold) == 2
        armed = True
        assert check_get(cache, cold) == 0
        assert timed_out
        assert [cache.engine.where(k) for k in cold] == [j3, j3]
        assert cache.stats()["checksum_failures"] == 0
        check_consistent(cache)
        armed = False
        assert check_get(cache, cold[1:]) == 1
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=4, policy={"name": "lru"})) as cache:
        assert cache.lookup(cold) == (2, ["l3_nvme"] * 2)
        assert check_get(cache, cold) == 2


def test_an_l3_read_that_fails_its_crc_still_drops_the_chunk(tmp_path):
    """A chunk whose L3 bytes fail their CRC32C is dropped from L3 (and its index), unlike one whose read timed
    out: its bytes are in doubt."""
    keys = chunk_keys(range(3), "m", "t")
    with TieredCache(tiers(tmp_path, l1=1, l2=0, l3=4, policy={"name": "lru"})) as cache:
        cache.put(keys, chunks(keys))
        j3 = cache.names.index("l3_nvme")
        bad = next(k for k in keys if cache.engine.where(k) == j3)
        with open(tmp_path / "l3" / DATA_FILE, "r+b") as f:
            f.seek(cache.engine.slots[j3][bad] * PAGE + 7)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
        assert check_get(cache, [bad]) == 0
        assert cache.engine.where(bad) < 0 and cache.stats()["checksum_failures"] == 1
        check_consistent(cache)
