"""What the posix tests' stuck-syscall fakes share."""

from __future__ import annotations


def head(views: list, part: int | None) -> list[memoryview]:
    """The first ``part`` bytes of ``views`` (all of them when None) as byte views: what a syscall that comes back
    short moved."""
    left = sum(memoryview(v).nbytes for v in views) if part is None else part
    out = []
    for v in views:
        v = memoryview(v).cast("B")
        take = min(v.nbytes, left)
        if take:
            out.append(v[:take])
            left -= take
    return out
