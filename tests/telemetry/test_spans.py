"""Span recording: configured fields only, JSON lines on disk, nothing at all when spans are off."""

from __future__ import annotations

import importlib.util
import json

import pytest

from datamover.telemetry.config import ObservabilityConfig
from datamover.telemetry.spans import JsonlExporter, OtelExporter, SpanRecorder


def test_recorder_keeps_configured_fields(tmp_path):
    path = tmp_path / "spans.jsonl"
    recorder = SpanRecorder(JsonlExporter(path), ["from_tier", "to_tier", "latency_us"])
    recorder.record([{"from_tier": "l2_dram", "to_tier": "l1_hbm", "latency_us": 12.5, "prefix_hash": 7}])
    recorder.record([{"from_tier": "caller", "to_tier": "l1_hbm"}])
    recorder.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"from_tier": "l2_dram", "to_tier": "l1_hbm", "latency_us": 12.5},
        {"from_tier": "caller", "to_tier": "l1_hbm", "latency_us": None},
    ]


def test_spans_off_means_no_recorder(tmp_path):
    assert SpanRecorder.from_config(ObservabilityConfig()) is None
    on = SpanRecorder.from_config(ObservabilityConfig(spans=True, span_path=str(tmp_path / "s.jsonl")))
    assert isinstance(on.exporter, JsonlExporter)
    on.close()


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry") is not None, reason="opentelemetry is installed")
def test_otel_exporter_says_what_it_needs():
    with pytest.raises(RuntimeError, match="opentelemetry-api"):
        OtelExporter()
