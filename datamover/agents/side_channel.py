"""The TCP side channel: peers fetch an agent's metadata, push theirs, or ask it to forget them.

Wire format: the client opens with a 4-byte verb. ``GET `` is answered with
``DMMD`` + a 4-byte big-endian length + the current blob. ``PUSH`` carries
``length + blob`` then ``length + proof`` (the sender's identity token, or
nothing); ``DROP`` carries ``length + payload`` (see ``peer_auth``). Both are
answered with ``OK``+``\\0\\0`` or ``ERR `` + length + reason. The blob is
produced at request time, so memory registered since a peer's last fetch is
included when it fetches again.

The server is one thread multiplexing every connection (``selectors``), so an
idle or slow client holds no thread and blocks nobody: each connection must
deliver its request within ``deadline_s``, and take its reply within as
long again once it is ready (the handler's own time is not counted); at most
``max_connections`` are open (a new one evicts the oldest still sending its
request); a length over ``max_request_bytes``, or one that would take the
bytes buffered for all requests past ``max_buffered_bytes``, is refused from
its header, before anything is allocated. Handlers run on ``workers`` threads.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import DatamoverError, InvalidMetadata, RemoteDisconnected, RemoteRefused
from .limits import check_limits
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.side_channel")

MAGIC = b"DMMD"
GET, PUSH, DROP = b"GET ", b"PUSH", b"DROP"
OK, ERR = b"OK\0\0", b"ERR "
_HEAD = struct.Struct("!4sI")
_LEN = struct.Struct("!I")
_MAX_PROOF = 256
#: the most bytes of an ERR reason sent or read
_MAX_REASON = 4096
#: how long the server stops listening after accept failed with no connection to close (out of descriptors)
ACCEPT_PAUSE_S = 0.1
#: the fields each verb carries after it: (name, most bytes); PUSH's blob limit is the server's max_request_bytes
_FIELDS = {GET: (), PUSH: (("blob", None), ("proof", _MAX_PROOF)), DROP: (("payload", None),)}


@dataclass(frozen=True)
class SideChannelLimits:
    """How much the side channel gives any client (see the module docstring)."""

    max_connections: int = 256
    deadline_s: float = 5.0
    max_request_bytes: int = 8 << 20
    max_buffered_bytes: int = 64 << 20
    workers: int = 2

    def __post_init__(self) -> None:
        check_limits("side_channel", self)


class _Conn:
    __slots__ = ("buf", "deadline", "fields", "need", "opened", "out", "reserved", "sock", "state", "verb")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.opened = time.monotonic()
        self.deadline = deadline
        self.buf = bytearray()
        self.need = 4
        self.state = "verb"  # verb -> len -> body (per field) -> busy (handler) -> reply
        self.verb = b""
        self.fields: list[bytes] = []
        self.out: memoryview | None = None
        self.reserved = 0


class MetadataServer:
    """Serves ``provider()`` on (host, port); ``on_push(blob, proof)`` and ``on_drop(payload)`` take the other verbs.

    Port 0 picks a free one. Without a handler, that verb is refused.
    """

    def __init__(
        self,
        provider: Callable[[], bytes],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        on_push: Callable[[bytes, bytes], object] | None = None,
        on_drop: Callable[[bytes], object] | None = None,
        limits: SideChannelLimits | None = None,
    ) -> None:
        self._provider = provider
        self._handlers = {PUSH: on_push, DROP: on_drop}
        self.limits = lim = limits or SideChannelLimits()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, int(port)))
        self._sock.listen(min(1024, max(64, lim.max_connections)))
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._replies: collections.deque[tuple[_Conn, bytes]] = collections.deque()
        self._buffered = 0
        self._pool = ThreadPoolExecutor(max(1, lim.workers), thread_name_prefix=f"dm-metadata-{self.port}-h")
        self._stop = threading.Event()
        self.evicted = self.expired = 0
        self._resume_at = 0.0  # when the listener is selected again after accept failed (0: it is)
        self._thread = threading.Thread(target=self._serve, name=f"dm-metadata-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- the loop --------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._turn():
                    return
            except Exception:  # a bug in one turn must not stop this agent serving GET, PUSH and DROP
                log.exception("side channel: a turn of the server loop failed; serving on")

    def _turn(self) -> bool:
        """Wait for and serve one round of events, then close the connections past their deadline; False to stop."""
        now = time.monotonic()
        soonest = min((c.deadline for c in self._conns.values() if c.state != "busy"), default=now + 1.0)
        if self._resume_at:
            soonest = min(soonest, self._resume_at)
        try:
            events = self._sel.select(max(0.0, min(soonest - now, 1.0)))
        except OSError:
            return False
        for key, mask in events:
            if self._stop.is_set():
                return False
            if key.fileobj is self._sock:
                self._accept()
            elif key.fileobj is self._wake_r:
                self._drain_wake()
            else:
                conn = self._conns.get(key.fd)
                if conn is not None:
                    self._step(conn, mask)
        now = time.monotonic()
        if self._resume_at and now >= self._resume_at:
            self._resume_at = 0.0
            self._sel.register(self._sock, selectors.EVENT_READ, None)
        for conn in [c for c in self._conns.values() if c.deadline <= now and c.state != "busy"]:
            self.expired += 1
            log.debug("side channel: a client used its %g s without finishing; closed", self.limits.deadline_s)
            self._close(conn)
        return True

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (EMFILE, ENFILE) or memory: the client stays queued
                # and the listener readable, so make room, or stop listening a moment instead of spinning
                if not self._evict():
                    self._pause_accept(exc)
                return
            if len(self._conns) >= self.limits.max_connections and not self._evict():
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self.limits.deadline_s)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _pause_accept(self, exc: OSError) -> None:
        """Stop selecting the listener for ACCEPT_PAUSE_S (accept failed and no connection could be closed)."""
        log.warning("side channel: accept failed (%s); not accepting for %g s", exc, ACCEPT_PAUSE_S)
        self._sel.unregister(self._sock)
        self._resume_at = time.monotonic() + ACCEPT_PAUSE_S

    def _evict(self) -> bool:
        """Close the oldest connection still sending its request, to make room; False if every one is working."""
        waiting = [c for c in self._conns.values() if c.state in ("verb", "len", "body")]
        if not waiting:
            return False
        self.evicted += 1
        self._close(min(waiting, key=lambda c: c.opened))
        return True

    def _step(self, conn: _Conn, mask: int) -> None:
        with self._io(conn):
            if mask & selectors.EVENT_WRITE and conn.state == "reply":
                self._send(conn)
            elif mask & selectors.EVENT_READ and conn.state in ("verb", "len", "body"):
                self._receive(conn)
            elif mask & selectors.EVENT_READ:  # a client talking while its reply is prepared, or closing
                if not conn.sock.recv(4096):
                    self._close(conn)

    @contextlib.contextmanager
    def _io(self, conn: _Conn) -> Iterator[None]:
        """Socket calls on ``conn``: one that would block is tried again later; a lost client is closed."""
        try:
            yield
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            log.debug("side channel client lost: %s", exc)
            self._close(conn)

    def _receive(self, conn: _Conn) -> None:
        chunk = conn.sock.recv(min(conn.need - len(conn.buf), 1 << 20))
        if not chunk:
            self._close(conn)
            return
        conn.buf += chunk
        if len(conn.buf) < conn.need:
            return
        data, conn.buf = bytes(conn.buf), bytearray()
        if conn.state == "verb":
            conn.verb = data
            if data not in _FIELDS:
                self._reply(conn, _error(f"unknown side channel verb {data!r}"))
                return
        elif conn.state == "len":
            (n,) = _LEN.unpack(data)
            why = self._refuse_size(conn, n)
            if why is not None:
                self._reply(conn, _error(why))
                return
            if n:
                conn.state, conn.need = "body", n
                return
            conn.fields.append(b"")
        else:
            conn.fields.append(data)
        if len(conn.fields) < len(_FIELDS[conn.verb]):
            conn.state, conn.need = "len", _LEN.size
            return
        conn.state = "busy"
        self._pool.submit(self._handle, conn)

    def _refuse_size(self, conn: _Conn, n: int) -> str | None:
        name, most = _FIELDS[conn.verb][len(conn.fields)]
        most = self.limits.max_request_bytes if most is None else most
        if n > most:
            return f"side channel {conn.verb.decode().strip()} {name} of {n} bytes; at most {most} accepted"
        if self._buffered + n > self.limits.max_buffered_bytes:
            return f"side channel busy: {self._buffered} bytes of requests already buffered; try again"
        self._buffered += n
        conn.reserved += n
        return None

    def _handle(self, conn: _Conn) -> None:
        """On a worker: run the verb's handler; the loop sends what it answered."""
        try:
            if conn.verb == GET:
                blob = self._provider()
                reply = _HEAD.pack(MAGIC, len(blob)) + blob
            else:
                handler = self._handlers.get(conn.verb)
                if handler is None:
                    raise RemoteRefused(f"this agent does not accept {conn.verb.decode().strip()} requests")
                handler(*conn.fields)
                reply = OK
        except DatamoverError as exc:
            reply = _error(str(exc))
        except Exception as exc:  # one failed request must not stop the server
            log.warning("side channel request failed: %s", exc)
            reply = _error(f"{type(exc).__name__}: {exc}")
        conn.fields = []
        self._replies.append((conn, reply))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._replies:
            conn, reply = self._replies.popleft()
            if conn.sock.fileno() >= 0 and self._conns.get(conn.sock.fileno()) is conn:
                with self._io(conn):  # the client may have reset its connection while it waited
                    self._reply(conn, reply)

    def _reply(self, conn: _Conn, data: bytes) -> None:
        self._release(conn)
        if conn.state == "busy":  # the time this agent took to answer is not the client's: it gets its own
            conn.deadline = time.monotonic() + self.limits.deadline_s
        conn.state, conn.out = "reply", memoryview(data)
        self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, None)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        assert conn.out is not None
        n = conn.sock.send(conn.out[: 1 << 20])
        conn.out = conn.out[n:]
        if not conn.out.nbytes:
            self._close(conn)

    def _release(self, conn: _Conn) -> None:
        self._buffered -= conn.reserved
        conn.reserved = 0

    def _close(self, conn: _Conn) -> None:
        self._release(conn)
        fd = conn.sock.fileno()
        if self._conns.get(fd) is conn:
            del self._conns[fd]
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.sock.close()

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(5)
        for conn in list(self._conns.values()):
            self._close(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)  # a handler may wait on the agent closing this
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()


def _error(reason: str) -> bytes:
    data = reason.encode(errors="replace")[:_MAX_REASON]
    return _HEAD.pack(ERR, len(data)) + data


def fetch_metadata(host: str, port: int, timeout: float = 5.0) -> bytes:
    """Read a peer's blob from its side channel within ``timeout`` seconds in all (not per read: a peer dripping
    bytes holds nobody past it); RemoteDisconnected if unreachable or too slow, InvalidMetadata if garbled."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(GET)
            magic, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size, deadline))
            if magic == ERR:
                reason = _recv_exact(sock, min(n, _MAX_REASON), deadline).decode(errors="replace")
                raise RemoteRefused(f"{host}:{port} refused GET: {reason}")
            if magic != MAGIC:
                raise InvalidMetadata(f"{host}:{port} is not a datamover metadata side channel")
            if n > MAX_BLOB_BYTES:
                raise InvalidMetadata(f"{host}:{port} announced a {n}-byte blob; at most {MAX_BLOB_BYTES} accepted")
            return _recv_exact(sock, n, deadline)
    except OSError as exc:
        raise RemoteDisconnected(f"cannot fetch metadata from {host}:{port}: {exc.strerror or exc}") from None


def send_request(host: str, port: int, verb: bytes, payload: bytes, timeout: float = 5.0, proof: bytes = b"") -> None:
    """Send a PUSH (with ``proof``) or a DROP to a peer's side channel and take its answer within ``timeout``
    seconds in all; RemoteRefused carries the peer's reason."""
    frame = verb + _LEN.pack(len(payload)) + payload
    if verb == PUSH:
        frame += _LEN.pack(len(proof)) + proof
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(frame)
            status = _recv_exact(sock, 4, deadline)
            if status == OK:
                return
            if status != ERR:
                raise InvalidMetadata(f"{host}:{port} answered {status!r}: not a datamover side channel")
            (n,) = _LEN.unpack(_recv_exact(sock, 4, deadline))
            reason = _recv_exact(sock, min(n, _MAX_REASON), deadline).decode(errors="replace")
    except OSError as exc:
        raise RemoteDisconnected(f"cannot reach the side channel at {host}:{port}: {exc.strerror or exc}") from None
    raise RemoteRefused(f"{host}:{port} refused {verb.decode().strip()}: {reason}")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (monotonic); TimeoutError (an OSError) once it passes."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {len(buf)} of {n} bytes")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise InvalidMetadata(f"side channel closed after {len(buf)} of {n} bytes (truncated)")
        buf += chunk
    return bytes(buf)
