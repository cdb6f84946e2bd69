"""CRC32C as S3 writes it (base64 of the big-endian value), and the metadata key that carries an object's: one
definition for the writes that store it and the reads that check it."""

from __future__ import annotations

import base64
from typing import Any

#: metadata key holding the whole object's CRC32C (base64 of the big-endian 4 bytes)
CRC_META = "crc32c"


def crc32c_b64(data: Any) -> str:
    """CRC32C of ``data`` as S3 writes it: base64 of the 4 big-endian bytes."""
    import crc32c

    return b64(crc32c.crc32c(data))


def b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()
