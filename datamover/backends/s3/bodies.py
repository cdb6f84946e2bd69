"""Response bodies read into the caller's memory: a chunk at a time through a worker's own buffer, each copy made inside
the transfer's fence, so that no byte lands there once the transfer ended ERR or was released."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import DatamoverError
from ..fence import ReadFence
from .checksums import b64


class Cancelled(DatamoverError):
    """Internal: a part noticed the transfer was cancelled (the completion already holds the reason)."""

    def __init__(self) -> None:
        super().__init__("cancelled", backend="s3")


def read_into(
    body: Any,
    dst: np.ndarray,
    stage: memoryview,
    fence: ReadFence,
    crc: bool = False,
    got: list[int] | None = None,
    ended: bool = False,
) -> str | None:
    """Fill ``dst`` from a response body a chunk at a time through ``stage``, each chunk copied inside ``fence``;
    with ``crc``, return the CRC32C of what was read. ``got[0]`` counts the bytes read; a body that ends early
    raises Ended with ``ended`` (the answer had no length: the object is shorter), else ConnectionResetError."""
    import crc32c

    mv = memoryview(dst).cast("B")
    done = got if got is not None else [0]
    value = 0
    while done[0] < mv.nbytes:
        if fence.cancelled:
            raise Cancelled()
        at = done[0]
        n = body.readinto(stage[: min(stage.nbytes, mv.nbytes - at)])
        if not n:
            if ended:
                raise Ended()
            raise ConnectionResetError(f"the response ended after {at} of {mv.nbytes} bytes")
        if crc:
            value = crc32c.crc32c(stage[:n], value)
        land(fence, mv, at, stage[:n])
        done[0] = at + n
    return b64(value) if crc else None


def land(fence: ReadFence, dst: memoryview, at: int, data: Any) -> None:
    """Copy ``data`` into the caller's memory at ``at``, inside the fence; raises Cancelled (copying nothing) once
    the transfer was cancelled."""
    if not fence.enter():
        raise Cancelled()
    try:
        dst[at : at + len(data)] = data
    finally:
        fence.leave()


def zero(fence: ReadFence, dst: np.ndarray) -> None:
    """Zero bytes that landed unverified, inside the fence; not once the transfer was released or timed out (the
    memory is the caller's again)."""
    if fence.join():
        try:
            dst[:] = 0
        finally:
            fence.leave()


def at_end(body: Any) -> bool:
    """Whether a body read to the bytes asked for has ended (reads at most one more byte)."""
    return not body.read(1)


class Ended(Exception):
    """Internal: a body without Content-Length ended before the bytes asked for."""
