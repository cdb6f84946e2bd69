"""NIXL itself for the benchmark: its settings, how to load its Python API, and how to make an agent.

Shared by the in-process side (``nixl``) and the target process (``nixl_peer``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import BackendUnavailable, NixlError

DEFAULT_UCX_TLS = "self,sm,tcp"
UCX_ERR_MODES = ("none", "peer")
POSIX_QUEUES = {"aio": "use_aio", "uring": "use_uring", "posixaio": "use_posix_aio"}


@dataclass
class NixlSettings:
    """The NIXL knobs that change its numbers; all are printed above the results."""

    ucx_tls: str = DEFAULT_UCX_TLS
    ucx_err_mode: str = "none"
    posix_queue: str = "aio"
    progress_thread: bool = False
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.ucx_err_mode not in UCX_ERR_MODES:
            raise ValueError(f"ucx_err_mode must be one of {UCX_ERR_MODES}, got {self.ucx_err_mode!r}")
        if self.posix_queue not in POSIX_QUEUES:
            raise ValueError(f"posix_queue must be one of {tuple(POSIX_QUEUES)}, got {self.posix_queue!r}")

    @contextlib.contextmanager
    def pinned_env(self) -> Iterator[None]:
        """UCX_TLS pinned for every UCX context created inside (NIXL's and ucxx's alike), restored after."""
        before = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = self.ucx_tls
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = before

    def header(self) -> dict[str, Any]:
        return asdict(self) | {"UCX_TLS (env)": os.environ.get("UCX_TLS", ""), "NIXL's UCX_MODULES": ucx_modules()}


#: UCX's modules that need an RDMA device. Through them NIXL's wheel loads libibverbs and the libnl it bundles,
#: whose exit handler (``rtnl_tc_unregister``) crashes the process after it is done (SIGSEGV, exit code 139).
RDMA_MODULES_OFF = "^ib,rdmacm"


def rdma_devices() -> list[str]:
    """This host's RDMA devices (``/sys/class/infiniband``); empty on a machine without InfiniBand or RoCE."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def ucx_modules() -> str:
    """The UCX_MODULES NIXL loads UCX with here: the caller's, else all but the RDMA ones without a device."""
    return os.environ.get("UCX_MODULES") or ("all" if rdma_devices() else RDMA_MODULES_OFF)


@contextlib.contextmanager
def ucx_modules_for_this_host() -> Iterator[None]:
    """While NIXL loads UCX: leave out the RDMA modules where there is no RDMA device (they cannot be used)."""
    if "UCX_MODULES" in os.environ or rdma_devices():
        yield
        return
    os.environ["UCX_MODULES"] = RDMA_MODULES_OFF
    try:
        yield
    finally:
        os.environ.pop("UCX_MODULES", None)


#: where NIXL's Python API lives: the ``nixl`` meta package, or a CUDA-flavoured wheel installed alone
API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def nixl_api():
    """NIXL's ``_api`` module (nixl_agent, nixl_agent_config); ImportError naming what to install."""
    errors = []
    for name in API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def nixl_status() -> tuple[bool, str]:
    """Whether NIXL's Python API imports here, and if not, why."""
    try:
        nixl_api()
    except ImportError as exc:
        return False, f"nixl is not installed ({exc}); pip install --no-deps nixl nixl-cu12"
    except Exception as exc:  # a broken native library raises OSError or RuntimeError
        return False, f"nixl failed to load: {type(exc).__name__}: {exc}"
    return True, "ok"


def nixl_versions() -> dict[str, str]:
    """Installed NIXL distributions and their versions."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def make_agent(name: str, settings: NixlSettings, backends: dict[str, dict[str, str]]):
    """A nixl_agent with exactly ``backends`` created with the given init params."""
    ok, reason = nixl_status()
    if not ok:
        raise BackendUnavailable(reason, backend="nixl")
    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs every agent and backend at INFO, to stdout

    with ucx_modules_for_this_host():
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=settings.progress_thread, backends=[]))
        for backend, params in backends.items():
            try:
                agent.create_backend(backend, params)
            except Exception as exc:
                msg = f"NIXL could not create its {backend} backend ({params}): {exc}"
                raise NixlError(msg, backend="nixl") from exc
    return agent


def ucx_params(settings: NixlSettings) -> dict[str, str]:
    return {"ucx_error_handling_mode": settings.ucx_err_mode}


def posix_params(settings: NixlSettings) -> dict[str, str]:
    return {POSIX_QUEUES[settings.posix_queue]: "true"}
