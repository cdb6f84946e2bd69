"""UCP one-sided put/get through ctypes, on the context, worker and endpoint handles ucxx already owns.

ucxx's Python layer exposes tag, stream and active-message operations but not
RMA. The libucp it loads exports ``ucp_mem_map``, ``ucp_rkey_pack``,
``ucp_ep_rkey_unpack``, ``ucp_put_nbi``/``ucp_get_nbi`` (host rows),
``ucp_put_nbx``/``ucp_get_nbx`` (device rows) and ``ucp_ep_flush_nbx``;
this module binds exactly those (the same library object ucxx uses, so the
handles are valid here) and nothing else.
Requests are polled with ``ucp_request_check_status``: no callbacks into
Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import UcpError

UCS_OK = 0
UCS_INPROGRESS = 1
_MEMORY_TYPE = {"host": 0, "cuda": 1}
_FIELD_ADDRESS, _FIELD_LENGTH, _FIELD_MEMORY_TYPE = 1 << 0, 1 << 1, 1 << 4


class _MemMapParams(ctypes.Structure):
    # ucp_mem_map_params_t up to memory_type; the tail is padding for fields this code never sets
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("_tail", ctypes.c_uint8 * 64),
    ]


def _loaded(stem: str) -> str:
    """The path this process already mapped ``stem`` (e.g. 'libucp') from.

    Opening the same file under another name (libucp.so.0 against ucxx's
    libucp.so) gives a second, separate UCX in one process: its handles then
    point into a library whose global state (async thread, event sets) was
    never set up, and transfers hang or the process crashes at exit.
    """
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith(stem + ".so"):
                return path
    raise UcpError(f"{stem} is not loaded; import ucxx first")


@functools.lru_cache(maxsize=1)
def ucp() -> Any:
    """The libucp that ucxx loaded (the very same library object), with argument and result types declared."""
    from ucxx._lib import libucxx  # noqa: F401  (loads libucp)

    lib = ctypes.CDLL(_loaded("libucp"))
    ucs = ctypes.CDLL(_loaded("libucs"))
    vp, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    sig = {
        "ucp_mem_map": ([vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)], st),
        "ucp_mem_unmap": ([vp, vp], st),
        "ucp_rkey_pack": ([vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)], st),
        "ucp_rkey_buffer_release": ([vp], None),
        "ucp_ep_rkey_unpack": ([vp, ctypes.c_char_p, ctypes.POINTER(vp)], st),
        "ucp_rkey_destroy": ([vp], None),
        "ucp_ep_flush_nbx": ([vp, vp], ctypes.c_ssize_t),
        "ucp_request_check_status": ([vp], st),
        "ucp_request_free": ([vp], None),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    ucs.ucs_status_string.argtypes, ucs.ucs_status_string.restype = [st], ctypes.c_char_p
    lib.status_string = ucs.ucs_status_string
    return lib


class RequestParam(ctypes.Structure):
    """ucp_request_param_t: only op_attr_mask, memory_type and memh are ever set here."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
        ("_tail", ctypes.c_uint8 * 64),
    ]


_OP_ATTR_MEMORY_TYPE, _OP_ATTR_MEMH = 1 << 6, 1 << 8

# an all-zero ucp_request_param_t: no callback, auto-detected memory, the request is ours to free
_NO_PARAM = RequestParam()
NO_PARAM = ctypes.addressof(_NO_PARAM)


def memh_param(memh: int) -> RequestParam:
    """Request parameters naming a device buffer's memory handle and type, so UCP skips detecting them."""
    return RequestParam(op_attr_mask=_OP_ATTR_MEMH | _OP_ATTR_MEMORY_TYPE, memh=memh, memory_type=_MEMORY_TYPE["cuda"])


def status_text(status: int) -> str:
    return ucp().status_string(status).decode(errors="replace")


def _check(status: int, what: str) -> None:
    if status != UCS_OK:
        raise UcpError(f"{what} failed: {status_text(status)}", status=status)


def mem_map(context: int, addr: int, length: int, cuda: bool = False) -> int:
    """Register ``[addr, addr+length)`` with UCP for remote access; returns the memory handle."""
    params = _MemMapParams(
        field_mask=_FIELD_ADDRESS | _FIELD_LENGTH | _FIELD_MEMORY_TYPE,
        address=addr,
        length=length,
        memory_type=_MEMORY_TYPE["cuda" if cuda else "host"],
    )
    memh = ctypes.c_void_p()
    _check(ucp().ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)), "ucp_mem_map")
    return memh.value


def mem_unmap(context: int, memh: int) -> None:
    _check(ucp().ucp_mem_unmap(context, memh), "ucp_mem_unmap")


def rkey_pack(context: int, memh: int) -> bytes:
    """The packed remote key a peer unpacks to reach the mapped memory."""
    lib = ucp()
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    _check(lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack")
    try:
        return ctypes.string_at(buf, size.value)
    finally:
        lib.ucp_rkey_buffer_release(buf)


def rkey_unpack(ep: int, packed: bytes) -> int:
    """A peer's packed key, usable for put/get on ``ep`` until ``rkey_destroy``."""
    rkey = ctypes.c_void_p()
    _check(ucp().ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey)), "ucp_ep_rkey_unpack")
    return rkey.value


def rkey_destroy(rkey: int) -> None:
    ucp().ucp_rkey_destroy(rkey)


class Flush:
    """Remote completion of every put/get posted on one endpoint before it: one request, polled."""

    __slots__ = ("req", "status")

    def __init__(self, ep: int) -> None:
        ptr = ucp().ucp_ep_flush_nbx(ep, NO_PARAM)
        self.req = ptr if ptr > 0 else 0
        self.status = UCS_INPROGRESS if ptr > 0 else ptr

    def poll(self) -> int:
        """UCS_INPROGRESS until the flush ends, then its status (UCS_OK or an error)."""
        if self.req:
            lib = ucp()
            status = lib.ucp_request_check_status(self.req)
            if status == UCS_INPROGRESS:
                return status
            lib.ucp_request_free(self.req)
            self.req, self.status = 0, status
        return self.status

    def abandon(self) -> None:
        """Stop tracking: UCP frees the request when it ends."""
        if self.req:
            ucp().ucp_request_free(self.req)
            self.req = 0


Row = tuple  # (local addr, length, remote addr, rkey, request param or None), as ctypes values ready to pass


def make_row(laddr: int, n: int, raddr: int, rkey: int, param: RequestParam | None) -> Row:
    """One put/get's arguments converted once, so posting it again costs no conversions.

    A row without ``param`` (host memory) is posted with ``ucp_put_nbi``/``ucp_get_nbi``; one with it (the
    memh and memory type of device memory) with ``ucp_put_nbx``/``ucp_get_nbx``.
    """
    return (
        ctypes.c_void_p(laddr),
        ctypes.c_size_t(n),
        ctypes.c_uint64(raddr),
        ctypes.c_void_p(rkey),
        ctypes.byref(param) if param is not None else None,
    )


@functools.lru_cache(maxsize=1)
def _raw() -> tuple[Any, Any, Any, Any, Any]:
    """put/get nbi, put/get nbx and request_free without argtypes: the rows carry ctypes values already."""
    lib = ctypes.CDLL(_loaded("libucp"))
    put_nbi, get_nbi = lib.ucp_put_nbi, lib.ucp_get_nbi
    put_nbx, get_nbx, free = lib.ucp_put_nbx, lib.ucp_get_nbx, lib.ucp_request_free
    put_nbi.restype = get_nbi.restype = ctypes.c_int
    put_nbx.restype = get_nbx.restype = ctypes.c_ssize_t
    free.restype = None
    return put_nbi, get_nbi, put_nbx, get_nbx, free


def post_rows(get: bool, ep: int, rows: list[Row]) -> int:
    """Post one put (or get) per row (see ``make_row``); returns UCS_OK or the first error.

    Completion is left to the endpoint flush that follows. The implicit
    (nbi) calls hand back no request, which halves the foreign calls per
    row.
    The nbx requests device rows get are freed at once.
    """
    put_nbi, get_nbi, put_nbx, get_nbx, free = _raw()
    nbi, nbx, ep_arg = (get_nbi, get_nbx, ctypes.c_void_p(ep)) if get else (put_nbi, put_nbx, ctypes.c_void_p(ep))
    for laddr, n, raddr, rkey, param in rows:
        if param is None:
            status = nbi(ep_arg, laddr, n, raddr, rkey)
            if status < 0:
                return status
            continue
        ptr = nbx(ep_arg, laddr, n, raddr, rkey, param)
        if ptr > 0:
            free(ctypes.c_void_p(ptr))
        elif ptr < 0:
            return ptr
    return UCS_OK


# -- the native path: rows posted and the worker progressed in C, the GIL released (datamover.backends.ucx._ucp) --

_NATIVE_ENV = "DATAMOVER_UCX_NATIVE"  # "0": use the ctypes path even where the extension loads


@functools.lru_cache(maxsize=1)
def _native_state() -> tuple[Any, str]:
    """(the bound _ucp module or None, why): which path posts rows, and the reason."""
    if os.environ.get(_NATIVE_ENV, "1") == "0":
        return None, f"ctypes: {_NATIVE_ENV}=0"
    try:
        _ucp = importlib.import_module("datamover.backends.ucx._ucp")
    except ImportError as exc:
        return None, f"ctypes: the native extension datamover.backends.ucx._ucp was not built ({exc})"
    stale = _stale_build(_ucp)
    if stale:
        return None, stale
    try:
        ucp()  # loads libucp through ucxx
        _ucp.bind(_loaded("libucp"))
    except (ImportError, OSError, UcpError) as exc:
        return None, f"ctypes: the native extension cannot bind libucp ({exc})"
    return _ucp, f"native: rows posted and UCX progressed in C with the GIL released ({_loaded('libucp')})"


def _stale_build(_ucp: Any) -> str:
    """Why the loaded extension must not be used, or "": built from another _ucp.c than the one beside it.

    Only a source checkout ships _ucp.c; there a ``git pull`` without a rebuild would otherwise call C
    functions whose arguments changed.
    """
    source = Path(__file__).with_name("_ucp.c")
    if not source.is_file():
        return ""
    want = hashlib.sha256(source.read_bytes()).hexdigest()
    built = getattr(_ucp, "SOURCE_SHA256", "")
    if built == want:
        return ""
    return (
        f"ctypes: the native extension {getattr(_ucp, '__file__', '_ucp')} was built from another {source.name} "
        f"(built {built[:12] or 'unrecorded'}, source {want[:12]}): rebuild it with `pip install -e .` or "
        "`python setup.py build_ext --inplace`"
    )


def native() -> Any:
    """The bound native module, or None where the ctypes path is in use."""
    return _native_state()[0]


def data_path() -> str:
    """Which path posts one-sided rows here and why ("native: ..." or "ctypes: ..."), for ``datamover info``."""
    return _native_state()[1]


def native_rows(laddr: Any, lengths: Any, raddr: Any, rkeys: Any, params: list[RequestParam | None]) -> np.ndarray:
    """A prepared transfer's rows as the (n, 5) uint64 array {laddr, length, raddr, rkey, param} ``post_native``
    reads; ``param`` is the address of a device row's request parameters (kept alive by the caller), else 0."""
    rows = np.empty((len(lengths), 5), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = laddr, lengths, raddr, rkeys
    rows[:, 4] = [0 if p is None else ctypes.addressof(p) for p in params] if any(params) else 0
    return rows


def post_native(
    get: bool, ep: int, rows: np.ndarray, progress: Any = None, cork: Any = None, push_every: int = 0, data: Any = None
) -> tuple[Any, int]:
    """Post every row's get (``get``) or put and one endpoint flush in C: (flush, UCS_OK) or (None, the error).

    The flush has ``poll()`` and ``abandon()`` as ``Flush`` has, and
    ``drive(worker_handle, until)``: progress the worker in C, the GIL
    released, until it ends or the monotonic time ``until``. With
    ``progress`` (the native progress thread), that thread is held off the
    worker from before the first row until the flush ends, or ``unhold()``
    gives the request to it: the caller's waiter drives its own request, and
    its events wake nobody else. ``cork``: (fd, inode) pairs of tcp sockets
    corked while the rows are posted (``tcp_sockets``), what was sent let out
    every ``push_every`` rows (0: once, after the flush is posted). ``data``: the DataWorker ``ep`` is on.
    """
    got = native().post(get, ep, rows, progress, cork, push_every, data)
    return (None, got) if isinstance(got, int) else (got, UCS_OK)
