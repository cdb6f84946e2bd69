"""Prometheus alerting rules from the config's `burn_rate_alerts`, over the metric names the exporter emits.

- p99_latency_ms: p99 of chunk-move latency over the window above the threshold (ms);
- hit_rate_hbm: L1 hits / all lookups over the window below the threshold;
- swap_eviction_rate_per_sec: evictions per second over the window above the threshold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import yaml

from ..policy.config import BurnRateAlerts, ConfigError, load_config
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


def add_alerts_parser(sub: argparse._SubParsersAction) -> None:
    """Add `alerts` to a subcommand parser (datamover/cli.py wires it in)."""
    p = sub.add_parser("alerts", help="write Prometheus alerting rules from the config's burn_rate_alerts")
    p.add_argument("--config", help="tier config YAML (default: the documented defaults)")
    p.add_argument("--output", "-o", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_alerts)


def cmd_alerts(args: argparse.Namespace) -> int:
    """Write the rules file the arguments ask for."""
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"datamover alerts: {exc}", file=sys.stderr)
        return 2
    text = alerts_yaml(config.observability.burn_rate_alerts)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m datamover.telemetry.alerts [--config FILE] [-o OUT]`."""
    parser = argparse.ArgumentParser(prog="datamover alerts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_alerts_parser(sub)
    args = parser.parse_args(["alerts", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
