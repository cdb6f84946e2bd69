"""Alert rules are built over exactly the metric names the exporter emits."""

from __future__ import annotations

import re

import yaml

from datamover.policy.alerts_cli import main as alerts_main
from datamover.policy.config import TierConfig
from datamover.telemetry.alerts import alert_rules, alerts_yaml
from datamover.telemetry.config import AlertRule, BurnRateAlerts
from datamover.telemetry.metrics import CacheMetrics


def emitted_names() -> set[str]:
    m = CacheMetrics()
    m.hits.labels("l1_hbm").inc()
    m.misses.inc()
    m.evictions.labels("l1_hbm").inc(3)
    m.record_move("l1_hbm", "l2_dram", "memcpy", chunks=4, nbytes=4 * 65536, seconds=0.002)
    text = m.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_record_moves():
    m = CacheMetrics()
    m.record_move("l2_dram", "l1_hbm", "memcpy", chunks=4, nbytes=1024, seconds=0.004)
    text = m.render().decode()
    labels = 'backend="memcpy",from_tier="l2_dram",to_tier="l1_hbm"'
    assert f"datamover_chunk_moves_total{{{labels}}} 4.0" in text
    assert f"datamover_chunk_moved_bytes_total{{{labels}}} 1024.0" in text
    assert 'datamover_chunk_move_latency_seconds_count{from_tier="l2_dram",to_tier="l1_hbm"} 1.0' in text
    assert 'datamover_chunk_move_latency_seconds_bucket{from_tier="l2_dram",le="0.001",to_tier="l1_hbm"} 0.0' in text
    assert 'datamover_chunk_move_latency_seconds_bucket{from_tier="l2_dram",le="0.005",to_tier="l1_hbm"} 1.0' in text


def test_alert_expressions_use_emitted_metrics():
    names = emitted_names()
    rules = alert_rules(TierConfig().observability.burn_rate_alerts)["groups"][0]["rules"]
    assert len(rules) == 4
    for rule in rules:
        used = set(re.findall(r"datamover_[a-z_]+", rule["expr"]))
        assert used and used <= names, (rule["alert"], used - names)


def test_alert_thresholds_and_windows():
    alerts = BurnRateAlerts(
        p99_latency_ms=(AlertRule("5m", 800.0),),
        hit_rate_hbm=(AlertRule("30m", 0.6),),
        swap_eviction_rate_per_sec=(AlertRule("15m", 10000.0), AlertRule("1h", 500.0)),
    )
    doc = yaml.safe_load(alerts_yaml(alerts))
    exprs = [r["expr"] for r in doc["groups"][0]["rules"]]
    assert exprs[0].endswith("[5m]))) > 0.8")  # ms in the config, seconds in the histogram
    assert 'tier="l1_hbm"}[30m]' in exprs[1] and exprs[1].endswith("< 0.6")
    assert exprs[2].endswith("[15m])) > 10000") and exprs[3].endswith("[1h])) > 500")


def test_alerts_command(tmp_path, capsys):
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "kv_cache_tiered:\n  observability:\n    burn_rate_alerts:\n"
        "      hit_rate_hbm:\n        - {window: 10m, below: 0.75}\n"
    )
    out = tmp_path / "rules.yaml"
    assert alerts_main(["--config", str(config), "-o", str(out)]) == 0
    rules = yaml.safe_load(out.read_text())["groups"][0]["rules"]
    assert any("[10m]" in r["expr"] and r["expr"].endswith("< 0.75") for r in rules)
    config.write_text("kv_cache_tiered:\n  observability:\n    burn_rate_alerts:\n      hit_rate: []\n")
    assert alerts_main(["--config", str(config)]) == 2
    assert "kv_cache_tiered.observability.burn_rate_alerts.hit_rate: unknown key" in capsys.readouterr().err
