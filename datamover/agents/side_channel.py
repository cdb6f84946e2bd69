"""The TCP side channel: peers fetch an agent's metadata, push theirs, or ask it to forget them.

Wire format: the client opens with a 4-byte verb. ``GET `` is answered with
``DMMD`` + a 4-byte big-endian length + the current blob. ``PUSH`` and
``DROP`` carry ``length + payload`` (a metadata blob; an agent's name, signed
like a blob when a secret is set) and are answered with ``OK``+``\\0\\0`` or
``ERR `` + length + reason. The blob is produced at request time, so memory
registered since a peer's last fetch is included when it fetches again.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from ..errors import DatamoverError, InvalidMetadata, RemoteDisconnected, RemoteRefused
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.side_channel")

MAGIC = b"DMMD"
GET, PUSH, DROP = b"GET ", b"PUSH", b"DROP"
OK, ERR = b"OK\0\0", b"ERR "
_HEAD = struct.Struct("!4sI")


class MetadataServer:
    """Serves ``provider()`` on (host, port); ``on_push(blob)`` and ``on_drop(payload)`` take the other verbs.

    Port 0 picks a free one. Without a handler, that verb is refused.
    """

    def __init__(
        self,
        provider: Callable[[], bytes],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_push: Callable[[bytes], object] | None = None,
        on_drop: Callable[[bytes], object] | None = None,
    ) -> None:
        self._provider = provider
        self._handlers = {PUSH: on_push, DROP: on_drop}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, int(port)))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"dm-metadata-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn.settimeout(5.0)
                self._answer(conn)
            except Exception as exc:  # one failed client must not stop the server
                log.warning("side channel request failed: %s", exc)
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        verb = _recv_exact(conn, 4)
        if verb == GET:
            blob = self._provider()
            conn.sendall(_HEAD.pack(MAGIC, len(blob)) + blob)
            return
        handler = self._handlers.get(verb)
        if verb not in self._handlers:
            raise InvalidMetadata(f"unknown side channel verb {verb!r}")
        payload = _recv_sized(conn, "request")
        try:
            if handler is None:
                raise RemoteRefused(f"this agent does not accept {verb.decode().strip()} requests")
            handler(payload)
        except DatamoverError as exc:
            reason = str(exc).encode()
            conn.sendall(_HEAD.pack(ERR, len(reason)) + reason)
            return
        conn.sendall(OK)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(2)


def fetch_metadata(host: str, port: int, timeout: float = 5.0) -> bytes:
    """Read a peer's blob from its side channel; RemoteDisconnected if unreachable, InvalidMetadata if garbled."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(GET)
            magic, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
            if magic != MAGIC:
                raise InvalidMetadata(f"{host}:{port} is not a datamover metadata side channel")
            if n > MAX_BLOB_BYTES:
                raise InvalidMetadata(f"{host}:{port} announced a {n}-byte blob; at most {MAX_BLOB_BYTES} accepted")
            return _recv_exact(sock, n)
    except OSError as exc:
        raise RemoteDisconnected(f"cannot fetch metadata from {host}:{port}: {exc.strerror or exc}") from None


def send_request(host: str, port: int, verb: bytes, payload: bytes, timeout: float = 5.0) -> None:
    """Send a PUSH or DROP to a peer's side channel; RemoteRefused carries the peer's reason."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(verb + struct.pack("!I", len(payload)) + payload)
            status = _recv_exact(sock, 4)
            if status == OK:
                return
            if status != ERR:
                raise InvalidMetadata(f"{host}:{port} answered {status!r}: not a datamover side channel")
            reason = _recv_sized(sock, "reply").decode(errors="replace")
    except OSError as exc:
        raise RemoteDisconnected(f"cannot reach the side channel at {host}:{port}: {exc.strerror or exc}") from None
    raise RemoteRefused(f"{host}:{port} refused {verb.decode().strip()}: {reason}")


def _recv_sized(sock: socket.socket, what: str) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"side channel {what} of {n} bytes; at most {MAX_BLOB_BYTES} accepted")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise InvalidMetadata(f"side channel closed after {len(buf)} of {n} bytes (truncated)")
        buf += chunk
    return bytes(buf)
