"""``nixlAgent`` and ``nixlAgentConfig``: NIXL's binding-level agent over datamover's ``Agent``.

Same methods, arguments and return values as NIXL's pybind11 ``nixlAgent``
(integer handles for backends, prepared lists and requests; status codes;
``nixl*Error`` raised for bad input). Every byte is moved by the datamover
Agent (``self.agent``) and its backends.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import weakref
from typing import Any

from ...agents import Agent, AgentConfig, Registration
from ...backends import backend_names, backend_status
from ...descriptors import MemType
from ._backends import BackendsMixin
from ._memory import MemoryMixin
from ._metadata import MetadataMixin
from ._telemetry import NixlEvents, telemetry_enabled
from ._types import DEFAULT_COMM_PORT, nixl_plugin_names, nixl_thread_sync_t
from ._worker import MetadataWorker
from ._xfer import XferMixin

log = logging.getLogger("datamover.compat.nixl")
_live: weakref.WeakSet[nixlAgent] = weakref.WeakSet()


class nixlAgentConfig:
    """NIXL's binding config; ``useProgThread``, ``syncMode`` and the delays are kept but change nothing
    (datamover backends progress on their own threads and the Agent is thread-safe)."""

    def __init__(
        self,
        useProgThread: bool = True,
        useListenThread: bool = False,
        listenPort: int = DEFAULT_COMM_PORT,
        syncMode: int = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT,
        captureTelemetry: bool = False,
    ) -> None:
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.captureTelemetry = captureTelemetry

    def __repr__(self) -> str:
        return f"nixlAgentConfig({vars(self)})"


class nixlAgent(BackendsMixin, MemoryMixin, XferMixin, MetadataMixin):
    """A NIXL agent: backends, registrations, transfers and metadata through integer handles."""

    def __init__(self, name: str, config: nixlAgentConfig | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty string")
        self.config = config or nixlAgentConfig()
        self.name = name
        usable = [n for n in backend_names() if backend_status(n)[0]]
        self._plugins = [p for n in usable for p in nixl_plugin_names(n)]
        listen = int(self.config.listenPort) if self.config.useListenThread else None
        self.agent = Agent(name, AgentConfig(backends={n: {} for n in usable}, listen_port=listen))
        self._ids = itertools.count(1)
        self._handles: dict[int, Any] = {}
        self._handle_of: dict[str, int] = {}
        self._backend_of: dict[int, str] = {}
        self._backend_info: dict[str, tuple[dict[str, str], list[str]]] = {}
        self._regs: dict[tuple[MemType, int, int, int], Registration | None] = {}
        self._region_refs: dict[tuple[MemType, int, int, int], int] = {}
        self._core_refs: dict[int, int] = {}
        self._files: dict[int, Registration] = {}
        self._obj_keys: dict[int, str] = {}
        self._obj_bucket: str | None = None
        self._labels: dict[str, Any] = {}
        self._reached: set[tuple[str, int]] = set()  # metadata listeners reached once (see _reaching)
        self._cost: dict[str, tuple[float, float]] = {}
        self._telemetry_on = telemetry_enabled(bool(self.config.captureTelemetry))
        try:
            self._events = NixlEvents(name, self._telemetry_on)
        except BaseException:
            self.agent.close()
            raise
        self._worker = MetadataWorker(name)
        self._closed = False
        _live.add(self)

    def _new_handle(self, obj: Any) -> int:
        h = next(self._ids)
        self._handles[h] = obj
        return h

    @property
    def listen_port(self) -> int | None:
        """The port this agent serves its metadata on (useful when 0 was asked)."""
        addr = self.agent.listen_address
        return None if addr is None else int(addr[1])

    @property
    def events(self) -> NixlEvents:
        """This agent's NIXL telemetry events (counters, and the Prometheus collector under NIXL's names)."""
        return self._events

    def close(self) -> None:
        """Run the queued metadata jobs (bounded), then stop backends and drop registrations."""
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        for h, obj in list(self._handles.items()):
            xfer = getattr(obj, "xfer", None)
            if xfer is not None:
                try:
                    xfer.release()
                except Exception as exc:
                    log.debug("releasing request %d at close: %s", h, exc)
        self._handles.clear()
        self.agent.close()
        self._events.close()
        self._regs.clear()
        self._region_refs.clear()
        self._core_refs.clear()
        self._files.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown: nothing left to tell
            pass

    def __repr__(self) -> str:
        return f"nixlAgent({self.name!r}, backends={list(self._handle_of)})"


@atexit.register
def _close_all() -> None:
    """At exit, every agent still alive runs its queued invalidations (bounded) and stops, as NIXL's destructor."""
    for agent in list(_live):
        try:
            agent.close()
        except Exception as exc:
            log.debug("closing %r at exit: %s", agent, exc)
