"""Registration: a region of memory (or a file) made addressable for transfers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .buffers import host_view
from .desclist import DescList, block_step
from .memtype import MemType


@dataclass(eq=False)
class Registration:
    """One registered region; each capable backend keeps its handle in ``handles``.

    For DRAM/VRAM ``addr`` is the base pointer and ``dev`` the device; for a
    FILE ``addr`` is 0, ``length`` the registered size and ``dev`` the file's
    id, which FILE descriptors carry.
    """

    id: int
    mem_type: MemType
    addr: int
    length: int
    dev: int
    owner: Any = None
    path: str | None = None
    direct: bool = False
    handles: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    _array: np.ndarray | None = field(default=None, repr=False)

    @property
    def array(self) -> np.ndarray:
        """The region as a writable uint8 numpy view (DRAM only; no copy)."""
        if self.mem_type != MemType.DRAM:
            raise TypeError(f"a {self.mem_type} registration has no host view")
        if self._array is None:
            self._array = host_view(self.addr, self.length)
        return self._array

    @property
    def end(self) -> int:
        return self.addr + self.length

    def descs(self, offset: int = 0, length: int | None = None) -> DescList:
        """One descriptor covering ``length`` bytes at ``offset`` in this region."""
        n = self.length - offset if length is None else length
        return DescList.from_columns(self.addr + offset, n, self.dev, self.mem_type, owners=(self.owner,))

    def blocks(self, block_size: int) -> DescList:
        """The region cut into ``block_size`` blocks (last one shorter if it must be)."""
        size = block_step(block_size, self.length)
        starts = np.arange(0, self.length, size, dtype=np.int64)
        return DescList.from_columns(
            self.addr + starts,
            np.minimum(size, self.length - starts),
            self.dev,
            self.mem_type,
            owners=(self.owner,),
        )
