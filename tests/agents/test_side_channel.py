"""The metadata side channel: fetch, push and drop between agents, with and without a shared secret."""

import socket

import numpy as np
import pytest

from datamover import Agent
from datamover.agents.side_channel import fetch_metadata
from datamover.errors import InvalidMetadata, RemoteDisconnected, RemoteRefused


def _agent(name, secret=None):
    return Agent(name, {"backends": {"memcpy": {}}, "listen_port": 0, "secret": secret})


def test_push_and_drop():
    with _agent("a") as a, _agent("b") as b:
        buf = np.zeros(4096, np.uint8)
        reg = a.register_memory(buf)
        a.send_metadata(*b.listen_address)
        assert b.remotes == ["a"]
        assert b.remote_metadata("a").regions[0][2] == reg.addr
        a.invalidate_at(*b.listen_address)
        assert b.remotes == []
        a.invalidate_at(*b.listen_address)  # forgetting an agent twice is harmless
        assert b.fetch_remote(*a.listen_address) == "a"


def test_secret_guards_push_and_drop():
    with _agent("a", b"s3cret") as a, _agent("b", b"s3cret") as b, _agent("evil", b"wrong") as evil:
        a.send_metadata(*b.listen_address)
        assert b.remotes == ["a"]
        with pytest.raises(RemoteRefused, match="signature"):
            evil.send_metadata(*b.listen_address)
        with pytest.raises(RemoteRefused, match="signature"):
            evil.invalidate_at(*b.listen_address)
        assert b.remotes == ["a"], "a peer without the secret made the agent forget another"
        a.invalidate_at(*b.listen_address)
        assert b.remotes == []


def test_garbage_push_is_refused_and_server_keeps_serving():
    with _agent("b") as b:
        host, port = b.listen_address
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"PUSH" + (7).to_bytes(4, "big") + b"garbage" + (0).to_bytes(4, "big"))
            assert s.recv(4) == b"ERR "
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"HACK")
        assert b.remotes == []
        assert len(fetch_metadata(host, port)) > 0


def test_unreachable_and_not_a_side_channel():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with _agent("a") as a:
        with pytest.raises(RemoteDisconnected):
            a.send_metadata("127.0.0.1", port)
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        try:
            import threading

            def answer():
                conn, _ = srv.accept()
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad\r\n\r\n")
                conn.close()

            t = threading.Thread(target=answer)
            t.start()
            with pytest.raises(InvalidMetadata, match="not a datamover side channel"):
                a.send_metadata(*srv.getsockname())
            t.join(5)
        finally:
            srv.close()
