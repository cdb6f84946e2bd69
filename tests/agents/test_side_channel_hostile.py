"""The side channel against hostile or broken clients (issue 14, items 5 and 6).

Idle and slow clients are real sockets held open at a known point of the protocol (nothing races a sleep); budgets
and identity checks are exercised through the real server.
"""

import errno
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datamover import Agent
from datamover.agents.metadata import encode_metadata
from datamover.agents.side_channel import DROP, PUSH, MetadataServer, fetch_metadata, send_request
from datamover.descriptors import MemType
from datamover.errors import DatamoverError, RemoteDisconnected, RemoteRefused
from datamover.testing.waiting import until


def _agent(name, **extra):
    return Agent(name, {"backends": {"memcpy": {}}, "listen_port": 0, "extra": extra})


def _until(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _blob(name, n):
    return encode_metadata(name, {}, [(MemType.DRAM, 0, i * 8192, 4096, i + 1) for i in range(n)])


def test_200_idle_connections_do_not_stop_a_fetch():
    with _agent("a") as a, _agent("b") as b:
        idle = [socket.create_connection(b.listen_address, timeout=5) for _ in range(200)]
        try:
            assert _until(lambda: b._peers.server.open_connections == 200, 10)
            assert a.fetch_remote(*b.listen_address, timeout=10) == "b"  # the old server: 200 x 5 s before it
        finally:
            for s in idle:
                s.close()


def test_past_the_cap_the_oldest_idle_connection_makes_room():
    with _agent("a") as a, _agent("b", side_channel={"max_connections": 8}) as b:
        idle = [socket.create_connection(b.listen_address, timeout=5) for _ in range(8)]
        try:
            assert _until(lambda: b._peers.server.open_connections == 8, 10)
            assert a.fetch_remote(*b.listen_address, timeout=10) == "b"
            assert b._peers.server.evicted >= 1
            assert idle[0].recv(1) == b""  # the oldest was closed for it
        finally:
            for s in idle:
                s.close()


def test_a_slow_client_is_cut_at_its_deadline_and_holds_up_nobody():
    # 2 s: the fetch below, a legitimate client, must deliver its own request and take its reply within it too
    with _agent("a") as a, _agent("b", side_channel={"deadline_s": 2.0}) as b:
        slow = socket.create_connection(b.listen_address, timeout=10)
        try:
            slow.sendall(PUSH + struct.pack("!I", 1000))  # then the body a byte at a time: a slow-loris
            assert a.fetch_remote(*b.listen_address, timeout=4) == "b"  # not after it (the old server: 5 s)
            slow.settimeout(0.2)
            t0, cut = time.monotonic(), False
            while not cut and time.monotonic() - t0 < 10:
                try:
                    slow.sendall(b"S")
                    cut = slow.recv(1) == b""
                except TimeoutError:
                    continue
                except OSError:
                    cut = True
            assert cut, "a client trickling its request was never cut off"
        finally:
            slow.close()
        assert _until(lambda: b._peers.server.open_connections == 0, 5) and b._peers.server.expired >= 1


def _refusal(s: socket.socket) -> bytes:
    """The side channel's ERR answer on ``s``: its reason."""
    assert s.recv(4) == b"ERR "
    (n,) = struct.unpack("!I", s.recv(4))
    return s.recv(n)


@pytest.mark.parametrize("verb", [PUSH, DROP])
def test_a_huge_push_is_refused_from_its_length_before_any_byte_is_read(verb):
    with _agent("b") as b:
        with socket.create_connection(b.listen_address, timeout=5) as s:
            s.sendall(verb + struct.pack("!I", 20 << 20))  # announces 20 MB, sends none of it
            assert b"at most 8388608" in _refusal(s)
        assert b.remotes == []


def test_requests_buffered_for_all_clients_together_are_bounded_from_their_length():
    """Each announced body is reserved from its length header: one more than ``max_buffered_bytes`` in all is refused
    before a byte of it is read, and the reservation goes with its connection."""
    limit = 1 << 20
    with _agent("a") as a, _agent("b", side_channel={"max_buffered_bytes": limit}) as b:
        held = socket.create_connection(b.listen_address, timeout=5)
        try:
            held.sendall(PUSH + struct.pack("!I", limit - 100))  # reserved; its body never comes
            assert _until(lambda: b._peers.server.open_connections == 1, 10)
            with socket.create_connection(b.listen_address, timeout=5) as s:
                s.sendall(PUSH + struct.pack("!I", 200))  # under 8 MiB alone, over the limit with the other
                assert b"busy" in _refusal(s)
            assert a.fetch_remote(*b.listen_address, timeout=10) == "b"  # a GET buffers nothing
        finally:
            held.close()
        assert _until(lambda: b._peers.server.open_connections == 0, 10)
        a.register_memory(np.zeros(4096, np.uint8))
        a.send_metadata(*b.listen_address)  # the held reservation went with its connection
        assert b.remotes == ["a"]


def test_pushed_peers_are_bounded_in_number_a_gone_one_making_room():
    with _agent("b", push_budget={"max_peers": 2}) as b:
        send_request(*b.listen_address, PUSH, _blob("one", 1))
        send_request(*b.listen_address, PUSH, _blob("two", 1))
        with pytest.raises(RemoteRefused, match="at most 2 peers"):
            send_request(*b.listen_address, PUSH, _blob("three", 1))
        b.remove_remote("one")
        send_request(*b.listen_address, PUSH, _blob("three", 1))
        assert sorted(b.remotes) == ["three", "two"]


def test_pushed_metadata_has_a_region_budget_checked_before_unpacking():
    with _agent("b", push_budget={"max_regions": 1000}) as b:
        with pytest.raises(RemoteRefused, match="at most 1000"):
            send_request(*b.listen_address, PUSH, _blob("big", 1001))
        send_request(*b.listen_address, PUSH, _blob("fits", 1000))
        assert b.remotes == ["fits"]


def test_pushed_metadata_has_a_byte_budget_released_when_a_peer_goes():
    # the agent decodes each 20,000-region blob before it answers (under tracemalloc, slowly): the client waits
    # up to 60 s for that answer, not send_request's default 5 s (a load of 17 took longer)
    n, wait = 20_000, 60.0
    with _agent("b") as b:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            send_request(*b.listen_address, PUSH, _blob("one", n), timeout=wait)
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert b.remotes == ["one"]
        assert kept < 120 * n, f"a pushed region costs {kept / n:.0f} bytes kept"
        per_peer = b.remote_metadata("one").nbytes
    with _agent("c", push_budget={"max_bytes": int(2.5 * per_peer)}) as c:
        send_request(*c.listen_address, PUSH, _blob("one", n), timeout=wait)
        send_request(*c.listen_address, PUSH, _blob("two", n), timeout=wait)
        with pytest.raises(RemoteRefused, match="budget"):
            send_request(*c.listen_address, PUSH, _blob("three", n), timeout=wait)
        c.remove_remote("one")  # its share is released
        send_request(*c.listen_address, PUSH, _blob("three", n), timeout=wait)
        assert sorted(c.remotes) == ["three", "two"]


def test_an_unauthenticated_client_cannot_drop_or_replace_a_peer():
    with _agent("a") as a, _agent("b") as b:
        a.register_memory(np.zeros(4096, np.uint8))
        a.send_metadata(*b.listen_address)
        real = b.remote_metadata("a")
        # forget "a": the bare name (what DROP used to be), then a made-up token
        for payload in (b"a", b"a\0" + b"x" * 32):
            with pytest.raises(RemoteRefused, match="token"):
                send_request(*b.listen_address, DROP, payload)
        # replace "a" with a blob of the attacker's (no ident, then a forged one), with and without a proof
        forged = [encode_metadata("a", {}, []), encode_metadata("a", {}, [], ident=real.ident)]
        for blob in forged:
            for proof in (b"", b"y" * 32):
                with pytest.raises(RemoteRefused, match="already known"):
                    send_request(*b.listen_address, PUSH, blob, proof=proof)
        assert b.remote_metadata("a") is real
        # the real agent still replaces and drops itself
        a.register_memory(np.zeros(8192, np.uint8))
        a.send_metadata(*b.listen_address)
        assert len(b.remote_metadata("a").regions) == 2
        a.invalidate_at(*b.listen_address)
        assert b.remotes == []
        assert len(fetch_metadata(*b.listen_address)) > 0


@pytest.fixture(scope="module")
def fuzzed():
    with _agent("a") as a, _agent("b", side_channel={"deadline_s": 0.5}) as b:
        a.register_memory(np.zeros(4096, np.uint8))
        a.send_metadata(*b.listen_address)
        yield a, b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.binary(max_size=64),
        st.tuples(
            st.sampled_from([PUSH, DROP, b"GET ", b"PUS"]), st.integers(0, (1 << 32) - 1), st.binary(max_size=64)
        ).map(lambda t: t[0] + struct.pack("!I", t[1]) + t[2]),
    )
)
def test_any_bytes_leave_the_peers_and_the_server_as_they_were(fuzzed, data):
    _, b = fuzzed
    before = b.remote_metadata("a")
    with socket.create_connection(b.listen_address, timeout=5) as s:
        try:  # the server may answer and cut the client at any point: that is its right
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError:
            pass
    assert b.remotes == ["a"] and b.remote_metadata("a") is before
    assert len(fetch_metadata(*b.listen_address, timeout=5)) > 0


def test_a_push_of_millions_of_empty_lists_is_refused_before_they_are_built():
    """8 MB of metadata whose 65,535 region rows each hold 120 empty lists: 7.9M Python lists (a peak of about
    600 MB for one unauthenticated PUSH, two handled at once) before. The decoder counts lists and maps as msgpack
    builds them (a region row each, and a few) and refuses the blob at the first one over."""
    import msgpack

    rows = b"\xdc" + struct.pack(">H", 65535) + (b"\xdc\x00\x78" + b"\x90" * 120) * 65535
    blob = b"\x83" + b"".join(map(msgpack.packb, ["schema", 1, "name", "bomb", "regions"])) + rows
    assert len(blob) < 8 << 20  # under the side channel's PUSH limit: the decoder is what must refuse it
    with _agent("a") as a:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            with pytest.raises(RemoteRefused, match="lists and maps"):
                send_request(*a.listen_address, PUSH, blob)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 100 << 20, f"decoding one PUSH took a peak of {peak >> 20} MiB"
        assert a.remotes == []


def test_a_client_reset_while_its_reply_is_sent_closes_that_connection_and_the_server_serves_on(monkeypatch):
    """The first reply's send raises ConnectionResetError (the client reset as its answer was ready): that client
    is cut, and the server thread still answers the next GET (the old loop died there and served nobody again)."""
    real_send = MetadataServer._send
    failed = []

    def reset_once(self, conn):
        if not failed:
            failed.append(conn)
            raise ConnectionResetError(104, "Connection reset by peer")
        return real_send(self, conn)

    monkeypatch.setattr(MetadataServer, "_send", reset_once)
    server = MetadataServer(lambda: b"blob")
    try:
        with pytest.raises(DatamoverError):
            fetch_metadata(*server.address, timeout=5)
        assert failed, "the reply's send was never reached"
        assert fetch_metadata(*server.address, timeout=5) == b"blob"
        assert server._thread.is_alive()
        until(lambda: server.open_connections == 0, 5, "the server closing its connections")
    finally:
        server.close()


def test_an_unexpected_error_in_a_turn_of_the_loop_is_logged_and_the_server_serves_on(monkeypatch, caplog):
    real_accept = MetadataServer._accept
    failed = []

    def broken_once(self):
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the loop")
        return real_accept(self)

    monkeypatch.setattr(MetadataServer, "_accept", broken_once)
    server = MetadataServer(lambda: b"blob")
    try:
        with socket.create_connection(server.address, timeout=5):  # its accept fails; the next turn accepts it
            pass
        assert fetch_metadata(*server.address, timeout=5) == b"blob"
        assert failed and "a turn of the server loop failed" in caplog.text
    finally:
        server.close()


def _drip_server(head: bytes, n: int, gap_s: float) -> tuple[socket.socket, threading.Event]:
    """A hostile side channel: answers ``head`` then ``n`` bytes, one every ``gap_s`` seconds, until told to stop."""
    lst = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = lst.accept()
        with conn:
            conn.recv(64)
            conn.sendall(head)
            for _ in range(n):
                if stop.wait(gap_s):
                    return
                try:
                    conn.sendall(b"\x80")
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    return lst, stop


@pytest.mark.parametrize(
    "call, head",
    [
        (lambda addr: fetch_metadata(*addr, timeout=0.5), b"DMMD" + struct.pack("!I", 100)),
        (lambda addr: fetch_metadata(*addr, timeout=0.5), b"ERR " + struct.pack("!I", 100)),
        (lambda addr: send_request(*addr, PUSH, b"x", timeout=0.5), b"ERR " + struct.pack("!I", 100)),
    ],
    ids=["get-blob", "get-err-reason", "push-err-reason"],
)
def test_a_peer_dripping_bytes_cannot_hold_a_call_past_its_timeout(call, head):
    """A byte every 0.1 s never trips a 0.5 s per-read timeout: the old client read 100 of them (10 s); the timeout
    now bounds the call."""
    lst, stop = _drip_server(head, 100, 0.1)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteDisconnected, match="timed out"):
            call(lst.getsockname())
        assert time.monotonic() - t0 < 3
    finally:
        stop.set()
        lst.close()


def test_a_long_err_reason_is_read_to_4096_bytes_only():
    lst, stop = _drip_server(b"ERR " + struct.pack("!I", 1 << 30) + b"r" * 4096, 0, 0)
    try:
        with pytest.raises(RemoteRefused) as caught:
            send_request(*lst.getsockname(), DROP, b"x", timeout=5)
        assert str(caught.value).endswith("r" * 4096)  # not a wait for, or an allocation of, the 1 GiB announced
    finally:
        stop.set()
        lst.close()


def test_refresh_waits_the_agents_configured_timeout(monkeypatch):
    from datamover.agents import side_channel

    with _agent("a") as a, Agent("b", {"backends": {"memcpy": {}}, "timeout_s": 1.5}) as b:
        b.fetch_remote(*a.listen_address)
        asked = []
        real = side_channel.fetch_metadata
        monkeypatch.setattr(side_channel, "fetch_metadata", lambda *args, **kw: asked.append(kw) or real(*args, **kw))
        assert b.refresh_remote("a") == "a"
        assert asked == [{"timeout": 1.5}]


def test_pushed_connection_info_counts_against_the_byte_budget():
    """Each push keeps 60 KiB of connection info and no region: a 100 KiB budget takes one such peer, not two (the
    old budget counted regions only, and a peer's megabytes of 'backends' were kept uncounted)."""
    import msgpack

    def blob(name):
        return msgpack.packb(
            {"schema": 1, "name": name, "backends": {"junk": {"x": b"j" * (60 << 10)}}, "regions": []},
            use_bin_type=True,
        )

    with _agent("b", push_budget={"max_bytes": 100 << 10}) as b:
        send_request(*b.listen_address, PUSH, blob("one"))
        with pytest.raises(RemoteRefused, match="budget"):
            send_request(*b.listen_address, PUSH, blob("two"))
        assert b.remotes == ["one"]


def test_out_of_descriptors_the_server_pauses_accepting_instead_of_spinning(monkeypatch, caplog):
    """accept fails with EMFILE while the client stays queued (the listener stays readable): the server stops
    listening for a moment (it called accept in a tight loop, a core at 100 %), then serves the client."""
    server = MetadataServer(lambda: b"blob")
    real_accept = socket.socket.accept
    calls = []

    def out_of_fds(sock):
        if sock is server._sock and len(calls) < 3:
            calls.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(sock)

    monkeypatch.setattr(socket.socket, "accept", out_of_fds)
    try:
        assert fetch_metadata(*server.address, timeout=10) == b"blob"  # served once accept works again
        assert len(calls) == 3
        assert calls[2] - calls[0] >= 2 * 0.09  # a pause after each failure, not a spin
        assert "accept failed" in caplog.text
    finally:
        server.close()
