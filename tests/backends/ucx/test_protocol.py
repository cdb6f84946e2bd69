"""The ucx control protocol's framing: hostile bytes raise typed errors, signed frames resist tampering."""

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover.backends.ucx.messages import Message, Notif
from datamover.backends.ucx.protocol import MAX_FRAME, FrameConn
from datamover.errors import AuthenticationError, InvalidMetadata


def _pair():
    a, b = socket.socketpair()
    return FrameConn(a, outbound=True), FrameConn(b, outbound=False)


def _drain(conn):
    out = []
    for _ in range(100):
        got = conn.feed()
        out += got
        if not got:
            break
    return out


@given(st.binary(max_size=2048))
def test_random_bytes_give_messages_or_typed_errors(blob):
    tx, rx = _pair()
    try:
        tx.sock.sendall(blob)
        try:
            msgs = _drain(rx)
        except InvalidMetadata:
            return
        for m in msgs:
            assert isinstance(m, Message)
    finally:
        tx.close()
        rx.close()


def test_oversized_frame_is_refused():
    tx, rx = _pair()
    tx.sock.sendall((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(InvalidMetadata, match="exceeds"):
        _drain(rx)


def test_frames_round_trip_in_order_and_split_reads():
    tx, rx = _pair()
    msgs = [Notif(bytes(range(i % 256)) * 10) for i in range(200)]
    for m in msgs:
        tx.send(m)
    got = []
    for _ in range(10_000):  # the socket buffer is smaller than the frames: flush as the reader drains it
        if len(got) == len(msgs):
            break
        tx.flush()
        got += rx.feed()
    assert got == msgs


@given(st.integers(0, 200), st.integers(1, 255))
def test_signed_frames_detect_any_flipped_byte(pos, flip):
    tx, rx = _pair()
    key = b"k" * 32
    tx.authenticate(key)
    rx.authenticate(key)
    tx.send(Notif(b"x" * 100))
    raw = bytearray(rx.sock.recv(4096))
    pos %= len(raw)
    if pos < 4:
        return  # the length prefix: covered by the truncation/oversize paths
    raw[pos] ^= flip
    a, b = socket.socketpair()
    forged = FrameConn(b, outbound=False)
    forged.authenticate(key)
    a.sendall(bytes(raw))
    with pytest.raises((AuthenticationError, InvalidMetadata)):
        _drain(forged)


def test_replayed_signed_frame_is_refused():
    tx, rx = _pair()
    key = b"s" * 32
    tx.authenticate(key)
    rx.authenticate(key)
    tx.send(Notif(b"once"))
    frame = rx.sock.recv(4096)
    a, b = socket.socketpair()
    victim = FrameConn(b, outbound=False)
    victim.authenticate(key)
    a.sendall(frame + frame)
    with pytest.raises(AuthenticationError):
        _drain(victim)


def test_a_frame_read_with_a_handshake_frame_is_judged_after_it():
    """A peer's handshake frame and a large frame after it arrive in one read: ``feed`` returns the handshake frame
    alone, so that its handler opens the connection up (or sets the key) before the next is judged. Before, the
    next frame was judged by the handshake's 64 KiB bound and the connection refused (a fresh-clone CI run caught
    test_ucx_hostile_target this way)."""
    tx, rx = _pair()
    tx.open_up()
    tx.send(Notif(b"welcome"))
    tx.send(Notif(b"x" * (100 << 10)))
    first = rx.feed()
    assert [m.msg for m in first] == [b"welcome"]
    rx.open_up()
    assert [len(m.msg) for m in rx.feed()] == [100 << 10] and not rx.has_frame
