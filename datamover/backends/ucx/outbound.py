"""The initiator side of the control protocol: connecting to peers, the handshake, requests queued behind it."""

from __future__ import annotations

import dataclasses
import hmac
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ...errors import (
    AuthenticationError,
    DatamoverError,
    InvalidMetadata,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
)
from ..base import (
    Completion,
    TransferRequest,
)
from . import cma, rma
from .config import _MASK40, _MAX_RKEYS, _READ_TAG, log, parse_rkeys, peer_elsewhere
from .messages import Challenge, Done, Error, Fail, Hello, Message, Notif, Refuse, Revoke, Rkeys, Welcome
from .protocol import FrameConn, decode, handshake_mac, new_nonce, session_key
from .rkeys import RkeyCheck
from .state import OutOp, Peer


class Outbound:
    """The initiator side of the control protocol: connecting to peers, the handshake, requests queued behind it."""

    # -- initiator side ---------------------------------------------------------
    def _peer(self, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise RemoteDisconnected(f"agent {name!r} is not loaded into the ucx backend", backend=self.name)
        if peer.state == "idle":
            self._connect(peer)
        return peer

    def _connect(self, peer: Peer) -> None:
        host, port = peer.info["host"], peer.info["port"]
        try:
            sock = socket.create_connection((host, port), timeout=float(self.params["connect_timeout_s"]))
        except OSError as exc:
            raise RemoteDisconnected(
                f"cannot reach agent {peer.name!r} at {host}:{port}: {exc.strerror or exc}", backend=self.name
            ) from None
        peer.conn = FrameConn(sock, outbound=True, budget=self._frames)
        peer.nonce = new_nonce()
        peer.state = "connecting"
        peer.since = time.monotonic()
        self._sel.register(sock, selectors.EVENT_READ, peer)

    def _disconnect_peer(self, peer: Peer, why: BaseException) -> None:
        """Close the connection to ``peer`` and fail its requests with ``why``.

        Requests with UCX operations still running are finished last: one-sided gets or puts in flight, and
        owner-served receives or sends still posted (a READ's take what the owner still sends, a WRITE's go on
        reading the caller's buffer). The worker is replaced and kept, never progressed again (quarantined), first,
        so that none of their bytes moves after ERR.
        """
        directs = [d for d in list(self._directs) if d.peer is peer]
        for direct in directs:
            self.one_sided._forget_direct(direct)
        posted = (
            []
            if self._resetting
            else [op for op in peer.ops.values() if op.reqs is not None and not op.abandoned and op.reqs.pending()]
        )
        in_flight = not self._resetting and (bool(posted) or any(self.one_sided._in_flight(d) for d in directs))
        self._fail_ops(peer, why, keep=posted)
        self._retired.cancel_now(self._quiesced)  # what they had in flight goes before the endpoint closes
        for entry in [r for r in self._revokes if r[0] is peer]:
            entry[2].abandon()
            self._revokes.remove(entry)
        with self._rma_lock:
            peer.state = "closing"
            for rkey in peer.rkeys.values():
                self._destroy_rkey(rkey)
            peer.rkeys.clear()
            if peer.data_ep is not None:
                if self._data is not None:
                    status = self._data.close_ep(peer.data_ep)
                    if status not in (rma.UCS_OK, rma.UCS_INPROGRESS):  # left open: the peer's segments stay mapped
                        log.warning("closing the data endpoint to %r failed: %s", peer.name, rma.status_text(status))
                peer.data_ep = None
            peer.regions = {}
            peer.epoch = next(self._epochs)
            peer.session += 1
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
        if peer.ep is not None and not peer.elsewhere:  # UCX endpoints of the connection stay (see _maybe_recycle)
            self.departed += 1
        self._retire_ep(peer.ep)
        peer.ep = None
        peer.state = "idle"
        if in_flight:
            self._reset_worker(
                f"agent {peer.name!r} was let go with UCX operations of its transfers in flight",
                quarantine=True,
                culprit=peer.name,
            )
            for direct in directs:
                self._undriven(direct)
        for op in posted:
            op.finish(op.failure or why)
        for direct in directs:
            self.one_sided._finish_direct(direct, why)

    def _fail_ops(self, peer: Peer, why: BaseException, keep: Sequence[OutOp] = ()) -> None:
        """End the peer's requests with ``why`` and forget them (in a call of its own: no local keeps one); those
        in ``keep`` are finished by the caller, once the worker their operations are on was replaced, and only
        their operations still posted go now (cancelled with the others: what was not matched yet never lands)."""
        kept = {id(op) for op in keep}
        for op in list(peer.ops.values()):
            self._active_out.pop(op.id, None)
            if id(op) in kept:
                reqs = op.reqs
                self._retired.add(reqs.reqs[reqs.k :])  # type: ignore[union-attr]
                reqs.k = len(reqs.reqs)  # type: ignore[union-attr]
            else:
                op.finish(op.failure or why)  # what made it fail first says more than the hang-up that may follow
        peer.ops.clear()

    def _drop_peer(self, name: str, why: BaseException) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            self._disconnect_peer(peer, why)

    def _add_peer(self, name: str, info: dict[str, Any]) -> None:
        old = self._peers.get(name)
        if old is not None and old.info == info:
            return
        if old is not None and _same_process(old.info, info):
            # its worker was replaced since (a reset or a recycle): a connection takes the current worker's address
            # from the welcome, so the one it has (and the transfers on it) go on
            old.info = info
            return
        if old is not None:
            self._drop_peer(name, RemoteDisconnected(f"agent {name!r} came back with new metadata", backend=self.name))
        self._peers[name] = Peer(name, info)

    def _start(self, req: TransferRequest, completion: Completion, deadline: float) -> None:
        try:
            peer = self._peer(req.remote_agent)  # type: ignore[arg-type]
        except Exception as exc:
            err = exc if isinstance(exc, DatamoverError) else DatamoverError(f"{exc}", backend=self.name)
            completion.finish_part(err)
            return
        op = OutOp(self._next_op, peer, req, completion, deadline)
        self._next_op += 1
        peer.ops[op.id] = op
        if peer.state == "ready":
            self._launch(peer, op)
        else:
            peer.queue.append(("req", op))

    def _notify(self, name: str, message: bytes, done: Completion, claim: threading.Lock) -> None:
        """Send a notification now, or queue it behind the handshake; ``claim`` taken first means its caller gave up."""
        try:
            peer = self._peer(name)
        except DatamoverError as exc:
            done.finish_part(exc)
            return
        if peer.state == "ready":
            self._send_notif(peer, message, done, claim)
        else:
            peer.queue.append(("notify", (message, done, claim)))

    @staticmethod
    def _send_notif(peer: Peer, message: bytes, done: Completion, claim: threading.Lock) -> None:
        if claim.acquire(blocking=False):  # else its caller was told it was not sent: it never is
            peer.conn.send(Notif(message))  # type: ignore[union-attr]
            done.finish_part()

    def _launch(self, peer: Peer, op: OutOp) -> None:
        """Send the request and post this side's UCX operations at once (no round trip first).

        READ posts its receives before the request leaves, so the target's
        sends always find them; WRITE posts its sends right after the request.
        """
        if op.completion.cancelled or time.monotonic() > op.deadline - float(self.params["launch_margin_s"]):
            self.tagged._end(op, op.completion.error or self.tagged._late(op))
            return
        gone = op.req.plan.regions - self.host.regions.keys()
        if gone:
            self.tagged._end(op, NotRegistered(f"local region(s) {sorted(gone)} were deregistered", backend=self.name))
            return
        rows = self.one_sided._one_sided_rows(peer, op.req) if peer.regions else None
        if not isinstance(rows, cma.CmaPlan) and (held := self._held(peer.name, op.req.op)) is not None:
            self.tagged._end(op, held)
            return
        if rows is not None:
            self.one_sided._launch_one_sided(peer, op, rows)
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
        msg = dataclasses.replace(op.req.plan.msg, id=op.id, tag=op.tag0)
        if op.req.op == "READ" and not self.tagged._post_local(peer, op):
            return
        peer.conn.send(msg)  # type: ignore[union-attr]
        if op.req.op == "WRITE":
            self.tagged._post_local(peer, op)

    def _on_peer_msg(self, peer: Peer, msg: Message) -> None:
        """Dispatch a message from a target (already parsed by ``messages.from_wire``) by its type."""
        kind = type(msg)
        if (kind in _HANDSHAKE) != (peer.state == "connecting") and kind is not Error:
            raise InvalidMetadata(f"control message {msg.WIRE!r} out of order (connection {peer.state})")
        handler = _FROM_TARGET.get(kind)
        if handler is None:
            raise InvalidMetadata(f"control message {msg.WIRE!r} is not one a target sends")
        if kind in _ABOUT_AN_OP:
            op = peer.ops.get(msg.id)  # type: ignore[attr-defined]
            if op is not None:
                handler(self, peer, op, msg)
            return
        handler(self, peer, msg)

    def _on_error(self, peer: Peer, msg: Error) -> None:
        kind = AuthenticationError if msg.auth else RemoteRefused
        self._disconnect_peer(peer, kind(f"agent {peer.name!r} refused the connection: {msg.reason}"))

    def _on_notif(self, peer: Peer, msg: Notif) -> None:
        self.host.deliver_notification(peer.name, msg.msg)

    def _on_rkeys(self, peer: Peer, msg: Rkeys) -> None:
        if self._one_sided:
            regions = {**peer.regions, **self._offered(peer, msg.add)}
            if len(regions) > _MAX_RKEYS:  # each message is bounded, not what they add up to
                raise InvalidMetadata(
                    f"agent {peer.name!r} offered more than {_MAX_RKEYS} regions for one-sided access (what a welcome "
                    "may carry)"
                )
            with self._rma_lock:
                peer.regions = regions
                peer.epoch = next(self._epochs)

    def _on_revoke(self, peer: Peer, msg: Revoke) -> None:
        self.one_sided._forget_region(peer, msg.id)

    def _on_refuse(self, peer: Peer, op: OutOp, msg: Refuse) -> None:
        row = msg.row
        index = op.req.caller_index(row) if row is not None and 0 <= row < len(op.req.local) else None
        why = RemoteRefused(f"agent {peer.name!r} refused: {msg.reason}", index=index, backend=self.name)
        self._fail_served(op, why)  # a READ's receives are completed here: the target sent nothing

    def _on_done(self, peer: Peer, op: OutOp, msg: Done) -> None:
        op.done_msg = True
        self.tagged._maybe_done(op)

    def _on_fail(self, peer: Peer, op: OutOp, msg: Fail) -> None:
        self._fail_served(
            op, RemoteDisconnected(f"agent {peer.name!r} failed the transfer: {msg.reason}", backend=self.name)
        )

    def _hello(self, peer: Peer, msg: Challenge) -> None:
        peer.nonce_t = nonce_t = msg.nonce
        body = self.host.name.encode() + self._address
        mac = handshake_mac(self._secret, b"hello", nonce_t, peer.nonce, body) if self._secret else b""
        peer.conn.send(Hello(self.host.name, self._address, peer.nonce, mac, self._tcp_rx))  # type: ignore[union-attr]

    def _welcome(self, peer: Peer, msg: Welcome) -> None:
        conn_id, address, rkeys, local = msg.conn_id, msg.address, msg.rkeys, msg.local
        nonce_t = peer.nonce_t
        if self._secret:
            body = conn_id.to_bytes(8, "big") + address + rkeys + local
            want = handshake_mac(self._secret, b"welcome", nonce_t, peer.nonce, body)
            if not hmac.compare_digest(msg.mac, want):
                raise AuthenticationError(f"agent {peer.name!r} does not know the shared secret")
            peer.conn.authenticate(session_key(self._secret, nonce_t, peer.nonce))  # type: ignore[union-attr]
        else:
            peer.conn.open_up()  # type: ignore[union-attr]
        want = peer.info.get("incarnation")
        if want is not None and msg.incarnation != want:
            host, port = peer.info["host"], peer.info["port"]
            raise RemoteDisconnected(
                f"agent {peer.name!r} at {host}:{port} is not the process its metadata loaded here describes (it "
                "restarted, or another agent took its port): load its current metadata",
                backend=self.name,
            )
        checked = self._addr_check.check(address, f"agent {peer.name!r}")
        self._check_segments(f"agent {peer.name!r}", msg.tcp_rx)
        try:  # the target's current worker (it may have been reset since its metadata was published)
            ucx_addr = self._ucx.UCXAddress.create_from_buffer(address)
            peer.ep = self._worker.create_endpoint_from_worker_address(ucx_addr, bool(self.params["error_handling"]))
            peer.data_ep = self._data.connect(bytes(address)) if self._data is not None else None
        except Exception as exc:
            raise InvalidMetadata(f"agent {peer.name!r} sent an unusable UCX address: {exc}") from None
        peer.conn_id = conn_id
        peer.keys = RkeyCheck(checked)
        regions = self._offered(peer, decode(rkeys, max_maps=0) if rkeys else []) if self._one_sided else {}
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
            peer.elsewhere = peer_elsewhere(peer.conn.sock)  # type: ignore[union-attr]
            peer.cork = None
            if peer.elsewhere:
                try:
                    peer.ip = str(peer.conn.sock.getpeername()[0])  # type: ignore[union-attr]
                except OSError:
                    peer.ip = ""
        self._ready(peer)

    @staticmethod
    def _offered(peer: Peer, rows: object) -> dict[int, tuple[str, int, int, int, bytes]]:
        """A target's rkey rows checked field by field, each packed key parsed (rkeys.py) before UCX sees it."""
        regions = parse_rkeys(peer.name, rows)
        if peer.keys is None:
            raise InvalidMetadata(f"agent {peer.name!r} sent rkeys before its UCX address")
        for rid, (mem, _dev, _addr, _n, key) in regions.items():
            peer.keys.check(f"agent {peer.name!r}", rid, mem, key)
        return regions

    def _ready(self, peer: Peer) -> None:
        peer.state = "ready"
        queue, peer.queue = peer.queue, []
        for kind, item in queue:
            if kind == "req":
                self._launch(peer, item)
            else:
                self._send_notif(peer, *item)

    def _send_after(self, peer: Peer, message: bytes) -> None:
        """A notification for a request that already completed (its data has landed)."""
        if peer.conn is not None and peer.state == "ready":
            peer.conn.send(Notif(message))

    def _check_handshakes(self, now: float) -> None:
        """Give up on targets that did not finish the handshake within connect_timeout_s (what waits on it fails)."""
        late = now - float(self.params["connect_timeout_s"])
        for peer in [p for p in self._peers.values() if p.state == "connecting" and p.since < late]:
            why = f"agent {peer.name!r} did not finish the handshake within {self.params['connect_timeout_s']} s"
            self._disconnect_peer(peer, RemoteDisconnected(why, backend=self.name))

    def _check_cancelled(self) -> None:
        """Ops still waiting for the handshake give up when released or late; launched ones run to the end."""
        now = time.monotonic()
        for peer in self._peers.values():
            if peer.state == "ready":
                continue
            for op in list(peer.ops.values()):
                if op.reqs is None and not op.abandoned and (op.completion.cancelled or now > op.deadline):
                    op.finish(op.completion.error or self.tagged._late(op))


def _same_process(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two connection infos of a peer name one process (its incarnation, host and port), whatever the
    worker address."""
    return old.get("incarnation") is not None and all(old.get(k) == new.get(k) for k in ("incarnation", "host", "port"))


# what a target may send an initiator, by message type; the last three are about one of its requests
_FROM_TARGET: dict[type[Message], Callable[..., None]] = {
    Challenge: Outbound._hello,
    Welcome: Outbound._welcome,
    Error: Outbound._on_error,
    Notif: Outbound._on_notif,
    Rkeys: Outbound._on_rkeys,
    Revoke: Outbound._on_revoke,
    Refuse: Outbound._on_refuse,
    Done: Outbound._on_done,
    Fail: Outbound._on_fail,
}
_HANDSHAKE = frozenset({Challenge, Welcome})
_ABOUT_AN_OP = frozenset({Refuse, Done, Fail})
