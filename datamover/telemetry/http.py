"""The Prometheus scrape endpoint: a thread per connection, as prometheus_client's own, but bounded.

prometheus_client's `start_http_server` gives every connection a thread and never times one out, so any process
that can reach the port can hold threads and file descriptors without bound (a client that opens connections
and sends nothing). Here at most `max_connections` are served at once (more are answered 503 and closed) and
each is closed `deadline_s` after it was accepted, however slowly its client sends or reads.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger("datamover.telemetry")

MAX_CONNECTIONS = 16
DEADLINE_S = 10.0
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.deadline_s  # each read and write of the connection
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A WSGI server of bounded connections; `close()` stops it. `refused` counts connections turned away."""

    daemon_threads = True
    request_queue_size = 64
    max_connections = MAX_CONNECTIONS
    deadline_s = DEADLINE_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: dict[socket.socket, float] = {}  # connection -> when it is closed, served or not
        self._lock = threading.Lock()
        self.refused = 0

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._lock:
            if len(self._open) >= self.max_connections:
                self.refused += 1
                busy = True
            else:
                self._open[request] = time.monotonic() + self.deadline_s
                busy = False
        if busy:  # a fresh socket's send buffer takes the answer without blocking
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
        return not busy

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Between polls (every 0.5 s): cut the connections past their deadline (their threads then finish)."""
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, end in self._open.items() if end < now]
        for sock in late:
            with contextlib.suppress(OSError):  # closed meanwhile by its own thread
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics endpoint: a request from %s failed", client_address, exc_info=True)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.shutdown()
        self.server_close()


def serve_metrics(
    registry: Any,
    port: int,
    addr: str = "127.0.0.1",
    *,
    max_connections: int = MAX_CONNECTIONS,
    deadline_s: float = DEADLINE_S,
) -> MetricsServer:
    """Serve `registry` (a prometheus_client registry or collector) at http://addr:port/metrics from a daemon
    thread; port 0 picks a free one (`server.server_port`)."""
    from prometheus_client import make_wsgi_app

    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsServer", (MetricsServer,), {"address_family": family})
    server = cast(MetricsServer, make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, _Handler))
    server.max_connections, server.deadline_s = max_connections, deadline_s
    threading.Thread(target=server.serve_forever, name="dm-metrics-http", daemon=True).start()
    return server
