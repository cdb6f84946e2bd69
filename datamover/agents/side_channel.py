"""The TCP side channel: an agent serves its current metadata blob to whoever connects.

Wire format: the server writes ``DMMD`` + a 4-byte big-endian length + the
blob, then closes. The blob is produced at request time, so memory registered
since a peer's last fetch is included when it fetches again (refresh).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable

from ..errors import InvalidMetadata, RemoteDisconnected
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.side_channel")

MAGIC = b"DMMD"
_HEAD = struct.Struct("!4sI")


class MetadataServer:
    """Answers every TCP connection on (host, port) with ``provider()``; port 0 picks a free one."""

    def __init__(self, provider: Callable[[], bytes], host: str = "127.0.0.1", port: int = 0) -> None:
        self._provider = provider
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
                blob = self._provider()
                conn.sendall(_HEAD.pack(MAGIC, len(blob)) + blob)
            except Exception as exc:  # one failed client must not stop the server
                log.warning("serving metadata failed: %s", exc)
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(2)


def fetch_metadata(host: str, port: int, timeout: float = 5.0) -> bytes:
    """Read a peer's blob from its side channel; RemoteDisconnected if unreachable, InvalidMetadata if garbled."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            head = _recv_exact(sock, _HEAD.size)
            magic, n = _HEAD.unpack(head)
            if magic != MAGIC:
                raise InvalidMetadata(f"{host}:{port} is not a datamover metadata side channel")
            if n > MAX_BLOB_BYTES:
                raise InvalidMetadata(f"{host}:{port} announced a {n}-byte blob; at most {MAX_BLOB_BYTES} accepted")
            return _recv_exact(sock, n)
    except OSError as exc:
        raise RemoteDisconnected(f"cannot fetch metadata from {host}:{port}: {exc.strerror or exc}") from None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise InvalidMetadata(f"side channel closed after {len(buf)} of {n} bytes (truncated)")
        buf += chunk
    return bytes(buf)
