"""What to move: memory types and descriptor lists."""

from .buffers import BufferInfo, aligned_empty, buffer_info, host_view
from .desclist import DescList
from .memtype import MemType
from .strided import StridedDescList

__all__ = ["BufferInfo", "DescList", "MemType", "StridedDescList", "aligned_empty", "buffer_info", "host_view"]
