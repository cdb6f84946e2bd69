"""The backend conformance kit, importable by third-party backends' test suites."""

from .buffers import FileBuffer, HostBuffer, TestBuffer, VramBuffer, gpu_skip_reason
from .conformance import BackendConformance, random_bytes

__all__ = [
    "BackendConformance",
    "FileBuffer",
    "HostBuffer",
    "TestBuffer",
    "VramBuffer",
    "gpu_skip_reason",
    "random_bytes",
]
