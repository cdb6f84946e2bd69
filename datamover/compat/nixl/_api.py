"""NIXL's Python API (``nixl._api``): ``nixl_agent``, ``nixl_agent_config`` and the handle types.

Same calls, arguments, defaults, return values and errors as NIXL 1.5.1's
``_api.py``, over the binding-level ``nixlAgent`` (``self.agent``) that this
package's ``_bindings`` provides on datamover. Where datamover is stricter on
purpose, it is so in its own API (``datamover.agents``), not here.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np

from . import _bindings as nixlBind
from ._descs import NIXL_MEMS, build, build_remote, seg
from .logging import get_logger

logger = get_logger(__name__)
DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT
#: Opaque backend handle: NIXL's is an int too.
nixl_backend_handle = int
_STATES = {nixlBind.NIXL_SUCCESS: "DONE", nixlBind.NIXL_IN_PROG: "PROC"}


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from ``prep_xfer_dlist``); ``release()`` frees it."""

    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True

    def __del__(self) -> None:
        """Release on garbage collection, as NIXL's handle does (a dropped list would stay in the agent)."""
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request (from ``initialize_xfer`` or ``make_prepped_xfer``); ``release()`` frees it."""

    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    @property
    def xfer(self) -> Any:
        """The datamover Transfer behind the request."""
        return self._agent.xfer_of(self._handle)

    @property
    def error(self) -> BaseException | None:
        """Why the transfer is in ERR (None otherwise): what NIXL only writes to its log."""
        return self.xfer.error

    def release(self) -> None:
        """Free the request, aborting it (and waiting for the abort) when in flight."""
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"


class nixl_thread_sync_t(Enum):
    """Thread synchronization modes (datamover's Agent is thread-safe in all of them)."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """NIXL's agent configuration; same arguments, order and defaults.

    ``enable_listen_thread`` serves this agent's metadata on ``listen_port``
    (0: any free port, see ``nixl_agent.listen_port``); ``num_threads`` becomes
    each backend's thread count; ``enable_prog_thread`` and ``sync_mode`` are
    kept and change nothing.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],  # noqa: B006 - NIXL's default
        sync_mode: nixl_thread_sync_t | None = None,
    ) -> None:
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.sync_mode = sync_mode


_THREAD_PARAM = {"UCX": "num_threads", "OBJ": "num_threads", "LIBFABRIC": "num_threads", "GDS_MT": "thread_count",
                 "UCCL": "num_cpus"}  # fmt: skip


class nixl_agent:
    """NIXL's agent: ``self.agent`` is the binding-level nixlAgent, ``self.datamover`` the datamover Agent."""

    def __init__(self, agent_name: str, nixl_conf: nixl_agent_config | None = None, instantiate_all: bool = False):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if nixl_conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = nixl_conf.enable_pthread
        cfg.useListenThread = nixl_conf.enable_listen
        cfg.listenPort = nixl_conf.port
        cfg.syncMode = (nixl_conf.sync_mode or default_sync).value
        cfg.captureTelemetry = nixl_conf.capture_telemetry
        self.agent = nixlBind.nixlAgent(agent_name, cfg)
        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        if not self.plugin_list:
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        self.nixl_mems = dict(NIXL_MEMS)
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        try:
            for bknd in self.plugin_list if instantiate_all else nixl_conf.backends:
                if bknd not in self.plugin_list:
                    logger.warning("Skipping backend registration %s due to the missing plugin.", bknd)
                    continue
                init = {}
                if nixl_conf.num_threads > 0 and bknd in _THREAD_PARAM:
                    init[_THREAD_PARAM[bknd]] = str(nixl_conf.num_threads)
                self.create_backend(bknd, init)
        except BaseException:
            self.agent.close()
            raise
        logger.info("Initialized NIXL agent: %s", agent_name)

    # -- datamover's additions ----------------------------------------------------
    @property
    def datamover(self) -> Any:
        """The datamover Agent that moves this agent's bytes."""
        return self.agent.agent

    @property
    def listen_port(self) -> int | None:
        """The port this agent serves its metadata on (``enable_listen_thread``), e.g. when 0 was asked."""
        return self.agent.listen_port

    @property
    def capture_telemetry(self) -> bool:
        return self.agent._telemetry_on

    def close(self) -> None:
        """Run queued metadata jobs (bounded), stop backends, drop registrations (NIXL does this on destruction)."""
        self.agent.close()

    def __enter__(self) -> nixl_agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"nixl_agent({self.name!r}, backends={list(self.backends)})"

    # -- plugins and backends ---------------------------------------------------------
    def _load_plugin_params(self, plugin: str) -> None:
        if plugin not in self.plugin_list:
            return
        try:
            self.plugin_b_options[plugin], self.plugin_mem_types[plugin] = self.agent.getPluginParams(plugin)
        except Exception:
            logger.warning("Failed to load params for plugin %s", plugin, exc_info=True)

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006
        """Start a backend by its NIXL name with NIXL-style string parameters."""
        self.backends[backend] = self.agent.createBackend(backend, initParams)
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(self.backends[backend])
        logger.info("Backend %s was instantiated", backend)

    def _handles(self, backends: Any) -> list[int]:
        return [self.backends[b] for b in backends or []]

    # -- memory -----------------------------------------------------------------
    def register_memory(self, reg_list: Any, mem_type: str | None = None, backends: list[str] = []) -> Any:  # noqa: B006
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        self.agent.registerMem(reg_descs, self._handles(backends))
        return reg_descs

    def deregister_memory(self, dereg_list: Any, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: str | None = None) -> list[dict[str, str] | None]:
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        return self.agent.queryMem(reg_descs, self.backends[backend])

    # -- transfers ----------------------------------------------------------------
    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.makeConnection(remote_agent, self._handles(backends))

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_prepped_dlist_handle:
        """Validate a list once for ``make_prepped_xfer``: ``"NIXL_INIT_AGENT"`` (or "") for the local side, this
        agent's name for a loopback remote side, a peer's name for its memory. An Nx5 array (addr, len, devId,
        stride, count) is a strided list: ``count`` blocks of ``len`` bytes, ``stride`` apart, per row."""
        if agent_name in ("", "NIXL_INIT_AGENT"):
            agent_name = nixlBind.NIXL_INIT_AGENT
        handles = self._handles(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            handle = self.agent.prepXferDlist(agent_name, seg(mem_type), xfer_list, handles)
        else:
            handle = self.agent.prepXferDlist(agent_name, self.get_xfer_descs(xfer_list, mem_type), handles)
        return nixl_prepped_dlist_handle(self.agent, handle)

    def get_strided_xfer_descs(self, descs: Any, mem_type: str) -> np.ndarray:
        """An Nx5 (addr, len, devId, stride, count) array for ``prep_xfer_dlist``, from tuples or an array."""
        arr = np.asarray(descs, dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 5:
            raise ValueError(f"strided descriptors need 5 fields (addr, len, devId, stride, count), got {arr.shape}")
        seg(mem_type)
        return arr

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """(duration us, error margin us, method): "ANALYTICAL_BACKEND" (here from this agent's past transfers on
        that backend) or "UNKNOWN" (0, 0) before any, the only two NIXL's _api answers."""
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        return duration, margin, "ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND else "UNKNOWN"

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
        op = self.nixl_ops[operation]
        handle = self.agent.makeXferReq(
            op, local_xfer_side._handle, local_indices, remote_xfer_side._handle, remote_indices,
            notif_msg, self._handles(backends), skip_desc_merge,
        )  # fmt: skip
        return nixl_xfer_handle(self.agent, handle)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        handles = self._handles(backends)
        handle = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg, handles)
        return nixl_xfer_handle(self.agent, handle)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer: "DONE" when it already finished, "PROC" in flight. A failure raises its nixl*Error
        (as NIXL's binding does, so its "ERR" is never returned): a refused post leaves the handle as it was."""
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """ "DONE" or "PROC"; a failed transfer raises its nixl*Error (nixlBackendError for I/O failures, ...)."""
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The name (a key of ``self.backends``) of the backend chosen for the transfer."""
        b_handle = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == b_handle)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: list[str] | None = None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # -- notifications --------------------------------------------------------------
    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: list[str] = [],  # noqa: B006
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from the peer starts with (or contains) ``lookup_tag``; that one is removed."""
        self.update_notifs(backends)
        msgs = self.notifs.get(remote_agent_name, [])
        for k, msg in enumerate(msgs):
            if (tag_is_prefix and msg.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in msg):
                del msgs[k]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self.backends[backend])

    # -- metadata --------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: list[str] = []) -> bytes:  # noqa: B006
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: list[str] = [],  # noqa: B006
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # -- descriptor lists ----------------------------------------------------------
    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        """A nixlXferDList from (addr, len, devId) tuples or an Nx3 array with ``mem_type``, a contiguous
        tensor or list of them, or a nixlXferDList; None (logged) or an error where NIXL gives one (see _descs)."""
        return build(nixlBind.nixlXferDList, descs, mem_type, 3, self.nixl_mems)

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        """A nixlRegDList from (addr, len, devId, metaInfo) tuples or an Nx3 array with ``mem_type``, a contiguous
        tensor or list of them, or a nixlRegDList; None (logged) or an error where NIXL gives one (see _descs)."""
        return build(nixlBind.nixlRegDList, descs, mem_type, 4, self.nixl_mems)

    def get_remote_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        return build_remote(descs, mem_type, self.nixl_mems)

    def get_serialized_descs(self, descs: Any) -> bytes:
        """Pickle a descriptor list, as NIXL does."""
        return nixlBind.serialize_dlist(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """Unpickle a list; a blob naming anything but NIXL's list classes is refused (nixlInvalidParamError)."""
        return nixlBind.deserialize_dlist(serialized_descs)
