"""Per-transfer telemetry: when it started, how long posting and moving took, how much."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferTelemetry:
    """Measurements of the last post of a transfer (seconds and bytes)."""

    start_time: float  # wall clock (time.time()) at post
    post_duration_s: float  # time spent inside post()
    transfer_duration_s: float | None  # post to completion; None while in flight
    bytes: int
    descriptors: int  # as the caller gave them, before coalescing
    rows: int  # what the backend saw after coalescing
    backend: str
