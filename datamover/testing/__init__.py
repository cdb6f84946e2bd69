"""The backend conformance kit, importable by third-party backends' test suites."""

from .buffers import FileBuffer, HostBuffer, TestBuffer, VramBuffer, gpu_skip_reason
from .conformance import BackendConformance, random_bytes
from .hosts import Host, TestHosts, TestHostsUnavailable

__all__ = [
    "BackendConformance",
    "FileBuffer",
    "Host",
    "HostBuffer",
    "TestBuffer",
    "TestHosts",
    "TestHostsUnavailable",
    "VramBuffer",
    "gpu_skip_reason",
    "random_bytes",
]
