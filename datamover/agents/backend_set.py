"""The backends one agent runs: which are enabled, starting each on first use, and which moves what."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from ..backends import backend_names, backend_status, get_backend_class
from ..backends.base import Backend, BackendHost
from ..descriptors import MemType
from ..errors import BackendUnavailable, UnsupportedTransfer
from .config import AgentConfig

log = logging.getLogger("datamover.agent")


class BackendSet:
    """An agent's backends, started lazily; ``running`` maps name -> instance.

    A backend is made with the agent's ``BackendHost`` (``host``) and, when it
    starts, registers every region of the host it can serve. The backend that
    moves a pair of memory types is remembered per (types, remote?, names asked for).
    """

    def __init__(self, host: BackendHost, config: AgentConfig, lock: threading.RLock) -> None:
        self._host = host
        self._config = config
        self._lock = lock
        self._enabled: list[str] | None = None
        self.running: dict[str, Backend] = {}
        # (local, remote, to a peer, backends asked for) -> the backend that moves it
        self._chosen: dict[tuple, Backend] = {}

    def enabled(self) -> list[str]:
        """Backend names the agent may use, in preference order."""
        if self._enabled is None:
            if self._config.backends is not None:
                self._enabled = list(self._config.backends)
            else:
                self._enabled = [n for n in backend_names() if backend_status(n)[0]]
        return self._enabled

    def usable(self, name: str) -> bool:
        """Whether ``name`` is enabled and its dependencies load here."""
        return name in self.enabled() and backend_status(name)[0]

    def get(self, name: str) -> Backend:
        """The running instance of backend ``name``, started on first use."""
        with self._lock:
            inst = self.running.get(name)
            if inst is not None:
                return inst
            if name not in self.enabled():
                raise BackendUnavailable(f"backend {name!r} is not enabled in this agent's config", backend=name)
            ok, reason = backend_status(name)
            if not ok:
                raise BackendUnavailable(reason, backend=name)
            cls = get_backend_class(name)
            params = (self._config.backends or {}).get(name, {})
            inst = cls(self._host, params)
            done = []
            try:
                for reg in self._host.regions.values():
                    if reg.mem_type in cls.mem_types():
                        reg.handles[name] = inst.register(reg)
                        done.append(reg)
            except BaseException:
                for reg in done:  # what this start registered (a posix file's descriptors) goes with it
                    with contextlib.suppress(Exception):
                        inst.deregister(reg, reg.handles.pop(name))
                inst.close()
                raise
            self.running[name] = inst
            return inst

    def choose(self, local: MemType, remote: MemType, remote_agent: bool, only: Any) -> Backend:
        """The backend that moves ``local`` -> ``remote`` (to a peer or not), among ``only`` if given."""
        key = (local, remote, remote_agent, only if only is None or isinstance(only, str) else tuple(only))
        inst = self._chosen.get(key)
        if inst is None:
            inst = self._chosen[key] = self._pick(local, remote, remote_agent, only)
        return inst

    def _pick(self, local: MemType, remote: MemType, remote_agent: bool, only: Any) -> Backend:
        names = self.enabled() if only is None else ([only] if isinstance(only, str) else list(only))
        unusable = []
        for name in names:
            try:
                cls = get_backend_class(name)
            except Exception as exc:
                unusable.append(f"{name} ({exc})")
                continue
            if not cls.moves(local, remote, remote_agent):
                continue
            ok, reason = backend_status(name)
            if ok:
                return self.get(name)
            unusable.append(f"{name} ({reason})")
        where = "to a remote agent" if remote_agent else "within this agent"
        msg = f"no enabled backend moves {local} -> {remote} {where}; tried {', '.join(names) or 'none'}"
        if unusable:
            msg += "; unusable here: " + "; ".join(unusable)
        raise UnsupportedTransfer(msg)

    def connection_infos(self) -> dict[str, dict[str, Any]]:
        """Each enabled remote-capable backend's connection info (started if need be), for metadata."""
        infos = {}
        for name in self.enabled():
            try:
                cls = get_backend_class(name)
            except Exception:
                continue
            if cls.supports_remote and backend_status(name)[0]:
                infos[name] = self.get(name).connection_info()
        return infos

    def close(self) -> None:
        """Stop every running backend (a failure is logged and the others still close)."""
        for inst in self.running.values():
            try:
                inst.close()
            except Exception as exc:  # closing must go on for the other backends
                log.warning("closing backend %s failed: %s", inst.name, exc)
        self.running.clear()
        self._chosen.clear()
