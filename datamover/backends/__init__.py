"""How to move bytes: the Backend interface and the registry of backends by name.

Backends are found through the ``datamover.backends`` entry-point group, so a
third-party package adds one without touching datamover; the built-in ones
are also known by module path so a source checkout works uninstalled.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points

from ..errors import BackendUnavailable, BrokenBackend, UnknownBackend
from .base import Backend, BackendHost, Completion, Op, TransferRequest

ENTRY_POINT_GROUP = "datamover.backends"

#: Built-in backends in preference order: the first that moves a pair is chosen.
BUILTIN: dict[str, str] = {
    "memcpy": "datamover.backends.memcpy:MemcpyBackend",
    "posix": "datamover.backends.posix:PosixBackend",
    "cuda": "datamover.backends.cuda:CudaBackend",
    "gds": "datamover.backends.gds:GdsBackend",
    "ucx": "datamover.backends.ucx:UcxBackend",
    "s3": "datamover.backends.s3:S3Backend",
}

_lock = threading.Lock()
_registered: dict[str, type[Backend] | str] = {}
_discovered = False


def register_backend(name: str, cls: type[Backend] | str) -> None:
    """Make a backend class (or "module:Class" path) known under ``name``."""
    with _lock:
        _registered[name] = cls


def _discover() -> None:
    global _discovered
    with _lock:
        if _discovered:
            return
        for name, target in BUILTIN.items():
            _registered.setdefault(name, target)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _registered.setdefault(ep.name, ep.value)
        _discovered = True


def backend_names() -> list[str]:
    """Every known backend name, built-ins first in preference order."""
    _discover()
    with _lock:
        return list(_registered)


def get_backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; imports its module on first use."""
    _discover()
    with _lock:
        target = _registered.get(name)
    if target is None:
        raise UnknownBackend(f"unknown backend {name!r}; known: {', '.join(backend_names())}", backend=name)
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # a broken plugin must not break the others
            raise BrokenBackend(f"cannot load {target}: {type(exc).__name__}: {exc}") from exc
        with _lock:
            _registered[name] = cls
        return cls
    return target


def backend_status(name: str) -> tuple[bool, str]:
    """(usable here, reason) for the backend ``name``, never raising."""
    try:
        cls = get_backend_class(name)
    except BackendUnavailable as exc:  # unknown, or its module does not import
        return False, exc.reason
    try:
        return cls.available()
    except Exception as exc:  # availability probes must not take the CLI down
        return False, f"availability check failed: {type(exc).__name__}: {exc}"


__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendHost",
    "BrokenBackend",
    "Completion",
    "Op",
    "TransferRequest",
    "UnknownBackend",
    "backend_names",
    "backend_status",
    "get_backend_class",
    "register_backend",
]
