"""The target side of the control protocol: accepting initiators, their hello, and what they ask for."""

from __future__ import annotations

import hmac
import selectors
from collections.abc import Callable

import msgpack

from ...errors import (
    AuthenticationError,
    InvalidMetadata,
)
from .config import log, peer_elsewhere
from .messages import Cancel, Challenge, Error, Hello, Message, Notif, Req, Revoked, Welcome
from .protocol import FrameConn, handshake_mac, session_key
from .state import Inbound


class Serving:
    """The target side of the control protocol: accepting initiators, their hello, and what they ask for."""

    # -- target side --------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if len(self._inbound) >= int(self.params["max_inbound"]):
                log.warning("refusing a control connection: %d already open", len(self._inbound))
                sock.close()
                continue
            inbound = Inbound(FrameConn(sock, outbound=False, budget=self._frames), self._next_conn_id)
            self._next_conn_id = self._next_conn_id % ((1 << 22) - 1) + 1
            self._inbound[sock.fileno()] = inbound
            self._sel.register(sock, selectors.EVENT_READ, inbound)
            inbound.conn.send(Challenge(inbound.nonce))

    def _drop_silent(self, now: float) -> None:
        """Hang up on connections that never completed the handshake in time (they hold a socket and a buffer)."""
        late = now - float(self.params["connect_timeout_s"])
        for inbound in [i for i in self._inbound.values() if not i.name and i.since < late]:
            log.warning("dropping a control connection that did not say hello in time")
            self._drop_inbound(inbound)

    def _drop_inbound(self, inbound: Inbound) -> None:
        for waiting in self.mapped_regions.revoking.values():
            waiting.discard(inbound.conn_id)
        for op_id in inbound.ops:
            self._active_in.pop((inbound.conn_id, op_id), None)
        inbound.ops.clear()
        self._retired.cancel_now(self._quiesced)  # what was in flight goes before its endpoint closes
        try:
            self._sel.unregister(inbound.conn.sock)
        except (KeyError, ValueError):
            pass
        self._inbound = {k: v for k, v in self._inbound.items() if v is not inbound}
        inbound.conn.close()
        if inbound.name and not inbound.elsewhere:  # it said hello: UCX endpoints of its stay (see _maybe_recycle)
            self.departed += 1
        self._retire_ep(inbound.ep)
        inbound.ep = None

    def _on_inbound_msg(self, inbound: Inbound, msg: Message) -> None:
        """Dispatch a message from an initiator (already parsed by ``messages.from_wire``) by its type."""
        if type(msg) is Hello:
            if inbound.name:
                raise InvalidMetadata("a second hello on one connection")
            self._on_hello(inbound, msg)
            return
        if not inbound.name:
            raise InvalidMetadata(f"control message {msg.WIRE!r} before hello")
        handler = _FROM_INITIATOR.get(type(msg))
        if handler is None:
            raise InvalidMetadata(f"control message {msg.WIRE!r} is not one an initiator sends")
        handler(self, inbound, msg)

    def _on_req(self, inbound: Inbound, msg: Req) -> None:
        self.tagged._serve(inbound, msg)

    def _on_notif_from(self, inbound: Inbound, msg: Notif) -> None:
        self.host.deliver_notification(inbound.name, msg.msg)

    def _on_revoked(self, inbound: Inbound, msg: Revoked) -> None:
        self.mapped_regions.revoking.get(msg.id, set()).discard(inbound.conn_id)

    def _on_cancel(self, inbound: Inbound, msg: Cancel) -> None:
        self.tagged._cancel_served(inbound, msg.id)

    def _on_hello(self, inbound: Inbound, msg: Hello) -> None:
        name, address, nonce_i = msg.name, msg.address, msg.nonce
        if self._secret:
            want = handshake_mac(self._secret, b"hello", inbound.nonce, nonce_i, name.encode() + address)
            if not hmac.compare_digest(msg.mac, want):
                inbound.conn.send(Error("authentication failed (shared secret)", auth=True))
                raise AuthenticationError(f"agent {name!r} failed authentication")
        try:
            self._addr_check.check(address, f"agent {name!r}")
            self._check_segments(f"agent {name!r}", msg.tcp_rx)
        except InvalidMetadata as exc:
            inbound.conn.send(Error(exc.reason))
            raise
        try:
            ucx_addr = self._ucx.UCXAddress.create_from_buffer(address)
            inbound.ep = self._worker.create_endpoint_from_worker_address(ucx_addr, bool(self.params["error_handling"]))
        except Exception as exc:
            inbound.conn.send(Error(f"cannot reach your UCX worker: {exc}"))
            raise InvalidMetadata(f"agent {name!r} sent an unusable UCX address: {exc}") from None
        inbound.name = name
        inbound.elsewhere = peer_elsewhere(inbound.conn.sock)
        if inbound.elsewhere:
            self.pacing.serving_far()
        rkeys = msgpack.packb([entry for _, entry in self.mapped_regions.mapped.values()])
        local = msgpack.packb(self._cma_token.offer()) if self._cma_token is not None else b""
        mac = b""
        if self._secret:
            body = inbound.conn_id.to_bytes(8, "big") + self._address + rkeys + local
            mac = handshake_mac(self._secret, b"welcome", inbound.nonce, nonce_i, body)
        inbound.conn.send(Welcome(inbound.conn_id, self._address, rkeys, local, mac, self._tcp_rx, self._incarnation))
        if self._secret:
            inbound.conn.authenticate(session_key(self._secret, inbound.nonce, nonce_i))
        else:
            inbound.conn.open_up()

    def _check_segments(self, who: str, peer_rx: int) -> None:
        """Refuse a peer whose UCX receives smaller tcp segments than this side sends (UCX would abort on one)."""
        if self._tcp_tx and peer_rx and self._tcp_tx > peer_rx:
            raise InvalidMetadata(
                f"{who} receives UCX tcp segments of {peer_rx} bytes, this agent sends up to {self._tcp_tx} (UCX "
                "aborts on a larger one): give both agents the same UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE "
                "(ucx_config)"
            )


# what an initiator may send after its hello, by message type
_FROM_INITIATOR: dict[type[Message], Callable[..., None]] = {
    Req: Serving._on_req,
    Notif: Serving._on_notif_from,
    Revoked: Serving._on_revoked,
    Cancel: Serving._on_cancel,
}
