"""The Prometheus metrics of the KV cache: every name is defined here, once, for the exporter and the alert rules.

`CacheMetrics` owns the collectors in its own `CollectorRegistry` (so two caches or two tests never collide) and
renders them in the Prometheus text format; `serve(port)` exposes them over HTTP (bounded: `http.py`). The names
are plain constants: `datamover alerts` uses them without prometheus_client (the telemetry extra), which only
`CacheMetrics` imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .http import MetricsServer

PREFIX = "datamover"

# Exposed names (Counters gain the `_total` suffix on the wire; histograms add _bucket/_sum/_count).
HITS = f"{PREFIX}_cache_hits"  # labels: tier
MISSES = f"{PREFIX}_cache_misses"
EVICTIONS = f"{PREFIX}_cache_evictions"  # labels: tier
CHECKSUM_FAILURES = f"{PREFIX}_cache_checksum_failures"  # labels: tier
MOVES = f"{PREFIX}_chunk_moves"  # labels: from_tier, to_tier, backend
MOVED_BYTES = f"{PREFIX}_chunk_moved_bytes"  # labels: from_tier, to_tier, backend
ERRORS = f"{PREFIX}_chunk_move_errors"  # labels: from_tier, to_tier, backend, error
MOVE_LATENCY = f"{PREFIX}_chunk_move_latency_seconds"  # labels: from_tier, to_tier
RESIDENT = f"{PREFIX}_tier_resident_chunks"  # labels: tier

LATENCY_BUCKETS = (1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0)
MOVE_LABELS = ("from_tier", "to_tier", "backend")


def exposed(name: str) -> str:
    """The name a counter has in the scrape output (`_total` appended)."""
    return f"{name}_total"


class CacheMetrics:
    """Counters (hits, misses, evictions, moves, bytes, errors), move latency, and tier occupancy."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter(HITS, "chunk lookups served by a tier", ["tier"], registry=r)
        self.misses = Counter(MISSES, "chunk lookups served by no tier (recomputed)", registry=r)
        self.evictions = Counter(EVICTIONS, "chunks evicted (demoted or dropped) from a tier", ["tier"], registry=r)
        self.checksum_failures = Counter(
            CHECKSUM_FAILURES, "chunk reads whose CRC32C did not match (served as misses)", ["tier"], registry=r
        )
        self.moves = Counter(MOVES, "chunks moved between tiers", MOVE_LABELS, registry=r)
        self.moved_bytes = Counter(MOVED_BYTES, "bytes moved between tiers", MOVE_LABELS, registry=r)
        self.errors = Counter(ERRORS, "failed chunk moves", [*MOVE_LABELS, "error"], registry=r)
        self.latency = Histogram(
            MOVE_LATENCY,
            "latency of one move (a batch of chunks in one transfer)",
            ["from_tier", "to_tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resident = Gauge(RESIDENT, "chunks resident in a tier", ["tier"], registry=r)

    def record_move(self, from_tier: str, to_tier: str, backend: str, chunks: int, nbytes: int, seconds: float) -> None:
        """Count one move of a batch of `chunks` chunks (one transfer) that took `seconds`."""
        self.moves.labels(from_tier, to_tier, backend).inc(chunks)
        self.moved_bytes.labels(from_tier, to_tier, backend).inc(nbytes)
        self.latency.labels(from_tier, to_tier).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1", **limits: Any) -> MetricsServer:
        """Expose the metrics at http://addr:port/metrics from a daemon thread, bounded in connections and in
        time per connection (`limits`: max_connections, deadline_s; see `datamover.telemetry.http`)."""
        from .http import serve_metrics  # http.server and wsgiref: only where metrics are served

        return serve_metrics(self.registry, port, addr, **limits)
