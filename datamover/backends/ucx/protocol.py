"""The UCX backend's control protocol: length-prefixed msgpack frames over TCP, optionally HMAC-signed.

The messages the frames carry are the typed ones of ``messages``.

Data moves over UCX; requests, acknowledgements, refusals and notifications
move over one TCP connection per (initiator, target) pair. The connection is
also how a dead peer is noticed: the kernel closes a killed process's
sockets, so the survivor reads EOF at once.

Handshake: the target sends ``challenge`` with a nonce; the initiator answers
``hello`` (its name, UCX worker address and its own nonce); the target
answers ``welcome`` (a connection id, and its incarnation: the initiator
hangs up on a process other than the one whose connection info it loaded,
e.g. one restarted on the same port). With a shared secret both handshake
messages carry an HMAC over both nonces, and every later frame carries a
16-byte HMAC over (direction, sequence number, payload) under a session key,
so a peer without the secret is refused and frames cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import msgpack

from ...errors import AuthenticationError, InvalidMetadata
from .messages import MAX_RKEY_ROWS, Message, from_wire

MAX_FRAME = 64 << 20  # after the handshake: a request of MAX_ROWS rows (24 bytes each) fits with room to spare
MAX_HELLO_FRAME = 64 << 10  # before it: challenge, hello, welcome carry an address, a token and small keys
MAC_LEN = 16
_LEN = struct.Struct("!I")
_CHUNK = 1 << 20


#: an rkey row (``messages.Rkeys``) has six fields: the only lists a message holds besides the list of rows
_ROW_FIELDS = 6


def decode(payload: bytes, max_maps: int = 1) -> object:
    """A msgpack document shaped like a control message, or InvalidMetadata: at most ``max_maps`` maps of up to
    64 entries, and lists only as rkey rows (at most ``MAX_RKEY_ROWS`` lists, one of them longer than six).

    Bytes bound only what a document spends on strings: 64 MiB of empty arrays would be 64M Python lists (about
    4 GiB); the hooks refuse the first container over those counts, so the work stops there.
    """
    maps = lists = long = 0

    def on_map(d: dict) -> dict:
        nonlocal maps
        maps += 1
        if maps > max_maps:
            raise ValueError("maps nested in a control message")
        return d

    def on_list(items: list) -> list:
        nonlocal lists, long
        lists += 1
        long += len(items) > _ROW_FIELDS
        if lists > MAX_RKEY_ROWS + 1 or long > 1:
            raise ValueError("lists nested in a control message beyond its rkey rows")
        return items

    try:
        return msgpack.unpackb(
            payload, raw=False, object_hook=on_map, list_hook=on_list, max_map_len=64,
            max_array_len=MAX_RKEY_ROWS, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:
        raise InvalidMetadata(f"control frame is not a valid message: {type(exc).__name__}: {exc}"[:200]) from None


class FrameBudget:
    """The bytes of frames not yet complete that the connections sharing it may hold in all.

    Each connection holds at most one frame (``MAX_FRAME``), but 1024 of them are 64 GiB: a peer that sends
    the start of a large frame and stops would keep it forever. A connection that would take more than what
    is left is refused (its peer is told nothing more; the caller drops it).
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def new_nonce() -> bytes:
    return os.urandom(16)


def handshake_mac(secret: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes, body: bytes) -> bytes:
    """The MAC a side proves the secret with during the handshake."""
    return hmac.new(secret, role + nonce_a + nonce_b + body, hashlib.sha256).digest()


def session_key(secret: bytes, nonce_t: bytes, nonce_i: bytes) -> bytes:
    return hmac.new(secret, b"datamover-ucx-session" + nonce_t + nonce_i, hashlib.sha256).digest()


class FrameConn:
    """A non-blocking TCP connection that sends and receives whole msgpack frames.

    ``feed`` reads what the socket has and returns complete messages;
    ``send`` queues a message and ``flush`` writes as much as the socket
    takes, so two service threads writing to each other never deadlock.
    """

    def __init__(self, sock: socket.socket, outbound: bool, budget: FrameBudget | None = None) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.sock = sock
        self._in = bytearray()
        self._out = bytearray()
        self._key: bytes | None = None
        self._send_dir = b"I" if outbound else b"T"
        self._recv_dir = b"T" if outbound else b"I"
        self._send_seq = 0
        self._recv_seq = 0
        self.closed = False
        self.max_frame = MAX_HELLO_FRAME  # raised by ``authenticate``/``open_up`` once the handshake is done
        self._budget = budget
        self._held = 0  # the bytes of an incomplete frame charged to the budget

    def fileno(self) -> int:
        return self.sock.fileno()

    def authenticate(self, key: bytes) -> None:
        """From now on sign every frame sent and require a valid MAC on every frame received."""
        self._key = key
        self.open_up()

    def open_up(self) -> None:
        """The handshake is done: frames up to MAX_FRAME are read from now on (a request of MAX_ROWS rows)."""
        self.max_frame = MAX_FRAME

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + payload, hashlib.sha256).digest()[:MAC_LEN]

    def send(self, msg: Message) -> None:
        payload = msgpack.packb(msg.to_wire(), use_bin_type=True)
        if self._key is not None:
            payload += self._mac(self._send_dir, self._send_seq, payload)
            self._send_seq += 1
        self._out += _LEN.pack(len(payload))
        self._out += payload
        self.flush()

    @property
    def wants_write(self) -> bool:
        return bool(self._out) and not self.closed

    def flush(self) -> None:
        """Write queued bytes until the socket would block."""
        while self._out and not self.closed:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.closed = True
                return
            del self._out[:n]

    def feed(self) -> list[Message]:
        """Read available bytes; return complete messages, each parsed by ``messages.from_wire``.

        Reads at most one frame ahead (the socket keeps the rest), so a connection holds at most one frame;
        what an incomplete frame holds is charged to the shared budget. Sets ``closed`` on EOF or error. Before the
        handshake is done it returns one frame at a time (``has_frame`` says another is held).

        Raises AuthenticationError on a bad MAC and InvalidMetadata on a malformed frame, a frame over
        ``max_frame``, or an incomplete frame the budget has no room for.
        """
        while len(self._in) <= self.max_frame + 4:
            try:
                chunk = self.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self._in += chunk
            if len(chunk) < _CHUNK:
                break
        out = []
        while len(self._in) >= 4:
            (n,) = _LEN.unpack_from(self._in)
            if n > self.max_frame:
                raise InvalidMetadata(f"control frame of {n} bytes exceeds {self.max_frame}")
            if len(self._in) < 4 + n:
                break
            payload = bytes(self._in[4 : 4 + n])
            del self._in[: 4 + n]
            if self._key is not None:
                body, mac = payload[:-MAC_LEN], payload[-MAC_LEN:]
                if len(payload) < MAC_LEN or not hmac.compare_digest(
                    mac, self._mac(self._recv_dir, self._recv_seq, body)
                ):
                    raise AuthenticationError("control frame failed authentication (bad or missing HMAC)")
                self._recv_seq += 1
                payload = body
            out.append(from_wire(decode(payload)))
            if self.max_frame == MAX_HELLO_FRAME:  # a handshake frame: its handler may raise the bound or set the
                break  # key, by which the frames after it (read with it, kept here: ``has_frame``) are judged
        if self._budget is not None:
            self._charge(len(self._in))
        return out

    @property
    def has_frame(self) -> bool:
        """Whether a whole frame is held, read with the last handshake frame ``feed`` returned: feed again."""
        return len(self._in) >= 4 and len(self._in) >= 4 + _LEN.unpack_from(self._in)[0]

    def _charge(self, held: int) -> None:
        """Charge the budget for ``held`` bytes of an incomplete frame (what was charged before is returned)."""
        budget = self._budget
        assert budget is not None
        budget.give(self._held)
        self._held = 0
        if held and not budget.take(held):
            self._in.clear()
            raise InvalidMetadata(
                f"control frames not yet complete would hold more than {budget.limit} bytes in all "
                f"({budget.used} held by other connections, {held} by this one)"
            )
        self._held = held

    def close(self) -> None:
        self.closed = True
        self._in.clear()
        if self._budget is not None:
            self._charge(0)
        try:
            self.sock.close()
        except OSError:
            pass


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer whose host vanished (no RST) within seconds, not hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 5000)):
        if hasattr(socket, opt):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
            except OSError:
                pass
