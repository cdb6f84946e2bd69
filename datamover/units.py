"""Byte units: the KiB/MiB/GiB constants, size strings parsed ('16M') and written ('16 MiB')."""

from __future__ import annotations

from typing import Any

from .errors import InvalidParameter

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SUFFIX = {"K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_size(value: Any, what: str = "size") -> int:
    """An int, or a size string like '4K', '64KiB', '1.5G', '4096', as bytes; InvalidParameter naming ``what``."""
    if isinstance(value, bool):
        raise InvalidParameter(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int) or (hasattr(value, "__index__") and not isinstance(value, str)):
        n = int(value)
    elif isinstance(value, str):
        t = value.strip().upper().removesuffix("IB").removesuffix("B")
        mult = _SUFFIX.get(t[-1:], 1)
        try:
            n = int(float(t[:-1] if mult > 1 else t) * mult)
        except (ValueError, OverflowError):  # OverflowError: "inf", "1e400"
            raise InvalidParameter(f"{what} must be a byte count like 4096 or '16G', got {value!r}") from None
    else:
        raise InvalidParameter(f"{what} must be a byte count like 4096 or '16G', got {value!r}")
    if n < 0:
        raise InvalidParameter(f"{what} must be >= 0, got {value!r}")
    return n


def size_text(n: int) -> str:
    """4096 -> '4 KiB', 1048576 -> '1 MiB', 1000 -> '1000 B': the largest unit that divides ``n``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"
