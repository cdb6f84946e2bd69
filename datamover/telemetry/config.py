"""Telemetry's configuration (`kv_cache_tiered.observability`): spans, their fields, and burn-rate alert windows.

The sections are declared here, with the checks of their own values, so telemetry depends on nothing above it;
the tier config (`datamover.policy.config`) embeds `ObservabilityConfig` and validates it with these checks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, shown

SPAN_FIELDS = (
    "layer_id",
    "head_id",
    "token_range",
    "from_tier",
    "to_tier",
    "size_bytes",
    "latency_us",
    "prefix_hash",
    "hit_or_miss",
)
# The seed template spells the tier fields `from_layer` / `to_layer`; accept them as the same fields.
SPAN_FIELD_ALIASES = {"from_layer": "from_tier", "to_layer": "to_tier"}
# Each alert fires on one side of its threshold; `threshold` or that side's word may name it.
ALERT_SIDE = {"p99_latency_ms": "above", "hit_rate_hbm": "below", "swap_eviction_rate_per_sec": "above"}
_DURATION = re.compile(r"^(\d+)(s|m|h|d)$")
_MILLIS = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s)?$")


def _f(default: Any, doc: str, **checks: Any) -> Any:
    """A config field: its (immutable) default, its documentation, and optional checks (choices)."""
    return field(default=default, metadata={"doc": doc, **checks})


@dataclass(frozen=True)
class AlertRule:
    """One burn-rate window: fire when the metric over `window` is above or below `threshold`."""

    window: str
    threshold: float


@dataclass(frozen=True)
class BurnRateAlerts:
    """Alert windows; thresholds: p99 latency in ms (above), L1 hit rate (below), evictions per second (above)."""

    p99_latency_ms: tuple[AlertRule, ...] = _f(
        (AlertRule("5m", 800.0), AlertRule("1h", 600.0)), "p99 block-move latency above threshold ms over window"
    )
    hit_rate_hbm: tuple[AlertRule, ...] = _f((AlertRule("30m", 0.6),), "L1 hit rate below threshold over window")
    swap_eviction_rate_per_sec: tuple[AlertRule, ...] = _f(
        (AlertRule("15m", 10000.0),), "evictions per second above threshold over window"
    )


@dataclass(frozen=True)
class ObservabilityConfig:
    """Spans, counters and alerts."""

    spans: bool = _f(False, "emit a span per chunk move (off: the hot path does no span work)")
    span_exporter: str = _f("jsonl", "where spans go", choices=("jsonl", "otel"))
    span_path: str = _f("datamover-spans.jsonl", "file for the jsonl span exporter")
    span_fields: tuple[str, ...] = _f(SPAN_FIELDS, "fields each span carries (a subset of the nine span fields)")
    burn_rate_alerts: BurnRateAlerts = field(
        default_factory=BurnRateAlerts, metadata={"doc": "alert windows for `datamover alerts`"}
    )


def parse_duration(value: Any, path: str) -> str:
    """A Prometheus duration like 5m, 1h, 30s (ConfigError at `path` otherwise)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    if not match or not int(match.group(1)):  # Prometheus refuses an empty range, [0m]
        raise ConfigError(path, f"expected a Prometheus duration above 0 like 5m, 1h, 30s, got {shown(value)}")
    return value


def parse_alert_rules(value: Any, path: str, name: str) -> tuple[AlertRule, ...]:
    """The YAML list of `{window, threshold}` mappings of alert `name` (one of ALERT_SIDE)."""
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of {{window, threshold}} mappings, got {type(value).__name__}")
    unit_ms = name == "p99_latency_ms"
    allowed = ("threshold", ALERT_SIDE[name])
    rules = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(where, f"expected a mapping like {{window: 5m, threshold: 800ms}}, got {shown(item)}")
        for key in item:
            if key != "window" and key not in allowed:
                raise ConfigError(f"{where}.{key}", f"unknown key (expected window and one of {', '.join(allowed)})")
        limits = [k for k in allowed if k in item]
        if "window" not in item or len(limits) != 1:
            raise ConfigError(where, f"needs a window and exactly one of {', '.join(allowed)}")
        raw = item[limits[0]]
        match = _MILLIS.match(raw.strip()) if isinstance(raw, str) else None
        number = math.nan
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            number = float(raw) if abs(raw) < 1e308 else math.inf  # float() of a 400-digit int overflows
        elif match and (unit_ms or match.group(2) is None):
            number = float(match.group(1)) * (1000.0 if match.group(2) == "s" else 1.0)
        top = 1.0 if name == "hit_rate_hbm" else math.inf  # a rate above 1 always fires, a negative never or always
        if not 0.0 <= number <= top or math.isinf(number):
            bounds = "from 0 to 1" if top == 1.0 else "a finite number of 0 or more" + (" (ms)" if unit_ms else "")
            raise ConfigError(f"{where}.{limits[0]}", f"expected {bounds}, got {shown(raw)}")
        rules.append(AlertRule(parse_duration(item["window"], f"{where}.window"), number))
    return tuple(rules)


def parse_span_fields(value: Any, path: str) -> tuple[str, ...]:
    """The YAML list of span field names (aliases accepted), each one of SPAN_FIELDS."""
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of field names, got {type(value).__name__}")
    out = []
    for i, name in enumerate(value):
        name = SPAN_FIELD_ALIASES.get(name, name) if isinstance(name, str) else name
        if name not in SPAN_FIELDS:
            raise ConfigError(f"{path}[{i}]", f"unknown span field {shown(name)} (known: {', '.join(SPAN_FIELDS)})")
        out.append(name)
    return tuple(out)


__all__ = [
    "ALERT_SIDE",
    "SPAN_FIELDS",
    "SPAN_FIELD_ALIASES",
    "AlertRule",
    "BurnRateAlerts",
    "ConfigError",
    "ObservabilityConfig",
    "parse_alert_rules",
    "parse_duration",
    "parse_span_fields",
]
