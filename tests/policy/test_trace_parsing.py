"""load_trace on generated input: well-formed traces load exactly, anything else is a ValueError naming the line."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.policy.replay import load_trace

GOOD = b'{"timestamp": 0, "hash_ids": [7]}\n'

stamps = st.one_of(
    st.integers(-(10**15), 10**15), st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
)
ids = st.lists(st.integers(-(2**70), 2**70), max_size=12)
requests = st.lists(st.tuples(stamps, ids), max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "t.jsonl"

    def write(data: bytes):
        path.write_bytes(data)
        return path

    return write


def as_int64(i: int) -> int:
    """What an id becomes: its value modulo 2**64, read as a signed 64-bit integer."""
    return int(np.uint64(i % 2**64).view(np.int64))


@settings(max_examples=150)
@given(requests)
def test_a_well_formed_trace_loads_exactly(trace_file, rows):
    text = "".join(json.dumps({"timestamp": t, "input_length": 1, "hash_ids": h}) + "\n" for t, h in rows)
    path = trace_file(text.encode())
    kept = [(t, h) for t, h in rows if h]
    if not kept:
        with pytest.raises(ValueError, match=r"^trace .*t.jsonl: no "):
            load_trace(path)
        return
    trace = load_trace(path)
    assert trace.keys.tolist() == [as_int64(i) for _, h in kept for i in h]
    assert trace.times.tolist() == [t / 1000.0 for t, h in kept for _ in h]
    assert trace.request.tolist() == [r for r, (_, h) in enumerate(kept) for _ in h]
    assert (trace.requests, trace.skipped) == (len(kept), len(rows) - len(kept))
    assert trace.out_of_order == sum(b[0] / 1000.0 < a[0] / 1000.0 for a, b in zip(kept, kept[1:]))  # in seconds
    assert trace.repeating == sum(len({as_int64(i) for i in h}) < len(h) for _, h in kept)


@settings(max_examples=150)
@given(requests, st.sampled_from(["first", "second"]))
def test_the_halves_split_by_time(trace_file, rows, part):
    text = "".join(json.dumps({"timestamp": t, "hash_ids": h}) + "\n" for t, h in rows)
    path = trace_file(text.encode())
    ms = [t for t, _ in rows]
    middle = (min(ms) + max(ms)) / 2.0 / 1000.0 if ms else 0.0
    kept = [h for t, h in rows if (t / 1000.0 < middle) == (part == "first") and h]
    try:
        trace = load_trace(path, part=part)
    except ValueError as exc:
        assert not kept and re.match(r"^trace .*t.jsonl: (no |the (first|second) half)", str(exc))
        return
    assert trace.keys.tolist() == [as_int64(i) for h in kept for i in h]


def check_named(path) -> None:
    """A trace whose second line is generated loads, or is a ValueError naming line 2 (never another exception)."""
    try:
        load_trace(path)
    except ValueError as exc:
        assert re.match(r"^trace .*t.jsonl(, line 2)?: ", str(exc)), str(exc)
        assert "\n" not in str(exc)


@settings(max_examples=300)
@given(st.binary(max_size=64).filter(lambda b: b"\n" not in b))
def test_any_bytes_are_a_trace_line_or_a_named_error(trace_file, line):
    check_named(trace_file(GOOD + line + b"\n"))


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["timestamp", "hash_ids", "input_length", "x"]), json_values, max_size=4))
def test_any_json_object_is_a_request_or_a_named_error(trace_file, row):
    line = json.dumps(row).encode()  # NaN and Infinity too, as Python writes them
    path = trace_file(GOOD + line + b"\n")
    ids, stamp = row.get("hash_ids"), row.get("timestamp")
    good = (
        isinstance(ids, list)
        and all(type(i) is int for i in ids)
        and type(stamp) in (int, float)
        and math.isfinite(stamp)
    )
    if not good:
        with pytest.raises(ValueError, match=r"^trace .*t.jsonl, line 2: "):
            load_trace(path)
        return
    trace = load_trace(path)
    assert trace.keys.tolist() == [7, *(as_int64(i) for i in ids)]


@settings(max_examples=200)
@given(json_values)
def test_any_json_value_on_a_line_is_a_request_or_a_named_error(trace_file, value):
    check_named(trace_file(GOOD + json.dumps(value).encode() + b"\n"))
