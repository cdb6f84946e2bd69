"""get_xfer_descs / get_reg_descs / get_remote_descs refuse what NIXL refuses, with NIXL's exception types.

The same inputs go through the facade and, where a NIXL wheel is installed, through NIXL's own agent: each gives the
same list, None, or an exception of the built-in type NIXL raises (the facade's is also a nixlInvalidParamError).
The few inputs where datamover differs on purpose are checked on their own.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from datamover.compat import nixl as nx
from datamover.compat.nixl import nixl_agent, nixl_agent_config

# tensors made once: each case gives the same memory to both agents
T, ONES, EMPTY, SCALAR = torch.zeros(8), torch.ones(4), torch.zeros(0), torch.tensor(1.0)
STRIDED = torch.zeros(8, 8).t()

#: inputs by name: a factory each (a generator is used up once)
CASES: dict[str, Callable[[], Any]] = {
    "empty list": lambda: [],
    "empty tuple": lambda: (),
    "3-tuples": lambda: [(1, 2, 0), (3, 4, 1)],
    "4-tuples": lambda: [(1, 2, 0, "m"), (3, 4, 1, b"n")],
    "tuple of tuples": lambda: ((1, 2, 0),),
    "tuple of 4-tuples": lambda: ((1, 2, 0, "m"),),
    "2-tuple": lambda: [(1, 2)],
    "a later row of another width": lambda: [(1, 2, 0), (1, 2)],
    "a later 4-row among 3-rows": lambda: [(1, 2, 0), (3, 4, 0, "x")],
    "a later list row": lambda: [(1, 2, 0), [3, 4, 0]],
    "a later list 4-row": lambda: [(1, 2, 0, "m"), [3, 4, 0, "n"]],
    "a list row": lambda: [[1, 2, 0]],
    "float addr": lambda: [(1.5, 2, 0)],
    "whole float addr": lambda: [(1.0, 2, 0)],
    "np.float64 addr": lambda: [(np.float64(1.0), 2, 0)],
    "str addr": lambda: [("1", 2, 0)],
    "str devId": lambda: [(1, 2, "0")],
    "None addr": lambda: [(None, 2, 0)],
    "tuple addr": lambda: [((1, 2), 0, 0)],
    "bool addr": lambda: [(True, 2, 0)],
    "np.int64 fields": lambda: [(np.int64(1), np.int32(2), np.uint8(0))],
    "negative addr": lambda: [(-1, 2, 0)],
    "negative len": lambda: [(1, -2, 0)],
    "negative devId": lambda: [(1, 2, -1)],
    "addr 2**64": lambda: [(2**64, 2, 0)],
    "a bad field after a bad row width": lambda: [(1.5, 2, 0), (1, 2)],
    "int metaInfo": lambda: [(1, 2, 0, 5)],
    "None metaInfo": lambda: [(1, 2, 0, None)],
    "bytearray metaInfo": lambda: [(1, 2, 0, bytearray(b"x"))],
    "memoryview metaInfo": lambda: [(1, 2, 0, memoryview(b"x"))],
    "np.str_ metaInfo": lambda: [(1, 2, 0, np.str_("s"))],
    "5-tuple": lambda: [(1, 2, 0, "m", "z")],
    "a tensor as a row": lambda: [(1, 2, 0), T],
    "array 0x3": lambda: np.zeros((0, 3), np.int64),
    "array int64": lambda: np.array([[1, 2, 0], [3, 4, 1]], np.int64),
    "array uint64": lambda: np.array([[1, 2, 0], [3, 4, 1]], np.uint64),
    "array float64": lambda: np.array([[1, 2, 0]], np.float64),
    "array int32": lambda: np.array([[1, 2, 0]], np.int32),
    "array uint8": lambda: np.array([[1, 2, 0]], np.uint8),
    "array bool": lambda: np.array([[1, 1, 0]], bool),
    "array object": lambda: np.array([[1, 2, 0]], object),
    "array str": lambda: np.array([["1", "2", "0"]]),
    "array big-endian int64": lambda: np.array([[1, 2, 0]], ">i8"),
    "array 1-D": lambda: np.array([1, 2, 0], np.int64),
    "array 0-D": lambda: np.array(5),
    "array 2x3x1": lambda: np.zeros((2, 3, 1), np.int64),
    "array 2x4": lambda: np.zeros((2, 4), np.int64),
    "array Fortran order": lambda: np.asfortranarray(np.array([[1, 2, 0], [3, 4, 0]], np.int64)),
    "array strided view": lambda: np.array([[1, 2, 0], [5, 5, 5], [3, 4, 0]], np.int64)[::2],
    "str": lambda: "not descriptors",
    "empty str": lambda: "",
    "bytes": lambda: b"abc",
    "int": lambda: 5,
    "None": lambda: None,
    "dict": lambda: {0: (1, 2, 0)},
    "set": lambda: {(1, 2, 0)},
    "generator": lambda: ((1, 2, 0) for _ in range(1)),
    "range": lambda: range(3),
    "list of ints": lambda: [5],
    "list of None": lambda: [None],
    "tensor": lambda: T,
    "non-contiguous tensor": lambda: STRIDED,
    "empty tensor": lambda: EMPTY,
    "0-d tensor": lambda: SCALAR,
    "list of tensors": lambda: [T, ONES],
    "tuple of tensors": lambda: (T,),
    "a non-contiguous tensor in a list": lambda: [T, STRIDED],
    "a list of one empty tensor": lambda: [EMPTY],
}
MEMS = ["DRAM", "cpu", "FILE", "OBJ", None, "HBM3"]
METHODS = ["get_xfer_descs", "get_reg_descs", "get_remote_descs"]


def _outcome(call: Callable[[], Any]) -> tuple:
    """("list", class name, memory type, rows) / ("None",) / ("raise", exception)."""
    try:
        out = call()
    except Exception as exc:  # what is raised is the outcome
        return ("raise", exc)
    if out is None:
        return ("None",)
    rows = []
    for i in range(out.descCount()):  # (NIXL's lists have no bounds check on iteration)
        row = tuple(out[i])
        rows.append(row[:3] + tuple(x.decode() if isinstance(x, bytes) else x for x in row[3:]))
    return ("list", type(out).__name__, int(out.getType()), rows)


def _real_api() -> Any:
    for name in ("nixl_cu12", "nixl_cu13", "nixl_rocm"):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    pytest.skip("no NIXL wheel (nixl_cu12 / nixl_cu13) installed")


@pytest.fixture(scope="module")
def agents():
    api = _real_api()
    real = api.nixl_agent("parity-real", api.nixl_agent_config(backends=[]))
    ours = nixl_agent("parity-ours", nixl_agent_config(backends=[]))
    yield real, ours
    ours.close()


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_facade_answers_as_nixl(agents, case, caplog):
    """Before: [] and empty arrays or tensors made an empty list (NIXL: IndexError), a tuple of tuples, float or
    str fields, int metaInfo (5 zero bytes), int32/uint8 or non-contiguous arrays made a list (floats truncated),
    None, an int, a set or a generator gave None (NIXL: TypeError), and bytes agent names were kept as "b'x'"."""
    caplog.set_level(logging.CRITICAL)
    real, ours = agents
    for method in METHODS:
        for mem in MEMS:
            want = _outcome(lambda a=real, f=method, m=mem: getattr(a, f)(CASES[case](), m))
            got = _outcome(lambda a=ours, f=method, m=mem: getattr(a, f)(CASES[case](), m))
            where = f"{method}({case}, {mem!r})"
            if want[0] == "raise":
                assert got[0] == "raise", f"{where}: NIXL raises {want[1]!r}, the facade gives {got}"
                assert isinstance(got[1], type(want[1])), f"{where}: NIXL raises {want[1]!r}, the facade {got[1]!r}"
            else:
                assert got == want, where


_OURS_ONLY = {  # datamover differs from NIXL here on purpose
    "addr 2**63": (lambda: [(2**63, 2, 0)], "DRAM"),  # fields are int64 here; NIXL takes them up to 2**64-1
    "uint64 array over 2**63": (lambda: np.array([[2**63 + 5, 2, 0]], np.uint64), "DRAM"),
    "negative int64 array": (lambda: np.array([[-1, 2, 0]], np.int64), "DRAM"),  # NIXL reads -1 as 2**64-1
}


@pytest.mark.parametrize("case", _OURS_ONLY, ids=list(_OURS_ONLY))
def test_fields_at_or_over_2_63_are_refused_as_invalid_params(case):
    make, mem = _OURS_ONLY[case]
    with nixl_agent("over", nixl_agent_config(backends=[])) as agent:
        with pytest.raises(nx.nixlInvalidParamError):
            agent.get_xfer_descs(make(), mem)


@pytest.mark.parametrize(
    ("method", "descs", "mem", "builtin", "names"),
    [
        ("get_xfer_descs", [], "DRAM", IndexError, "nixlXferDList(mem_type)"),
        ("get_reg_descs", np.zeros((0, 3), np.int64), "DRAM", IndexError, "nixlRegDList(mem_type)"),
        ("get_xfer_descs", ((1, 2, 0),), "DRAM", TypeError, "not a tuple"),
        ("get_xfer_descs", None, "DRAM", TypeError, "from a NoneType"),
        ("get_xfer_descs", [(1, 2, 0), (3, 4, 0), [5, 6, 0]], "DRAM", TypeError, "descriptor 2: a list, not a tuple"),
        ("get_xfer_descs", [(1, 2, 0), (1, 2)], "DRAM", ValueError, "descriptor 1: 2 fields"),
        ("get_xfer_descs", np.array([[1, 2, 0]], np.int32), "DRAM", ValueError, "int64 or uint64"),
        ("get_xfer_descs", np.zeros((4, 3), np.int64)[::2], "DRAM", ValueError, "C-contiguous"),
        ("get_xfer_descs", [(1, 2, 0), (1.5, 2, 0)], "DRAM", RuntimeError, "descriptor 1: addr 1.5 is not an integer"),
        ("get_xfer_descs", [(1, -2, 0)], "DRAM", RuntimeError, "descriptor 0: len -2"),
        ("get_reg_descs", [(1, 2, 0, 5)], "DRAM", RuntimeError, "descriptor 0: a int as metaInfo"),
        ("get_remote_descs", [(1, 2, 0, None)], "DRAM", RuntimeError, "a NoneType as metaInfo or agent name"),
    ],
)
def test_refusals_are_nixls_exception_types_naming_the_descriptor(method, descs, mem, builtin, names):
    """Without a NIXL wheel too: the built-in type NIXL raises, also a nixlInvalidParamError, naming what is wrong."""
    with nixl_agent("refuse", nixl_agent_config(backends=[])) as agent:
        with pytest.raises(builtin) as info:
            getattr(agent, method)(descs, mem)
    assert isinstance(info.value, nx.nixlInvalidParamError)
    assert names in str(info.value)


def test_what_nixl_accepts_still_makes_the_same_lists():
    """Lists of tuples (as vLLM's NixlConnector passes them), int64/uint64 arrays, tensors, bytes agent names."""
    with nixl_agent("accept", nixl_agent_config(backends=[])) as agent:
        x = agent.get_xfer_descs([(1, 2, 0), (np.int64(3), True, np.uint8(1))], "VRAM")
        assert list(x) == [(1, 2, 0), (3, 1, 1)] and x.getType() == nx.VRAM_SEG
        from_array = agent.get_xfer_descs(np.array([[1, 2, 0]], np.uint64), "DRAM")
        assert from_array == agent.get_xfer_descs([(1, 2, 0)], "DRAM")
        reg = agent.get_reg_descs([(1, 2, 0, "a"), (3, 4, 0, bytearray(b"b")), (5, 6, 0, np.str_("c"))], "DRAM")
        assert reg.meta == (b"a", b"b", b"c")
        remote = agent.get_remote_descs([(1, 2, 0, b"peer"), (3, 4, 0, "other")], "DRAM")
        assert remote.agents == ("peer", "other")
        assert agent.get_reg_descs(nx.nixlRegDList(nx.DRAM_SEG)).isEmpty()  # an empty list is made with its class


def test_a_memory_type_is_looked_up_by_name_as_nixl_does():
    """NIXL looks ``mem_type`` up in ``nixl_mems`` (KeyError for its enum too, which the facade used to take), and
    only once the first tuple's width fits (a 4-tuple for get_xfer_descs is None, whatever the memory type)."""
    with nixl_agent("mems", nixl_agent_config(backends=[])) as agent:
        with pytest.raises(KeyError, match="unknown memory type"):
            agent.get_xfer_descs([(1, 2, 0)], nx.DRAM_SEG)
        assert agent.get_xfer_descs([(1, 2, 0, "m")], "HBM3") is None
        with pytest.raises(KeyError, match="'HBM3'"):
            agent.get_reg_descs([(1, 2, 0, "m")], "HBM3")
