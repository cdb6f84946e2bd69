"""The binding agent's plugins and backends: NIXL names and string parameters onto datamover backends."""

from __future__ import annotations

import logging
import os
from typing import Any

from ...backends import get_backend_class
from ...descriptors import MemType
from ._errors import nixl_errors, nixlInvalidParamError, nixlNotFoundError
from ._types import datamover_backend_name

log = logging.getLogger("datamover.compat.nixl")

# NIXL init-parameter names that mean "how many worker threads"
_THREAD_PARAMS = ("num_threads", "thread_count", "num_cpus", "num_workers")
# NIXL's OBJ plugin parameters -> datamover s3 parameters ("bucket" is kept by the agent)
_OBJ_PARAMS = {
    "endpoint_override": "endpoint_url",
    "access_key": "access_key_id",
    "secret_key": "secret_access_key",
    "session_token": "session_token",
    "region": "region",
    "use_virtual_addressing": "addressing_style",
    "ca_bundle": "verify_tls",
}
_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")


def mem_names(mems: frozenset[MemType]) -> list[str]:
    """NIXL's names of memory types: "DRAM_SEG", "VRAM_SEG", "FILE_SEG", "OBJ_SEG"."""
    return [f"{m.value}_SEG" for m in MemType if m in mems]


def param_str(value: Any) -> str:
    if value is None:
        return ""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def param_value(key: str, value: Any, default: Any) -> Any:
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


def _threads_param(cls: type) -> str | None:
    """The backend's own name for its thread count."""
    return next((k for k in ("threads", "concurrency") if k in cls.default_params), None)


class BackendsMixin:
    """getAvailPlugins, getPluginParams, createBackend, getBackendParams."""

    agent: Any
    _plugins: list[str]
    _handle_of: dict[str, int]
    _backend_of: dict[int, str]
    _backend_info: dict[str, tuple[dict[str, str], list[str]]]
    _obj_bucket: str | None
    _new_handle: Any

    def getAvailPlugins(self) -> list[str]:
        """NIXL names of the backends usable on this machine."""
        return list(self._plugins)

    def getPluginParams(self, plugin: str) -> tuple[dict[str, str], list[str]]:
        """(parameters with their defaults as strings, memory types) of a plugin; nixlNotFoundError if absent."""
        if plugin not in self._plugins:
            raise nixlNotFoundError(f"plugin {plugin!r} is not available here; available: {self._plugins}")
        cls = get_backend_class(datamover_backend_name(plugin))
        return {k: param_str(v) for k, v in cls.default_params.items()}, mem_names(cls.mem_types())

    def getBackendParams(self, handle: int) -> tuple[dict[str, str], list[str]]:
        """(parameters, memory types) of a created backend."""
        name = self._backend_name(handle)
        return self._backend_info[name]

    def backend_name(self, handle: Any) -> str:
        """The NIXL name of a backend handle."""
        return self._backend_name(handle)

    def _backend_name(self, handle: Any) -> str:
        name = self._backend_of.get(int(handle))
        if name is None:
            raise nixlNotFoundError(f"no backend with handle {handle!r} was created in this agent")
        return name

    def _backend_names(self, handles: Any) -> list[str] | None:
        """datamover backends a call may use from a list of backend handles; None (any) for an empty list."""
        if not handles:
            return None
        return list(dict.fromkeys(datamover_backend_name(self._backend_name(h)) for h in handles))

    def createBackend(self, plugin: str, params: dict[str, str] | None = None) -> int:
        """Start a backend by its NIXL name with NIXL-style string parameters; returns its handle.

        Thread-count parameters (``num_threads``, ``thread_count``, ...) map to
        the backend's ``threads`` (s3: ``concurrency``); parameters the backend
        does not know are logged and ignored, as NIXL plugins do.
        """
        if plugin not in self._plugins:
            raise nixlNotFoundError(f"plugin {plugin!r} is not available here; available: {self._plugins}")
        if plugin in self._handle_of:
            raise nixlInvalidParamError(f"backend {plugin!r} was already created")
        name = datamover_backend_name(plugin)
        cls = get_backend_class(name)
        init = dict(params or {})
        if plugin == "OBJ":
            init = self._obj_params(init)
        conv: dict[str, Any] = {}
        for key, value in init.items():
            target = key if key in cls.default_params else (_threads_param(cls) if key in _THREAD_PARAMS else None)
            if target not in cls.default_params:
                log.debug("backend %s: ignoring parameter %r, which datamover's %s does not take", plugin, key, name)
                continue
            if isinstance(value, str) and value == param_str(cls.default_params[target]):
                continue  # a default handed back (get_plugin_params -> create_backend) changes nothing
            raw = target == "verify_tls" and isinstance(value, str) and value.lower() not in _BOOL_WORDS
            conv[target] = value if raw else param_value(key, value, cls.default_params[target])
        cfg_backends = self.agent.config.backends
        cfg_backends[name] = {**cfg_backends.get(name, {}), **conv}
        with nixl_errors():
            inst = self.agent.backend(name)
        stale = {k: v for k, v in conv.items() if inst.params.get(k) != v}
        if stale:
            raise nixlInvalidParamError(f"backend {plugin!r} is already running with other parameters: {stale}")
        handle = self._new_handle(inst)
        self._handle_of[plugin] = handle
        self._backend_of[handle] = plugin
        self._backend_info[plugin] = (
            {k: param_str(v) for k, v in inst.params.items()},
            mem_names(cls.mem_types()),
        )
        return handle

    def _obj_params(self, init: dict[str, Any]) -> dict[str, Any]:
        """NIXL OBJ parameters in s3's names; the bucket (param or AWS_DEFAULT_BUCKET) stays here."""
        init = dict(init)
        self._obj_bucket = init.pop("bucket", None) or os.environ.get("AWS_DEFAULT_BUCKET")
        endpoint = init.pop("endpoint_override", None) or os.environ.get("AWS_ENDPOINT_OVERRIDE")
        scheme = init.pop("scheme", None)
        if endpoint:
            init["endpoint_override"] = endpoint if "://" in endpoint else f"{scheme or 'https'}://{endpoint}"
        if "use_virtual_addressing" in init:
            virtual = param_value("use_virtual_addressing", init["use_virtual_addressing"], False)
            init["use_virtual_addressing"] = "virtual" if virtual else "path"
        return {_OBJ_PARAMS.get(k, k): v for k, v in init.items()}
