"""What a TieredCache counts: hits per tier, misses and checksum failures, and after each operation the
evictions and resident chunks per tier, mirrored into its `CacheMetrics` when it has them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..telemetry.metrics import CacheMetrics
from .plan import SlotEngine


class Counters:
    """The cache's counts (`hits`, `misses`, `checksum_failures`) and its metrics' updates."""

    def __init__(self, metrics: CacheMetrics | None) -> None:
        self.metrics = metrics
        self.hits: Counter = Counter()
        self.misses = 0
        self.checksum_failures = 0

    def served(self, tiers: Sequence[str], asked: int, delivered: int) -> None:
        """A get of `asked` chunks delivered the first `delivered` of them, from `tiers` (one name per chunk)."""
        served = Counter(tiers[:delivered])
        self.hits.update(served)
        self.misses += asked - delivered
        if self.metrics is not None:
            for name, count in served.items():
                self.metrics.hits.labels(name).inc(count)
            self.metrics.misses.inc(asked - delivered)

    def checksum_failed(self, tier: str) -> None:
        """A chunk read from ``tier`` (L3 or L4) failed its CRC32C."""
        self.checksum_failures += 1
        if self.metrics is not None:
            self.metrics.checksum_failures.labels(tier).inc()

    def op_done(self, engine: SlotEngine, names: Sequence[str], evictions_before: list[int]) -> None:
        """Eviction counters and occupancy gauges after an operation."""
        if self.metrics is None:
            return
        for j, name in enumerate(names):
            if engine.evictions[j] > evictions_before[j]:
                self.metrics.evictions.labels(name).inc(engine.evictions[j] - evictions_before[j])
            self.metrics.resident.labels(name).set(len(engine.resident[j]))

    def lookups(self, names: Sequence[str]) -> dict[str, Any]:
        """The lookups, hits and hit rates per tier, and misses, as `TieredCache.stats` reports them."""
        lookups = sum(self.hits.values()) + self.misses
        return {
            "lookups": lookups,
            "hits": {name: self.hits[name] for name in names},
            "hit_rates": {name: self.hits[name] / lookups if lookups else 0.0 for name in names},
            "misses": self.misses,
        }
