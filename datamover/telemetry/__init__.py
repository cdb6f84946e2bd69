"""What happened: per-transfer telemetry, spans and counters."""

from .transfer import TransferTelemetry

__all__ = ["TransferTelemetry"]
