"""What to move: memory types, descriptor lists, and the registered regions they must fall in."""

from .buffers import BufferInfo, aligned_empty, buffer_info, host_view
from .desclist import DescList
from .memtype import MemType
from .regions import RegionTable
from .registration import Registration
from .strided import StridedDescList

__all__ = [
    "BufferInfo",
    "DescList",
    "MemType",
    "RegionTable",
    "Registration",
    "StridedDescList",
    "aligned_empty",
    "buffer_info",
    "host_view",
]
