"""A file whose writes fail as on a full disk: the L3 index log's fault, injected at a known point."""

from __future__ import annotations

import errno
from typing import Any


class FullDisk:
    """Wraps an open file: every write raises ENOSPC, everything else goes to the file."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)
