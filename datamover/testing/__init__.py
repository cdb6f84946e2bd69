"""The backend conformance kit, importable by third-party backends' test suites.

Names are loaded on first use, so the service helpers (``datamover.testing.mooncake``, ``.s3server``) import
without pytest, which only the conformance kit needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .buffers import FileBuffer, HostBuffer, ObjectBuffer, TestBuffer, VramBuffer, gpu_skip_reason
    from .conformance import BackendConformance, ObjectStoreConformance, random_bytes
    from .hosts import Host, TestHosts, TestHostsUnavailable

_WHERE = {
    "BackendConformance": "conformance",
    "FileBuffer": "buffers",
    "Host": "hosts",
    "HostBuffer": "buffers",
    "ObjectBuffer": "buffers",
    "ObjectStoreConformance": "conformance",
    "TestBuffer": "buffers",
    "TestHosts": "hosts",
    "TestHostsUnavailable": "hosts",
    "VramBuffer": "buffers",
    "gpu_skip_reason": "buffers",
    "random_bytes": "conformance",
}

__all__ = [
    "BackendConformance",
    "FileBuffer",
    "Host",
    "HostBuffer",
    "ObjectBuffer",
    "ObjectStoreConformance",
    "TestBuffer",
    "TestHosts",
    "TestHostsUnavailable",
    "VramBuffer",
    "gpu_skip_reason",
    "random_bytes",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
