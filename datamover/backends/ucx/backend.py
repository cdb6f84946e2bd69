"""ucx: one-sided WRITE/READ into a remote agent's registered DRAM/VRAM.

Two data paths, one protocol around them:

- **One-sided** (default, ``one_sided``): a target maps each registered
  region with ``ucp_mem_map`` and hands peers its packed rkey, with the
  region's bounds, over the authenticated control connection (in the
  welcome, then as regions come and go). The initiator checks every row
  against those bounds and posts one ``ucp_put_nbi``/``ucp_get_nbi`` per
  row and one endpoint flush; the target's CPU stays out of the data path,
  as with NIXL. ucxx's Python layer has no RMA, so ``rma`` binds these
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
progress while requests are in flight and sleeps in epoll otherwise."""

from __future__ import annotations

import collections
import gc
import itertools
import os
import selectors
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...descriptors import MemType
from ...errors import (
    InvalidMetadata,
    RemoteDisconnected,
)
from ..base import (
    Backend,
    BackendHost,
    Completion,
    TransferRequest,
    finished_completion,
)
from ..workers import Workers
from . import cma, rma
from .address import AddressCheck
from .cancel_drain import CancelDrains
from .config import (
    _MAX_ADDRESS,
    _NATIVE_RMA,
    import_ucxx,
    log,
    make_context,
    probe_transports,
    tcp_segments,
    transports_of,
)
from .direct_cma import DirectCma
from .fence import Fencing
from .losses import Losses
from .messages import MAX_INCARNATION, Req
from .one_sided import OneSided
from .outbound import Outbound
from .pacing import Pacing
from .params import DEFAULT_PARAMS, LOOSE_PARAMS, check_params
from .protocol import FrameBudget
from .regions import MappedRegions
from .retired import Retired
from .service import ServiceLoop
from .serving import Serving
from .state import Direct, Drain, Inbound, OutOp, Peer, UcxPlan, row_views
from .tagged import Tagged


class UcxBackend(ServiceLoop, Fencing, Outbound, Serving, Backend):
    """Transfers to and from other agents' registered DRAM/VRAM through UCX."""

    name = "ucx"
    pairs = frozenset(
        {(MemType.DRAM, MemType.DRAM), (MemType.DRAM, MemType.VRAM), (MemType.VRAM, MemType.DRAM),
         (MemType.VRAM, MemType.VRAM)}
    )  # fmt: skip
    supports_local = False
    supports_remote = True
    supports_notifications = True
    default_params = DEFAULT_PARAMS
    loose_params = LOOSE_PARAMS

    def __init__(self, host: BackendHost, params=None) -> None:
        super().__init__(host, params)
        check_params(self.params, self.name)
        ucx_api, Array = import_ucxx()
        self._ucx, self._Array = ucx_api, Array
        # the data paths; this object chooses between them per request
        self.one_sided, self.cma_path, self.tagged = OneSided(self), DirectCma(self), Tagged(self)
        self._ctx, config = make_context(ucx_api, self.params["ucx_config"], bool(self.params["cma"]))
        self._tcp_tx, self._tcp_rx = tcp_segments(config)  # compared with each peer's in the handshake
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self._address = self._worker.address.tobytes()
        # which process this is, in its connection info and its welcome: an initiator holding the metadata of
        # an earlier process at the same host and port (it restarted) is refused, not served by this one
        self._incarnation = os.urandom(16)
        # peers' worker addresses are parsed against this worker's own before UCX unpacks them
        self._addr_check = AddressCheck(self._address)
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
        self._peers: dict[str, Peer] = {}
        self._inbound: dict[int, Inbound] = {}
        self._frames = FrameBudget(int(self.params["max_buffered_bytes"]))
        # the service thread ended / close() gave up waiting for it (then the thread closes what it polls)
        self._ending, self._ended, self._orphaned = threading.Lock(), False, False
        self._next_conn_id = 1
        self._next_op = 1
        self._tag_ctr = 0
        self._active_out: dict[int, OutOp] = {}
        self._active_in: dict[tuple[int, int], Inbound] = {}
        self._graveyard: list[tuple[float, Any]] = []
        self._self_ep: Any = None
        self._draining: list[Drain] = []
        # in-flight UCX requests nobody tracks any more, dropped once they end or cancelled safely (retired.py);
        # waiters progress the worker only holding the gate, so that such a cancel can stop them
        self._retired = Retired()
        self._progress_gate = threading.Lock()
        self._checked: dict[tuple, tuple] = {}  # request descriptors -> (region table, views, region ids)
        # replaced workers with a cancelled READ's gets or receives still posted into a caller's memory: never
        # progressed again (so none of those bytes can land), freed by close()
        self._quarantined: list[tuple] = []
        # (peer name, incarnation) -> the quarantines that process of the peer made
        self._quarantines_by: collections.Counter[tuple[str, bytes]] = collections.Counter()
        self.losses = Losses(self)  # lost control connections, and hang-ups mid-WRITE waiting for their probe
        self.hangups = self.losses.counts
        self._one_sided = bool(self.params["one_sided"])
        self._emulated_max = int(self.params["emulated_max_bytes"])
        self._rma_native = any(t.split("/")[0] in _NATIVE_RMA for t in transports_of(self._ctx.info))
        self.mapped_regions = MappedRegions(self)  # mapped for one-sided access, revoked at deregistration
        self._revokes: list[tuple[Peer, int, rma.Flush]] = []  # revocations we confirm once our ops ended
        self._epochs = itertools.count(1)
        # callers post one-sided requests themselves (see _post_direct); this orders those posts against the
        # service thread changing a peer's endpoint, rkeys or regions
        self._rma_lock = threading.RLock()
        self._directs: list[Direct] = []
        self._drivers: set[Direct] = set()  # requests a waiter is progressing UCX for right now
        self._cut_drains = CancelDrains()  # cancelled requests whose UCX operations get cancel_drain_s to end
        # requests this agent started one-sided / through the owner, and requests it served as the owner
        self.counts = {"one-sided": 0, "of them direct cma": 0, "served by the owner": 0, "served for peers": 0}
        self._cma_token = cma.Token() if self._one_sided and self.params["direct_cma"] else None
        self._cma_pool: Workers | None = None
        # id -> (peer, local regions) of direct cma requests copying in parts: a revocation from that peer is
        # confirmed, and a local region they touch unmapped, only once they ended
        self._cma_ops: dict[int, tuple[Peer, frozenset]] = {}
        self._cma_ids = itertools.count(1)
        self.resets = 0
        # connections to peers on this host closed since the worker was made (each left UCX endpoints on it, see
        # recycle_after_departed), and the times the worker was replaced for them (not counted in resets)
        self.departed = 0
        self.recycles = 0
        self._resetting = False  # _reset_worker is disconnecting every peer
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._progress: Any = None  # the native progress thread, when there is one (then UCX's fd is its own)
        self._data: Any = None  # the one-sided rows' serialized worker (rma.native().DataWorker), made with it
        self.pacing = Pacing(self)  # the progress thread's settings and the waiters'
        self._ucx_watched = False  # UCX's event fd is in the selector (not while a waiter progresses UCX)
        if not self.pacing.start_progress():
            self._watch_ucx(True)
        self._stop = False  # no command is accepted (close() began, or the service thread ended)
        self._closed = False
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
            ctx, _ = make_context(ucx_api, {}, False)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "ucx": ".".join(map(str, ucx_api.get_ucx_version())),
            "transports available": ", ".join(transports_of(ctx.info)),
            "transports in use (same host)": "; ".join(probe_transports()) or "unknown",
            "UCX_TLS": ctx.config.get("TLS", "?"),
            "direct cma": cma.availability(),
            "native path": rma.data_path(),
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
            "peers on other machines": {  # name -> how long its waiters poll UCX before sleeping (us)
                name: round(self.pacing.drive_spin_s(p) * 1e6) for name, p in list(self._peers.items()) if p.elsewhere
            },
            "control": f"{self.params['host']}:{self._port}",
            "control bytes buffered": {"held": self._frames.used, "limit": self._frames.limit},
            "rows served for peers": {"now": self.served_rows(), "limit": int(self.params["max_served_rows"])},
            "native path": rma.data_path(),
            "UCX progress": self.pacing.progress_mode(),
            "data worker": self.pacing.data_worker_text(),
            "native progress": dict(self._progress.stats) if self._progress is not None else {},
            "READ cork": self.pacing.read_cork_text(),
            "progress cork": self.pacing.progress_cork_text(),
            "tcp segments": {"send": self._tcp_tx, "receive": self._tcp_rx} if self._tcp_tx else "tcp not in use",
            "worker resets": self.resets,
            "worker recycles": {"done": self.recycles, "connections closed since": self.departed},
            "hang-ups mid-WRITE": dict(self.hangups),
            "quarantined workers": {"held": len(self._quarantined), "by peer": self._quarantines_by_name()},
            "requests let go in flight": {"held": len(self._retired), "cancelled": self._retired.cancelled},
            "cancelled requests draining": len(self._cut_drains),
            "requests": dict(self.counts),
        }

    def _quarantines_by_name(self) -> dict[str, int]:
        """The quarantined workers by the peer they count against (its processes together)."""
        out: collections.Counter[str] = collections.Counter()
        for (name, _), n in self._quarantines_by.items():
            out[name] += n
        return dict(out)

    # -- metadata and peers ---------------------------------------------------

    def connection_info(self) -> dict[str, Any]:
        host = self.params["host"]
        if host in ("0.0.0.0", ""):
            host = socket.gethostbyname(socket.gethostname())
        return {"address": self._address, "host": host, "port": self._port, "incarnation": self._incarnation}

    def add_remote(self, name: str, info: Mapping[str, Any]) -> None:
        address, host, port = info.get("address"), info.get("host"), info.get("port")
        incarnation = info.get("incarnation")  # absent in the info of a peer from before it
        if not isinstance(address, bytes) or not 0 < len(address) <= _MAX_ADDRESS:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'address' must be 1..{_MAX_ADDRESS} bytes")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'host' must be a host name")
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'port' must be 1..65535")
        if incarnation is not None and (
            not isinstance(incarnation, bytes) or not 0 < len(incarnation) <= MAX_INCARNATION
        ):
            raise InvalidMetadata(f"ucx connection info of {name!r}: 'incarnation' must be 1..{MAX_INCARNATION} bytes")
        checked = {"address": address, "host": host, "port": port}
        if incarnation is not None:
            checked["incarnation"] = incarnation
        self._call(lambda: self._add_peer(name, checked))

    def remove_remote(self, name: str) -> None:
        self._call(lambda: self._drop_peer(name, RemoteDisconnected(f"agent {name!r} was removed", backend=self.name)))

    def register(self, reg: Any) -> int | None:
        """Map the region for one-sided access and hand its rkey to every connected peer."""
        return self.mapped_regions.register(reg)

    def deregister(self, reg: Any, handle: Any) -> None:
        """Make sure no peer still reads or writes ``reg``, then unmap it (see ``MappedRegions.deregister``)."""
        self.mapped_regions.deregister(reg, handle)

    # -- transfers -------------------------------------------------------------
    def plan(self, req: TransferRequest) -> UcxPlan:
        return UcxPlan(
            views=row_views(req.registrations, req.local_regions, req.local.addr, req.local.length, self._Array),
            regions=frozenset(np.unique(req.local_regions).tolist()),
            msg=Req(
                id=0,
                op=req.op,
                mem=req.remote.mem_type.value,
                addr=np.ascontiguousarray(req.remote.addr, dtype="<i8").tobytes(),
                length=np.ascontiguousarray(req.remote.length, dtype="<i8").tobytes(),
                dev=np.ascontiguousarray(req.remote.dev, dtype="<i8").tobytes(),
                tag=0,
                notify=req.notify,
            ),
        )

    def post(self, req: TransferRequest) -> Completion:
        if len(req.local) == 0:
            return finished_completion()
        deadline = req.deadline
        if self._one_sided:
            completion = self._post_direct(req, deadline)
            if completion is not None:
                return completion
        completion = self._fenced()
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
            rows = self.one_sided._one_sided_rows(peer, req)
            if rows is None:
                return None
            in_parts = isinstance(rows, cma.CmaPlan) and rows.nbytes > int(self.params["cma_inline_bytes"])
            if in_parts:
                # checked against the rkeys the peer holds now: its revocations, and our deregistrations of the
                # local regions, wait for the parts
                op_id = next(self._cma_ids)
                self._cma_ops[op_id] = (peer, req.plan.regions)
            elif isinstance(rows, cma.CmaPlan):
                error = self.cma_path._copy_cma(peer, req, rows, deadline)
            elif (held := self._held(peer.name, req.op)) is not None:
                completion = Completion(1)
                completion.finish_part(held)
                return completion
            else:
                flush, status = self.one_sided._post_one_sided(peer, req.op, rows)
        if in_parts:
            return self.cma_path._start_cma_parts(peer, req, rows, deadline, op_id)  # type: ignore[arg-type]
        if isinstance(rows, cma.CmaPlan):
            if error is None:
                if req.notify:
                    self._submit(lambda: self._send_after(peer, req.notify))
                return finished_completion()
            completion = Completion(1)
            completion.finish_part(error)
            return completion
        completion = self._fenced()
        if flush is None:
            completion.finish_part(self.one_sided._status_error(status, peer))
            return completion
        direct = Direct(peer, req, completion, flush, deadline)
        if not self.one_sided._finish_direct(direct):
            # the waiter progresses UCX itself (no thread hop); the service thread picks it up at its next
            # turn for callers that never wait
            self._directs.append(direct)
            completion.set_assist(lambda: self.one_sided._drive(direct))
        return completion

    def send_notification(self, remote: str, message: bytes) -> None:
        """Send ``message`` once the peer is connected; one reported as not sent is never sent later."""
        done, claim = Completion(1), threading.Lock()  # who takes ``claim`` first: the sender, or this giving up
        self._submit(lambda: self._notify(remote, bytes(message), done, claim))
        if not done.wait(float(self.params["connect_timeout_s"]) + 1.0):
            if claim.acquire(blocking=False):
                raise RemoteDisconnected(f"notification to {remote!r} was not sent in time", backend=self.name)
            done.wait(float(self.params["close_timeout_s"]))  # being sent right now: it finishes at once
        if done.error is not None:
            raise done.error

    def served_rows(self) -> int:
        """Rows of peers' requests with sends or receives posted here, not yet ended (``max_served_rows``)."""
        return sum(len(entry[0].reqs) for i in list(self._inbound.values()) for entry in list(i.ops.values()))

    def close(self) -> None:
        """Stop the service thread; it frees every UCX object (endpoints, workers, the context) as it ends, so
        they are gone when this returns. A thread still running after ``close_timeout_s`` (a UCX call that does
        not return) is left to free them, and what it polls, when it ends: logged as an error."""
        if self._closed:
            return
        self._closed = True
        with self._ending:  # commands queued before this are run (or failed) by the service thread's end
            self._stop = True
        self._wake()
        self._thread.join(float(self.params["close_timeout_s"]))
        with self._ending:  # the thread, at its end, reads this under the same lock
            self._orphaned = not self._ended
        if self._orphaned:
            log.error(
                "the ucx service thread of %s did not end within %g s; it frees its UCX objects when it ends",
                self.host.name, float(self.params["close_timeout_s"]),
            )  # fmt: skip
            return
        self._close_rest(wait=True)
        gc.collect()

    def _close_rest(self, wait: bool) -> None:
        """What the service thread polls and hands work to, once it has ended (or as its last act)."""
        if self._cma_pool is not None:
            self._cma_pool.shutdown(wait=wait)
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
