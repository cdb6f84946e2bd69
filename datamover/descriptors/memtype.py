"""Memory types: where the bytes a descriptor names live."""

from __future__ import annotations

from enum import Enum

from ..errors import InvalidDescriptor


class MemType(str, Enum):
    """The four kinds of memory a descriptor can name.

    DRAM: host memory (addr is a pointer). VRAM: GPU memory (addr is a device
    pointer, dev the GPU index). FILE: a registered file (addr is the offset,
    dev the file's id). OBJ: an object in a store (dev indexes the list's key
    table, addr is the offset inside the object).
    """

    DRAM = "DRAM"
    VRAM = "VRAM"
    FILE = "FILE"
    OBJ = "OBJ"

    @classmethod
    def parse(cls, value: MemType | str) -> MemType:
        """Accept a MemType or its name in any case; NIXL's spellings included."""
        if isinstance(value, MemType):
            return value
        key = str(value).strip().upper()
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InvalidDescriptor(f"unknown memory type {value!r}; expected one of {names}") from None

    def __str__(self) -> str:
        return self.value


_ALIASES = {"CPU": "DRAM", "HOST": "DRAM", "GPU": "VRAM", "CUDA": "VRAM", "OBJECT": "OBJ"}
