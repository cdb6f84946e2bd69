"""ucx: one-sided WRITE/READ into a remote agent's registered DRAM/VRAM.

Two data paths, one protocol around them:

- **One-sided** (default, ``one_sided``): a target maps each registered
  region with ``ucp_mem_map`` and hands peers its packed rkey, with the
  region's bounds, over the authenticated control connection (in the
  welcome, then as regions come and go). The initiator checks every row
  against those bounds and posts one ``ucp_put_nbi``/``ucp_get_nbi`` per
  row and one endpoint flush; the target's CPU stays out of the data path,
  as with NIXL. ucxx's Python layer has no RMA, so ``ucx_rma`` binds these
  calls through ctypes on ucxx's own handles. A peer on the same host that
  the kernel lets this process attach to (``direct_cma``, see ``cma``) is
  instead written and read with process_vm_writev/readv, ``IOV_MAX`` rows
  per syscall, against the same rkey bounds. Deregistration revokes the
  rkey and waits until every connected peer confirms its operations on the
  region ended.
- **Served by the owner** (rows the target did not offer, e.g. a stale or
  forged blob, or ``one_sided: False``): the initiator sends the remote
  descriptors over TCP and posts one tag send (WRITE) or receive (READ) per
  row; the target checks every descriptor against its own registrations
  before posting the matching receives or sends on the registered buffer
  itself. A refused request names the descriptor, and the data of a refused
  WRITE is drained into scratch memory.

Notifications ride the control connection after the data (after the flush,
one-sided). Data endpoints come from worker addresses with UCX error
handling off, which lets UCX pick shared memory on one host. A dead peer is
noticed through the control connection: the kernel closes a killed
process's sockets, TCP keepalive covers a vanished host, and every request
to that peer ends in ERR with RemoteDisconnected. Two things keep the
survivor alive: cma is off by default (UCX aborts a process whose
process_vm_readv/writev hits a dead peer), and when a peer dies while
sending to us the worker is replaced (its shared-memory receive queue can
stay blocked); the target's welcome carries its current worker address, so
peers reconnect transparently.

One service thread owns the UCX worker and every socket: it spins on UCX
progress while requests are in flight and sleeps in epoll otherwise.
"""

from __future__ import annotations

import collections
import errno as errno_mod
import functools
import hmac
import itertools
import logging
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..descriptors import DescList, MemType
from ..descriptors.desclist import check_rows
from ..errors import (
    AuthenticationError,
    DatamoverError,
    InvalidMetadata,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
    TransferIOError,
    TransferTimeout,
)
from . import cma
from . import ucx_rma as rma
from .base import (
    Backend,
    BackendHost,
    Completion,
    TransferRequest,
    finished_completion,
    run_parts,
    split_by_bytes,
)
from .ucx_protocol import FrameConn, handshake_mac, new_nonce, session_key
from .workers import Workers

log = logging.getLogger("datamover.ucx")

_MASK40 = (1 << 40) - 1
_READ_TAG = 1 << 63
_MAX_ADDRESS = 1 << 16
_DRAIN_MAX = 64 << 20  # scratch for the data of a refused WRITE; longer messages are truncated into it
_DRAIN_ROWS = 1 << 20
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


class _CudaView:
    """A device range as ``__cuda_array_interface__``, so ucxx moves VRAM without a host copy."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }  # fmt: skip


def _views(regs: Mapping[int, Any], rids: np.ndarray, addr: np.ndarray, length: np.ndarray, Array) -> list:
    """One ucxx Array per row, viewing the registered memory itself (no staging copy)."""
    out = []
    off = addr.tolist()
    ln = length.tolist()
    cache: dict[int, Any] = {}
    for rid, a, n in zip(rids.tolist(), off, ln):
        base = cache.get(rid)
        if base is None:
            reg = regs[rid]
            base = cache[rid] = (reg, memoryview(reg.array) if reg.mem_type == MemType.DRAM else None)
        reg, mv = base
        if mv is not None:
            start = a - reg.addr
            out.append(Array(mv[start : start + n]))
        else:
            out.append(Array(_CudaView(a, n)))
    return out


class _Requests:
    """UCX requests of one operation, checked for completion in posting order."""

    __slots__ = ("k", "reqs")

    def __init__(self, reqs: list) -> None:
        self.reqs = reqs
        self.k = 0

    def poll(self) -> BaseException | bool:
        """True when all completed, an exception on the first failure, False while pending."""
        reqs, k, n = self.reqs, self.k, len(self.reqs)
        while k < n:
            r = reqs[k]
            if not r.completed:
                self.k = k
                return False
            try:
                r.check_error()
            except Exception as exc:  # a UCX error object: map it for the caller
                self.k = k
                return exc
            k += 1
        self.k = n
        return True

    def pending(self) -> list[int]:
        return [i for i in range(self.k, len(self.reqs)) if not self.reqs[i].completed]


@dataclass(eq=False)
class UcxPlan:
    """One request, prepared once: local row views, the local regions it touches, the control message to the
    owner, and (cached by the first one-sided post) the peer epoch and rows it was planned against."""

    views: Any
    regions: frozenset[int]
    msg: dict[str, Any]
    one_sided: Any = None


class _Direct:
    """A one-sided request's puts/gets, posted by the caller (or, queued behind the handshake, by the service
    thread), until the endpoint flush after them ends; finished once, by whoever sees it end."""

    __slots__ = ("completion", "deadline", "done", "driven", "flush", "lock", "notify", "peer", "regions", "since")

    def __init__(
        self, peer: _Peer, req: TransferRequest, completion: Completion, flush: rma.Flush, deadline: float
    ) -> None:
        self.peer = peer
        self.deadline = deadline
        self.completion = completion
        self.flush = flush
        self.notify = req.notify
        self.regions = req.plan.regions
        self.lock = threading.Lock()
        self.done = False
        self.driven = False  # a waiter progresses UCX for it: the service thread keeps out of its way
        self.since = time.monotonic()


class _OutOp:
    """A request this agent initiated, from post to completion."""

    __slots__ = ("abandoned", "completion", "deadline", "done_msg", "id", "peer", "req", "reqs", "tag0")

    def __init__(self, op_id: int, peer: _Peer, req: TransferRequest, completion: Completion, deadline: float) -> None:
        self.id = op_id
        self.deadline = deadline
        self.peer = peer
        self.req = req
        self.completion = completion
        self.abandoned = False
        self.done_msg = req.op == "READ"
        self.reqs: _Requests | None = None
        self.tag0 = 0

    def finish(self, error: BaseException | None = None) -> None:
        if self.completion.finished_at is None and not self.abandoned:
            self.completion.finish_part(error)
        self.abandoned = True


class _Peer:
    """An outbound connection to one remote agent: control socket plus UCX data endpoint."""

    def __init__(self, name: str, info: Mapping[str, Any]) -> None:
        self.name = name
        self.info = dict(info)
        self.conn: FrameConn | None = None
        self.ep: Any = None
        self.state = "idle"  # idle -> connecting -> ready; back to idle when the connection drops
        self.nonce = b""
        self.nonce_t = b""
        self.conn_id = 0
        self.queue: list[tuple[str, Any]] = []  # what waits for the handshake
        self.ops: dict[int, _OutOp] = {}
        # the target's regions open to put/get: id -> (mem type, dev, addr, length, packed rkey); and the
        # rkeys unpacked on the current endpoint. ``epoch`` changes with either, invalidating cached plans.
        self.regions: dict[int, tuple[str, int, int, int, bytes]] = {}
        self.rkeys: dict[int, int] = {}
        self.epoch = 0
        self.cma_pid = 0  # the peer's pid when this process may attach to it (direct_cma), else 0
        self.cma_why = "not connected"  # why not, for describe()


class _Inbound:
    """A connection from an initiator that this agent serves."""

    def __init__(self, conn: FrameConn, conn_id: int) -> None:
        self.conn = conn
        self.conn_id = conn_id
        self.nonce = new_nonce()
        self.name = ""
        self.ep: Any = None
        # op id -> (requests, op, notify, first tag, ids of the registered regions it touches)
        self.ops: dict[int, tuple[_Requests, str, bytes, int, frozenset[int]]] = {}


class UcxBackend(Backend):
    """Transfers to and from other agents' registered DRAM/VRAM through UCX."""

    name = "ucx"
    pairs = frozenset(
        {(MemType.DRAM, MemType.DRAM), (MemType.DRAM, MemType.VRAM), (MemType.VRAM, MemType.DRAM),
         (MemType.VRAM, MemType.VRAM)}
    )  # fmt: skip
    supports_local = False
    supports_remote = True
    supports_notifications = True
    default_params = {
        # control listener: bound here and advertised in the metadata
        "host": "127.0.0.1",
        "port": 0,
        # UCX settings passed to the context, e.g. {"TLS": "tcp"}
        "ucx_config": {},
        # cma lets UCX read a peer's memory with process_vm_readv; when that peer dies mid-transfer UCX
        # (error handling off) aborts the survivor, so unless this is on, TLS defaults to everything but cma
        "cma": False,
        # UCX endpoint error handling: on forces transports that report peer failure (tcp, much slower)
        "error_handling": False,
        # let peers put into and get from this agent's registered memory directly (UCP RMA, as NIXL does:
        # the owner's CPU stays out of the data path) and do the same to peers that allow it; off, every
        # request is checked and served by the owner over tag send/recv
        "one_sided": True,
        # one-sided to a peer on this host that the kernel lets this process attach to (a probe at connect time
        # tells): DRAM rows go with process_vm_writev/readv, up to IOV_MAX rows per syscall, instead of one UCX
        # put/get per row; a peer dying mid-copy makes the copy fail (not this process abort, as UCX's cma does)
        "direct_cma": True,
        # direct cma requests of up to this many bytes are copied inside post() (as posix's inline_bytes): 1 MiB
        # copied there ran about 25% faster than handed to a thread; larger ones in parts on up to
        # cma_threads threads (a waiting caller copies parts too), so that post() returns at once and large
        # copies use more than one core
        "cma_inline_bytes": 1 << 20,
        "cma_threads": 2,
        # a part is a run of chunks of one syscall each: a quarter of a request per thread, 1 MiB to this
        "cma_chunk_bytes": 8 << 20,
        # where UCX can only emulate put/get (no cma or RDMA: active messages through shared memory or tcp),
        # requests with a row larger than this go through the owner, whose tag rendezvous streams large
        # messages faster
        "emulated_max_bytes": 8 << 20,
        # keep polling UCX this long after the last activity before sleeping in epoll
        "spin_us": 2000,
        "connect_timeout_s": 5.0,
        # a request with less than this left of its timeout is not started: it could not finish, and once
        # started its bytes cannot be called back (tag send/recv has no cancel that is safe for the peer)
        "launch_margin_s": 0.001,
    }

    def __init__(self, host: BackendHost, params=None) -> None:
        super().__init__(host, params)
        ucx_api, Array = import_ucxx()
        self._ucx, self._Array = ucx_api, Array
        config = ucx_config(self.params["ucx_config"], bool(self.params["cma"]))
        self._ctx = ucx_api.UCXContext(config, feature_flags=_features(ucx_api))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        self._secret: bytes | None = host.secret
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.params["host"], int(self.params["port"])))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._cmds: collections.deque[Callable[[], None]] = collections.deque()
        self._peers: dict[str, _Peer] = {}
        self._inbound: dict[int, _Inbound] = {}
        self._next_conn_id = 1
        self._next_op = 1
        self._tag_ctr = 0
        self._active_out: dict[int, _OutOp] = {}
        self._active_in: dict[tuple[int, int], _Inbound] = {}
        self._graveyard: list[tuple[float, Any]] = []
        self._self_ep: Any = None
        self._draining: list[tuple[float, list, Any]] = []
        self._checked: dict[tuple, tuple] = {}  # request descriptors -> (region table, views, region ids)
        self._old_workers: list[tuple] = []  # kept alive: their endpoints and requests still point at them
        self._one_sided = bool(self.params["one_sided"])
        self._emulated_max = int(self.params["emulated_max_bytes"])
        self._rma_native = any(t.split("/")[0] in _NATIVE_RMA for t in transports_of(self._ctx.info))
        self._mapped: dict[int, tuple[int, list]] = {}  # region id -> (memh, [id, mem, dev, addr, length, rkey])
        self._revoking: dict[int, set[int]] = {}  # region id -> inbound connections yet to confirm its revocation
        self._revokes: list[tuple[_Peer, int, rma.Flush]] = []  # revocations we confirm once our ops ended
        self._epochs = itertools.count(1)
        # callers post one-sided requests themselves (see _post_direct); this orders those posts against the
        # service thread changing a peer's endpoint, rkeys or regions
        self._rma_lock = threading.RLock()
        self._directs: list[_Direct] = []
        self._drivers: set[_Direct] = set()  # requests a waiter is progressing UCX for right now
        self._params: dict[int, rma.RequestParam] = {}  # VRAM region id -> put/get parameters naming its memh
        # requests this agent started one-sided / through the owner, and requests it served as the owner
        self.counts = {"one-sided": 0, "of them direct cma": 0, "served by the owner": 0, "served for peers": 0}
        self._cma_token = cma.Token() if self._one_sided and self.params["direct_cma"] else None
        self._cma_pool: Workers | None = None
        # id -> (peer, local regions) of direct cma requests copying in parts: a revocation from that peer is
        # confirmed, and a local region they touch unmapped, only once they ended
        self._cma_ops: dict[int, tuple[_Peer, frozenset]] = {}
        self._cma_ids = itertools.count(1)
        self.resets = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._worker.epoll_file_descriptor, selectors.EVENT_READ, "ucx")
        self._ucx_watched = True  # UCX's event fd is in the selector (not while a waiter progresses UCX)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"dm-ucx-{host.name}", daemon=True)
        self._thread.start()

    # -- class-level facts -----------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            ucx_api, _ = import_ucxx()
            import ucxx
        except Exception as exc:
            return False, f"ucxx is not importable ({type(exc).__name__}: {exc}); pip install ucxx-cu12"
        major, minor, patch = ucx_api.get_ucx_version()
        return True, f"ucxx {ucxx.__version__}, UCX {major}.{minor}.{patch}"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        """UCX version and the transports this machine offers (the data path picks among them)."""
        try:
            ucx_api, _ = import_ucxx()
            ctx = ucx_api.UCXContext(ucx_config({}, False), feature_flags=_features(ucx_api))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "ucx": ".".join(map(str, ucx_api.get_ucx_version())),
            "transports available": ", ".join(transports_of(ctx.info)),
            "transports in use (same host)": "; ".join(probe_transports()) or "unknown",
            "UCX_TLS": ctx.config.get("TLS", "?"),
            "direct cma": cma.availability(),
            "data path": "one-sided put/get (UCP RMA, rkeys over the control connection; same-host peers "
            "this process may attach to: process_vm_writev/readv, IOV_MAX rows per call), or tag send/recv "
            "served by the owner; endpoints from worker addresses, UCX error handling off; peer failure via "
            "control TCP",
        }

    def describe(self) -> dict[str, Any]:
        return {
            "transports": ", ".join(transports_of(self._ctx.info)),
            "UCX_TLS": self._ctx.config.get("TLS", "?"),
            "error_handling": bool(self.params["error_handling"]),
            "data path": (
                (
                    "one-sided put/get"
                    if self._rma_native
                    else f"one-sided put/get (emulated by UCX) up to "
                    f"{self._emulated_max} B rows, served by the owner above"
                )
                if self._one_sided
                else "tag send/recv served by the owner"
            ),
            "direct cma": {
                name: f"pid {p.cma_pid}" if p.cma_pid else p.cma_why for name, p in list(self._peers.items())
            },
            "control": f"{self.params['host']}:{self._port}",
            "worker resets": self.resets,
            "requests": dict(self.counts),
        }

    # -- metadata and peers ---------------------------------------------------
    def connection_info(self) -> dict[str, Any]:
        host = self.params["host"]
        if host in ("0.0.0.0", ""):
            host = socket.gethostbyname(socket.gethostname())
        return {"address": self._address, "host": host, "port": self._port}

    def add_remote(self, name: str, info: Mapping[str, Any]) -> None:
        address, host, port = info.get("address"), info.get("host"), info.get("port")
        if not isinstance(address, bytes) or not 0 < len(address) <= _MAX_ADDRESS:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'address' must be 1..{_MAX_ADDRESS} bytes")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'host' must be a host name")
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'port' must be 1..65535")
        info = {"address": address, "host": host, "port": port}
        self._call(lambda: self._add_peer(name, info))

    def remove_remote(self, name: str) -> None:
        self._call(lambda: self._drop_peer(name, RemoteDisconnected(f"agent {name!r} was removed", backend=self.name)))

    def _add_peer(self, name: str, info: dict[str, Any]) -> None:
        old = self._peers.get(name)
        if old is not None and old.info == info:
            return
        if old is not None:
            self._drop_peer(name, RemoteDisconnected(f"agent {name!r} came back with new metadata", backend=self.name))
        self._peers[name] = _Peer(name, info)

    def register(self, reg: Any) -> int | None:
        """Map the region for one-sided access and hand its rkey to every connected peer."""
        if not self._one_sided:
            return None
        box: list[int] = []
        self._call(lambda: box.append(self._map(reg)))
        return box[0]

    def _map(self, reg: Any) -> int:
        memh = rma.mem_map(self._ctx.handle, reg.addr, reg.length, cuda=reg.mem_type == MemType.VRAM)
        try:
            entry = [reg.id, reg.mem_type.value, reg.dev, reg.addr, reg.length, rma.rkey_pack(self._ctx.handle, memh)]
        except BaseException:
            rma.mem_unmap(self._ctx.handle, memh)
            raise
        self._mapped[reg.id] = (memh, entry)
        if reg.mem_type == MemType.VRAM:
            self._params[reg.id] = rma.memh_param(memh)
        for inbound in self._inbound.values():
            if inbound.name:
                inbound.conn.send({"t": "rkeys", "add": [entry]})
        return memh

    def deregister(self, reg: Any, handle: Any) -> None:
        """Make sure no peer still reads or writes ``reg``, then unmap it.

        Peers holding its rkey are told to drop it and confirm once their
        operations on us have ended; then served operations are waited for.
        """
        if threading.current_thread() is self._thread or self._stop:
            return
        deadline = time.monotonic() + self.host.timeout_s
        box: list[bool] = []
        if handle is not None:
            self._call(lambda: self._revoke(reg.id))
            self._wait_until(lambda: box.append(bool(self._revoking.get(reg.id))), box, deadline)
            self._call(lambda: self._revoke_done(reg.id, handle))

        def probe() -> None:
            box.append(self._in_use(reg.id))

        if not self._wait_until(probe, box, deadline):
            log.warning("deregistering region %d while UCX operations on it are still pending", reg.id)

    def _wait_until(self, probe: Callable[[], None], box: list[bool], deadline: float) -> bool:
        """Run ``probe`` on the service thread until it reports False (True) or the deadline passes (False)."""
        while True:
            box.clear()
            self._call(probe)
            if not box[0]:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    def _revoke(self, rid: int) -> None:
        self._mapped.pop(rid, None)
        self._params.pop(rid, None)
        waiting = set()
        for inbound in self._inbound.values():
            if inbound.name:
                inbound.conn.send({"t": "revoke", "id": rid})
                waiting.add(inbound.conn_id)
        if waiting:
            self._revoking[rid] = waiting

    def _revoke_done(self, rid: int, memh: int) -> None:
        late = self._revoking.pop(rid, set())
        if late:
            # a peer that neither confirmed nor disconnected may still write: cut it off before unmapping
            for inbound in [i for i in self._inbound.values() if i.conn_id in late]:
                log.warning("agent %r did not confirm dropping region %d; disconnecting it", inbound.name, rid)
                self._drop_inbound(inbound)
            self._reset_worker(f"peers {sorted(late)} kept region {rid} after it was deregistered")
        rma.mem_unmap(self._ctx.handle, memh)

    def _in_use(self, rid: int) -> bool:
        if any(rid in op.req.plan.regions for op in self._active_out.values()):
            return True
        if any(rid in d.regions for d in self._directs if not d.done):
            return True
        if any(rid in regions for _, regions in list(self._cma_ops.values())):
            return True
        for peer in self._peers.values():  # requests waiting for the handshake will post soon
            if any(rid in op.req.plan.regions for op in peer.ops.values() if op.reqs is None and not op.abandoned):
                return True
        return any(rid in entry[4] for inbound in self._inbound.values() for entry in inbound.ops.values())

    # -- transfers -------------------------------------------------------------
    def plan(self, req: TransferRequest) -> UcxPlan:
        return UcxPlan(
            views=_views(req.registrations, req.local_regions, req.local.addr, req.local.length, self._Array),
            regions=frozenset(np.unique(req.local_regions).tolist()),
            msg={
                "t": "req",
                "op": req.op,
                "mem": req.remote.mem_type.value,
                "addr": np.ascontiguousarray(req.remote.addr, dtype="<i8").tobytes(),
                "len": np.ascontiguousarray(req.remote.length, dtype="<i8").tobytes(),
                "dev": np.ascontiguousarray(req.remote.dev, dtype="<i8").tobytes(),
                "notify": req.notify,
            },
        )

    def post(self, req: TransferRequest) -> Completion:
        if len(req.local) == 0:
            return finished_completion()
        deadline = req.deadline
        if self._one_sided:
            completion = self._post_direct(req, deadline)
            if completion is not None:
                return completion
        completion = Completion(1)
        self._submit(lambda: self._start(req, completion, deadline))
        return completion

    def _post_direct(self, req: TransferRequest, deadline: float) -> Completion | None:
        """Post a one-sided request from the caller's thread; None when it must go through the service thread.

        The worker is thread-safe (ucxx creates it multi-threaded). A waiter
        progresses UCX until the flush ends (no thread hop); the service thread
        polls the flush of callers that never wait. Rows copied with direct cma
        are done when ``post`` returns.
        """
        peer = self._peers.get(req.remote_agent)  # type: ignore[arg-type]
        if peer is None or peer.state != "ready" or not peer.regions or req.plan.regions - self.host.regions.keys():
            return None
        with self._rma_lock:
            if peer.state != "ready" or peer.ep is None:
                return None
            rows = self._one_sided_rows(peer, req)
            if rows is None:
                return None
            in_parts = isinstance(rows, cma.CmaPlan) and rows.nbytes > int(self.params["cma_inline_bytes"])
            if in_parts:
                # checked against the rkeys the peer holds now: its revocations, and our deregistrations of the
                # local regions, wait for the parts
                op_id = next(self._cma_ids)
                self._cma_ops[op_id] = (peer, req.plan.regions)
            elif isinstance(rows, cma.CmaPlan):
                error = self._copy_cma(peer, req, rows, deadline)
            else:
                flush, status = self._post_one_sided(peer, req.op, rows)
        if in_parts:
            return self._start_cma_parts(peer, req, rows, deadline, op_id)  # type: ignore[arg-type]
        if isinstance(rows, cma.CmaPlan):
            if error is None:
                if req.notify:
                    self._submit(lambda: self._send_after(peer, req.notify))
                return finished_completion()
            completion = Completion(1)
            completion.finish_part(error)
            return completion
        completion = Completion(1)
        if flush is None:
            completion.finish_part(self._status_error(status, peer))
            return completion
        direct = _Direct(peer, req, completion, flush, deadline)
        if not self._finish_direct(direct):
            # the waiter progresses UCX itself (no thread hop); the service thread picks it up at its next
            # turn for callers that never wait
            self._directs.append(direct)
            completion.set_assist(lambda: self._drive(direct))
        return completion

    def _start_cma_parts(
        self, peer: _Peer, req: TransferRequest, plan: cma.CmaPlan, deadline: float, op_id: int
    ) -> Completion:
        """Copy a large direct cma request in parts on the cma threads (and in a waiting caller).

        The caller entered it in ``_cma_ops`` while its rows were checked; it
        stays there until every part ended, so a revocation of a region it
        touches is confirmed to the peer only after that, and a local region it
        reads or writes is not unmapped before.
        """
        if self._cma_pool is None:
            self._cma_pool = Workers(int(self.params["cma_threads"]), f"dm-ucx-cma-{self.host.name}")
        self.counts["one-sided"] += 1
        self.counts["of them direct cma"] += 1
        pid = peer.cma_pid
        if plan.ranges is None:
            sizes = np.array([c[2] for c in plan.chunks], dtype=np.int64)
            # at least 2 MiB a part: on the 2-vCPU VM, 1 MiB split over two threads ran slower than on one
            plan.ranges = split_by_bytes(sizes, int(self.params["cma_threads"]), 2 << 20)

        def part(first: int, last: int, completion: Completion) -> None:
            error = self._copy_chunks(peer, pid, req, plan, first, last, deadline, completion)
            if error is not None:
                raise error

        def done(c: Completion) -> None:
            with self._rma_lock:
                self._cma_ops.pop(op_id, None)
                revokes = self._revokes and not self._cma_copying(peer)
            try:
                if revokes:
                    self._submit(self._check_revokes)
                if c.error is None and req.notify:
                    self._submit(lambda: self._send_after(peer, req.notify))
            except RemoteDisconnected:
                pass  # the backend closed meanwhile: there is no peer left to tell

        completion = run_parts(self._cma_pool, plan.ranges, part, backend=self.name)
        completion.add_done_callback(done)
        return completion

    def _cma_copying(self, peer: _Peer) -> bool:
        """Whether a direct cma request to or from ``peer`` is still copying in parts."""
        return any(p is peer for p, _ in list(self._cma_ops.values()))

    def _finish_direct(self, direct: _Direct, why: BaseException | None = None) -> bool:
        """Finish ``direct`` if its flush ended (or with ``why``); True once it is finished."""
        with direct.lock:
            if direct.done:
                return True
            status = rma.UCS_INPROGRESS if why is not None else direct.flush.poll()
            if why is None and status == rma.UCS_INPROGRESS:
                return False
            if why is not None:
                direct.flush.abandon()
            direct.done = True
        if why is None and status == rma.UCS_OK:
            if direct.notify:
                self._submit(lambda: self._send_after(direct.peer, direct.notify))
            direct.completion.finish_part()
        else:
            direct.completion.finish_part(why or self._status_error(status, direct.peer))
        return True

    def _drive(self, direct: _Direct) -> None:
        """A waiter's assist: progress UCX until the flush ends, or leave it to the service thread.

        It stops at the request's deadline, so the waiter can report the timeout.
        """
        worker, deadline, clock = self._worker, direct.deadline, time.monotonic
        direct.driven = True
        self._drivers.add(direct)
        try:
            while not self._finish_direct(direct) and direct.peer.state == "ready" and not self._stop:
                while worker.progress_once():  # drain what UCX can do before looking at the flush again
                    pass
                if clock() > deadline:
                    return
        finally:
            direct.driven = False
            self._drivers.discard(direct)
            if not self._drivers:
                self._wake()  # the service thread sleeps in select while a waiter drives: UCX is its again

    def _check_directs(self) -> None:
        """Finish callers' requests nobody drives; those a waiter drives are left alone, except to clear them."""
        late = time.monotonic() - _DIRECT_GRACE_S
        done = [
            d for d in list(self._directs) if d.done or (not d.driven and d.since < late and self._finish_direct(d))
        ]
        for d in done:
            self._directs.remove(d)

    def _send_after(self, peer: _Peer, message: bytes) -> None:
        """A notification for a request that already completed (its data has landed)."""
        if peer.conn is not None and peer.state == "ready":
            peer.conn.send({"t": "notif", "msg": message})

    def send_notification(self, remote: str, message: bytes) -> None:
        done = Completion(1)
        self._submit(lambda: self._notify(remote, bytes(message), done))
        if not done.wait(float(self.params["connect_timeout_s"]) + 1.0):
            raise RemoteDisconnected(f"notification to {remote!r} was not sent in time", backend=self.name)
        if done.error is not None:
            raise done.error

    # -- plumbing between caller threads and the service thread ---------------
    def _submit(self, fn: Callable[[], None]) -> None:
        if self._stop:
            raise RemoteDisconnected("the ucx backend is closed", backend=self.name)
        self._cmds.append(fn)
        self._wake()

    def _wake(self) -> None:
        """Wake the service thread from its wait in select (a full pipe already will; a closed one means stopped)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _watch_ucx(self, on: bool) -> None:
        """Put UCX's event fd in the service thread's selector, or take it out while a waiter progresses UCX."""
        if on != self._ucx_watched:
            if on:
                self._sel.register(self._worker.epoll_file_descriptor, selectors.EVENT_READ, "ucx")
            else:
                self._sel.unregister(self._worker.epoll_file_descriptor)
            self._ucx_watched = on

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the service thread and wait for it; its exception is re-raised here."""
        if threading.current_thread() is self._thread:
            fn()
            return
        box: list[BaseException] = []
        ev = threading.Event()

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                box.append(exc)
            ev.set()

        self._submit(run)
        while not ev.wait(1.0):
            if not self._thread.is_alive():
                raise RemoteDisconnected("the ucx service thread is not running", backend=self.name)
        if box:
            raise box[0]

    # -- service thread ---------------------------------------------------------
    def _run(self) -> None:
        spin = float(self.params["spin_us"]) * 1e-6
        last = time.monotonic()
        last_scan = 0.0
        try:
            while not self._stop:
                worker = self._worker
                busy = False
                while self._cmds:
                    busy = True
                    try:
                        self._cmds.popleft()()
                    except Exception:  # a bug in one command must not stop the service for every peer
                        log.exception("ucx command failed")
                n = 0
                # a waiter progressing the same worker does this thread's UCX work too; two threads
                # progressing one worker only contend for its lock (and the GIL)
                while not self._drivers and worker.progress_once() and n < 64:
                    n += 1
                busy |= n > 0
                if self._active_out or self._active_in or self._revokes:
                    busy |= self._check_requests()
                if self._directs:
                    self._check_directs()
                now = time.monotonic()
                if now - last_scan > 0.005:
                    last_scan = now
                    self._check_cancelled()
                    self._bury()
                if busy:
                    last = now
                if self._drivers:
                    # a waiter progresses UCX: sleep on sockets and commands only, leaving it the GIL (UCX's
                    # event fd stays readable while nobody arms the worker, so it is left out of the wait)
                    self._watch_ucx(False)
                    self._poll(0.005)
                    continue
                self._watch_ucx(True)
                if self._poll(0.0):
                    last = now
                    continue
                if now - last < spin or self._cmds:
                    # spinning: let the caller's threads take the GIL now rather than at the next switch interval
                    time.sleep(0)
                    continue
                if not worker.arm():
                    continue
                # with requests in flight wake often: ucxx can finish a request without a UCX event firing
                in_flight = self._active_out or self._active_in or self._revokes or self._directs
                if self._poll(0.001 if in_flight else 0.05):
                    last = time.monotonic()
        except BaseException:
            log.exception("ucx service thread of %s died", self.host.name)
            raise
        finally:
            self._shutdown()

    def _poll(self, timeout: float) -> bool:
        """Handle ready sockets (waiting up to ``timeout`` s); True when something happened."""
        for conn in self._all_conns():
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0)
            key = self._sel.get_map().get(conn.sock)
            if key is not None and key.events != want:
                self._sel.modify(conn.sock, want, key.data)
        events = self._sel.select(timeout)
        woke = False
        for key, mask in events:
            what = key.data
            # UCX's event fd stays readable until the next arm(): not a reason to keep spinning
            woke |= what != "ucx" or timeout > 0
            if what == "wake":
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            elif what == "listen":
                self._accept()
            elif what == "ucx":
                pass
            elif what.conn is not None:
                if mask & selectors.EVENT_WRITE:
                    what.conn.flush()
                if mask & selectors.EVENT_READ:
                    self._read(what)
        return woke

    def _all_conns(self) -> list[FrameConn]:
        out = [p.conn for p in self._peers.values() if p.conn is not None]
        out += [i.conn for i in self._inbound.values()]
        return out

    def _read(self, owner: _Peer | _Inbound) -> None:
        conn = owner.conn
        try:
            msgs = conn.feed()
        except (AuthenticationError, InvalidMetadata) as exc:
            self._lost(owner, exc)
            return
        for msg in msgs:
            try:
                if isinstance(owner, _Peer):
                    self._on_peer_msg(owner, msg)
                else:
                    self._on_inbound_msg(owner, msg)
            except (AuthenticationError, InvalidMetadata) as exc:
                self._lost(owner, exc)
                return
            except (KeyError, TypeError, ValueError) as exc:
                self._lost(owner, InvalidMetadata(f"malformed control message {msg.get('t')!r}: {exc}"))
                return
            except Exception as exc:  # e.g. UCX refusing an address: drop this connection, keep serving
                log.exception("handling control message %r failed", msg.get("t"))
                self._lost(owner, DatamoverError(f"{type(exc).__name__}: {exc}", backend=self.name))
                return
        if conn.closed:
            self._lost(owner, None)

    def _lost(self, owner: _Peer | _Inbound, why: BaseException | None) -> None:
        if isinstance(owner, _Peer):
            receiving = any(op.req.op == "READ" and op.reqs is not None for op in owner.ops.values())
            if why is None:
                why = RemoteDisconnected(
                    f"agent {owner.name!r} disconnected (control connection closed)", backend=self.name
                )
            self._disconnect_peer(owner, why)
        else:
            receiving = any(entry[1] == "WRITE" for entry in owner.ops.values())
            if why is not None:
                log.warning("dropping connection from %r: %s", owner.name or "?", why)
            self._drop_inbound(owner)
        if receiving:
            # a peer that died while sending to us can leave our shared-memory receive queue blocked for
            # every sender; only a fresh worker gets past it
            self._reset_worker(f"agent {owner.name!r} died while sending to this agent")

    def _reset_worker(self, reason: str) -> None:
        """Replace the UCX worker: every connection drops (its transfers fail), peers reconnect on next use."""
        log.warning("resetting the UCX worker of %s: %s", self.host.name, reason)
        why = RemoteDisconnected(f"UCX worker reset ({reason}); retry the transfer", backend=self.name)
        for peer in list(self._peers.values()):
            self._disconnect_peer(peer, why)
        for inbound in list(self._inbound.values()):
            self._drop_inbound(inbound)
        if self._ucx_watched:
            self._sel.unregister(self._worker.epoll_file_descriptor)
        self._old_workers.append((self._worker, self._self_ep, self._graveyard, self._draining))
        self._graveyard, self._draining, self._self_ep = [], [], None
        self._worker = self._ucx.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        if self._ucx_watched:
            self._sel.register(self._worker.epoll_file_descriptor, selectors.EVENT_READ, "ucx")
        self.resets += 1

    def _bury(self) -> None:
        """Let closed endpoints go once their cancelled requests had time to finish."""
        now = time.monotonic()
        self._graveyard = [(t, ep) for t, ep in self._graveyard if now - t < 10.0]
        self._draining = [d for d in self._draining if now - d[0] < 60.0 and not all(r.completed for r in d[1])]

    def _retire_ep(self, ep: Any) -> None:
        if ep is None:
            return
        try:
            ep.close()
        except Exception as exc:
            log.debug("closing endpoint: %s", exc)
        self._graveyard.append((time.monotonic(), ep))

    # -- initiator side ---------------------------------------------------------
    def _peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise RemoteDisconnected(f"agent {name!r} is not loaded into the ucx backend", backend=self.name)
        if peer.state == "idle":
            self._connect(peer)
        return peer

    def _connect(self, peer: _Peer) -> None:
        host, port = peer.info["host"], peer.info["port"]
        try:
            sock = socket.create_connection((host, port), timeout=float(self.params["connect_timeout_s"]))
        except OSError as exc:
            raise RemoteDisconnected(
                f"cannot reach agent {peer.name!r} at {host}:{port}: {exc.strerror or exc}", backend=self.name
            ) from None
        peer.conn = FrameConn(sock, outbound=True)
        peer.nonce = new_nonce()
        peer.state = "connecting"
        self._sel.register(sock, selectors.EVENT_READ, peer)

    def _disconnect_peer(self, peer: _Peer, why: BaseException) -> None:
        for op in list(peer.ops.values()):
            self._active_out.pop(op.id, None)
            op.finish(why)
        peer.ops.clear()
        for direct in [d for d in self._directs if d.peer is peer]:
            self._finish_direct(direct, why)
            self._directs.remove(direct)
        for entry in [r for r in self._revokes if r[0] is peer]:
            entry[2].abandon()
            self._revokes.remove(entry)
        with self._rma_lock:
            peer.state = "closing"
            for rkey in peer.rkeys.values():
                rma.rkey_destroy(rkey)
            peer.rkeys.clear()
            peer.regions = {}
            peer.epoch = next(self._epochs)
        for kind, item in peer.queue:
            if kind == "notify":
                item[1].finish_part(why)
        peer.queue.clear()
        if peer.conn is not None:
            try:
                self._sel.unregister(peer.conn.sock)
            except (KeyError, ValueError):
                pass
            peer.conn.close()
            peer.conn = None
        self._retire_ep(peer.ep)
        peer.ep = None
        peer.state = "idle"

    def _drop_peer(self, name: str, why: BaseException) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            self._disconnect_peer(peer, why)

    def _start(self, req: TransferRequest, completion: Completion, deadline: float) -> None:
        try:
            peer = self._peer(req.remote_agent)  # type: ignore[arg-type]
        except Exception as exc:
            err = exc if isinstance(exc, DatamoverError) else DatamoverError(f"{exc}", backend=self.name)
            completion.finish_part(err)
            return
        op = _OutOp(self._next_op, peer, req, completion, deadline)
        self._next_op += 1
        peer.ops[op.id] = op
        if peer.state == "ready":
            self._launch(peer, op)
        else:
            peer.queue.append(("req", op))

    def _notify(self, name: str, message: bytes, done: Completion) -> None:
        try:
            peer = self._peer(name)
        except DatamoverError as exc:
            done.finish_part(exc)
            return
        if peer.state == "ready":
            peer.conn.send({"t": "notif", "msg": message})  # type: ignore[union-attr]
            done.finish_part()
        else:
            peer.queue.append(("notify", (message, done)))

    def _launch(self, peer: _Peer, op: _OutOp) -> None:
        """Send the request and post this side's UCX operations at once (no round trip first).

        READ posts its receives before the request leaves, so the target's
        sends always find them; WRITE posts its sends right after the request.
        """
        if op.completion.cancelled or time.monotonic() > op.deadline - float(self.params["launch_margin_s"]):
            self._end(op, op.completion.error or self._late(op))
            return
        gone = op.req.plan.regions - self.host.regions.keys()
        if gone:
            self._end(op, NotRegistered(f"local region(s) {sorted(gone)} were deregistered", backend=self.name))
            return
        rows = self._one_sided_rows(peer, op.req) if peer.regions else None
        if rows is not None:
            self._launch_one_sided(peer, op, rows)
            return
        self.counts["served by the owner"] += 1
        n = len(op.req.local)
        if op.req.op == "WRITE":
            if (self._tag_ctr & _MASK40) + n > _MASK40:
                self._tag_ctr = (self._tag_ctr | _MASK40) + 1
            op.tag0 = (peer.conn_id << 40) | (self._tag_ctr & _MASK40)
        else:
            op.tag0 = _READ_TAG | (self._tag_ctr & ((1 << 62) - 1))
        self._tag_ctr += n
        msg = dict(op.req.plan.msg)
        msg["id"] = op.id
        msg["tag"] = op.tag0
        if op.req.op == "READ" and not self._post_local(peer, op):
            return
        peer.conn.send(msg)  # type: ignore[union-attr]
        if op.req.op == "WRITE":
            self._post_local(peer, op)

    def _on_peer_msg(self, peer: _Peer, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "challenge":
            self._hello(peer, msg)
            return
        if t == "welcome":
            self._welcome(peer, msg)
            return
        if t == "error":
            kind = AuthenticationError if msg.get("auth") else RemoteRefused
            self._disconnect_peer(peer, kind(f"agent {peer.name!r} refused the connection: {msg.get('reason')}"))
            return
        if t == "notif":
            self.host.deliver_notification(peer.name, bytes(msg["msg"]))
            return
        if t == "rkeys":
            if self._one_sided:
                offered = _parse_rkeys(peer.name, msg["add"])
                with self._rma_lock:
                    peer.regions = {**peer.regions, **offered}
                    peer.epoch = next(self._epochs)
            return
        if t == "revoke":
            self._forget_region(peer, int(msg["id"]))
            return
        op = peer.ops.get(msg["id"])
        if op is None:
            return
        if t == "refuse":
            row = int(msg["row"]) if msg.get("row") is not None else None
            index = op.req.caller_index(row) if row is not None and 0 <= row < len(op.req.local) else None
            self._end(
                op, RemoteRefused(f"agent {peer.name!r} refused: {msg['reason']}", index=index, backend=self.name)
            )
            if op.req.op == "READ" and op.reqs is not None:
                # the target sent nothing: complete our receives with empty messages from ourselves
                self._self_complete(op.tag0, op.reqs.pending())
        elif t == "done":
            op.done_msg = True
            self._maybe_done(op)
        elif t == "fail":
            self._end(
                op, RemoteDisconnected(f"agent {peer.name!r} failed the transfer: {msg['reason']}", backend=self.name)
            )

    def _hello(self, peer: _Peer, msg: dict[str, Any]) -> None:
        peer.nonce_t = nonce_t = bytes(msg["nonce"])
        body = self.host.name.encode() + self._address
        mac = handshake_mac(self._secret, b"hello", nonce_t, peer.nonce, body) if self._secret else b""
        peer.conn.send(  # type: ignore[union-attr]
            {"t": "hello", "name": self.host.name, "address": self._address, "nonce": peer.nonce, "mac": mac}
        )

    def _welcome(self, peer: _Peer, msg: dict[str, Any]) -> None:
        conn_id, address, rkeys = int(msg["conn_id"]), bytes(msg["address"]), bytes(msg.get("rkeys") or b"")
        local = bytes(msg.get("local") or b"")
        nonce_t = peer.nonce_t
        if self._secret:
            body = conn_id.to_bytes(8, "big") + address + rkeys + local
            want = handshake_mac(self._secret, b"welcome", nonce_t, peer.nonce, body)
            if not hmac.compare_digest(bytes(msg.get("mac") or b""), want):
                raise AuthenticationError(f"agent {peer.name!r} does not know the shared secret")
            peer.conn.authenticate(session_key(self._secret, nonce_t, peer.nonce))  # type: ignore[union-attr]
        try:  # the target's current worker (it may have been reset since its metadata was published)
            ucx_addr = self._ucx.UCXAddress.create_from_buffer(address)
            peer.ep = self._worker.create_endpoint_from_worker_address(ucx_addr, bool(self.params["error_handling"]))
        except Exception as exc:
            raise InvalidMetadata(f"agent {peer.name!r} sent an unusable UCX address: {exc}") from None
        peer.conn_id = conn_id
        regions = _parse_rkeys(peer.name, msgpack.unpackb(rkeys) if rkeys else []) if self._one_sided else {}
        pid, why = 0, "direct_cma is off here" if self._cma_token is None else "the peer offered no token"
        if self._cma_token is not None and local:
            try:
                offer = msgpack.unpackb(local)
            except Exception:
                offer = None
            pid, why = cma.probe(offer if isinstance(offer, dict) else None)
        with self._rma_lock:
            peer.epoch = next(self._epochs)
            peer.regions = regions
            peer.cma_pid, peer.cma_why = pid, why
        self._ready(peer)

    def _ready(self, peer: _Peer) -> None:
        peer.state = "ready"
        queue, peer.queue = peer.queue, []
        for kind, item in queue:
            if kind == "req":
                self._launch(peer, item)
            else:
                peer.conn.send({"t": "notif", "msg": item[0]})  # type: ignore[union-attr]
                item[1].finish_part()

    def _one_sided_rows(self, peer: _Peer, req: TransferRequest) -> list[rma.Row] | cma.CmaPlan | None:
        """(local addr, length, remote addr, rkey) per row when the target opened every row to put/get, else None.

        For a peer this process may attach to (``direct_cma``), DRAM rows come as one ``cma.CmaPlan`` instead.

        The rows are checked against the bounds the target itself sent with
        its rkeys (not only against its metadata), so a stale or forged blob
        falls back to the served path, where the owner refuses it.
        """
        with self._rma_lock:
            cached = req.plan.one_sided
            if cached is not None and cached[0] == peer.epoch:
                return cached[1]
            rows = self._check_rows(peer, req)
            req.plan.one_sided = (peer.epoch, rows)
            return rows

    def _check_rows(self, peer: _Peer, req: TransferRequest) -> list[rma.Row] | cma.CmaPlan | None:
        direct = bool(peer.cma_pid) and req.local.mem_type == MemType.DRAM and req.remote.mem_type == MemType.DRAM
        if not direct and not self._rma_native and len(req.local) and int(req.local.length.max()) > self._emulated_max:
            return None
        rows = None
        uniq, inv = np.unique(req.remote_regions, return_inverse=True)
        entries = [peer.regions.get(r) for r in uniq.tolist()]
        if all(e is not None and e[0] == req.remote.mem_type.value for e in entries):
            dev, start, length = (np.array([e[k] for e in entries], dtype=np.int64)[inv] for k in (1, 2, 3))  # type: ignore[index]
            addr, n = req.remote.addr, req.remote.length
            if ((addr >= start) & (addr + n <= start + length) & (req.remote.dev == dev)).all():
                if direct:
                    # chunks small enough that every cma thread gets a few, large enough to keep syscalls few
                    threads, most = int(self.params["cma_threads"]), int(self.params["cma_chunk_bytes"])
                    chunk = min(most, max(1 << 20, int(n.sum()) // (4 * threads)))
                    return cma.CmaPlan(req.local.addr, addr, n, chunk)
                keys = np.array([self._rkey(peer, r) for r in uniq.tolist()], dtype=np.uint64)[inv]
                params = [self._params.get(r) for r in req.local_regions.tolist()]
                cols = (req.local.addr.tolist(), n.tolist(), addr.tolist(), keys.tolist(), params)
                rows = list(map(rma.make_row, *cols))
        return rows

    def _rkey(self, peer: _Peer, rid: int) -> int:
        rkey = peer.rkeys.get(rid)
        if rkey is None:
            rkey = peer.rkeys[rid] = rma.rkey_unpack(peer.ep.handle, peer.regions[rid][4])
        return rkey

    def _post_one_sided(self, peer: _Peer, op: str, rows: list[rma.Row]) -> tuple[rma.Flush | None, int]:
        """Post every row's put (WRITE) or get (READ), then one flush; (flush, UCS_OK) or (None, the error)."""
        with self._rma_lock:
            ep = peer.ep.handle
            status = rma.post_rows(op == "READ", ep, rows)
            self.counts["one-sided"] += 1
            return (rma.Flush(ep) if status == rma.UCS_OK else None), status

    def _copy_cma(self, peer: _Peer, req: TransferRequest, plan: cma.CmaPlan, deadline: float) -> DatamoverError | None:
        """Copy every row of ``plan`` to (WRITE) or from (READ) the peer now, locked; the typed error if one failed."""
        self.counts["one-sided"] += 1
        self.counts["of them direct cma"] += 1
        if len(plan.chunks) == 1:
            stop = plan.run(peer.cma_pid, req.op == "WRITE")
            return None if stop is None else self._cma_error(peer, req, *stop)
        return self._copy_chunks(peer, peer.cma_pid, req, plan, 0, len(plan.chunks), deadline)

    def _copy_chunks(
        self,
        peer: _Peer,
        pid: int,
        req: TransferRequest,
        plan: cma.CmaPlan,
        first: int,
        last: int,
        deadline: float,
        completion: Completion | None = None,
    ) -> DatamoverError | None:
        """Copy chunks [first, last) of ``plan``; the typed error of a failed or late copy, else None.

        A part (``completion`` given) stops before any chunk once cancelled or past the deadline; a copy
        inside ``post()`` (no completion) checks the deadline from its second chunk on.
        """
        write = req.op == "WRITE"
        for i in range(first, last):
            if completion is not None and completion.cancelled:
                return None
            if (completion is not None or i > first) and time.monotonic() > deadline:
                return self._cma_timeout(req)
            stop = plan.run(pid, write, i, i + 1)
            if stop is not None:
                return self._cma_error(peer, req, *stop)
        return None

    def _cma_timeout(self, req: TransferRequest) -> TransferTimeout:
        return TransferTimeout(
            f"{req.op} of {len(req.local)} row(s) did not complete within {req.timeout:g} s", backend=self.name
        )

    def _cma_error(self, peer: _Peer, req: TransferRequest, row: int, err: int) -> DatamoverError:
        """A failed process_vm_writev/readv as a typed error naming the caller's descriptor."""
        call = "process_vm_writev" if req.op == "WRITE" else "process_vm_readv"
        what = f"{call} into agent {peer.name!r} failed: {errno_mod.errorcode.get(err, err)} ({os.strerror(err)})"
        if err == errno_mod.ESRCH or not _alive(peer.cma_pid):
            return RemoteDisconnected(
                f"agent {peer.name!r} went away ({what})", index=req.caller_index(row), backend=self.name
            )
        return TransferIOError(what, errno=err, index=req.caller_index(row), backend=self.name)

    def _status_error(self, status: int, peer: _Peer) -> DatamoverError:
        return _ucx_error(rma.UcpError(rma.status_text(status), status=status), peer.name, 0, self.name)

    def _launch_one_sided(self, peer: _Peer, op: _OutOp, rows: list[rma.Row] | cma.CmaPlan) -> None:
        """A queued request's one-sided posts: done when the flush ends (direct cma: at once)."""
        if isinstance(rows, cma.CmaPlan):
            with self._rma_lock:  # before the handshake only: copied here, whatever its size
                error = self._copy_cma(peer, op.req, rows, op.deadline)
            if error is None and op.req.notify:
                self._send_after(peer, op.req.notify)
            self._end(op, error)
            return
        flush, status = self._post_one_sided(peer, op.req.op, rows)
        if flush is None:
            self._end(op, self._status_error(status, peer))
            return
        # from here it is tracked like a request its caller posted directly
        peer.ops.pop(op.id, None)
        direct = _Direct(peer, op.req, op.completion, flush, op.deadline)
        direct.since = 0.0  # its caller may be asleep in wait() already: no grace before the service thread polls
        if not self._finish_direct(direct):
            self._directs.append(direct)
            op.completion.set_assist(lambda: self._drive(direct))

    def _forget_region(self, peer: _Peer, rid: int) -> None:
        """The target deregistered ``rid``: stop using its rkey, confirm once our operations on it ended."""
        with self._rma_lock:
            known = rid in peer.regions or rid in peer.rkeys
            if known:
                peer.regions = {k: v for k, v in peer.regions.items() if k != rid}
                peer.epoch = next(self._epochs)
                flush = rma.Flush(peer.ep.handle)  # covers every put/get posted before it, from any thread
        if not known:
            peer.conn.send({"t": "revoked", "id": rid})  # type: ignore[union-attr]
            return
        self._revokes.append((peer, rid, flush))
        self._check_revokes()

    def _check_revokes(self) -> None:
        for entry in list(self._revokes):
            peer, rid, flush = entry
            if flush.poll() == rma.UCS_INPROGRESS or self._cma_copying(peer):
                continue
            self._revokes.remove(entry)
            with self._rma_lock:
                rkey = peer.rkeys.pop(rid, None)
                if rkey is not None:
                    rma.rkey_destroy(rkey)
            if peer.conn is not None:
                peer.conn.send({"t": "revoked", "id": rid})

    def _post_local(self, peer: _Peer, op: _OutOp) -> bool:
        views = op.req.plan.views
        tag, ep, T = op.tag0, peer.ep, self._ucx.UCXXTag
        try:
            if op.req.op == "WRITE":
                reqs = [ep.tag_send(v, T(tag + i)) for i, v in enumerate(views)]
            else:
                reqs = [ep.tag_recv(v, T(tag + i)) for i, v in enumerate(views)]
        except Exception as exc:
            self._end(op, RemoteDisconnected(f"posting to agent {peer.name!r} failed: {exc}", backend=self.name))
            return False
        op.reqs = _Requests(reqs)
        self._active_out[op.id] = op
        return True

    def _maybe_done(self, op: _OutOp) -> None:
        if op.done_msg and op.reqs is not None and op.reqs.k >= len(op.reqs.reqs):
            self._end(op, None)

    def _end(self, op: _OutOp, error: BaseException | None) -> None:
        """Finish the caller's completion; UCX requests still pending stay tracked until they end."""
        op.finish(error)
        if op.reqs is None or op.reqs.k >= len(op.reqs.reqs):
            self._active_out.pop(op.id, None)
            op.peer.ops.pop(op.id, None)

    def _check_requests(self) -> bool:
        progressed = False
        if self._revokes:
            self._check_revokes()
        for op in list(self._active_out.values()):
            k = op.reqs.k  # type: ignore[union-attr]
            res = op.reqs.poll()  # type: ignore[union-attr]
            progressed |= op.reqs.k != k  # type: ignore[union-attr]
            if res is False:
                continue
            if op.abandoned:
                self._active_out.pop(op.id, None)
                op.peer.ops.pop(op.id, None)
            elif res is True:
                self._active_out.pop(op.id, None)
                self._maybe_done(op)
            else:
                idx = op.req.caller_index(op.reqs.k)  # type: ignore[union-attr]
                op.reqs.k = len(op.reqs.reqs)  # type: ignore[union-attr]
                self._end(op, _ucx_error(res, op.peer.name, idx, self.name))
        for key, inbound in list(self._active_in.items()):
            entry = inbound.ops.get(key[1])
            if entry is None:
                self._active_in.pop(key, None)
                continue
            reqs, op_name, notify, _, _ = entry
            k = reqs.k
            res = reqs.poll()
            progressed |= reqs.k != k
            if res is False:
                continue
            self._active_in.pop(key, None)
            inbound.ops.pop(key[1], None)
            if res is True:
                if notify:
                    self.host.deliver_notification(inbound.name, notify)
                if op_name == "WRITE":
                    inbound.conn.send({"t": "done", "id": key[1]})
            else:
                inbound.conn.send({"t": "fail", "id": key[1], "reason": f"{type(res).__name__}: {res}"})
        return progressed

    def _late(self, op: _OutOp) -> TransferTimeout:
        return TransferTimeout(
            f"{op.req.op} to agent {op.peer.name!r} did not start within {op.req.timeout:g} s", backend=self.name
        )

    def _check_cancelled(self) -> None:
        """Ops still waiting for the handshake give up when released or late; launched ones run to the end."""
        now = time.monotonic()
        for peer in self._peers.values():
            if peer.state == "ready":
                continue
            for op in list(peer.ops.values()):
                if op.reqs is None and not op.abandoned and (op.completion.cancelled or now > op.deadline):
                    op.finish(op.completion.error or self._late(op))

    def _self_complete(self, tag0: int, rows: list[int]) -> None:
        """Complete pending receives of ours that no peer will ever match, with empty self-sends."""
        if not rows:
            return
        if self._self_ep is None:
            self._self_ep = self._worker.create_endpoint_from_worker_address(self._worker.address, False)
        empty = self._Array(memoryview(bytearray(1))[:0])
        for i in rows:
            self._self_ep.tag_send(empty, self._ucx.UCXXTag(tag0 + i))

    # -- target side --------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            inbound = _Inbound(FrameConn(sock, outbound=False), self._next_conn_id)
            self._next_conn_id = self._next_conn_id % ((1 << 22) - 1) + 1
            self._inbound[sock.fileno()] = inbound
            self._sel.register(sock, selectors.EVENT_READ, inbound)
            inbound.conn.send({"t": "challenge", "nonce": inbound.nonce})

    def _drop_inbound(self, inbound: _Inbound) -> None:
        for waiting in self._revoking.values():
            waiting.discard(inbound.conn_id)
        for op_id in inbound.ops:
            self._active_in.pop((inbound.conn_id, op_id), None)
        inbound.ops.clear()
        try:
            self._sel.unregister(inbound.conn.sock)
        except (KeyError, ValueError):
            pass
        self._inbound = {k: v for k, v in self._inbound.items() if v is not inbound}
        inbound.conn.close()
        self._retire_ep(inbound.ep)
        inbound.ep = None

    def _on_inbound_msg(self, inbound: _Inbound, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "hello":
            self._on_hello(inbound, msg)
            return
        if not inbound.name:
            raise InvalidMetadata(f"control message {t!r} before hello")
        if t == "req":
            self._serve(inbound, msg)
        elif t == "notif":
            self.host.deliver_notification(inbound.name, bytes(msg["msg"]))
        elif t == "revoked":
            self._revoking.get(int(msg["id"]), set()).discard(inbound.conn_id)

    def _on_hello(self, inbound: _Inbound, msg: dict[str, Any]) -> None:
        name, address, nonce_i = msg["name"], bytes(msg["address"]), bytes(msg["nonce"])
        if not isinstance(name, str) or not name or not 0 < len(address) <= _MAX_ADDRESS:
            raise InvalidMetadata("hello carries no valid name and UCX address")
        if self._secret:
            want = handshake_mac(self._secret, b"hello", inbound.nonce, nonce_i, name.encode() + address)
            if not hmac.compare_digest(bytes(msg.get("mac") or b""), want):
                inbound.conn.send({"t": "error", "auth": True, "reason": "authentication failed (shared secret)"})
                raise AuthenticationError(f"agent {name!r} failed authentication")
        try:
            ucx_addr = self._ucx.UCXAddress.create_from_buffer(address)
            inbound.ep = self._worker.create_endpoint_from_worker_address(ucx_addr, bool(self.params["error_handling"]))
        except Exception as exc:
            inbound.conn.send({"t": "error", "reason": f"cannot reach your UCX worker: {exc}"})
            raise InvalidMetadata(f"agent {name!r} sent an unusable UCX address: {exc}") from None
        inbound.name = name
        rkeys = msgpack.packb([entry for _, entry in self._mapped.values()])
        local = msgpack.packb(self._cma_token.offer()) if self._cma_token is not None else b""
        mac = b""
        if self._secret:
            body = inbound.conn_id.to_bytes(8, "big") + self._address + rkeys + local
            mac = handshake_mac(self._secret, b"welcome", inbound.nonce, nonce_i, body)
        inbound.conn.send(
            {"t": "welcome", "conn_id": inbound.conn_id, "address": self._address, "rkeys": rkeys, "local": local,
             "mac": mac}
        )  # fmt: skip
        if self._secret:
            inbound.conn.authenticate(session_key(self._secret, inbound.nonce, nonce_i))

    def _serve(self, inbound: _Inbound, msg: dict[str, Any]) -> None:
        self.counts["served for peers"] += 1
        op_id, op = int(msg["id"]), msg["op"]
        tag0 = int(msg["tag"])
        # a prepared transfer posted again sends the same descriptors: reuse their check while the
        # registrations are unchanged (the table object is rebuilt on every change)
        key = (msg.get("mem"), msg.get("addr"), msg.get("len"), msg.get("dev"))
        cached = self._checked.get(key)
        if cached is not None and cached[0] is self.host.region_table:
            views, regions = cached[1], cached[2]
        else:
            try:
                descs, rids = self._validate(msg)
            except DatamoverError as exc:
                inbound.conn.send({"t": "refuse", "id": op_id, "row": exc.index, "reason": exc.reason})
                if op == "WRITE":
                    self._drain(inbound, msg, tag0)
                return
            views = _views(self.host.regions, rids, descs.addr, descs.length, self._Array)
            regions = frozenset(rids.tolist())
            if len(self._checked) >= 256:
                self._checked.pop(next(iter(self._checked)))
            self._checked[key] = (self.host.region_table, views, regions)
        ep, T = inbound.ep, self._ucx.UCXXTag
        try:
            if op == "WRITE":
                reqs = [ep.tag_recv(v, T(tag0 + i)) for i, v in enumerate(views)]
            else:
                reqs = [ep.tag_send(v, T(tag0 + i)) for i, v in enumerate(views)]
        except Exception as exc:
            inbound.conn.send({"t": "fail", "id": op_id, "reason": f"posting failed: {exc}"})
            return
        inbound.ops[op_id] = (_Requests(reqs), op, bytes(msg.get("notify") or b""), tag0, regions)
        self._active_in[(inbound.conn_id, op_id)] = inbound

    def _validate(self, msg: dict[str, Any]) -> tuple[DescList, np.ndarray]:
        """The request's descriptors checked against this agent's registrations; raises naming the row."""
        from ..errors import InvalidDescriptor

        if msg["op"] not in ("WRITE", "READ"):
            raise InvalidDescriptor(f"unknown op {msg['op']!r}")
        mem = MemType.parse(msg["mem"])
        if mem not in (MemType.DRAM, MemType.VRAM):
            raise InvalidDescriptor(f"ucx serves DRAM and VRAM, not {mem}")
        cols = [msg["addr"], msg["len"], msg["dev"]]
        if not all(isinstance(c, bytes) and len(c) % 8 == 0 for c in cols) or len({len(c) for c in cols}) != 1:
            raise InvalidDescriptor("descriptor columns must be equal-length int64 arrays")
        rows = np.empty((len(cols[0]) // 8, 3), dtype=np.int64, order="F")
        for k, c in enumerate(cols):
            rows[:, k] = np.frombuffer(c, dtype="<i8")
        check_rows(rows)  # negative fields, address overflow; the same checks DescList makes, without its overhead
        descs = DescList.wrap(rows, mem, None, ())
        rids = self.host.region_table.lookup(descs, owner=f"agent {self.host.name!r}", backend=self.name)
        return descs, rids

    def _drain(self, inbound: _Inbound, msg: dict[str, Any], tag0: int) -> None:
        """Consume the refused request's data into scratch memory, so none of it touches registered memory."""
        try:
            n = len(msg["len"]) // 8
            longest = int(np.frombuffer(msg["len"], dtype="<i8").max()) if n else 0
        except (TypeError, ValueError):
            return
        scratch = memoryview(bytearray(max(1, min(longest, _DRAIN_MAX))))
        sink = self._Array(scratch)
        ep, T = inbound.ep, self._ucx.UCXXTag
        reqs = [ep.tag_recv(sink, T(tag0 + i)) for i in range(min(n, _DRAIN_ROWS))]
        self._draining.append((time.monotonic(), reqs, scratch))

    # -- lifetime ---------------------------------------------------------------
    def _shutdown(self) -> None:
        why = RemoteDisconnected("the ucx backend was closed", backend=self.name)
        for name in list(self._peers):
            self._drop_peer(name, why)
        for inbound in list(self._inbound.values()):
            self._drop_inbound(inbound)
        for memh, _ in self._mapped.values():
            rma.mem_unmap(self._ctx.handle, memh)
        self._mapped.clear()
        for fn in list(self._cmds):
            try:
                fn()
            except Exception:
                pass
        self._cmds.clear()
        try:
            self._listener.close()
        except OSError:
            pass

    def close(self) -> None:
        if self._stop:
            return
        self._submit(lambda: None)
        self._stop = True
        self._wake()
        self._thread.join(10)
        if self._cma_pool is not None:
            self._cma_pool.shutdown(wait=True)
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a copy into a dying peer can fail with EFAULT before ESRCH)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _features(ucx_api: Any) -> tuple:
    return (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP, ucx_api.Feature.RMA)


def _parse_rkeys(peer: str, rows: Any) -> dict[int, tuple[str, int, int, int, bytes]]:
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


def ucx_config(user: Mapping[str, Any], cma: bool) -> dict[str, str]:
    """UCX context settings: the user's, plus our defaults for what neither they nor the environment set.

    TLS without cma unless cma is allowed, tcp's own put off where shared memory can carry puts instead, and
    cma's copies per progress call raised.
    """
    config = {str(k): str(v) for k, v in dict(user).items()}
    if not cma and "TLS" not in config and "UCX_TLS" not in os.environ:
        config["TLS"] = "^cma"
    tls = config.get("TLS", os.environ.get("UCX_TLS"))
    shared_memory = any(tls_includes(tls, t, frozenset({"mm", "sm", "shm"})) for t in ("posix", "sysv"))
    if shared_memory and "TCP_PUT_ENABLE" not in config and "UCX_TCP_PUT_ENABLE" not in os.environ:
        # with tcp's own put, UCX carries puts between two processes of one host over loopback TCP (0.4-2.2 GB/s
        # for 64 KiB-1 MiB rows) rather than emulating them over shared memory (1.9-3.2 GB/s). Where no shared
        # memory is left (TLS tcp only, as between hosts without RDMA) it stays on: emulated over tcp, puts ran
        # 4x slower (0.5-0.6 GB/s against 2.5-3.1 for 1 MiB rows)
        config["TCP_PUT_ENABLE"] = "n"
    if "CMA_TX_QUOTA" not in config and "UCX_CMA_TX_QUOTA" not in os.environ:
        # cma copies a queued put/get per worker progress call by default (quota 1): one Python-level progress
        # per row; 64 per call measured 8-16% faster for 4-64 KiB rows, and equal for 1 MiB ones
        config["CMA_TX_QUOTA"] = "64"
    return config


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


def _ucx_error(exc: BaseException, peer: str, index: int, backend: str) -> DatamoverError:
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
from datamover.backends import ucx_rma as rma
from datamover.backends.ucx import _features, import_ucxx, ucx_config
u, Array = import_ucxx()
ctxs = [u.UCXContext(ucx_config({}, False), feature_flags=_features(u)) for _ in range(2)]
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
