"""A drop-in facade of NIXL's Python API (``nixl._api``) over ``datamover.agents.Agent``.

Change ``from nixl._api import nixl_agent, nixl_agent_config`` to
``from datamover.compat.nixl import nixl_agent, nixl_agent_config`` and a
NIXL program runs on datamover. The facade only translates: NIXL names,
descriptor lists and handles in, Agent calls out; every byte is moved by the
Agent's backends. Where datamover is stricter than NIXL, the method's
docstring says how.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import numpy as np

from ..agents import Agent, AgentConfig, Prepared, Registration, Transfer, XferState
from ..backends import backend_names, backend_status, get_backend_class
from ..descriptors import DescList, MemType
from ..errors import (
    AuthenticationError,
    BackendUnavailable,
    DatamoverError,
    InvalidDescriptor,
    InvalidMetadata,
    InvalidParameter,
    LengthMismatch,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
    TransferAborted,
    TransferStateError,
    UnsupportedTransfer,
)

log = logging.getLogger("datamover.compat.nixl")

#: NIXL's default metadata side-channel port.
DEFAULT_COMM_PORT = 8888
#: The agent name NIXL uses for the local side of ``prep_xfer_dlist``.
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
#: NIXL's etcd namespace when NIXL_ETCD_NAMESPACE is not set.
ETCD_NAMESPACE_DEFAULT = "/nixl/agents"
#: How long ``fetch_remote_metadata`` retries a peer listener that is not up yet.
FETCH_RETRY_S = 10.0

# -- backend names -----------------------------------------------------------

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
# NIXL init-parameter names that mean "how many worker threads"
_THREAD_PARAMS = ("num_threads", "thread_count", "num_cpus", "num_workers")
# NIXL's OBJ plugin parameters -> datamover s3 parameters ("bucket" is kept by the facade)
_OBJ_PARAMS = {
    "endpoint_override": "endpoint_url",
    "access_key": "access_key_id",
    "secret_key": "secret_access_key",
    "session_token": "session_token",
    "region": "region",
    "use_virtual_addressing": "addressing_style",
    "ca_bundle": "verify_tls",
}


def datamover_backend_name(nixl_name: str) -> str:
    """The datamover backend behind a NIXL plugin name (``"UCX"`` -> ``"ucx"``)."""
    return NIXL_TO_DATAMOVER.get(nixl_name, nixl_name)


def nixl_plugin_names(datamover_name: str) -> tuple[str, ...]:
    """The NIXL plugin name(s) a datamover backend answers to."""
    return _DATAMOVER_TO_NIXL.get(datamover_name, (datamover_name,))


# -- errors ------------------------------------------------------------------


class NixlError(Exception):
    """Base of the NIXL-named errors (NIXL's own derive from Exception directly)."""


class nixlNotPostedError(NixlError):
    pass


class nixlInvalidParamError(NixlError):
    pass


class nixlBackendError(NixlError):
    pass


class nixlNotFoundError(NixlError):
    pass


class nixlMismatchError(NixlError):
    pass


class nixlNotAllowedError(NixlError):
    pass


class nixlRepostActiveError(NixlError):
    pass


class nixlUnknownError(NixlError):
    pass


class nixlNotSupportedError(NixlError):
    pass


class nixlRemoteDisconnectError(NixlError):
    pass


class nixlCancelledError(NixlError):
    pass


class nixlNoTelemetryError(NixlError):
    pass


# first match wins: datamover error -> the NIXL error a NIXL program would catch
_ERROR_MAP: tuple[tuple[type[DatamoverError], type[NixlError]], ...] = (
    (NotRegistered, nixlNotFoundError),
    (LengthMismatch, nixlMismatchError),
    (InvalidMetadata, nixlInvalidParamError),
    (InvalidDescriptor, nixlInvalidParamError),
    (InvalidParameter, nixlInvalidParamError),
    (UnsupportedTransfer, nixlNotFoundError),
    (BackendUnavailable, nixlBackendError),
    (TransferStateError, nixlNotAllowedError),
    (TransferAborted, nixlCancelledError),
    (RemoteDisconnected, nixlRemoteDisconnectError),
    (RemoteRefused, nixlNotAllowedError),
    (AuthenticationError, nixlNotAllowedError),
)
_combined: dict[tuple[type, type], type] = {}


def _translate(exc: DatamoverError) -> Exception:
    """``exc`` as an instance of both its own class and the matching NIXL error class."""
    nixl_cls: type[NixlError] = next((n for d, n in _ERROR_MAP if isinstance(exc, d)), nixlBackendError)
    key = (nixl_cls, type(exc))
    cls = _combined.get(key)
    if cls is None:
        cls = type(nixl_cls.__name__, (nixl_cls, type(exc)), {"__module__": __name__})
        _combined[key] = cls
    err = cls.__new__(cls)
    err.args = exc.args
    err.__dict__.update(exc.__dict__)
    return err


@contextmanager
def _nixl_errors() -> Iterator[None]:
    """Re-raise datamover errors as NIXL-named ones (still instances of the datamover class)."""
    try:
        yield
    except DatamoverError as exc:
        if isinstance(exc, NixlError):
            raise
        raise _translate(exc) from exc


# -- enums -------------------------------------------------------------------


class nixl_mem_t(str, Enum):
    """NIXL's memory segment types; the value is the string NIXL programs pass."""

    DRAM_SEG = "DRAM"
    VRAM_SEG = "VRAM"
    BLK_SEG = "BLOCK"
    OBJ_SEG = "OBJ"
    FILE_SEG = "FILE"


class nixl_thread_sync_t(Enum):
    """NIXL's thread-synchronization modes; the Agent is always thread-safe, so all behave alike."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (
    nixl_mem_t.DRAM_SEG,
    nixl_mem_t.VRAM_SEG,
    nixl_mem_t.BLK_SEG,
    nixl_mem_t.OBJ_SEG,
    nixl_mem_t.FILE_SEG,
)
_SEG_OF = {MemType.DRAM: DRAM_SEG, MemType.VRAM: VRAM_SEG, MemType.FILE: FILE_SEG, MemType.OBJ: OBJ_SEG}


def _mem_type(value: Any) -> MemType:
    """A NIXL memory-type string ("DRAM", "cuda", ...) or nixl_mem_t as a MemType."""
    if isinstance(value, nixl_mem_t):
        value = value.value
    if isinstance(value, str) and value.strip().upper() in ("BLOCK", "BLK"):
        raise nixlNotSupportedError("BLOCK memory is not supported by datamover")
    try:
        return MemType.parse(value)
    except ValueError as exc:
        raise nixlInvalidParamError(str(exc)) from None


def _as_bytes(msg: bytes | str | bytearray | memoryview) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _as_name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


# -- descriptor lists --------------------------------------------------------


class _DList:
    """Common part of the two NIXL list types: a DescList plus NIXL's list methods."""

    __slots__ = ("_descs",)

    def __init__(self, type: Any, descs: Any = 0) -> None:
        mem = _mem_type(type)
        if isinstance(descs, int):
            rows: Any = np.zeros((descs, 3), dtype=np.int64)
        elif isinstance(descs, np.ndarray):
            rows = descs
        else:
            rows = self._rows_of_tuples(list(descs))
        try:
            self._descs = DescList(rows, mem)
        except InvalidDescriptor as exc:
            raise _translate(exc) from exc

    def _rows_of_tuples(self, descs: list) -> np.ndarray:
        return _tuple_rows(descs, 3)

    @classmethod
    def _wrap(cls, descs: DescList, meta: Sequence[bytes] | None = None) -> Any:
        out = cls.__new__(cls)
        out._descs = descs
        return out

    @property
    def descs(self) -> DescList:
        """The datamover DescList behind this list."""
        return self._descs

    def getType(self) -> nixl_mem_t:
        """The list's memory type."""
        return _SEG_OF[self._descs.mem_type]

    def descCount(self) -> int:
        return len(self._descs)

    def isEmpty(self) -> bool:
        return len(self._descs) == 0

    def __len__(self) -> int:
        return len(self._descs)

    def __bool__(self) -> bool:
        # NIXL's lists are always truthy: `if not descs:` tests for None, never for emptiness
        return True

    def _check_index(self, i: int) -> int:
        n = len(self._descs)
        if not -n <= i < n:
            raise IndexError(f"descriptor index {i} is out of range for {n} descriptors")
        return i % n

    def _set_rows(self, rows: np.ndarray) -> None:
        try:
            self._descs = DescList(rows, self._descs.mem_type)
        except InvalidDescriptor as exc:
            raise _translate(exc) from exc

    def print(self) -> None:
        """Print the list (NIXL's debugging aid)."""
        print(repr(self))


def _tuple_rows(descs: list, width: int) -> np.ndarray:
    if not descs:
        return np.zeros((0, 3), dtype=np.int64)
    if not all(isinstance(d, tuple) for d in descs):
        raise nixlInvalidParamError("each descriptor must be a tuple when provided as a list")
    lengths = {len(d) for d in descs}
    if lengths != {width}:
        raise nixlInvalidParamError(f"each descriptor tuple must have exactly {width} elements, got {sorted(lengths)}")
    try:
        rows = np.array([d[:3] for d in descs] if width != 3 else descs, dtype=np.int64)
    except (OverflowError, ValueError, TypeError) as exc:
        raise nixlInvalidParamError(f"descriptor fields must be integers in 0..2**63-1: {exc}") from None
    return rows


class nixlXferDList(_DList):
    """A transfer descriptor list: (addr, len, devId) rows of one memory type."""

    __slots__ = ()

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return self._descs[self._check_index(i)]

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(self._descs)

    def __setitem__(self, i: int, desc: tuple) -> None:
        rows = np.array(self._descs.rows)
        rows[self._check_index(i)] = _tuple_rows([tuple(desc)], 3)[0]
        self._set_rows(rows)

    def addDesc(self, desc: tuple) -> None:
        self._set_rows(np.concatenate([self._descs.rows, _tuple_rows([tuple(desc)], 3)]))

    append = addDesc

    def remDesc(self, i: int) -> None:
        self._set_rows(np.delete(self._descs.rows, self._check_index(i), axis=0))

    def clear(self) -> None:
        self._set_rows(np.zeros((0, 3), dtype=np.int64))

    def index(self, desc: tuple) -> int:
        """Position of ``desc`` in the list; nixlNotFoundError when absent."""
        row = _tuple_rows([tuple(desc)], 3)[0]
        hit = np.flatnonzero((self._descs.rows == row).all(axis=1))
        if hit.size == 0:
            raise nixlNotFoundError(f"descriptor {tuple(desc)} is not in the list")
        return int(hit[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, nixlXferDList):
            return NotImplemented
        return self._descs == other._descs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"nixlXferDList({self._descs.mem_type.value}, {list(self._descs)[:8]}{' ...' if len(self) > 8 else ''})"


class nixlRegDList(_DList):
    """A registration descriptor list: (addr, len, devId, metaInfo) rows of one memory type."""

    __slots__ = ("_meta",)

    def __init__(self, type: Any, descs: Any = 0) -> None:
        self._meta: tuple[bytes, ...] = ()
        super().__init__(type, descs)
        if len(self._meta) != len(self._descs):
            self._meta = (b"",) * len(self._descs)

    def _rows_of_tuples(self, descs: list) -> np.ndarray:
        rows = _tuple_rows(descs, 4)
        self._meta = tuple(_as_bytes(d[3]) for d in descs)
        return rows

    @classmethod
    def _wrap(cls, descs: DescList, meta: Sequence[bytes] | None = None) -> nixlRegDList:
        out = cls.__new__(cls)
        out._descs = descs
        out._meta = tuple(meta) if meta is not None else (b"",) * len(descs)
        return out

    @property
    def meta(self) -> tuple[bytes, ...]:
        """The metaInfo of every descriptor."""
        return self._meta

    def __getitem__(self, i: int) -> tuple[int, int, int, bytes]:
        k = self._check_index(i)
        return (*self._descs[k], self._meta[k])

    def __iter__(self) -> Iterator[tuple[int, int, int, bytes]]:
        return (self[i] for i in range(len(self)))

    def __setitem__(self, i: int, desc: tuple) -> None:
        k = self._check_index(i)
        rows = np.array(self._descs.rows)
        rows[k] = _tuple_rows([tuple(desc)], 4)[0]
        self._set_rows(rows)
        self._meta = (*self._meta[:k], _as_bytes(desc[3]), *self._meta[k + 1 :])

    def addDesc(self, desc: tuple) -> None:
        self._set_rows(np.concatenate([self._descs.rows, _tuple_rows([tuple(desc)], 4)]))
        self._meta = (*self._meta, _as_bytes(desc[3]))

    append = addDesc

    def remDesc(self, i: int) -> None:
        k = self._check_index(i)
        self._set_rows(np.delete(self._descs.rows, k, axis=0))
        self._meta = self._meta[:k] + self._meta[k + 1 :]

    def clear(self) -> None:
        self._set_rows(np.zeros((0, 3), dtype=np.int64))
        self._meta = ()

    def index(self, desc: tuple) -> int:
        """Position of ``desc`` (with its metaInfo) in the list; nixlNotFoundError when absent."""
        row = _tuple_rows([tuple(desc)], 4)[0]
        meta = _as_bytes(desc[3])
        for k in np.flatnonzero((self._descs.rows == row).all(axis=1)).tolist():
            if self._meta[k] == meta:
                return k
        raise nixlNotFoundError(f"descriptor {tuple(desc)} is not in the list")

    def trim(self) -> nixlXferDList:
        """The same descriptors without metaInfo, as a transfer list."""
        return nixlXferDList._wrap(self._descs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, nixlRegDList):
            return NotImplemented
        return self._descs == other._descs and self._meta == other._meta

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        rows = [self[i] for i in range(min(len(self), 8))]
        return f"nixlRegDList({self._descs.mem_type.value}, {rows}{' ...' if len(self) > 8 else ''})"


# -- serialization (msgpack, never pickle) -------------------------------------

_SERIAL_TAG = "datamover.nixl.dlist"
_SERIAL_VERSION = 1
_MAX_SERIAL_BYTES = 256 << 20
_MAX_META_BYTES = 4096


def serialize_dlist(descs: nixlXferDList | nixlRegDList) -> bytes:
    """Pack a descriptor list as msgpack: tag, version, kind, memory type, int64 rows, metaInfo."""
    if not isinstance(descs, (nixlXferDList, nixlRegDList)):
        raise nixlInvalidParamError(
            f"get_serialized_descs takes a nixlXferDList or nixlRegDList, got {type(descs).__name__}"
        )
    doc: dict[str, Any] = {
        "tag": _SERIAL_TAG,
        "v": _SERIAL_VERSION,
        "kind": "reg" if isinstance(descs, nixlRegDList) else "xfer",
        "mem": descs.descs.mem_type.value,
        "rows": np.ascontiguousarray(descs.descs.rows, dtype="<i8").tobytes(),
    }
    if isinstance(descs, nixlRegDList):
        doc["meta"] = list(descs.meta)
    return msgpack.packb(doc, use_bin_type=True)


def deserialize_dlist(blob: bytes) -> nixlXferDList | nixlRegDList:
    """Unpack ``serialize_dlist``'s output; anything else raises nixlInvalidParamError."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise nixlInvalidParamError(f"serialized descriptors must be bytes, got {type(blob).__name__}")
    if len(blob) > _MAX_SERIAL_BYTES:
        raise nixlInvalidParamError(f"serialized descriptors of {len(blob)} bytes exceed {_MAX_SERIAL_BYTES}")
    try:
        doc = msgpack.unpackb(
            bytes(blob), raw=False, strict_map_key=True, max_bin_len=_MAX_SERIAL_BYTES,
            max_str_len=_MAX_META_BYTES, max_array_len=_MAX_SERIAL_BYTES // 24, max_map_len=16, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:
        raise nixlInvalidParamError(f"serialized descriptors are not valid: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("tag") != _SERIAL_TAG:
        raise nixlInvalidParamError("serialized descriptors: not a datamover descriptor list")
    if doc.get("v") != _SERIAL_VERSION or type(doc.get("v")) is not int:
        raise nixlInvalidParamError(f"serialized descriptors: unsupported version {doc.get('v')!r}")
    kind = doc.get("kind")
    allowed = {"tag", "v", "kind", "mem", "rows"} | ({"meta"} if kind == "reg" else set())
    if kind not in ("reg", "xfer") or set(doc) != allowed:
        raise nixlInvalidParamError(f"serialized descriptors: bad kind {kind!r} or fields {sorted(map(str, doc))}")
    mem, raw = doc["mem"], doc["rows"]
    if not isinstance(mem, str) or not isinstance(raw, bytes) or len(raw) % 24:
        raise nixlInvalidParamError("serialized descriptors: 'mem' must be a string and 'rows' N*24 bytes")
    rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
    try:
        descs = DescList(rows, _mem_type(mem))
    except InvalidDescriptor as exc:
        raise _translate(exc) from exc
    if kind == "xfer":
        return nixlXferDList._wrap(descs)
    meta = doc["meta"]
    if not isinstance(meta, list) or len(meta) != len(descs) or not all(isinstance(m, bytes) for m in meta):
        raise nixlInvalidParamError("serialized descriptors: 'meta' must hold one bytes value per descriptor")
    return nixlRegDList._wrap(descs, meta)


# -- handles and telemetry -----------------------------------------------------


@dataclass(frozen=True)
class nixlXferTelemetry:
    """NIXL's per-transfer telemetry: times in microseconds, bytes and (merged) descriptor count."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from ``prep_xfer_dlist``); ``release()`` frees it."""

    __slots__ = ("_agent", "_released", "local", "prepared")

    def __init__(self, agent: nixl_agent, prepared: Prepared, local: bool) -> None:
        self._agent = agent
        self.prepared = prepared
        self.local = local
        self._released = False

    def release(self) -> None:
        self._released = True

    def _live(self) -> Prepared:
        if self._released:
            raise nixlNotAllowedError("the prepared descriptor list was released")
        return self.prepared

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle({self.prepared!r}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request (from ``initialize_xfer`` or ``make_prepped_xfer``); ``release()`` frees it."""

    __slots__ = ("_args", "_notify", "_released", "xfer")

    def __init__(self, xfer: Transfer, args: tuple, notify: bytes) -> None:
        self.xfer = xfer
        self._args = args  # (agent, op, local, local_idx, remote, remote_idx, backends): to re-make on a new notif
        self._notify = notify
        self._released = False

    @property
    def error(self) -> BaseException | None:
        """Why the transfer is in ERR (None otherwise): what NIXL only writes to its log."""
        return self.xfer.error

    def release(self) -> None:
        """Free the request, aborting it (and waiting for the abort) when in flight."""
        if not self._released:
            self.xfer.release()
            self._released = True

    def _live(self) -> Transfer:
        if self._released:
            raise nixlNotAllowedError("the transfer handle was released")
        return self.xfer

    def _renotify(self, notify: bytes) -> None:
        agent, op, lp, li, rp, ri, backends = self._args
        with _nixl_errors():
            new = agent.make_transfer(op, lp, li, rp, ri, notify=notify, backends=backends)
        self.xfer.release()
        self.xfer, self._notify = new, notify

    def __repr__(self) -> str:
        return f"nixl_xfer_handle({self.xfer!r}, released={self._released})"


# -- config and agent -----------------------------------------------------------


class nixl_agent_config:
    """NIXL's agent configuration; same arguments, order and defaults.

    ``enable_prog_thread`` and ``sync_mode`` are accepted and have no effect
    (datamover backends always progress on their own threads and the Agent is
    thread-safe). ``enable_listen_thread`` serves this agent's metadata on
    ``listen_port``; ``num_threads`` becomes each backend's thread count.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],  # noqa: B006 - NIXL's default, never mutated here
        sync_mode: nixl_thread_sync_t | None = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def _threads_param(cls: type) -> str | None:
    """The backend's own name for its thread count."""
    return next((k for k in ("threads", "concurrency") if k in cls.default_params), None)


def _param_str(value: Any) -> str:
    if value is None:
        return ""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _param_value(key: str, value: Any, default: Any) -> Any:
    """A NIXL string parameter converted to the type of datamover's default.

    For a default of None (unset), "" means unset and numbers become numbers.
    """
    if not isinstance(value, str) or isinstance(default, str):
        return value
    text = value.strip().lower()
    if default is None:
        if not text:
            return None
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return value
    try:
        if isinstance(default, bool):
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if isinstance(default, int):
            return int(text, 0)
        if isinstance(default, float):
            return float(text)
    except ValueError as exc:
        raise nixlInvalidParamError(f"backend parameter {key!r}: {exc}") from None
    return value


class nixl_agent:
    """NIXL's agent, backed by a datamover ``Agent`` (``self.agent``).

    Arguments, defaults, return values and raised errors follow
    ``nixl._api.nixl_agent``; where datamover is stricter, the method's
    docstring says how.
    """

    def __init__(self, agent_name: str, nixl_conf: nixl_agent_config | None = None, instantiate_all: bool = False):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            log.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        self.name = agent_name
        self.conf = nixl_conf
        self.capture_telemetry = bool(nixl_conf.capture_telemetry) or bool(os.environ.get("NIXL_TELEMETRY_ENABLE"))
        usable = [n for n in backend_names() if backend_status(n)[0]]
        self.plugin_list: list[str] = [p for n in usable for p in nixl_plugin_names(n)]
        if not self.plugin_list:
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        config = AgentConfig(
            backends={n: {} for n in usable},
            listen_port=int(nixl_conf.port) if nixl_conf.enable_listen else None,
        )
        self.agent = Agent(agent_name, config)
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self._regs: dict[tuple[MemType, int, int, int], Registration] = {}
        self._files: dict[int, Registration] = {}  # the caller's fd -> its FILE registration
        self._obj_keys: dict[int, str] = {}  # the caller's devId -> object key
        self._obj_bucket: str | None = None
        self.nixl_mems = {m.value: m for m in nixl_mem_t} | {"cpu": DRAM_SEG, "cuda": VRAM_SEG}
        self.nixl_ops = {"WRITE": "WRITE", "READ": "READ"}
        try:
            for bknd in self.plugin_list if instantiate_all else nixl_conf.backends:
                if bknd not in self.plugin_list:
                    log.warning("Skipping backend registration %s due to the missing plugin.", bknd)
                    continue
                init: dict[str, str] = {}
                if nixl_conf.num_threads > 0:
                    init["num_threads"] = str(nixl_conf.num_threads)
                self.create_backend(bknd, init)
        except BaseException:
            self.agent.close()
            raise

    # -- plugins and backends ---------------------------------------------------
    def get_plugin_list(self) -> list[str]:
        """NIXL names of the backends usable on this machine."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """Memory types a plugin moves; [] (with a warning) for one not available here."""
        if backend not in self.plugin_list:
            log.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return _mem_names(get_backend_class(datamover_backend_name(backend)).mem_types())

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """A plugin's parameters and their defaults, as strings."""
        if backend not in self.plugin_list:
            log.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        cls = get_backend_class(datamover_backend_name(backend))
        return {k: _param_str(v) for k, v in cls.default_params.items()}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """Memory types of a created backend; [] (with a warning) if not created."""
        if backend not in self.backend_mems:
            log.warning("Backend %s not instantiated to get its supported mem types.", backend)
            return []
        return self.backend_mems[backend]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """Parameters of a created backend; {} (with a warning) if not created."""
        if backend not in self.backend_options:
            log.warning("Backend %s not instantiated to get its parameters.", backend)
            return {}
        return self.backend_options[backend]

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006
        """Start a backend by its NIXL name with NIXL-style string parameters.

        Thread-count parameters (``num_threads``, ``thread_count``, ...) map to
        the backend's ``threads`` (s3: ``concurrency``); parameters the backend does not know are
        logged and ignored, as NIXL plugins do.
        """
        if backend not in self.plugin_list:
            raise nixlNotFoundError(f"plugin {backend!r} is not available here; available: {self.plugin_list}")
        if backend in self.backends:
            raise nixlInvalidParamError(f"backend {backend!r} was already created")
        name = datamover_backend_name(backend)
        cls = get_backend_class(name)
        init = dict(initParams or {})
        if backend == "OBJ":
            init = self._obj_params(init)
        params: dict[str, Any] = {}
        for key, value in init.items():
            target = key if key in cls.default_params else (_threads_param(cls) if key in _THREAD_PARAMS else None)
            if target not in cls.default_params:
                log.warning("backend %s: ignoring parameter %r, which datamover's %s does not take", backend, key, name)
                continue
            raw = target == "verify_tls" and isinstance(value, str) and value.lower() not in _BOOL_WORDS
            params[target] = value if raw else _param_value(key, value, cls.default_params[target])
        cfg_backends = self.agent.config.backends
        assert cfg_backends is not None
        cfg_backends[name] = {**cfg_backends.get(name, {}), **params}
        with _nixl_errors():
            inst = self.agent.backend(name)
        stale = {k: v for k, v in params.items() if inst.params.get(k) != v}
        if stale:
            raise nixlInvalidParamError(f"backend {backend!r} is already running with other parameters: {stale}")
        self.backends[backend] = id(inst)
        self.backend_mems[backend] = _mem_names(cls.mem_types())
        self.backend_options[backend] = {k: _param_str(v) for k, v in inst.params.items()}
        log.info("Backend %s was instantiated", backend)

    def _obj_params(self, init: dict[str, Any]) -> dict[str, Any]:
        """NIXL OBJ parameters in s3's names; the bucket (param or AWS_DEFAULT_BUCKET) stays here."""
        init = dict(init)
        self._obj_bucket = init.pop("bucket", None) or os.environ.get("AWS_DEFAULT_BUCKET")
        endpoint = init.pop("endpoint_override", None) or os.environ.get("AWS_ENDPOINT_OVERRIDE")
        scheme = init.pop("scheme", None)
        if endpoint:
            init["endpoint_override"] = endpoint if "://" in endpoint else f"{scheme or 'https'}://{endpoint}"
        if "use_virtual_addressing" in init:
            virtual = _param_value("use_virtual_addressing", init["use_virtual_addressing"], False)
            init["use_virtual_addressing"] = "virtual" if virtual else "path"
        return {_OBJ_PARAMS.get(k, k): v for k, v in init.items()}

    def _datamover_backends(self, backends: Any) -> list[str]:
        """The datamover backends a transfer may use: the ones asked for, else every one created.

        ``memcpy`` is always allowed for local DRAM -> DRAM moves, which NIXL's UCX does itself.
        """
        if isinstance(backends, (list, tuple)) and backends:
            missing = [b for b in backends if b not in self.backends]
            if missing:
                raise nixlNotFoundError(f"backend(s) {missing} were not created; created: {list(self.backends)}")
            return list(dict.fromkeys(datamover_backend_name(b) for b in backends))
        return list(dict.fromkeys(["memcpy", *(datamover_backend_name(b) for b in self.backends)]))

    # -- descriptors ------------------------------------------------------------
    def get_xfer_descs(self, descs: Any, mem_type: str | None = None, **_legacy: Any) -> nixlXferDList:
        """A nixlXferDList from (addr, len, devId) tuples or an (N, 3) array with ``mem_type``,
        a tensor or a list of tensors on one device, or a nixlXferDList (returned as is)."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError("RegList type detected for transfer, please use XferList (.trim())")
        return nixlXferDList._wrap(_build_descs(descs, mem_type, 3)[0])

    def get_reg_descs(self, descs: Any, mem_type: str | None = None, **_legacy: Any) -> nixlRegDList:
        """A nixlRegDList from (addr, len, devId[, metaInfo]) tuples or an (N, 3) array with ``mem_type``,
        a tensor or a list of tensors on one device, or a nixlRegDList (returned as is)."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError("XferList type detected for registration, please use RegList")
        dl, meta = _build_descs(descs, mem_type, 4)
        return nixlRegDList._wrap(dl, meta)

    def get_serialized_descs(self, descs: nixlXferDList | nixlRegDList) -> bytes:
        """Serialize a descriptor list with msgpack (NIXL uses pickle; a peer's bytes must not run code)."""
        return serialize_dlist(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> nixlXferDList | nixlRegDList:
        """The list ``get_serialized_descs`` packed; hostile or corrupt bytes raise nixlInvalidParamError."""
        return deserialize_dlist(serialized_descs)

    # -- memory -----------------------------------------------------------------
    def register_memory(self, reg_list: Any, mem_type: str | None = None, backends: list[str] = []) -> nixlRegDList:  # noqa: B006
        """Register memory (or files, by descriptor) and return the nixlRegDList registered.

        ``backends`` is accepted for compatibility: datamover registers with
        every backend that handles the memory type.
        """
        reg = self.get_reg_descs(reg_list, mem_type)
        mem = reg.descs.mem_type
        if mem == MemType.OBJ:
            self._register_objects(reg)
            return reg
        if mem == MemType.FILE:
            self._register_files(reg)
            return reg
        made: list[Registration] = []
        try:
            with _nixl_errors():
                for i, (addr, length, dev) in enumerate(reg.descs):
                    key = (mem, addr, length, dev)
                    if key in self._regs:
                        raise InvalidDescriptor(f"[{addr:#x}, +{length}) on dev {dev} is already registered", index=i)
                    r = self.agent.register_memory(reg.descs[i : i + 1])
                    made.append(r)  # type: ignore[arg-type]
                    self._regs[key] = r  # type: ignore[assignment]
        except BaseException:
            for r in made:
                self._regs.pop((r.mem_type, r.addr, r.length, r.dev), None)
            self.agent.deregister_memory(made)
            raise
        return reg

    def _register_files(self, reg: nixlRegDList) -> None:
        """FILE rows are (offset, len, fd, metaInfo): register each fd's file up to its furthest row."""
        d = reg.descs
        ends: dict[int, int] = {}
        for off, length, fd in d:
            ends[fd] = max(ends.get(fd, 0), off + length)
        for fd in ends:
            if fd in self._files:
                raise nixlInvalidParamError(f"file descriptor {fd} is already registered")
        made: list[tuple[int, Registration]] = []
        try:
            for fd, end in ends.items():
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                    direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
                except OSError as exc:
                    raise nixlInvalidParamError(f"file descriptor {fd} is not open: {exc.strerror}") from None
                with _nixl_errors():
                    r = self.agent.register_file(path, size=end, direct=direct, create=False)
                made.append((fd, r))
                self._files[fd] = r
        except BaseException:
            for fd, r in made:
                self._files.pop(fd, None)
                self.agent.deregister_memory(r)
            raise
        for off, length, fd in d:
            self._regs[(MemType.FILE, off, length, fd)] = self._files[fd]

    def _register_objects(self, reg: nixlRegDList) -> None:
        """OBJ rows are (offset, len, devId, key): devId names the object metaInfo gives (else str(devId))."""
        bucket = self._obj_bucket or os.environ.get("AWS_DEFAULT_BUCKET")
        if not bucket:
            raise nixlInvalidParamError("OBJ registration needs a bucket: create_backend('OBJ', {'bucket': ...})")
        keys: dict[int, str] = {}
        for (_, _, dev), meta in zip(reg.descs, reg.meta):
            key = os.fsdecode(meta) if meta else str(dev)
            if keys.get(dev, key) != key or (dev in self._obj_keys and self._obj_keys[dev] != key):
                raise nixlInvalidParamError(f"devId {dev} names two objects")
            keys[dev] = key
        with _nixl_errors():
            r = self.agent.register_objects(bucket, keys=list(dict.fromkeys(keys.values())))
        self._obj_keys.update(keys)
        for a, n, d in reg.descs:
            self._regs[(MemType.OBJ, a, n, d)] = r

    def deregister_memory(self, dereg_list: nixlRegDList, backends: list[str] = []) -> None:  # noqa: B006
        """Deregister what ``register_memory`` registered (the same descriptors, in any list).

        A file or an object registration made by one call goes as a whole.
        """
        reg = self.get_reg_descs(dereg_list)
        mem = reg.descs.mem_type
        keys = [(mem, a, n, d) for a, n, d in reg.descs]
        missing = [k for k in keys if k not in self._regs]
        if missing:
            _, a, n, d = missing[0]
            raise nixlNotFoundError(f"{mem} descriptor ({a:#x}, {n}, {d}) was not registered through this agent")
        regs = list({id(self._regs[k]): self._regs[k] for k in keys}.values())
        for k, r in list(self._regs.items()):
            if any(r is x for x in regs):
                del self._regs[k]
                if k[0] == MemType.OBJ:
                    self._obj_keys.pop(k[3], None)
        for fd, r in list(self._files.items()):
            if any(r is x for x in regs):
                del self._files[fd]
        with _nixl_errors():
            self.agent.deregister_memory(regs)

    def query_memory(self, reg_list: Any, backend: str, mem_type: str | None = None) -> list[dict[str, str] | None]:
        """For FILE descriptors, each file's size, mode and mtime by the path in metaInfo (None if absent)."""
        reg = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        if reg.descs.mem_type != MemType.FILE:
            raise nixlNotSupportedError(f"query_memory supports FILE descriptors only, got {reg.descs.mem_type}")
        out: list[dict[str, str] | None] = []
        for meta in reg.meta:
            try:
                st = os.stat(os.fsdecode(meta))
            except (OSError, ValueError):
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": oct(st.st_mode), "mtime": str(int(st.st_mtime))})
        return out

    # -- transfers --------------------------------------------------------------
    def _own_side(self, descs: DescList) -> DescList:
        """Descriptors of this agent in datamover's form: FILE rows carry the file's id, not the caller's fd,
        and OBJ rows index the list's own key table instead of naming a devId."""
        if descs.mem_type == MemType.OBJ and len(descs):
            devs, inverse = np.unique(descs.dev, return_inverse=True)
            missing = [int(d) for d in devs.tolist() if int(d) not in self._obj_keys]
            if missing:
                i = int(np.flatnonzero(descs.dev == missing[0])[0])
                raise nixlNotFoundError(f"descriptor {i}: object devId {missing[0]} is not registered")
            keys = [self._obj_keys[int(d)] for d in devs.tolist()]
            return DescList.from_columns(descs.addr, descs.length, inverse.reshape(-1), MemType.OBJ, keys=keys)
        if descs.mem_type != MemType.FILE or len(descs) == 0:
            return descs
        fds = np.fromiter(self._files.keys(), dtype=np.int64, count=len(self._files))
        ids = np.fromiter((r.dev for r in self._files.values()), dtype=np.int64, count=len(self._files))
        order = np.argsort(fds)
        fds, ids = fds[order], ids[order]
        pos = np.searchsorted(fds, descs.dev)
        ok = pos < fds.shape[0]
        ok[ok] = fds[pos[ok]] == descs.dev[ok]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise nixlNotFoundError(f"descriptor {i}: file descriptor {int(descs.dev[i])} is not registered")
        return DescList.from_columns(descs.addr, descs.length, ids[pos], MemType.FILE)

    def _peer(self, agent_name: str | bytes) -> str | None:
        """None for this agent (loopback), else the remote agent's name."""
        name = _as_name(agent_name)
        return None if name in ("", NIXL_INIT_AGENT, self.name) else name

    def _prepare(self, descs: Any, peer: str | None, mem_type: str | None = None) -> Prepared:
        """Validate descriptors; a peer's that its loaded metadata does not cover trigger one refetch
        from where that metadata came (its listener or etcd), since it may have registered them since."""
        dl = self.get_xfer_descs(descs, mem_type).descs
        if peer is None:
            with _nixl_errors():
                return self.agent.prepare(self._own_side(dl))
        try:
            with _nixl_errors():
                return self.agent.prepare(dl, peer)
        except NotRegistered:
            if peer not in self.agent.remotes:
                raise
            try:
                with _nixl_errors():
                    self.agent.refresh_remote(peer)
            except KeyError:  # metadata handed over as bytes: nowhere to refetch it from
                pass
        with _nixl_errors():
            return self.agent.prepare(dl, peer)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_xfer_handle:
        """Make (not post) a transfer between two descriptor lists; ``remote_agent`` may be this agent."""
        op = _op(operation)
        dm_backends = self._datamover_backends(backends)
        lp = self._prepare(local_descs, None)
        rp = self._prepare(remote_descs, self._peer(remote_agent))
        notify = _as_bytes(notif_msg)
        with _nixl_errors():
            xfer = self.agent.make_transfer(op, lp, None, rp, None, notify=notify, backends=dm_backends)
        return nixl_xfer_handle(xfer, (self.agent, op, lp, None, rp, None, dm_backends), notify)

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_prepped_dlist_handle:
        """Validate a descriptor list once: ``"NIXL_INIT_AGENT"`` (or "") for the local side,
        this agent's name for a loopback remote side, a peer's name for its memory.

        An (N, 5) array (addr, len, devId, stride, count) is expanded to
        ``count`` blocks per row, ``stride`` bytes apart.
        """
        self._datamover_backends(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            xfer_list = _expand_strided(xfer_list)
        name = _as_name(agent_name)
        local = name in ("", NIXL_INIT_AGENT)
        return nixl_prepped_dlist_handle(self, self._prepare(xfer_list, self._peer(name), mem_type), local)

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: list[int] | np.ndarray,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: list[int] | np.ndarray,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """Make a transfer from index lists (or 1-D int arrays) into two prepared lists."""
        op = _op(operation)
        dm_backends = self._datamover_backends(backends)
        lp, rp = local_xfer_side._live(), remote_xfer_side._live()
        li, ri = np.asarray(local_indices), np.asarray(remote_indices)
        notify = _as_bytes(notif_msg)
        with _nixl_errors():
            xfer = self.agent.make_transfer(op, lp, li, rp, ri, notify=notify, backends=dm_backends)
        return nixl_xfer_handle(xfer, (self.agent, op, lp, li, rp, ri, dm_backends), notify)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer; returns "DONE" when it already finished, "PROC" while in flight, "ERR" on failure.

        A non-empty ``notif_msg`` replaces the handle's notification from this post on.
        """
        xfer = handle._live()
        if xfer.state == XferState.PROC:
            raise nixlRepostActiveError("the transfer is still in flight; wait for DONE before posting it again")
        if notif_msg and _as_bytes(notif_msg) != handle._notify:
            handle._renotify(_as_bytes(notif_msg))
        with _nixl_errors():
            handle.xfer.post()
        return _state(handle.xfer)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """ "DONE", "PROC" or "ERR" (the cause is ``handle.error``); nixlNotPostedError before ``transfer``."""
        return _state(handle._live())

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """NIXL name of the backend the transfer runs on."""
        name = handle._live().backend.name
        return next((b for b in self.backends if datamover_backend_name(b) == name), nixl_plugin_names(name)[0])

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Times (us), bytes and merged descriptor count of the last post.

        Raises nixlNoTelemetryError unless ``capture_telemetry`` (or
        NIXL_TELEMETRY_ENABLE) is set, or when the transfer was never posted.
        """
        xfer = handle._live()
        if not self.capture_telemetry:
            raise nixlNoTelemetryError("telemetry is off; set capture_telemetry=True in nixl_agent_config")
        if xfer.state == XferState.INIT:
            raise nixlNoTelemetryError("the transfer was never posted")
        t = xfer.telemetry
        return nixlXferTelemetry(
            startTime=int(t.start_time * 1e6),
            postDuration=int(t.post_duration_s * 1e6),
            xferDuration=int((t.transfer_duration_s or 0.0) * 1e6),
            totalBytes=int(t.bytes),
            descCount=int(t.rows),
        )

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Free a transfer handle, aborting it if in flight."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        """Free a prepared descriptor list handle."""
        handle.release()

    # -- notifications ------------------------------------------------------------
    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """Notifications received since the last call, by sender name."""
        return self.agent.get_notifications()

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """Add new notifications to ``self.notifs`` and return it."""
        for sender, msgs in self.agent.get_notifications().items():
            self.notifs.setdefault(sender, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: list[str] = [],  # noqa: B006
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from ``remote_agent_name`` starts with (or contains) ``lookup_tag``;
        the one found is removed."""
        self.update_notifs(backends)
        tag = _as_bytes(lookup_tag)
        msgs = self.notifs.get(_as_name(remote_agent_name), [])
        for k, msg in enumerate(msgs):
            if msg.startswith(tag) if tag_is_prefix else tag in msg:
                del msgs[k]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        """Send a notification without data to a peer (or to this agent)."""
        if backend is not None and backend not in self.backends:
            raise nixlNotFoundError(f"backend {backend!r} was not created")
        with _nixl_errors():
            self.agent.send_notification(_as_name(remote_agent_name), _as_bytes(notif_msg))

    # -- metadata -----------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """This agent's metadata blob, for ``add_remote_agent`` on a peer."""
        with _nixl_errors():
            return self.agent.metadata()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns its name as bytes, as NIXL's binding does."""
        with _nixl_errors():
            return self.agent.add_remote(metadata).encode()

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a peer and disconnect from it."""
        try:
            with _nixl_errors():
                self.agent.remove_remote(_as_name(agent))
        except KeyError as exc:
            raise nixlNotFoundError(str(exc.args[0]) if exc.args else str(exc)) from exc

    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:  # noqa: B006
        """Check that ``remote_agent`` is loaded (nixlNotFoundError otherwise).

        datamover backends connect on the first transfer to a peer, so there is
        nothing to do ahead of it; NIXL documents this call as optional.
        """
        self._datamover_backends(backends)
        name = _as_name(remote_agent)
        if name not in self.agent.remotes:
            raise nixlNotFoundError(f"unknown remote agent {name!r}; load its metadata first")

    def check_remote_metadata(self, agent: str, descs: nixlXferDList | None = None) -> bool:
        """Whether the peer's metadata is loaded (and, with ``descs``, covers those descriptors)."""
        name = _as_name(agent)
        if name not in self.agent.remotes:
            return False
        if descs is None or len(descs.descs) == 0:
            return True
        try:
            self.agent.prepare(descs.descs, name)
        except DatamoverError:
            return False
        return True

    # -- metadata exchange: side channel and etcd ---------------------------------
    @property
    def listen_port(self) -> int | None:
        """The port this agent serves its metadata on (``enable_listen_thread``), e.g. when 0 was asked."""
        addr = self.agent.listen_address
        return None if addr is None else int(addr[1])

    def _etcd(self) -> tuple[list[str], str]:
        """Endpoints and namespace from NIXL_ETCD_ENDPOINTS / NIXL_ETCD_NAMESPACE, as NIXL reads them."""
        endpoints = [e.strip() for e in re.split(r"[,;]", os.environ.get("NIXL_ETCD_ENDPOINTS", "")) if e.strip()]
        if not endpoints:
            raise nixlInvalidParamError("no peer address given and NIXL_ETCD_ENDPOINTS is not set")
        namespace = os.environ.get("NIXL_ETCD_NAMESPACE", ETCD_NAMESPACE_DEFAULT).strip("/") or "nixl"
        return endpoints, namespace

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Push this agent's metadata to a peer's listener (``ip_addr``, ``port``), or publish it to etcd."""
        if ip_addr:
            with _nixl_errors():
                self.agent.send_metadata(ip_addr, int(port))
            return
        endpoints, namespace = self._etcd()
        with _nixl_errors():
            self.agent.publish(endpoints, namespace)

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Load a peer's metadata from its listener (``ip_addr``, ``port``) or, without an address, from etcd.

        Synchronous: when it returns, ``check_remote_metadata(remote_agent)`` is
        True. A listener not up yet (or an agent not yet in etcd) is waited for
        up to ``FETCH_RETRY_S`` (10 s); a peer whose metadata names another
        agent raises nixlMismatchError.
        """
        if label:
            raise nixlNotSupportedError("labelled (partial) metadata is not supported")
        name = _as_name(remote_agent)
        if not ip_addr:
            endpoints, namespace = self._etcd()
            with _nixl_errors():
                self.agent.fetch_remote(name, etcd=endpoints, namespace=namespace, timeout=max(FETCH_RETRY_S, 0.1))
            return
        deadline = time.monotonic() + FETCH_RETRY_S
        while True:
            try:
                with _nixl_errors():
                    got = self.agent.fetch_remote(ip_addr, int(port))
                break
            except RemoteDisconnected:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if got != name:
            self.agent.remove_remote(got)
            raise nixlMismatchError(f"{ip_addr}:{port} serves the metadata of {got!r}, not {name!r}")

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Tell the peer listening at (``ip_addr``, ``port``) to drop this agent, or withdraw it from etcd."""
        if ip_addr:
            with _nixl_errors():
                self.agent.invalidate_at(ip_addr, int(port))
            return
        self._etcd()
        with _nixl_errors():
            self.agent.unpublish()

    # -- lifetime -----------------------------------------------------------------
    def close(self) -> None:
        """Stop the agent's backends and drop its registrations (NIXL does this on destruction)."""
        self.agent.close()
        self._regs.clear()
        self._files.clear()

    def __enter__(self) -> nixl_agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"nixl_agent({self.name!r}, backends={list(self.backends)})"


# -- helpers ---------------------------------------------------------------------


def _op(operation: str) -> str:
    op = str(operation).upper()
    if op not in ("WRITE", "READ"):
        raise nixlInvalidParamError(f"operation must be 'WRITE' or 'READ', got {operation!r}")
    return op


def _state(xfer: Transfer) -> str:
    state = xfer.state
    if state == XferState.INIT:
        raise nixlNotPostedError("the transfer was never posted; call transfer() first")
    if state == XferState.RELEASED:
        raise nixlNotAllowedError("the transfer was released")
    return state.value


def _mem_names(mems: frozenset[MemType]) -> list[str]:
    return [m.value for m in MemType if m in mems]


def _expand_strided(arr: np.ndarray) -> np.ndarray:
    """(addr, len, devId, stride, count) rows -> (addr + k*stride, len, devId) for k < count."""
    if arr.dtype.kind not in "iu":
        raise nixlInvalidParamError(f"strided descriptors must be integers, got dtype {arr.dtype}")
    a = arr.astype(np.int64)
    counts = a[:, 4]
    if (counts < 0).any() or (a[:, 3] < 0).any():
        raise nixlInvalidParamError("strided descriptors need non-negative stride and count")
    rep = np.repeat(np.arange(a.shape[0]), counts)
    k = np.arange(rep.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((rep.shape[0], 3), dtype=np.int64)
    out[:, 0] = a[rep, 0] + k * a[rep, 3]
    out[:, 1] = a[rep, 1]
    out[:, 2] = a[rep, 2]
    return out


def _build_descs(descs: Any, mem_type: str | None, width: int) -> tuple[DescList, tuple[bytes, ...] | None]:
    """DescList (and metaInfo for registration lists) from any input NIXL's get_*_descs accepts."""
    if isinstance(descs, DescList):
        return descs, None
    if _is_torch_tensor(descs) or (
        isinstance(descs, (list, tuple)) and descs and all(_is_torch_tensor(t) for t in descs)
    ):
        tensors = [descs] if _is_torch_tensor(descs) else list(descs)
        if len({t.device for t in tensors}) > 1:
            raise nixlInvalidParamError("a list of tensors must be on one device")
        with _nixl_errors():
            return DescList.from_buffers(tensors), None
    if mem_type is None:
        raise nixlInvalidParamError("Please specify a mem type if not using Tensors")
    mem = _mem_type(mem_type)
    meta: tuple[bytes, ...] | None = None
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(f"Nx3 shape required for a descriptor array, got {descs.shape}")
        rows = descs
    elif isinstance(descs, (list, tuple)):
        if width == 4 and descs and isinstance(descs[0], tuple) and len(descs[0]) == 4:
            rows = _tuple_rows(list(descs), 4)
            meta = tuple(_as_bytes(d[3]) for d in descs)
        else:
            rows = _tuple_rows(list(descs), 3)
    else:
        raise nixlInvalidParamError(f"cannot make descriptors from a {type(descs).__name__}")
    with _nixl_errors():
        return DescList(rows, mem), meta


__all__ = [
    "BLK_SEG",
    "DEFAULT_COMM_PORT",
    "DRAM_SEG",
    "FILE_SEG",
    "NIXL_INIT_AGENT",
    "NIXL_TO_DATAMOVER",
    "OBJ_SEG",
    "VRAM_SEG",
    "NixlError",
    "datamover_backend_name",
    "deserialize_dlist",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_mem_t",
    "nixl_plugin_names",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "serialize_dlist",
]
