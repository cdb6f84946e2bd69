"""Spans: one record per chunk move, with the fields an SRE needs to replay where a block went and why.

Fields: layer_id, head_id, token_range, from_tier, to_tier, size_bytes, latency_us, prefix_hash, hit_or_miss.
A `SpanRecorder` keeps only the configured fields and hands spans to an exporter: JSON lines to a file, or
OpenTelemetry when `opentelemetry-api` is installed. A cache without a recorder does no span work at all.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError, shown
from .config import SPAN_FIELD_ALIASES, SPAN_FIELDS, ObservabilityConfig

__all__ = ["SPAN_FIELDS", "SPAN_FIELD_ALIASES", "JsonlExporter", "OtelExporter", "SpanExporter", "SpanRecorder"]


class SpanExporter(Protocol):
    """Where spans go."""

    def export(self, spans: Sequence[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class JsonlExporter:
    """Appends one JSON object per span to a file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[dict[str, Any]]) -> None:
        text = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class OtelExporter:
    """Emits each span through the OpenTelemetry API (whatever SDK and exporter the process configured)."""

    def __init__(self, name: str = "datamover.kvcache") -> None:
        try:
            from opentelemetry import trace
        except ImportError as exc:
            raise RuntimeError("span_exporter 'otel' needs opentelemetry-api (pip install opentelemetry-api)") from exc
        self._tracer = trace.get_tracer(name)

    def export(self, spans: Sequence[dict[str, Any]]) -> None:
        for span in spans:
            attrs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in span.items() if v is not None}
            with self._tracer.start_as_current_span(f"kv.move {span.get('from_tier')}->{span.get('to_tier')}") as s:
                s.set_attributes(attrs)

    def close(self) -> None:
        """Nothing to release: the SDK owns the pipeline."""


class SpanRecorder:
    """Filters spans to the configured fields and exports them in batches (one call per chunk batch)."""

    def __init__(self, exporter: SpanExporter, fields: Iterable[str] = SPAN_FIELDS) -> None:
        self.exporter = exporter
        self.fields = tuple(fields)

    @classmethod
    def from_config(
        cls, config: ObservabilityConfig, path: str = "kv_cache_tiered.observability"
    ) -> SpanRecorder | None:
        """The recorder the config (the section at `path`) asks for, or None when spans are off; a span file that
        cannot be opened is a ConfigError naming `span_path`, when the cache starts rather than at its first span."""
        if not config.spans:
            return None
        if config.span_exporter != "jsonl":
            return cls(OtelExporter(), config.span_fields)
        try:
            exporter = JsonlExporter(config.span_path)
        except OSError as exc:
            raise ConfigError(
                f"{path}.span_path", f"cannot append spans to {shown(config.span_path)}: {exc.strerror}"
            ) from exc
        return cls(exporter, config.span_fields)

    def record(self, spans: Iterable[dict[str, Any]]) -> None:
        """Export spans, keeping only the configured fields."""
        keep = self.fields
        self.exporter.export([{k: s.get(k) for k in keep} for s in spans])

    def close(self) -> None:
        self.exporter.close()
