"""NIXL's ``get_xfer_descs`` / ``get_reg_descs`` / ``get_remote_descs``: lists from tuples, arrays or tensors.

They follow NIXL 1.5's code path by path: input that cannot make a list is
logged and answered with None (a missing memory type, tuples of the wrong
width, a list of the other kind, a non-contiguous tensor), and what NIXL
raises on is raised as the same built-in type (also nixlInvalidParamError):
no descriptors (IndexError), not descriptors (TypeError), an array that is
not Nx3 int64/uint64 C-contiguous or a later tuple of the wrong width
(ValueError), a field that is not an unsigned integer or a metaInfo that is
not str or bytes (RuntimeError); an unknown memory type name is a KeyError.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._dlists import DescriptorTypeError, NoDescriptorsError, nixlRegDList, nixlRemoteDList, nixlXferDList
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


def _mem(mems: Mapping[str, nixl_mem_t], mem_type: Any) -> nixl_mem_t:
    """``mems[mem_type]``, as NIXL looks a memory type up (its names only: KeyError for anything else)."""
    try:
        return mems[mem_type]
    except KeyError:
        raise KeyError(f"unknown memory type {mem_type!r}: one of {', '.join(map(str, mems))}") from None


def _first(descs: Any, kind: type) -> Any:
    """``descs[0]``, which NIXL reads before anything else: an empty input is IndexError, one that cannot be
    indexed TypeError."""
    try:
        return descs[0]
    except IndexError:
        empty = f"{kind.__name__}(mem_type)"
        raise NoDescriptorsError(f"no descriptors (NIXL reads the first); an empty list is {empty}") from None
    except TypeError:
        raise DescriptorTypeError(f"cannot make a {kind.__name__} from a {type(descs).__name__}") from None


def build(kind: type, descs: Any, mem_type: Any, width: int, mems: Mapping[str, nixl_mem_t] = NIXL_MEMS) -> Any:
    """A list of ``kind`` from any input NIXL accepts, or None (logged) where NIXL returns None; raises where NIXL
    raises, with its exception type (see the module's docstring). ``mems``: the agent's memory-type names."""
    other = nixlRegDList if kind is nixlXferDList else nixlXferDList
    if isinstance(descs, kind):
        return descs
    if isinstance(descs, other):
        log.error("%s type detected, please use %s", other.__name__, kind.__name__)
        return None
    first = _first(descs, kind)
    if isinstance(first, tuple):
        if mem_type is None:
            log.error("Please specify a mem type if not using Tensors")
            return None
        if len(first) != width:
            log.error("%d-tuple list needed for %s", width, kind.__name__)
            return None
        return kind(_mem(mems, mem_type), descs)
    if isinstance(descs, np.ndarray):
        if mem_type is None:
            log.error("Please specify a mem type if not using Tensors")
            return None
        if descs.ndim != 2 or descs.shape[1] != 3:
            log.error("Nx3 shape required for a descriptor list from a numpy array")
            return None
        return kind(_mem(mems, mem_type), descs)
    if is_torch_tensor(descs):
        got = _tensor_rows([descs])
    elif is_torch_tensor(first):
        got = _tensor_rows([descs[i] for i in range(len(descs))])
    else:
        log.error("cannot make descriptors from a %s", type(descs).__name__)
        return None
    if got is None:
        return None
    rows, mem = got
    return kind(mem, rows)


def build_remote(descs: Any, mem_type: Any, mems: Mapping[str, nixl_mem_t] = NIXL_MEMS) -> nixlRemoteDList | None:
    """A nixlRemoteDList from (addr, len, devId, agent name) tuples, or None (logged); raises as ``build``."""
    if isinstance(descs, nixlRemoteDList):
        return descs
    first = _first(descs, nixlRemoteDList)
    if not isinstance(first, tuple):
        log.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
        return None
    if mem_type is None:
        log.error("Please specify a mem type")
        return None
    if len(first) != 4:
        log.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
        return None
    return nixlRemoteDList(_mem(mems, mem_type), descs)
