"""A target that answers the control protocol as no agent does: what the initiator keeps of it stays bounded.

The hostile target here speaks the protocol by hand with a real worker's address and packed rkey (borrowed from an
agent in this process), so every message it sends passes the per-message checks; what is tested is what the
initiator accumulates across messages.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from datamover import Agent
from datamover.agents.metadata import encode_metadata
from datamover.backends import backend_status
from datamover.backends.ucx.config import _MAX_RKEYS
from datamover.testing.waiting import until

from .control import TCP_RX, recv, send

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}


class OfferingTarget:
    """A control port that answers a hello with a welcome, then offers ``batches`` rkey messages of ``rows`` fresh
    regions each (all with one real key), then waits until the initiator hangs up."""

    def __init__(self, address: bytes, entry: list, batches: int, rows: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address, self.entry, self.batches, self.rows = address, entry, batches, rows
        self.sent = 0  # rkey messages sent before the initiator hung up
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            sock.settimeout(60)
            send(sock, {"t": "challenge", "nonce": b"n" * 16})
            recv(sock)
            send(sock, {"t": "welcome", "conn_id": 1, "address": self.address, "rkeys": b"", "local": b"",
                        "tcp_rx": TCP_RX})  # fmt: skip
            _, mem, dev, addr, length, key = self.entry
            try:
                for b in range(self.batches):
                    first = 1 + b * self.rows
                    rows = [[rid, mem, dev, addr, length, key] for rid in range(first, first + self.rows)]
                    send(sock, {"t": "rkeys", "add": rows})
                    self.sent += 1
            except OSError:
                return  # hung up on: what is tested
            while recv(sock) is not None:
                pass

    def close(self) -> None:
        self.listener.close()


def test_a_target_offering_regions_without_end_is_cut_off_at_the_welcome_bound():
    """Each rkey message is within its bounds (65536 rows); a target sending them without end had every region
    kept (5 messages of 32768: 163840 regions, each with its key, the whole table copied for each message). Past
    what a welcome may carry (65536 regions) it is now disconnected, and nothing of its offers is kept."""
    with Agent("lender", UCX) as lender, Agent("initiator", UCX) as agent:
        lent = lender.backend("ucx")
        reg = lender.register_memory(np.zeros(4096, np.uint8))
        address, entry = lent.connection_info()["address"], lent.mapped_regions.mapped[reg.id][1]
        batches, rows = 5, _MAX_RKEYS // 2
        target = OfferingTarget(address, entry, batches, rows)
        try:
            info = {"address": address, "host": "127.0.0.1", "port": target.port}
            agent.add_remote(encode_metadata("offering", {"ucx": info}, []))
            agent.send_notification("offering", b"connected")
            peer = agent.backend("ucx")._peers["offering"]
            # cut off: its regions go with the connection's teardown, which follows the state's change
            until(
                lambda: (peer.state != "ready" and not peer.regions) or len(peer.regions) == batches * rows,
                what="the offers handled, or the target cut off and its regions gone",
            )
            assert peer.state != "ready" and not peer.regions, f"{len(peer.regions)} regions kept of one target"
        finally:
            target.close()


class StallingTarget:
    """A control port that answers a hello with a welcome, then sends the start of a frame of ``claimed`` bytes
    (``sent`` of them) and stops; records whether the initiator hung up on it."""

    def __init__(self, address: bytes, claimed: int, sent: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address, self.claimed, self.sent = address, claimed, sent
        self.hung_up = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            sock.settimeout(30)
            send(sock, {"t": "challenge", "nonce": b"n" * 16})
            recv(sock)
            send(sock, {"t": "welcome", "conn_id": 1, "address": self.address, "rkeys": b"", "local": b"",
                        "tcp_rx": TCP_RX})  # fmt: skip
            recv(sock)  # the notification: the initiator took the welcome, its handshake is done
            try:
                sock.sendall(self.claimed.to_bytes(4, "big") + b"\x81" + b"x" * (self.sent - 1))
                while sock.recv(65536):
                    pass
            except TimeoutError:
                return
            except OSError:
                pass  # reset: closed with our bytes unread
            self.hung_up.set()

    def close(self) -> None:
        self.listener.close()


def test_targets_stalling_mid_frame_share_the_initiators_frame_budget():
    """A target may send the start of a frame of up to 64 MiB and stop. Inbound connections share a budget for such
    incomplete frames (``max_buffered_bytes``); the initiator's own connections did not, so each peer could hold
    64 MiB of its memory for as long as it liked. They now share it: past it, the connection is dropped."""
    cfg = {"backends": {"ucx": {"max_buffered_bytes": 12 << 20}}}
    with Agent("lender", UCX) as lender, Agent("initiator", cfg) as agent:
        address = lender.backend("ucx").connection_info()["address"]
        targets = [StallingTarget(address, 32 << 20, 5 << 20) for _ in range(3)]
        try:
            for k, target in enumerate(targets):
                info = {"address": address, "host": "127.0.0.1", "port": target.port}
                agent.add_remote(encode_metadata(f"stalling{k}", {"ucx": info}, []))
                agent.send_notification(f"stalling{k}", b"connected")
            # 3 x 5 MiB held against 12 MiB: whichever target's bytes go over first is cut off, only that one
            cut = lambda: [k for k, t in enumerate(targets) if t.hung_up.is_set()]  # noqa: E731
            until(lambda: cut(), what="a target past the budget cut off", timeout=20)
            assert len(cut()) == 1, f"targets {cut()} cut off, within the budget"
        finally:
            for target in targets:
                target.close()
