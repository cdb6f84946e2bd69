"""ucx settings, UCX facts and helpers: the context configuration, TLS reading, transport probes, error mapping."""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from ...descriptors import MemType
from ...errors import (
    DatamoverError,
    InvalidMetadata,
    InvalidParameter,
    RemoteDisconnected,
)
from ...units import parse_size

log = logging.getLogger("datamover.ucx")


_MASK40 = (1 << 40) - 1


_READ_TAG = 1 << 63


_PROBE_TAG = 3 << 62  # the receive-queue probe after a hang-up (READ tags stay below bit 62, WRITE tags below 63)


_MAX_ADDRESS = 1 << 16


_FENCE_S = 10.0  # the longest a cancel waits for its request's fence (a cma chunk in progress, the service thread)


_CACHE_ROWS = 4096  # a served request's checked views are kept for reuse up to this many rows


_DRAIN_MAX = 1 << 20  # scratch for the data of a refused WRITE; longer messages are truncated into it


_DRAIN_WINDOW = 256  # receives a refused WRITE's drain has posted at a time


_DRAINS_PER_PEER = 4  # refused WRITEs being drained for one connection; a peer sending more is dropped


_DRAIN_IDLE_S = 60.0  # a drain whose window saw nothing arrive this long is given up


_MAX_RKEYS = 1 << 16


# UCX transports that move put/get without the target's CPU (others emulate them over active messages)
_NATIVE_RMA = frozenset({"cma", "knem", "xpmem", "rc_verbs", "rc_mlx5", "dc_mlx5", "cuda_ipc", "gdr_copy"})


# a caller's own request is left to its waiter this long before the service thread progresses it
_DIRECT_GRACE_S = 0.002


_MAX_RKEY_BYTES = 4096


def import_ucxx():
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from ucxx._lib import libucxx as ucx_api
    from ucxx._lib.arr import Array

    return ucx_api, Array


def features(ucx_api: Any) -> tuple:
    return (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP, ucx_api.Feature.RMA)


def parse_rkeys(peer: str, rows: Any) -> dict[int, tuple[str, int, int, int, bytes]]:
    """A target's ``[[id, mem, dev, addr, length, rkey], ...]`` checked field by field; raises InvalidMetadata."""
    if not isinstance(rows, list) or len(rows) > _MAX_RKEYS:
        raise InvalidMetadata(f"agent {peer!r} sent rkeys that are not a list of at most {_MAX_RKEYS} rows")
    out = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 6):
            raise InvalidMetadata(f"agent {peer!r} sent an rkey row that is not [id, mem, dev, addr, length, rkey]")
        rid, mem, dev, addr, length, key = row
        ints = (rid, dev, addr, length)
        if not all(type(v) is int and 0 <= v < 1 << 63 for v in ints) or length == 0 or addr + length >= 1 << 63:
            raise InvalidMetadata(f"agent {peer!r} sent rkey row {rid!r} with a bad id, device or range")
        if mem not in (MemType.DRAM.value, MemType.VRAM.value):
            raise InvalidMetadata(f"agent {peer!r} sent rkey row {rid} for memory type {mem!r}")
        if not isinstance(key, bytes) or not 0 < len(key) <= _MAX_RKEY_BYTES:
            raise InvalidMetadata(f"agent {peer!r} sent rkey row {rid} whose key is not 1..{_MAX_RKEY_BYTES} bytes")
        out[rid] = (mem, dev, addr, length, key)
    return out


_TCP_SEGS = ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE")
_TCP_SEG_SIZE = "64k"


def ucx_config(user: Mapping[str, Any], cma: bool) -> dict[str, str]:
    """UCX context settings: the user's, plus our defaults for what neither they nor the environment set.

    TLS without cma unless cma is allowed, tcp's own put off where shared memory can carry puts instead, tcp's
    send and receive segments of 64 KiB, and cma's copies per progress call raised.
    """
    config = {str(k): str(v) for k, v in dict(user).items()}
    if not cma and "TLS" not in config and "UCX_TLS" not in os.environ:
        config["TLS"] = "^cma"
    tls = config.get("TLS", os.environ.get("UCX_TLS"))
    shared_memory = any(tls_includes(tls, t, frozenset({"mm", "sm", "shm"})) for t in ("posix", "sysv"))
    if shared_memory and "TCP_PUT_ENABLE" not in config and "UCX_TCP_PUT_ENABLE" not in os.environ:
        # with tcp's own put, UCX carries puts between two processes of one host over loopback TCP rather than
        # emulating them over shared memory, which is faster. Where no shared memory is left (TLS tcp only, as
        # between hosts without RDMA) it stays on: puts emulated over tcp are slower still (BENCHMARKS.md)
        config["TCP_PUT_ENABLE"] = "n"
    if tls_includes(tls, "tcp") and not any(k in config or f"UCX_{k}" in os.environ for k in _TCP_SEGS):
        # an emulated get (tcp has no get of its own) comes back in active messages of at most one send
        # segment each, copied through it: 64 KiB send segments instead of UCX's 8 KiB make a 64 KiB row one
        # message instead of eight (the measured effect is in BENCHMARKS.md); UCX receives 64 KiB segments by
        # default, set here too so that both stay equal; the handshake checks a peer receives what we send
        config.update(dict.fromkeys(_TCP_SEGS, _TCP_SEG_SIZE))
    if "USE_MT_MUTEX" not in config and "UCX_USE_MT_MUTEX" not in os.environ:
        # the worker is shared by threads (a caller driving its request, the native progress thread, the service
        # thread): with UCX's default spinlock a thread that finds it taken spins, on a core the holder may need
        config["USE_MT_MUTEX"] = "y"
    if "CMA_TX_QUOTA" not in config and "UCX_CMA_TX_QUOTA" not in os.environ:
        # cma copies a queued put/get per worker progress call by default (quota 1): one Python-level progress
        # per row; 64 per call measured 8-16% faster for 4-64 KiB rows, and equal for 1 MiB ones
        config["CMA_TX_QUOTA"] = "64"
    return config


# our defaults for transports UCX builds as loadable modules: a UCX that did not load the module (not built, not
# loadable, or left out by UCX_MODULES) refuses the whole context over them ("Invalid parameter")
_MODULE_DEFAULTS = {"CMA_TX_QUOTA": "cma"}


def make_context(
    ucx_api: Any, user: Mapping[str, Any], cma: bool, feature_flags: tuple | None = None
) -> tuple[Any, dict[str, str]]:
    """A UCX context made with ``ucx_config(user, cma)`` (and ``features`` unless given), and its settings.

    Where UCX refuses it, the context is made again without our defaults for transport modules (a UCX without
    its cma module would otherwise leave the backend unusable); the user's own settings are never dropped.
    """
    config = ucx_config(user, cma)
    flags = features(ucx_api) if feature_flags is None else feature_flags
    try:
        return ucx_api.UCXContext(config, feature_flags=flags), config
    except ucx_api.UCXInvalidParamError:
        given = {str(k) for k in dict(user)}
        ours = [k for k in _MODULE_DEFAULTS if k in config and k not in given]
        if not ours:
            raise
    for key in ours:
        del config[key]
    ctx = ucx_api.UCXContext(config, feature_flags=flags)
    log.info(
        "UCX refused %s (its %s module is not loaded): the context is made without them",
        ", ".join(ours), ", ".join(sorted({_MODULE_DEFAULTS[k] for k in ours})),
    )  # fmt: skip
    return ctx, config


UCX_TCP_SEG_DEFAULT = 8192  # UCX's own TCP_TX_SEG_SIZE; a peer that does not say what it receives is taken to
UCX_TCP_RX_SEG_DEFAULT = 65536  # UCX's own TCP_RX_SEG_SIZE (src/uct/tcp/tcp_iface.c, 1.15 to 1.23)


def tcp_segments(config: Mapping[str, str]) -> tuple[int, int]:
    """(send, receive) tcp segment bytes of a context made with ``config`` (UCX_* variables count too).

    (0, 0) where tcp is not in use. A peer must receive segments as large as this side sends: UCX aborts on
    a larger one, so the handshake compares them (``messages.Hello.tcp_rx``, ``Welcome.tcp_rx``).
    """
    if not tls_includes(config.get("TLS", os.environ.get("UCX_TLS")), "tcp"):
        return 0, 0
    out = []
    for key, default in zip(_TCP_SEGS, (UCX_TCP_SEG_DEFAULT, UCX_TCP_RX_SEG_DEFAULT)):
        value = config.get(key, os.environ.get(f"UCX_{key}"))
        try:
            out.append(parse_size(value) if value is not None else default)
        except InvalidParameter:
            out.append(default)
    return out[0], out[1]


def peer_elsewhere(sock: socket.socket) -> bool:
    """Whether the peer at the other end of a connected control socket runs on another machine.

    The peer's address is this machine's own exactly when a socket can bind to it (loopback, or any address of
    this network namespace; a test host has a namespace of its own, as a machine would).
    """
    try:
        ip = sock.getpeername()[0]
        with socket.socket(sock.family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError as exc:
        return exc.errno == errno.EADDRNOTAVAIL  # anything else (not connected, ...): taken as this machine
    return False


def tls_includes(tls: str | None, transport: str, groups: frozenset[str] = frozenset()) -> bool:
    """Whether a UCX_TLS value lets UCX use ``transport``.

    'a,b' names what to use ('all', or one of the ``groups`` the transport belongs to, names it too); '^a,b' names
    what not to; unset or empty means everything.
    """
    tls = (tls or "").strip()
    if not tls:
        return True
    names = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
    named = transport in names or bool(groups & names)
    return not named if tls.startswith("^") else named or "all" in names


# ucs_status_t values meaning the peer is gone: IO error, unreachable, canceled, connection reset, endpoint timeout
_PEER_GONE = frozenset({-3, -6, -16, -25, -80})


def ucx_error(exc: BaseException, peer: str, index: int, backend: str) -> DatamoverError:
    """A UCX request error as a typed one: a peer-side failure means the peer is gone."""
    name = type(exc).__name__
    status = getattr(exc, "status", 0)
    if status in _PEER_GONE or any(
        k in name for k in ("Canceled", "ConnectionReset", "Shmem", "Unreachable", "EndpointTimeout", "IOError")
    ):
        return RemoteDisconnected(f"agent {peer!r} went away: {name}: {exc}", index=index, backend=backend)
    return DatamoverError(f"UCX request to agent {peer!r} failed: {name}: {exc}", index=index, backend=backend)


def transports_of(info: str) -> list[str]:
    """Transport/device names from UCX's context info ('tcp/lo', 'cma/memory', ...)."""
    out = []
    for line in info.splitlines():
        if "resource" in line and "flags" in line:
            tl = line.rsplit(" ", 1)[-1].strip()
            if tl and tl not in out:
                out.append(tl)
    return out


_ROW = re.compile(r"\|\s*([0-9KMGinf.]+)\s*\|\s*(?:\(\?\)\s*)?([^|]+?)\s*\|\s*([\w/]+)\s*\|")


_TABLES = {
    "tagged message by ucp_tag_send* from host memory": "tag",
    "remote memory write by ucp_put* from host memory": "put",
    "remote memory read by ucp_get* into host memory": "get",
}


def transports_in_use(log: str) -> list[str]:
    """'<op> <sizes>: <protocol> over <transport>' rows of the tag, put and get tables in UCX_PROTO_INFO output."""
    out: list[str] = []
    table = None
    for line in log.splitlines():
        if "ucp_context" in line:
            table = next((name for title, name in _TABLES.items() if title in line), None)
            continue
        m = _ROW.search(line) if table else None
        if m:
            row = f"{table} {m.group(1)}: {m.group(2)} over {m.group(3)}"
            if row not in out:
                out.append(row)
    return out


_PROBE = """
import numpy as np
from datamover.backends.ucx import rma
from datamover.backends.ucx.config import import_ucxx, make_context
u, Array = import_ucxx()
ctxs = [make_context(u, {}, False)[0] for _ in range(2)]
ws = [u.UCXWorker(c) for c in ctxs]
ep = ws[0].create_endpoint_from_worker_address(ws[1].address, False)
def wait(done):
    while not done():
        ws[0].progress(); ws[1].progress()
for n in (64, 1 << 20):
    a, b = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    rs = [ep.tag_send(Array(a), u.UCXXTag(n)), ws[1].tag_recv(Array(b), u.UCXXTag(n))]
    wait(lambda: all(r.completed for r in rs))
    memh = rma.mem_map(ctxs[1].handle, b.ctypes.data, n)
    rkey = rma.rkey_unpack(ep.handle, rma.rkey_pack(ctxs[1].handle, memh))
    for get in (False, True):
        rma.post_rows(get, ep.handle, [rma.make_row(a.ctypes.data, n, b.ctypes.data, rkey, None)])
        flush = rma.Flush(ep.handle)
        wait(lambda: flush.poll() != rma.UCS_INPROGRESS)
    rma.rkey_destroy(rkey)
    rma.mem_unmap(ctxs[1].handle, memh)
"""


@functools.lru_cache(maxsize=1)
def probe_transports(timeout: float = 30.0) -> list[str]:
    """Which transports UCX picks for tag messages between two workers on this host (a subprocess probe)."""
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"probe failed: {exc}"]
    return transports_in_use(res.stdout + res.stderr)
