"""The metrics endpoint: any process can reach it, so it bounds what a client can hold, and its output parses."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from datamover.telemetry.metrics import CacheMetrics


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def silent_clients(port: int, n: int) -> list[socket.socket]:
    """Connections that send half a request line and then nothing (a slow or hostile client)."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HT")
        socks.append(sock)
    return socks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_silent_clients_hold_a_bounded_number_of_threads():
    """Each connection had its own thread for ever: 400 silent clients, 400 threads and 400 descriptors."""
    metrics = CacheMetrics()
    port = free_port()
    before = threading.active_count()
    server = metrics.serve(port)
    socks = silent_clients(port, 60)
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= 1 + 16  # the accept loop, and a thread per client served
        assert server.refused == 60 - 16
        busy = socks[-1].recv(100)  # the ones past the limit are told so and closed
        assert busy.startswith(b"HTTP/1.0 503") and socks[-1].recv(100) == b""
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_a_silent_client_is_cut_at_the_deadline_and_scrapes_go_on():
    metrics = CacheMetrics()
    metrics.record_move("l1_hbm", "l2_dram", "memcpy", 2, 8192, 0.001)
    server = metrics.serve(0, max_connections=2, deadline_s=0.5)
    port = server.server_port
    socks = silent_clients(port, 2)
    try:
        start = time.monotonic()
        for sock in socks:
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed by the server, its request unfinished
        assert time.monotonic() - start < 3
        assert "datamover_chunk_moves_total" in scrape(port)
        for junk in (b"\x00\xff not http\r\n\r\n", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"):
            bad = socket.create_connection(("127.0.0.1", port))
            bad.sendall(junk)
            bad.settimeout(5)
            answer = b"".join(iter(lambda: bad.recv(4096), b""))  # noqa: B023 (read before the next turn)
            assert b"400" in answer or b"414" in answer
            bad.close()
        assert "datamover_chunk_moves_total" in scrape(port)
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_label_values_from_users_are_escaped():
    """A quote, backslash or newline in a backend name stays inside its label and adds no sample."""
    metrics = CacheMetrics()
    evil = 'me"m\\cpy\nfake_metric 99'
    metrics.record_move("l1_hbm", "l2_dram", evil, 3, 4096, 0.001)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    samples = [s for f in families for s in f.samples]
    assert not any(s.name.startswith("fake") for s in samples)
    moves = [s for s in samples if s.name == "datamover_chunk_moves_total"]
    assert [(s.labels["backend"], s.value) for s in moves] == [(evil, 3.0)]
