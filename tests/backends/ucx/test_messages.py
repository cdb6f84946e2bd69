"""The ucx control messages: every type round-trips through msgpack, and hostile maps are refused by type and bound."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover.backends.ucx import messages as m
from datamover.backends.ucx.outbound import _FROM_TARGET, Outbound
from datamover.backends.ucx.serving import _FROM_INITIATOR, Serving
from datamover.errors import InvalidMetadata

u64 = st.integers(0, (1 << 64) - 1)
nonce = st.binary(max_size=m.MAX_NONCE)
reason = st.text(max_size=64)


def _columns():
    return st.integers(0, 32).flatmap(
        lambda n: st.tuples(*(st.binary(min_size=8 * n, max_size=8 * n) for _ in range(3)))
    )


_rkey_row = st.tuples(
    st.integers(0, (1 << 62) - 1), st.sampled_from(["DRAM", "VRAM"]), st.integers(0, 7),
    st.integers(0, 1 << 40), st.integers(1, 1 << 30), st.binary(min_size=1, max_size=64),
).map(list)  # fmt: skip

VALID = {
    m.Challenge: st.builds(m.Challenge, nonce),
    m.Hello: st.builds(m.Hello, st.text(min_size=1, max_size=32), st.binary(min_size=1, max_size=256), nonce, nonce),
    m.Welcome: st.builds(
        m.Welcome,
        u64,
        st.binary(min_size=1, max_size=256),
        st.binary(max_size=64),
        st.binary(max_size=64),
        nonce,
        incarnation=st.binary(max_size=m.MAX_INCARNATION),
    ),
    m.Error: st.builds(m.Error, reason, st.booleans()),
    m.Notif: st.builds(m.Notif, st.binary(max_size=256)),
    m.Rkeys: st.builds(m.Rkeys, st.lists(_rkey_row, max_size=4)),
    m.Revoke: st.builds(m.Revoke, u64),
    m.Refuse: st.builds(m.Refuse, u64, reason, st.none() | u64),
    m.Done: st.builds(m.Done, u64),
    m.Fail: st.builds(m.Fail, u64, reason),
    m.Revoked: st.builds(m.Revoked, u64),
    m.Cancel: st.builds(m.Cancel, u64),
    m.Req: st.tuples(
        u64,
        st.sampled_from(m.OPS),
        st.sampled_from(["DRAM", "VRAM", "FILE"]),
        _columns(),
        st.none() | st.binary(max_size=64),
    ).flatmap(  # a tag for each row: the last fits 64 bits (no rows: the tag itself does)
        lambda t: st.integers(0, m.U64 - max(1, len(t[3][0]) // 8)).map(lambda tag: m.Req(*t[:3], *t[3], tag, t[4]))
    ),
}


EXAMPLE = {
    m.Challenge: m.Challenge(b"n" * 16),
    m.Hello: m.Hello("init", b"address", b"n" * 16, b"mac"),
    m.Welcome: m.Welcome(5, b"address", b"rkeys", b"local", b"mac"),
    m.Error: m.Error("why", auth=True),
    m.Notif: m.Notif(b"note"),
    m.Rkeys: m.Rkeys([[1, "DRAM", 0, 4096, 4096, b"key"]]),
    m.Revoke: m.Revoke(1),
    m.Refuse: m.Refuse(1, "why", 3),
    m.Done: m.Done(1),
    m.Fail: m.Fail(1, "why"),
    m.Revoked: m.Revoked(1),
    m.Cancel: m.Cancel(1),
    m.Req: m.Req(1, "WRITE", "DRAM", b"a" * 16, b"b" * 16, b"c" * 16, 7, b"note"),
}


def test_every_message_type_has_a_strategy_and_a_unique_wire_name():
    assert set(VALID) == set(EXAMPLE) == set(m.MESSAGES.values())
    assert {cls.WIRE for cls in VALID} == set(m.MESSAGES)


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.WIRE)
@given(data=st.data())
def test_round_trip_through_msgpack(cls, data):
    msg = data.draw(VALID[cls])
    wire = msgpack.unpackb(msgpack.packb(msg.to_wire(), use_bin_type=True), raw=False)
    assert wire["t"] == cls.WIRE
    back = m.from_wire(wire)
    assert type(back) is cls and back == msg


def test_wire_keys_are_the_protocols():
    """The maps peers of earlier versions send and read: same keys (``len``, not the attribute's name)."""
    req = m.Req(1, "WRITE", "DRAM", b"a" * 8, b"b" * 8, b"c" * 8, 7, None).to_wire()
    assert req == {"t": "req", "id": 1, "op": "WRITE", "mem": "DRAM", "addr": b"a" * 8, "len": b"b" * 8,
                   "dev": b"c" * 8, "tag": 7, "notify": None}  # fmt: skip
    assert m.Error("no", auth=True).to_wire() == {"t": "error", "reason": "no", "auth": True}
    old_welcome = {"t": "welcome", "conn_id": 3, "address": b"x"}  # rkeys/local/mac optional
    assert m.from_wire(old_welcome) == m.Welcome(3, b"x", b"", b"", b"")
    old_hello = {"t": "hello", "name": "a", "address": b"x", "nonce": b"n"}  # no mac without a secret
    assert m.from_wire(old_hello).mac == b""


def test_unknown_keys_are_ignored():
    assert m.from_wire({"t": "done", "id": 4, "later": [1, 2]}) == m.Done(4)


@pytest.mark.parametrize("wire", [None, [], b"req", {"id": 1}, {"t": 1}, {"t": b"req"}, {"t": "x"}, {"t": ""}])
def test_a_frame_that_is_no_known_message_is_refused(wire):
    with pytest.raises(InvalidMetadata):
        m.from_wire(wire)


def _fields(cls):
    return [(cls, spec) for spec in cls.SPEC]


ALL_FIELDS = [pair for cls in VALID for pair in _fields(cls)]
FIELD_IDS = [f"{cls.WIRE}.{spec[1]}" for cls, spec in ALL_FIELDS]


def _example(cls):
    return EXAMPLE[cls].to_wire()


def _wrong_value(types):
    for value in (1, "s", b"b", True, None, [1], {"k": 1}, 1.5):
        if type(value) not in types:
            return value
    raise AssertionError(types)


@pytest.mark.parametrize(("cls", "spec"), ALL_FIELDS, ids=FIELD_IDS)
def test_each_field_is_refused_missing_mistyped_or_out_of_bounds(cls, spec):
    _, key, types, bound, required = spec
    base = _example(cls)
    if cls is m.Req and key == "tag":  # each row takes a tag: the largest tag fits a request of no rows
        base = {**base, "addr": b"", "len": b"", "dev": b""}
    if required:
        missing = dict(base)
        del missing[key]
        with pytest.raises(InvalidMetadata, match=f"lacks '{key}'"):
            m.from_wire(missing)
    for wrong in [_wrong_value(types), 1.5, {"k": 1}]:
        if type(wrong) in types:
            continue
        with pytest.raises(InvalidMetadata, match=f"'{key}' is a"):
            m.from_wire({**base, key: wrong})
    if int in types:
        for bad in (-1, bound):
            with pytest.raises(InvalidMetadata, match=f"'{key}' is out of range"):
                m.from_wire({**base, key: bad})
        assert getattr(m.from_wire({**base, key: bound - 1}), spec[0]) == bound - 1
    for kind, unit in ((bytes, b"x"), (str, "x"), (list, [0])):
        if kind in types:
            with pytest.raises(InvalidMetadata, match=f"'{key}' is longer than {bound}"):
                m.from_wire({**base, key: unit * (bound + 1)})
    if bool in types:
        with pytest.raises(InvalidMetadata, match=f"'{key}' is a int"):
            m.from_wire({**base, key: 1})


def test_fields_at_their_bound_are_accepted():
    n = 8 * m.MAX_ROWS
    big = m.from_wire({"t": "req", "id": (1 << 64) - 1, "op": "READ", "mem": "DRAM", "addr": b"\0" * n,
                       "len": b"\0" * n, "dev": b"\0" * n, "tag": 0, "notify": b"n" * m.MAX_NOTIFY})  # fmt: skip
    assert big.rows == m.MAX_ROWS
    assert m.from_wire({"t": "error", "reason": "r" * m.MAX_REASON}).reason == "r" * m.MAX_REASON
    assert m.from_wire({"t": "welcome", "conn_id": 0, "address": b"a" * m.MAX_ADDRESS}).address == b"a" * m.MAX_ADDRESS


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        ({"op": "COPY"}, "unknown op"),
        ({"op": ""}, "unknown op"),
        ({"addr": b"x" * 7, "len": b"x" * 7, "dev": b"x" * 7}, "equal-length int64"),
        ({"addr": b"x" * 8, "len": b"x" * 16, "dev": b"x" * 8}, "equal-length int64"),
        ({"addr": b"x" * 8, "len": b"x" * 8, "dev": b""}, "equal-length int64"),
        ({"tag": (1 << 64) - 1, "addr": b"x" * 16, "len": b"x" * 16, "dev": b"x" * 16}, "'tag'.*passes 2\\*\\*64"),
    ],
)
def test_a_request_with_an_unknown_op_or_ragged_columns_is_refused(wire, why):
    base = m.Req(1, "WRITE", "DRAM", b"a" * 8, b"b" * 8, b"c" * 8, 7, None).to_wire()
    with pytest.raises(InvalidMetadata, match=why):
        m.from_wire({**base, **wire})


def test_a_request_whose_last_row_takes_the_last_tag_is_accepted():
    wire = m.Req(1, "WRITE", "DRAM", b"a" * 16, b"b" * 16, b"c" * 16, (1 << 64) - 2, None).to_wire()
    assert m.from_wire(wire).tag == (1 << 64) - 2  # rows take tags 2**64-2 and 2**64-1


@pytest.mark.parametrize("wire", [{"name": ""}, {"address": b""}])
def test_a_hello_without_name_or_address_is_refused(wire):
    with pytest.raises(InvalidMetadata, match="no valid name"):
        m.from_wire({"t": "hello", "name": "a", "address": b"x", "nonce": b"", **wire})


@pytest.mark.parametrize(
    "rows",
    [[[1, "DRAM", 0, 0, 8]], [[1, "FILE", 0, 0, 8, b"k"]], [[1, "DRAM", 0, 0, 0, b"k"]], [[-1, "DRAM", 0, 0, 8, b"k"]],
     [[1, "DRAM", 0, 0, 8, b""]], [[True, "DRAM", 0, 0, 8, b"k"]], ["row"]],
)  # fmt: skip
def test_rkey_rows_are_checked_before_anyone_unpacks_a_key(rows):
    with pytest.raises(InvalidMetadata):
        m.from_wire({"t": "rkeys", "add": rows})


def test_the_dispatch_tables_cover_every_type_and_each_side_refuses_the_others():
    """Each type is handled by the side it is sent to; hello is the target's first, handled before its table."""
    assert set(_FROM_TARGET) | set(_FROM_INITIATOR) | {m.Hello} == set(m.MESSAGES.values())
    assert set(_FROM_TARGET) & set(_FROM_INITIATOR) == {m.Notif}

    class _Peer:
        state = "ready"
        ops: dict = {}

    for cls in set(_FROM_INITIATOR) - {m.Notif}:
        with pytest.raises(InvalidMetadata, match="is not one a target sends"):
            Outbound._on_peer_msg(None, _Peer(), EXAMPLE[cls])  # type: ignore[arg-type]

    class _Inbound:
        name = "peer"

    for cls in set(_FROM_TARGET) - {m.Notif}:
        with pytest.raises(InvalidMetadata, match="is not one an initiator sends"):
            Serving._on_inbound_msg(None, _Inbound(), EXAMPLE[cls])  # type: ignore[arg-type]


def test_handshake_messages_out_of_order_are_refused():
    class _Peer:
        state = "ready"
        ops: dict = {}

    for msg in (m.Challenge(b"n"), m.Welcome(1, b"a")):
        with pytest.raises(InvalidMetadata, match="out of order"):
            Outbound._on_peer_msg(None, _Peer(), msg)  # type: ignore[arg-type]
    _Peer.state = "connecting"
    with pytest.raises(InvalidMetadata, match="out of order"):
        Outbound._on_peer_msg(None, _Peer(), m.Done(1))  # type: ignore[arg-type]

    class _Inbound:
        name = ""

    with pytest.raises(InvalidMetadata, match="before hello"):
        Serving._on_inbound_msg(None, _Inbound(), m.Req(1, "READ", "DRAM", b"", b"", b"", 0))  # type: ignore[arg-type]
    _Inbound.name = "peer"
    with pytest.raises(InvalidMetadata, match="a second hello"):
        Serving._on_inbound_msg(None, _Inbound(), m.Hello("a", b"x", b""))  # type: ignore[arg-type]


def test_messages_are_frozen():
    msg = m.Done(1)
    with pytest.raises(AttributeError):
        msg.id = 2  # type: ignore[misc]
