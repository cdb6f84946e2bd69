"""What to move: memory types and descriptor lists."""

from .buffers import BufferInfo, aligned_empty, buffer_info, host_view
from .desclist import DescList
from .memtype import MemType

__all__ = ["BufferInfo", "DescList", "MemType", "aligned_empty", "buffer_info", "host_view"]
