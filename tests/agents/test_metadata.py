"""Metadata blobs: round trips, and truncated, corrupt or hostile blobs raising InvalidMetadata and changing nothing."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from datamover import Agent
from datamover.agents.metadata import (
    MAX_BACKENDS_BYTES,
    MAX_BACKENDS_DEPTH,
    MAX_BACKENDS_ITEMS,
    MAX_NAME_LEN,
    SCHEMA_VERSION,
    decode_metadata,
    encode_metadata,
    open_metadata,
    sign_metadata,
)
from datamover.descriptors import MemType
from datamover.errors import AuthenticationError, InvalidMetadata

INT64_MAX = (1 << 63) - 1


@pytest.fixture(scope="module")
def agent():
    with Agent("me", {"backends": {"memcpy": {}}}) as agent:
        agent.add_remote(encode_metadata("known", {}, [(MemType.DRAM, 0, 4096, 100, 1)]))
        yield agent


def _state(agent):
    return {n: agent.remote_metadata(n) for n in agent.remotes}


@st.composite
def regions(draw):
    """Non-overlapping regions: sorted starts with gaps, random memory types and devices."""
    n = draw(st.integers(0, 20))
    out, pos = [], draw(st.integers(0, 1 << 40))
    for rid in range(1, n + 1):
        length = draw(st.integers(1, 1 << 30))
        out.append((draw(st.sampled_from([MemType.DRAM, MemType.VRAM])), draw(st.integers(0, 3)), pos, length, rid))
        pos += length + draw(st.integers(0, 1 << 20))
    return out


names = st.text(min_size=1, max_size=40).filter(lambda s: s.strip())
infos = st.dictionaries(
    st.sampled_from(["ucx", "other"]),
    st.dictionaries(st.text(max_size=8), st.one_of(st.binary(max_size=32), st.integers(0, 65535), st.text(max_size=8))),
    max_size=2,
)


@given(names, infos, regions())
def test_roundtrip(name, backends, regs):
    meta = decode_metadata(encode_metadata(name, backends, regs))
    assert meta.name == name and meta.backends == backends
    assert list(meta.regions) == [(m, d, s, n, r) for m, d, s, n, r in regs]
    assert len(meta.table) == len(regs)


@given(st.binary(max_size=4096))
def test_random_bytes_raise_invalid_metadata_and_change_nothing(agent, blob):
    before = _state(agent)
    try:
        decode_metadata(blob)
    except InvalidMetadata:
        pass
    with pytest.raises((InvalidMetadata, AuthenticationError)):
        agent.add_remote(blob)
    assert _state(agent) == before


@given(regions().filter(bool), st.data())
def test_every_truncation_is_invalid(regs, data):
    blob = encode_metadata("peer", {}, regs)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(InvalidMetadata):
        decode_metadata(blob[:cut])


hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(-5, 5), max_size=6),
    st.dictionaries(st.text(max_size=4), st.integers(-(1 << 63), INT64_MAX), max_size=3),
)


def _valid_doc():
    return {
        "schema": SCHEMA_VERSION,
        "name": "peer",
        "backends": {"ucx": {"port": 1}},
        "regions": [["DRAM", 0, 4096, 4096, 1], ["VRAM", 1, 0, 1 << 20, 2]],
    }


@given(st.sampled_from(["schema", "name", "backends", "regions"]), hostile_values)
def test_mistyped_field_raises(agent, field, value):
    doc = _valid_doc()
    doc[field] = value
    blob = msgpack.packb(doc, use_bin_type=True)
    try:
        meta = decode_metadata(blob)
    except InvalidMetadata:
        before = _state(agent)
        with pytest.raises(InvalidMetadata):
            agent.add_remote(blob)
        assert _state(agent) == before
        return
    # decoding succeeded: only values that really are valid for the field may get here
    if field == "name":
        assert meta.name == value and isinstance(value, str)
    elif field == "backends":
        assert meta.backends == value == {}
    elif field == "regions":
        assert value == [] and meta.regions == ()
    elif not (type(value) is int and value == SCHEMA_VERSION):  # hypothesis may draw the one valid schema
        pytest.fail(f"schema {value!r} was accepted")


@given(st.integers(0, 4), hostile_values)
def test_mistyped_region_entry_raises(k, value):
    doc = _valid_doc()
    doc["regions"][0][k] = value
    ok = (k == 0 and value in ("DRAM", "VRAM", "FILE", "OBJ")) or (
        k > 0 and type(value) is int and 0 <= value <= INT64_MAX
    )
    if ok:
        return
    with pytest.raises(InvalidMetadata):
        decode_metadata(msgpack.packb(doc, use_bin_type=True))


@given(st.integers(1, 1 << 20), st.integers(0, (1 << 20) - 1))
def test_overlapping_regions_raise(length, shift):
    start = 1 << 30
    regs = [(MemType.DRAM, 0, start, length, 1), (MemType.DRAM, 0, start + shift % length, length, 2)]
    with pytest.raises(InvalidMetadata, match="overlap"):
        decode_metadata(encode_metadata("peer", {}, regs))


@given(st.integers(1, INT64_MAX), st.integers(1, INT64_MAX))
def test_huge_regions_raise_when_they_overflow(start, length):
    blob = encode_metadata("peer", {}, [(MemType.DRAM, 0, start, length, 1)])
    if start + length > INT64_MAX:
        with pytest.raises(InvalidMetadata, match="overflow"):
            decode_metadata(blob)
    else:
        assert decode_metadata(blob).regions[0][3] == length


@given(st.integers(-(1 << 63), (1 << 64) - 1).filter(lambda v: v != SCHEMA_VERSION))
def test_unknown_schema_version(version):
    doc = _valid_doc()
    doc["schema"] = version
    with pytest.raises(InvalidMetadata, match="schema"):
        decode_metadata(msgpack.packb(doc, use_bin_type=True))


def test_fixed_hostile_cases():
    cases = {
        "unknown field": {**_valid_doc(), "evil": 1},
        "name too long": {**_valid_doc(), "name": "x" * (MAX_NAME_LEN + 1)},
        "duplicate region ids": {**_valid_doc(), "regions": [["DRAM", 0, 0, 1, 7], ["DRAM", 0, 10, 1, 7]]},
        "unknown memory type": {**_valid_doc(), "regions": [["HBM9", 0, 0, 1, 1]]},
        "negative length": {**_valid_doc(), "regions": [["DRAM", 0, 0, -1, 1]]},
        "region too short": {**_valid_doc(), "regions": [["DRAM", 0, 0]]},
        "backend info not a map": {**_valid_doc(), "backends": {"ucx": [1, 2]}},
    }
    for what, doc in cases.items():
        with pytest.raises(InvalidMetadata):
            decode_metadata(msgpack.packb(doc, use_bin_type=True))
            pytest.fail(what)
    with pytest.raises(InvalidMetadata):
        decode_metadata(msgpack.packb([1, 2, 3]))
    with pytest.raises(InvalidMetadata):
        decode_metadata("not bytes")  # type: ignore[arg-type]
    # an array header announcing 2**32-1 items with nothing behind it
    with pytest.raises(InvalidMetadata):
        decode_metadata(b"\x84\xa7regions\xdd\xff\xff\xff\xff")


def test_own_metadata_is_refused(agent):
    with pytest.raises(InvalidMetadata, match="own"):
        agent.add_remote(agent.metadata())


@given(regions(), st.data())
def test_signed_blob_any_flipped_byte_is_refused(regs, data):
    blob = sign_metadata(encode_metadata("peer", {}, regs), b"key")
    assert open_metadata(blob, b"key") == blob[36:]
    i = data.draw(st.integers(0, len(blob) - 1))
    bad = bytearray(blob)
    bad[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises((AuthenticationError, InvalidMetadata)):
        decode_metadata(open_metadata(bytes(bad), b"key"))


def _with_backends(backends):
    return msgpack.packb({**_valid_doc(), "backends": backends}, use_bin_type=True)


@pytest.mark.parametrize(
    "backends, why",
    [
        ({"junk": {f"{i:x}": 0 for i in range(1_000_000)}}, "map of more than"),  # 7 MiB on the wire, 100 MB built
        ({"junk": {"k": list(range(MAX_BACKENDS_ITEMS))}}, "keys and elements"),
        ({"junk": {f"k{i}": [0] * 8 for i in range(MAX_BACKENDS_ITEMS // 8)}}, "keys and elements"),
        ({"junk": {"k": [[0] * (MAX_BACKENDS_DEPTH - 2)]}}, "deeper"),
        ({"ucx": {"address": b"a" * MAX_BACKENDS_BYTES}}, f"at most {MAX_BACKENDS_BYTES}"),
    ],
    ids=["million-keys", "long-list", "many-lists", "deep", "big-bytes"],
)
def test_a_backends_section_past_its_bounds_is_refused(backends, why):
    with pytest.raises(InvalidMetadata, match=why):
        decode_metadata(_with_backends(backends))


def test_the_backends_section_is_counted_in_what_the_metadata_keeps():
    """ucx's own bound on a worker address (64 KiB) fits, and the budget sees the bytes kept for it."""
    info = {"ucx": {"address": b"a" * (64 << 10), "host": "node-17.cluster", "port": 40123}, "memcpy": {}}
    meta = decode_metadata(_with_backends(info))
    bare = decode_metadata(_with_backends({}))
    assert meta.backends == info
    assert meta.nbytes - bare.nbytes >= 64 << 10
