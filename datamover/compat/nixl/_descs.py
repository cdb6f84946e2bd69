"""NIXL's ``get_xfer_descs`` / ``get_reg_descs`` / ``get_remote_descs``: lists from tuples, arrays or tensors.

As in NIXL, input that cannot make a list is logged and answered with None
(a missing memory type, tuples of the wrong width, a list of the other kind, a
non-contiguous tensor); an unknown memory type name raises KeyError.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ._dlists import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._types import DRAM_SEG, VRAM_SEG, is_torch_tensor, nixl_mem_t

log = logging.getLogger("nixl.api")

NIXL_MEMS: dict[str, nixl_mem_t] = {
    "DRAM": nixl_mem_t.DRAM_SEG,
    "VRAM": nixl_mem_t.VRAM_SEG,
    "FILE": nixl_mem_t.FILE_SEG,
    "BLOCK": nixl_mem_t.BLK_SEG,
    "OBJ": nixl_mem_t.OBJ_SEG,
    "cpu": nixl_mem_t.DRAM_SEG,  # deprecated in NIXL, still accepted
    "cuda": nixl_mem_t.VRAM_SEG,  # deprecated in NIXL, still accepted
}


def seg(mem_type: Any) -> nixl_mem_t:
    """A memory-type name as NIXL looks it up (KeyError when unknown); a nixl_mem_t passes as is."""
    if isinstance(mem_type, nixl_mem_t):
        return mem_type
    return NIXL_MEMS[mem_type]


def _tensor_rows(tensors: list) -> tuple[np.ndarray, nixl_mem_t] | None:
    device = tensors[0].device
    rows = np.zeros((len(tensors), 3), dtype=np.int64)
    for i, t in enumerate(tensors):
        if t.device != device:
            log.error("Please use a list of Tensors on one device")
            return None
        if not t.is_contiguous():
            log.error("Please use a list of contiguous Tensors")
            return None
        dev = t.get_device()
        rows[i] = (t.data_ptr(), t.numel() * t.element_size(), 0 if dev == -1 else dev)
    return rows, (DRAM_SEG if tensors[0].get_device() == -1 else VRAM_SEG)


def build(kind: type, descs: Any, mem_type: Any, width: int) -> Any:
    """A list of ``kind`` from any input NIXL accepts, or None (logged) where NIXL returns None."""
    other = nixlRegDList if kind is nixlXferDList else nixlXferDList
    if isinstance(descs, kind):
        return descs
    if isinstance(descs, other):
        log.error("%s type detected, please use %s", other.__name__, kind.__name__)
        return None
    if is_torch_tensor(descs):
        got = _tensor_rows([descs])
    elif isinstance(descs, (list, tuple)) and descs and is_torch_tensor(descs[0]):
        got = _tensor_rows(list(descs))
    elif isinstance(descs, np.ndarray):
        if mem_type is None:
            log.error("Please specify a mem type if not using Tensors")
            return None
        if descs.ndim != 2 or descs.shape[1] != 3:
            log.error("Nx3 shape required for a descriptor list from a numpy array")
            return None
        return kind(seg(mem_type), descs)
    elif isinstance(descs, (list, tuple)):
        if mem_type is None:
            log.error("Please specify a mem type if not using Tensors")
            return None
        mem = seg(mem_type)
        if descs and (not isinstance(descs[0], tuple) or len(descs[0]) != width):
            log.error("%d-tuple list needed for %s", width, kind.__name__)
            return None
        return kind(mem, list(descs))
    else:
        log.error("cannot make descriptors from a %s", type(descs).__name__)
        return None
    if got is None:
        return None
    rows, mem = got
    return kind(mem, rows)


def build_remote(descs: Any, mem_type: Any) -> nixlRemoteDList | None:
    """A nixlRemoteDList from (addr, len, devId, agent name) tuples, or None (logged)."""
    if isinstance(descs, nixlRemoteDList):
        return descs
    if mem_type is None:
        log.error("Please specify a mem type")
        return None
    if not isinstance(descs, (list, tuple)) or (descs and (not isinstance(descs[0], tuple) or len(descs[0]) != 4)):
        log.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
        return None
    return nixlRemoteDList(seg(mem_type), list(descs))
