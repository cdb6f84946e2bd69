"""Trace replay with real bytes: the first requests of a trace through a TieredCache, every hit's content checked.

Each request looks up its chunks (`get`: the longest cached prefix, copied into the request's buffer), checks
every delivered chunk byte for byte against the content its key stands for, "prefills" the rest (fills them with
that content) and `put`s them. Chunks are small (4 KiB by default); tier capacities in chunks stay those of the
config, and L3, if enabled, lives in a fresh temporary directory. The cache's clock is the trace's clock, so the
policy sees the same times as in simulation.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..agents import Agent
from .cache import TieredCache
from .config import GIB, TierConfig, with_overrides
from .cost import CostModel
from .keys import ChunkKey, chunk_keys
from .replay import Trace, load_trace

MODEL, TOKENIZER = "trace-model", "trace-tokenizer"


def chunk_content(key: ChunkKey, page: int) -> np.ndarray:
    """The bytes a chunk holds in a data replay: its 16-byte digest repeated (any misplaced chunk shows)."""
    return np.frombuffer(bytes.fromhex(key.digest()) * (page // 16), dtype=np.uint8)


def scaled_config(config: TierConfig, page: int, l3_dir: str) -> TierConfig:
    """The config with chunks of `page` bytes and the same tier capacities in chunks, L3 under `l3_dir`."""
    ratio = page / config.l1_hbm.page_size_bytes
    return with_overrides(
        config,
        l1_hbm={"page_size_bytes": page},
        l2_dram={"pinned_pool_gb": config.capacity_chunks("l2_dram") * page / GIB or config.l2_dram.pinned_pool_gb},
        l3_nvme={"path": l3_dir, "capacity_gb": config.l3_nvme.capacity_gb * ratio},
        l4_pool={"capacity_gb": config.l4_pool.capacity_gb * ratio},
    )


@dataclass
class DataReplayReport:
    """What a data replay did: lookups served per tier, misses, checks, bytes, time."""

    requests: int
    refs: int
    page_bytes: int
    stats: dict
    wrong_chunks: int
    bytes_delivered: int
    bytes_stored: int
    elapsed_s: float
    effective_ns: float

    def format(self) -> str:
        """The report as text."""
        s = self.stats
        lookups = s["lookups"]
        rates = "  ".join(f"{t} {h / lookups:.2%}" for t, h in s["hits"].items())
        moved = "  ".join(f"{pair} {n:,}" for pair, n in s["moved_chunks"].items())
        gbs = (self.bytes_delivered + self.bytes_stored) / self.elapsed_s / 1e9 if self.elapsed_s else 0.0
        lines = [
            f"with data: {self.requests:,} requests, {self.refs:,} chunk lookups of {self.page_bytes:,} bytes, "
            f"{self.elapsed_s:.2f} s ({gbs:.2f} GB/s through the cache API)",
            f"  prefix hits: {rates}  miss {s['misses'] / lookups:.2%}; effective cost "
            f"{self.effective_ns / 1e6:.2f} ms per access",
            f"  every delivered chunk checked: {self.wrong_chunks} wrong; CRC32C failures: {s['checksum_failures']}",
            f"  evictions: {s['evictions']}; moved chunks: {moved}",
            *(f"  note: {n}" for n in s["notes"]),
        ]
        return "\n".join(lines)


def run_with_data(
    trace_path: str | Path | Trace,
    config: TierConfig,
    requests: int = 2000,
    page: int = 4096,
    agent: Agent | None = None,
) -> DataReplayReport:
    """Replay the first `requests` requests with real bytes through a TieredCache and check every hit (a Trace
    given instead of a path is replayed as it is: the caller loaded its first requests)."""
    trace = trace_path if isinstance(trace_path, Trace) else load_trace(trace_path, requests)
    starts = np.flatnonzero(np.r_[True, np.diff(trace.request) != 0]) if len(trace.request) else np.zeros(0, int)
    bounds = np.r_[starts, len(trace.keys)]
    now = [0.0]
    wrong = delivered_bytes = stored_bytes = 0
    with tempfile.TemporaryDirectory(prefix="datamover-l3-") as l3_dir:
        sized = scaled_config(config, page, l3_dir)
        start = time.perf_counter()
        with TieredCache(sized, agent=agent, clock=lambda: now[0]) as cache:
            for r in range(len(starts)):
                lo, hi = int(bounds[r]), int(bounds[r + 1])
                now[0] = float(trace.times[lo])
                keys = chunk_keys(trace.keys[lo:hi].tolist(), MODEL, TOKENIZER)
                buf = np.zeros(len(keys) * page, dtype=np.uint8)
                n = cache.get(keys, buf)
                rows = buf.reshape(len(keys), page)
                wrong += sum(not np.array_equal(rows[i], chunk_content(k, page)) for i, k in enumerate(keys[:n]))
                if n < len(keys):
                    rest = keys[n:]
                    rows[n:] = np.stack([chunk_content(k, page) for k in rest])
                    cache.put(rest, buf[n * page :])
                delivered_bytes += n * page
                stored_bytes += (len(keys) - n) * page
            stats = cache.stats()
        elapsed = time.perf_counter() - start
    lookups = stats["lookups"] or 1
    cost = CostModel.from_config(config).effective_ns(
        {t: h / lookups for t, h in stats["hits"].items()}, stats["misses"] / lookups
    )
    return DataReplayReport(
        len(starts), len(trace.keys), page, stats, wrong, delivered_bytes, stored_bytes, elapsed, cost
    )
