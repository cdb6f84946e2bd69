"""TieredCache get/put with the caller's own descriptors: scattered chunks of registered memory, no Python per chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from datamover import DescList, aligned_empty
from datamover.errors import NotRegistered
from datamover.policy import ChunkKey, TieredCache
from datamover.policy.config import TierConfig, with_overrides

PAGE = 4096


def config(tmp: Path) -> TierConfig:
    return with_overrides(
        TierConfig(),
        l1_hbm={"enabled": False, "page_size_bytes": PAGE},
        l2_dram={"pinned_pool_gb": 4 * PAGE / 2**30},  # 4 chunks: the rest go down to NVMe
        l3_nvme={"enabled": True, "path": str(tmp / "l3"), "capacity_gb": 16 * PAGE / 2**30, "fsync_mode": "none"},
    )


def rows(buf: np.ndarray, slots: list[int]) -> DescList:
    return DescList.from_columns(buf.ctypes.data + np.array(slots, dtype=np.int64) * PAGE, PAGE)


def test_scattered_rows_round_trip_byte_exact_through_dram_and_nvme(tmp_path: Path) -> None:
    keys = [ChunkKey(i, "m", "t") for i in range(8)]
    with TieredCache(config(tmp_path)) as cache:
        src = aligned_empty(16 * PAGE)
        src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
        dst = aligned_empty(16 * PAGE)
        dst[:] = 0
        cache.agent.register_memory(src)
        cache.agent.register_memory(dst)
        src_slots, dst_slots = [9, 2, 14, 5, 0, 11, 7, 3], [1, 15, 4, 8, 12, 6, 10, 13]
        assert cache.put(keys, rows(src, src_slots)) == 8
        assert cache.stats()["resident"]["l3_nvme"] > 0  # some went through NVMe (CRC32C taken from the rows)
        assert cache.get(keys, rows(dst, dst_slots)) == 8
        s, d = src.reshape(16, PAGE), dst.reshape(16, PAGE)
        for a, b in zip(src_slots, dst_slots):
            assert np.array_equal(s[a], d[b])
        assert cache.stats()["checksum_failures"] == 0


def test_descriptors_outside_registered_memory_are_refused(tmp_path: Path) -> None:
    with TieredCache(config(tmp_path)) as cache:
        buf = aligned_empty(2 * PAGE)
        with pytest.raises(NotRegistered):
            cache.put([ChunkKey(1, "m", "t")], rows(buf, [0]))
        with pytest.raises(ValueError, match="chunk"):
            cache.put([ChunkKey(1, "m", "t")], DescList.from_columns(buf.ctypes.data, PAGE // 2))
