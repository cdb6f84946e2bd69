"""NIXL's enums and constants (as ``nixl._bindings`` has them) and the NIXL <-> datamover name maps."""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Any

from ...descriptors import MemType
from ._errors import nixl_status_t, nixlInvalidParamError, nixlNotSupportedError

#: NIXL's default metadata side-channel port.
DEFAULT_COMM_PORT = 8888
#: The agent name NIXL uses for the local side of ``prep_xfer_dlist``.
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
#: datamover has no UCX GPU device API: ``prep_mem_view`` is not available.
HAVE_UCX_GPU_DEVICE_API = False


class nixl_mem_t(IntEnum):
    """NIXL's memory segment types."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_thread_sync_t(IntEnum):
    """The binding's thread-synchronization modes; datamover's Agent is thread-safe in all of them."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_cost_t(IntEnum):
    """How ``estimateXferCost`` estimated: the backend's model (here: its measured throughput), or not at all.

    NIXL's enum names only ANALYTICAL_BACKEND; anything else reads as "UNKNOWN" in its ``_api``."""

    NIXL_COST_ANALYTICAL_BACKEND = 0
    NIXL_COST_UNKNOWN = 2


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (
    nixl_mem_t.DRAM_SEG,
    nixl_mem_t.VRAM_SEG,
    nixl_mem_t.BLK_SEG,
    nixl_mem_t.OBJ_SEG,
    nixl_mem_t.FILE_SEG,
)
NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND
NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_ERR_REMOTE_DISCONNECT = nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT
NIXL_ERR_CANCELED = nixl_status_t.NIXL_ERR_CANCELED
NIXL_ERR_NO_TELEMETRY = nixl_status_t.NIXL_ERR_NO_TELEMETRY
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT

_SEG_OF = {MemType.DRAM: DRAM_SEG, MemType.VRAM: VRAM_SEG, MemType.FILE: FILE_SEG, MemType.OBJ: OBJ_SEG}
_MEM_OF = {v: k for k, v in _SEG_OF.items()}


def seg_of(mem: MemType) -> nixl_mem_t:
    """The NIXL segment type of a datamover memory type."""
    return _SEG_OF[mem]


def mem_of(seg: Any) -> MemType:
    """The datamover memory type of a NIXL segment (or of a memory-type string such as "DRAM", "cuda").

    BLOCK raises nixlNotSupportedError; anything else unknown, nixlInvalidParamError.
    """
    if isinstance(seg, str):
        if seg.strip().upper() in ("BLOCK", "BLK"):
            raise nixlNotSupportedError("BLOCK memory is not supported by datamover")
        try:
            return MemType.parse(seg)
        except ValueError as exc:
            raise nixlInvalidParamError(str(exc)) from None
    try:
        seg = nixl_mem_t(seg)
    except (ValueError, TypeError):
        raise nixlInvalidParamError(f"unknown memory segment type {seg!r}") from None
    if seg == BLK_SEG:
        raise nixlNotSupportedError("BLOCK memory is not supported by datamover")
    return _MEM_OF[seg]


#: NIXL plugin name -> datamover backend name; names not listed map to themselves.
NIXL_TO_DATAMOVER: dict[str, str] = {
    "UCX": "ucx",
    "POSIX": "posix",
    "GDS": "gds",
    "GDS_MT": "gds",
    "OBJ": "s3",
    "memcpy": "memcpy",
    "cuda": "cuda",
}
_DATAMOVER_TO_NIXL: dict[str, tuple[str, ...]] = {
    "ucx": ("UCX",),
    "posix": ("POSIX",),
    "gds": ("GDS", "GDS_MT"),
    "s3": ("OBJ",),
    "memcpy": ("memcpy",),
    "cuda": ("cuda",),
    # datamover's mooncake backend is Mooncake *Store* (objects in a shared pool); NIXL's Mooncake plugin is
    # its transfer engine between agents, a different thing: no NIXL plugin answers for it
    "mooncake": (),
}


def datamover_backend_name(nixl_name: str) -> str:
    """The datamover backend behind a NIXL plugin name (``"UCX"`` -> ``"ucx"``)."""
    return NIXL_TO_DATAMOVER.get(nixl_name, nixl_name)


def nixl_plugin_names(datamover_name: str) -> tuple[str, ...]:
    """The NIXL plugin name(s) a datamover backend answers to."""
    return _DATAMOVER_TO_NIXL.get(datamover_name, (datamover_name,))


def as_bytes(msg: bytes | str | bytearray | memoryview) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def as_name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def is_torch_tensor(obj: object) -> bool:
    """Whether ``obj`` is a torch.Tensor, without importing torch (as NIXL checks)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)
