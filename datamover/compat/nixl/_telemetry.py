"""NIXL's telemetry: per-transfer ``nixlXferTelemetry``, its event stream and sinks, under NIXL's names.

Enabled as NIXL enables it (``NIXL_TELEMETRY_ENABLE`` y/yes/on/true/enable/1 or
n/no/off/false/disable/0, else the agent's ``captureTelemetry``). Events go to
in-process counters always, to NIXL's shared-memory ring buffer file at
``$NIXL_TELEMETRY_DIR/<agent name>`` (what NIXL's telemetry readers open) when
that is set, and to a Prometheus endpoint with NIXL's metric names
(``agent_tx_bytes_total``, ``agent_xfer_time_us``, ``agent_errors_total``, ...)
when ``NIXL_TELEMETRY_EXPORTER=prometheus`` (bounded in connections and time: ``datamover.telemetry.http``).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, shown
from ._types import nixl_status_t

log = logging.getLogger("datamover.compat.nixl")

TELEMETRY_VERSION = 4
EVENT_NAMES = (
    "agent_tx_bytes",
    "agent_rx_bytes",
    "agent_tx_requests_num",
    "agent_rx_requests_num",
    "agent_memory_registered",
    "agent_memory_deregistered",
    "agent_xfer_time",
    "agent_xfer_post_time",
    "agent_err_not_posted",
    "agent_err_invalid_param",
    "agent_err_backend",
    "agent_err_not_found",
    "agent_err_mismatch",
    "agent_err_not_allowed",
    "agent_err_repost_active",
    "agent_err_unknown",
    "agent_err_not_supported",
    "agent_err_remote_disconnect",
    "agent_err_canceled",
    "agent_err_no_telemetry",
    "agent_telemetry_events_dropped",
)
EVENT_TYPE = {n: i for i, n in enumerate(EVENT_NAMES)}
_ERR_EVENT = {s: f"agent_err_{s.name[len('NIXL_ERR_') :].lower()}" for s in nixl_status_t if s.value < 0}
_ERR_EVENT[nixl_status_t.NIXL_ERR_CANCELED] = "agent_err_canceled"
_TRUE = ("y", "yes", "on", "true", "enable", "1")
_FALSE = ("n", "no", "off", "false", "disable", "0")
DEFAULT_BUCKETS_US = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
                      500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000)  # fmt: skip


class nixlXferTelemetry:
    """NIXL's per-transfer telemetry: times in microseconds, bytes, descriptor count."""

    __slots__ = ("descCount", "postDuration", "startTime", "totalBytes", "xferDuration")

    def __init__(self, startTime: int, postDuration: int, xferDuration: int, totalBytes: int, descCount: int) -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)
        return f"nixlXferTelemetry({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, nixlXferTelemetry):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]


def telemetry_enabled(capture: bool) -> bool:
    """NIXL's rule: NIXL_TELEMETRY_ENABLE decides when set to a known word, else ``capture``."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE", "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    if env:
        log.warning("NIXL_TELEMETRY_ENABLE=%r is not a yes/no word; using capture_telemetry", env)
    return bool(capture)


class RingBufferFile:
    """NIXL's shared-memory cyclic buffer (version 4): a 40-byte header, then (u32 type, u64 value) events."""

    HEADER = struct.Struct("=QQiiQQ")
    EVENT = struct.Struct("=I4xQ")

    def __init__(self, path: str, capacity: int) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"telemetry buffer size must be a power of 2, got {capacity}")
        self.path = path
        self.capacity = capacity
        size = self.HEADER.size + self.EVENT.size * capacity
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.HEADER.pack_into(self._map, 0, 0, 0, TELEMETRY_VERSION, TELEMETRY_VERSION, capacity, capacity - 1)
        self.dropped = 0

    def push(self, event_type: int, value: int) -> bool:
        """Append an event; False (and counted) when the reader has fallen a whole buffer behind."""
        write_pos, read_pos = struct.unpack_from("=QQ", self._map, 0)
        nxt = (write_pos + 1) & (self.capacity - 1)
        if nxt == read_pos:
            self.dropped += 1
            return False
        self.EVENT.pack_into(self._map, self.HEADER.size + self.EVENT.size * write_pos, event_type, value)
        struct.pack_into("=Q", self._map, 0, nxt)
        return True

    def close(self) -> None:
        try:
            self._map.flush()
            self._map.close()
        except (ValueError, OSError):
            pass


@dataclass
class _Family:
    total: int = 0
    last: int = 0
    count: int = 0


class NixlEvents:
    """One agent's NIXL telemetry events: counted here, and written to the sinks the environment names."""

    def __init__(self, agent_name: str, enabled: bool) -> None:
        self.agent_name = agent_name
        self.enabled = enabled
        self._lock = threading.Lock()
        self.families = {n: _Family() for n in EVENT_NAMES}
        self.buckets = _buckets()
        self.histograms = {n: [0] * (len(self.buckets) + 1) for n in ("agent_xfer_time", "agent_xfer_post_time")}
        self.ring: RingBufferFile | None = None
        self.http: Any = None
        if not enabled:
            return
        exporter = os.environ.get("NIXL_TELEMETRY_EXPORTER", "").strip()
        tdir = os.environ.get("NIXL_TELEMETRY_DIR", "").strip()
        if exporter.lower() in ("", "buffer") and tdir:
            size = _env_int("NIXL_TELEMETRY_BUFFER_SIZE", 4096, 1 << 40)
            path = os.path.join(tdir, agent_name)
            try:
                self.ring = RingBufferFile(path, size)
            except ValueError as exc:
                raise ConfigError("NIXL_TELEMETRY_BUFFER_SIZE", str(exc)) from None
            except OSError as exc:
                raise ConfigError(
                    "NIXL_TELEMETRY_DIR", f"cannot make the telemetry buffer {path} of {size} events: {exc.strerror}"
                ) from exc
        elif exporter.lower() == "prometheus":
            self._serve_prometheus()
        elif exporter and exporter.upper() != "NOP":
            log.warning("telemetry exporter %r is not available in datamover; collecting in process only", exporter)

    def _emit(self, name: str, value: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            f = self.families[name]
            f.total += value
            f.last = value
            f.count += 1
            if name in self.histograms:
                h = self.histograms[name]
                h[next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
            if self.ring is not None and not self.ring.push(EVENT_TYPE[name], value):
                self.families["agent_telemetry_events_dropped"].total += 1

    def transfer(self, op: str, nbytes: int, xfer_us: int, post_us: int) -> None:
        """A finished request: NIXL's TX events for WRITE, RX for READ, and its two times."""
        side = "tx" if op == "WRITE" else "rx"
        self._emit(f"agent_{side}_bytes", nbytes)
        self._emit(f"agent_{side}_requests_num", 1)
        self._emit("agent_xfer_time", xfer_us)
        self._emit("agent_xfer_post_time", post_us)

    def memory(self, registered: int = 0, deregistered: int = 0) -> None:
        if registered:
            self._emit("agent_memory_registered", registered)
        if deregistered:
            self._emit("agent_memory_deregistered", deregistered)

    def error(self, status: nixl_status_t) -> None:
        name = _ERR_EVENT.get(nixl_status_t(status))
        if name is not None:
            self._emit(name, 1)

    def collector(self) -> Any:
        """A prometheus_client collector of these events under NIXL's metric names."""
        return _Collector(self)

    def _serve_prometheus(self) -> None:
        from prometheus_client import CollectorRegistry

        from ...telemetry.http import serve_metrics

        port = _env_int("NIXL_TELEMETRY_PROMETHEUS_PORT", 9090, 65535)
        local = os.environ.get("NIXL_TELEMETRY_PROMETHEUS_LOCAL", "").strip().lower() in _TRUE
        registry = CollectorRegistry()
        registry.register(self.collector())
        try:
            self.http = serve_metrics(registry, port, "127.0.0.1" if local else "0.0.0.0")
        except OSError as exc:  # another rank holds the port: NIXL runs on without a sink, and so do we
            log.warning("telemetry: cannot serve Prometheus on port %d (%s); running without a sink", port, exc)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.http is not None:
            try:
                self.http.close()
            except Exception as exc:
                log.debug("stopping the Prometheus endpoint: %s", exc)
            self.http = None


def _env_int(name: str, default: int, most: int) -> int:
    """An integer 0..most from environment variable `name` (`default` when unset), else a ConfigError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdecimal() or int(raw) > most:
        raise ConfigError(name, f"expected an integer from 0 to {most}, got {shown(raw)}")
    return int(raw)


def _buckets() -> tuple[float, ...]:
    raw = os.environ.get("NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US", "").strip()
    if not raw:
        return DEFAULT_BUCKETS_US
    try:
        vals = tuple(float(v) for v in raw.split(","))
    except ValueError:
        vals = ()
    if not vals or not all(0 < v < math.inf for v in vals) or any(b <= a for a, b in zip(vals, vals[1:])):
        raise ConfigError(
            "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US",
            f"expected increasing finite numbers above 0, comma-separated, got {shown(raw)}",
        )
    return vals


_HELP = {
    "agent_tx_bytes": "Number of bytes sent by the agent",
    "agent_rx_bytes": "Number of bytes received by the agent",
    "agent_tx_requests_num": "Number of requests sent by the agent",
    "agent_rx_requests_num": "Number of requests received by the agent",
    "agent_memory_registered": "Cumulative memory registered",
    "agent_memory_deregistered": "Cumulative memory deregistered",
    "agent_xfer_time": "Cumulative sum of transfer time from start to completion",
    "agent_xfer_post_time": "Cumulative sum of time from start to posting to the back-end",
    "agent_telemetry_events_dropped": "Cumulative telemetry events dropped",
}
_GAUGE = {
    "agent_tx_bytes": "agent_tx_last_bytes",
    "agent_rx_bytes": "agent_rx_last_bytes",
    "agent_memory_registered": "agent_memory_registered_last_bytes",
    "agent_memory_deregistered": "agent_memory_deregistered_last_bytes",
    "agent_xfer_time": "agent_xfer_time",
    "agent_xfer_post_time": "agent_xfer_post_time",
}


class _Collector:
    """NIXL's Prometheus families; ``describe`` is empty because a counter and a gauge share a base name."""

    def __init__(self, events: NixlEvents) -> None:
        self.events = events

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        ev = self.events
        labels = ["hostname", "agent_name"]
        values = [socket.gethostname(), ev.agent_name]
        with ev._lock:
            fams = {n: _Family(f.total, f.last, f.count) for n, f in ev.families.items()}
            hists = {n: list(h) for n, h in ev.histograms.items()}
        for name, help_ in _HELP.items():
            c = CounterMetricFamily(name, help_, labels=labels)
            c.add_metric(values, fams[name].total)
            yield c
            if name in _GAUGE:
                g = GaugeMetricFamily(_GAUGE[name], f"{help_} (last operation)", labels=labels)
                g.add_metric(values, fams[name].last)
                yield g
        for name, counts in hists.items():
            h = HistogramMetricFamily(f"{name}_us", f"Distribution of {name}, in microseconds", labels=labels)
            cum, buckets = 0, []
            for bound, n in zip([*map(str, ev.buckets), "+Inf"], counts):
                cum += n
                buckets.append((bound, cum))
            h.add_metric(values, buckets, sum_value=fams[name].total)
            yield h
        e = CounterMetricFamily("agent_errors", "Cumulative error count by status", labels=[*labels, "status"])
        for name in EVENT_NAMES:
            if name.startswith("agent_err_"):
                e.add_metric([*values, name[len("agent_err_") :]], fams[name].total)
        yield e
