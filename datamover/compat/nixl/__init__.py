"""A drop-in for NIXL's Python package (``nixl``) over ``datamover.agents.Agent``.

Laid out as NIXL's: ``_api`` (``nixl_agent``, ``nixl_agent_config``, handles),
``_bindings`` (the binding-level ``nixlAgent``, descriptor lists, errors,
enums), ``_utils`` (``malloc_passthru``, ...), ``logging`` (``get_logger``), so
every ``from nixl... import`` line maps one to one onto
``from datamover.compat.nixl... import``. To run a NIXL program unchanged:
``datamover nixl-run PROGRAM [ARGS]`` (or ``python -m datamover.compat.nixl``),
which makes ``import nixl`` resolve here inside that process and its Python
children; ``datamover.compat.nixl.alias`` does the same for engine processes.
"""

from __future__ import annotations

from . import _api, _bindings, _utils, logging
from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._bindings import *  # noqa: F403 - NIXL's package exposes every name of its submodules at the top
from ._bindings import __all__ as _binding_names
from ._serial import deserialize_dlist, serialize_dlist
from ._types import NIXL_TO_DATAMOVER, datamover_backend_name, nixl_plugin_names
from ._utils import ba_buf, free_passthru, malloc_passthru, verify_transfer
from .logging import get_logger

# NIXL's package sets _api's names last: its nixl_thread_sync_t (a Python Enum) is the top-level one
nixl_thread_sync_t = _api.nixl_thread_sync_t  # noqa: F811

__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_TO_DATAMOVER",
    "_api",
    "_bindings",
    "_utils",
    "ba_buf",
    "datamover_backend_name",
    "free_passthru",
    "get_logger",
    "malloc_passthru",
    "verify_transfer",
    "deserialize_dlist",
    "logging",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_plugin_names",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "serialize_dlist",
    *(n for n in _binding_names if n not in ("nixl_thread_sync_t", "DEFAULT_COMM_PORT")),
]
