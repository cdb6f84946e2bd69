"""Prometheus alerting rules from the config's `burn_rate_alerts`, over the metric names the exporter emits.

- p99_latency_ms: p99 of chunk-move latency over the window above the threshold (ms);
- hit_rate_hbm: L1 hits / all lookups over the window below the threshold;
- swap_eviction_rate_per_sec: evictions per second over the window above the threshold.

The `datamover alerts` command, which reads them from a tier config file, is `datamover.policy.alerts_cli`.
"""

from __future__ import annotations

import yaml

from .config import BurnRateAlerts
from .metrics import EVICTIONS, HITS, MISSES, MOVE_LATENCY, exposed

GROUP = "datamover-kv-cache"


def _p99_expr(window: str, threshold_ms: float) -> str:
    return f"histogram_quantile(0.99, sum by (le) (rate({MOVE_LATENCY}_bucket[{window}]))) > {threshold_ms / 1000.0:g}"


def _hit_rate_expr(window: str, floor: float) -> str:
    hits, misses = exposed(HITS), exposed(MISSES)
    lookups = f"(sum(rate({hits}[{window}])) + sum(rate({misses}[{window}])))"
    return f'sum(rate({hits}{{tier="l1_hbm"}}[{window}])) / {lookups} < {floor:g}'


def _eviction_expr(window: str, ceiling: float) -> str:
    return f"sum(rate({exposed(EVICTIONS)}[{window}])) > {ceiling:g}"


def alert_rules(alerts: BurnRateAlerts) -> dict:
    """A Prometheus rules document: one alert per configured window."""
    rules = []
    for rule in alerts.p99_latency_ms:
        rules.append(
            {
                "alert": f"DatamoverMoveLatencyP99High_{rule.window}",
                "expr": _p99_expr(rule.window, rule.threshold),
                "labels": {"severity": "page"},
                "annotations": {"summary": f"p99 chunk-move latency over {rule.window} is above {rule.threshold:g} ms"},
            }
        )
    for rule in alerts.hit_rate_hbm:
        rules.append(
            {
                "alert": f"DatamoverL1HitRateLow_{rule.window}",
                "expr": _hit_rate_expr(rule.window, rule.threshold),
                "labels": {"severity": "ticket"},
                "annotations": {"summary": f"L1 (HBM) hit rate over {rule.window} is below {rule.threshold:g}"},
            }
        )
    for rule in alerts.swap_eviction_rate_per_sec:
        rules.append(
            {
                "alert": f"DatamoverEvictionRateHigh_{rule.window}",
                "expr": _eviction_expr(rule.window, rule.threshold),
                "labels": {"severity": "ticket"},
                "annotations": {"summary": f"evictions over {rule.window} exceed {rule.threshold:g} per second"},
            }
        )
    return {"groups": [{"name": GROUP, "rules": rules}]}


def alerts_yaml(alerts: BurnRateAlerts) -> str:
    """The rules document as YAML, ready for Prometheus' rule_files."""
    return yaml.safe_dump(alert_rules(alerts), sort_keys=False, width=200)
