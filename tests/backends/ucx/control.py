"""Speaking the ucx control protocol by hand, as a hostile or dying peer would (tests only)."""

from __future__ import annotations

import os
import socket
import struct
import threading

import msgpack

from datamover.agents.metadata import decode_metadata

#: the tcp receive segment a hand-made hello or welcome advertises: that of the real agent whose UCX worker address
#: it borrows (ours: 64 KiB); a peer that says nothing is taken to keep UCX's 8 KiB and refused
TCP_RX = 64 << 10


def control_of(blob: bytes) -> tuple[str, int]:
    """The ucx control port an agent's metadata blob advertises."""
    info = decode_metadata(blob).backends["ucx"]
    return info["host"], info["port"]


def send(sock: socket.socket, msg: dict) -> None:
    payload = msgpack.packb(msg, use_bin_type=True)
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def recv(sock: socket.socket) -> dict | None:
    """The next frame, or None once the other side hung up."""
    try:
        head = recv_exact(sock, 4)
        if head is None:
            return None
        body = recv_exact(sock, struct.unpack("!I", head)[0])
    except (ConnectionResetError, TimeoutError):
        return None
    return None if body is None else msgpack.unpackb(body, raw=False)


class FakeTarget:
    """A control port that answers every hello with a welcome carrying ``self.address`` and ``self.rkeys``."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = b""
        self.rkeys = b""  # msgpack of the welcome's [[id, mem, dev, addr, length, packed key], ...]
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with sock:
                sock.settimeout(10)
                send(sock, {"t": "challenge", "nonce": os.urandom(16), "tcp_rx": TCP_RX})
                if recv(sock) is None:
                    continue
                send(
                    sock,
                    {
                        "t": "welcome",
                        "conn_id": 1,
                        "address": self.address,
                        "rkeys": self.rkeys,
                        "local": b"",
                        "tcp_rx": TCP_RX,
                    },
                )
                while recv(sock) is not None:  # until the initiator hangs up (remove_remote)
                    pass

    def close(self) -> None:
        self.stop = True
        self.listener.close()
