"""The control channel between vLLM's scheduler (the offloading manager) and its workers (where the KV bytes are).

vLLM runs the manager in the engine-core process and each worker, holding its KV cache and the TieredCache its
blocks go to, in a process of its own (on CPU always; on a GPU when TP > 1). The manager only asks questions: is a
block held, pin it for a load, unpin it, how are the tiers doing. Each worker answers them on a Unix socket under a
private directory, one msgpack frame per call; a worker in the manager's own process is called directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger("datamover.integrations.vllm")

MAX_FRAME = 8 << 20  # a frame larger than this is refused before it is read
MAX_KEYS = 1 << 16  # keys in one call
MAX_KEY_BYTES = 256
VERBS = ("lookup", "pin", "unpin", "stats", "clear")
_LEN = struct.Struct("!I")

# workers living in this process, by socket path: their manager calls them without a socket
_LOCAL: dict[str, Callable[[str, list], Any]] = {}


class ServiceError(RuntimeError):
    """The worker's cache service could not be reached or refused the call."""


def socket_path(engine_id: str, rank: int) -> str:
    """Where the worker of `rank` of engine `engine_id` listens (the same in the scheduler and the worker)."""
    directory = Path(tempfile.gettempdir()) / f"datamover-vllm-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    tag = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return str(directory / f"{tag}-{int(rank)}.sock")


def check_keys(value: Any) -> list[bytes]:
    """The keys argument of a call, checked: a list of at most MAX_KEYS byte strings of at most MAX_KEY_BYTES."""
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ValueError("keys must be a list of at most 65536 entries")
    if not all(isinstance(k, bytes) and len(k) <= MAX_KEY_BYTES for k in value):
        raise ValueError(f"each key must be bytes of at most {MAX_KEY_BYTES}")
    return value


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_FRAME:
        raise ValueError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return msgpack.unpackb(_recv_exact(sock, n), raw=False)


class CacheService:
    """Serves `handler(verb, args)` on a Unix socket at `path` (mode 0600), one thread per connection."""

    def __init__(self, path: str, handler: Callable[[str, list], Any]) -> None:
        self.path = path
        self._handler = handler
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._stop = threading.Event()
        _LOCAL[path] = handler
        self._thread = threading.Thread(target=self._serve, name="dm-vllm-service", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), name="dm-vllm-session", daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            while not self._stop.is_set():
                try:
                    request = _recv(conn)
                except (ConnectionError, OSError):
                    return
                except (ValueError, msgpack.UnpackException) as exc:
                    log.warning("datamover vllm service: dropping a malformed request (%s)", exc)
                    return
                try:
                    if not (isinstance(request, list) and len(request) == 2 and request[0] in VERBS):
                        raise ValueError(f"expected [verb, args] with a verb of {VERBS}")
                    if not isinstance(request[1], list):
                        raise ValueError("args must be a list")
                    reply = [True, self._handler(request[0], request[1])]
                except Exception as exc:  # the caller gets the reason; the service keeps serving
                    reply = [False, f"{type(exc).__name__}: {exc}"]
                try:
                    _send(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        _LOCAL.pop(self.path, None)
        try:
            self._sock.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


class CacheClient:
    """Calls one worker's CacheService (directly when that worker lives in this process)."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, verb: str, *args: Any) -> Any:
        """The worker's answer to `verb(*args)`; ServiceError if it cannot be had."""
        local = _LOCAL.get(self.path)
        if local is not None:
            return local(verb, list(args))
        with self._lock:
            for attempt in (0, 1):  # a connection the worker closed is re-opened once, before anything was sent
                try:
                    if self._sock is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.settimeout(self.timeout_s)
                        sock.connect(self.path)
                        self._sock = sock
                    _send(self._sock, [verb, list(args)])
                    break
                except OSError as exc:
                    self._drop()
                    if attempt:
                        raise ServiceError(f"datamover cache service at {self.path}: {exc}") from exc
            try:  # no retry once sent: pin and unpin are not idempotent
                ok, result = _recv(self._sock)
            except (OSError, ConnectionError, ValueError, TypeError, msgpack.UnpackException) as exc:
                self._drop()
                raise ServiceError(f"datamover cache service at {self.path}: {exc}") from exc
        if not ok:
            raise ServiceError(f"datamover cache service refused {verb}: {result}")
        return result

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


__all__ = ["CacheClient", "CacheService", "ServiceError", "check_keys", "socket_path"]
