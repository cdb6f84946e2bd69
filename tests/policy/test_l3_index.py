"""The L3 index log read back at start: what a damaged log may and may not make the cache believe."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.errors import ConfigError
from datamover.policy.keys import ChunkKey
from datamover.policy.l3_index import INDEX_FILE, L3Index, UnreadableKey, lock_directory, parse_record
from datamover.policy.slabs import DATA_FILE
from tests.policy.full_disk import FullDisk

KEY = ChunkKey(7, "m", "t")
CHUNK = 4096
LAYOUT = ["layout", CHUNK]


def make(directory) -> L3Index:
    return L3Index(directory, 10, "none", CHUNK)


def write_log(directory, records: list, layout: object = LAYOUT) -> None:
    head = [] if layout is None else [layout]
    (directory / INDEX_FILE).write_bytes(b"".join(msgpack.packb(r) for r in head + records))


def test_records_as_the_index_writes_them_are_read_back(tmp_path):
    index = make(tmp_path)
    index.load()
    index.stored(3, 0xDEADBEEF, KEY)
    index.stored(4, 1, ChunkKey(8, "m", "t", 2))
    index.stored(5, 2, ChunkKey(9, "m", "t", 2))
    index.freed(4)
    index.sync()
    assert make(tmp_path).load() == {3: (KEY, 0xDEADBEEF), 5: (ChunkKey(9, "m", "t", 2), 2)}


@pytest.mark.parametrize(
    "bad",
    [
        ["put", -1, 0, [7, "m", "t", None]],  # a negative slot would become a negative file offset
        ["put", True, 0, [7, "m", "t", None]],
        ["put", 1.0, 0, [7, "m", "t", None]],
        ["put", 1, -5, [7, "m", "t", None]],
        ["put", 1, 1 << 32, [7, "m", "t", None]],
        ["put", 1, 0],
        ["del"],
        ["del", -2],
        ["move", 1],
        {"put": 1},
        5,
    ],
)
def test_a_damaged_record_ends_the_log_and_what_came_before_is_kept(tmp_path, bad):
    with pytest.raises(ValueError):
        parse_record(bad)
    write_log(tmp_path, [["put", 2, 9, list(KEY)], bad, ["put", 5, 9, [8, "m", "t", None]]])
    assert make(tmp_path).load() == {2: (KEY, 9)}


def test_a_key_put_again_elsewhere_leaves_its_old_slots_new_owner(tmp_path):
    other = ChunkKey(8, "m", "t")
    write_log(tmp_path, [["put", 0, 1, list(KEY)], ["del", 0], ["put", 0, 2, list(other)], ["put", 1, 1, list(KEY)]])
    assert make(tmp_path).load() == {0: (other, 2), 1: (KEY, 1)}
    write_log(tmp_path, [["put", 0, 1, list(KEY)], ["put", 0, 2, list(other)], ["put", 1, 1, list(KEY)]])
    assert make(tmp_path).load() == {0: (other, 2), 1: (KEY, 1)}


_KEYS = [ChunkKey(h, "m", "t") for h in range(4)]
_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5), st.sampled_from(_KEYS)), st.tuples(st.just("del"), st.integers(0, 5))
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_op, max_size=6), max_size=5))
def test_any_stored_and_freed_records_replay_to_the_final_slots(tmp_path_factory, syncs):
    """What the cache recorded, synced in any batches, loads back as exactly the slots it last said."""
    directory = tmp_path_factory.mktemp("l3")
    index = make(directory)
    index.load()
    final: dict[int, ChunkKey] = {}
    for batch in syncs:
        for op in batch:
            if op[0] == "put":
                slot, key = op[1], op[2]
                final = {s: k for s, k in final.items() if k != key}  # a key lives in one slot: the latest
                final[slot] = key
                index.stored(slot, slot, key)
            else:
                final.pop(op[1], None)
                index.freed(op[1])
        index.sync()
    assert {slot: key for slot, (key, _) in make(directory).load().items()} == final


def test_a_log_given_up_keeps_no_records_pending(tmp_path):
    index = make(tmp_path)
    index.load()
    index._file = FullDisk(index._file)
    index.stored(1, 1, KEY)
    index.sync()  # the write fails: the log is removed, not written again this run
    assert not (tmp_path / INDEX_FILE).exists()
    for slot in range(100):
        index.stored(slot, 1, KEY)
        index.freed(slot)
        index.sync()
    assert index._pending == []  # they grew by every L3 placement and eviction for the rest of the run
    assert not (tmp_path / INDEX_FILE).exists()


@pytest.mark.parametrize(
    "fields", [[[7], "m", "t", None], [7, b"m", "t", None], [7, "m", "t", "layer"], [7, "m"], [True, "m", "t"], 7]
)
def test_a_put_of_a_key_that_is_no_chunk_key_is_skipped_its_slot_dropped_and_the_log_goes_on(tmp_path, fields):
    with pytest.raises(UnreadableKey):
        parse_record(["put", 2, 0, fields])
    other = ChunkKey(8, "m", "t")
    write_log(tmp_path, [["put", 2, 9, list(KEY)], ["put", 2, 0, fields], ["put", 5, 9, list(other)]])
    assert make(tmp_path).load() == {5: (other, 9)}  # slot 2 no longer holds KEY's bytes


@pytest.mark.parametrize(
    "bad", [ChunkKey(1 << 70, "m", "t"), ChunkKey(np.uint64(7), "m", "t"), ChunkKey(7, "\ud800", "t")]
)
def test_a_record_msgpack_cannot_pack_is_left_out_and_the_log_goes_on(tmp_path, bad):
    other = ChunkKey(8, "m", "t")
    index = make(tmp_path)
    index.load()
    index.stored(2, 9, other)
    index.sync()
    index.stored(1, 9, KEY)
    index.stored(2, 9, bad)  # overwrites other's slot: the log must not say other is there
    index.sync()  # raised, and every later sync raised it again (the record stayed pending)
    index.stored(3, 9, ChunkKey(9, "m", "t"))
    index.sync()
    assert make(tmp_path).load() == {1: (KEY, 9), 3: (ChunkKey(9, "m", "t"), 9)}


def test_a_compaction_leaves_out_an_entry_msgpack_cannot_pack(tmp_path):
    index = make(tmp_path)
    index.load()
    index.close({1: (ChunkKey(1 << 70, "m", "t"), 9), 2: (KEY, 9)})  # raised TypeError out of the cache's close
    assert make(tmp_path).load() == {2: (KEY, 9)}


class _Recorded:
    """A log file whose writes are recorded in `calls` before they are made."""

    def __init__(self, file, calls: list[str]) -> None:
        self.file, self.calls = file, calls

    def write(self, data: bytes) -> int:
        self.calls.append("write index.log")
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def record_syncs(monkeypatch, directory) -> list[str]:
    """Every fsync, fdatasync and rename from now on, in order, naming the file (or 'directory')."""
    calls: list[str] = []

    def name(fd: int) -> str:
        path = os.readlink(f"/proc/self/fd/{fd}")
        return "directory" if path == str(directory) else os.path.basename(path)

    for call in ("fsync", "fdatasync"):
        real = getattr(os, call)
        monkeypatch.setattr(os, call, lambda fd, real=real, call=call: (calls.append(f"{call} {name(fd)}"), real(fd)))
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    return calls


@pytest.mark.parametrize("mode", ["fsync", "fdatasync"])
def test_a_record_is_written_only_once_the_chunk_data_it_names_is_durable(tmp_path, monkeypatch, mode):
    (tmp_path / DATA_FILE).write_bytes(bytes(4 * CHUNK))
    index = L3Index(tmp_path, 4, mode, CHUNK)
    index.load()
    calls = record_syncs(monkeypatch, tmp_path)
    index._file = _Recorded(index._file, calls)
    index.stored(1, 9, KEY)
    index.sync()  # wrote the record first: a power cut could leave it naming a slot whose bytes never landed
    assert calls == [f"{mode} {DATA_FILE}", "write index.log", f"{mode} {INDEX_FILE}"]
    calls.clear()
    index.close({1: (KEY, 9)})  # the compacted log: data durable, log aside, renamed, the rename durable
    assert calls == [f"{mode} {DATA_FILE}", "fsync index.tmp", "replace", "fsync directory"]


def test_without_fsync_mode_nothing_is_synced_but_the_compacted_log(tmp_path, monkeypatch):
    (tmp_path / DATA_FILE).write_bytes(bytes(4 * CHUNK))
    index = make(tmp_path)
    index.load()
    calls = record_syncs(monkeypatch, tmp_path)
    index.stored(1, 9, KEY)
    index.sync()
    assert calls == []
    index.close({1: (KEY, 9)})
    assert calls == ["fsync index.tmp", "replace", "fsync directory"]


def test_slots_past_a_smaller_tier_are_dropped_and_the_log_goes_on(tmp_path):
    write_log(tmp_path, [["put", 12, 9, list(KEY)], ["put", 2, 9, [8, "m", "t", None]]])
    assert make(tmp_path).load() == {2: (ChunkKey(8, "m", "t"), 9)}


_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=12,
)
_record = st.one_of(
    _value,
    st.tuples(st.sampled_from(["put", "del"]), st.integers(-3, 12), st.integers(-3, 1 << 33), _value).map(list),
    st.tuples(st.just("put"), st.integers(-3, 12), st.integers(0, 9), st.lists(_value, max_size=5)).map(list),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_record, max_size=8), st.binary(max_size=6))
def test_any_log_loads_to_entries_the_cache_can_trust(tmp_path_factory, records, tail):
    directory = tmp_path_factory.mktemp("l3")
    write_log(directory, records)
    with open(directory / INDEX_FILE, "ab") as f:
        f.write(tail)
    entries = make(directory).load()
    keys = [key for key, _ in entries.values()]
    assert len(set(keys)) == len(keys)  # one slot per key
    for slot, (key, crc) in entries.items():
        assert type(slot) is int and 0 <= slot < 10
        assert type(crc) is int and 0 <= crc < 1 << 32
        assert type(key.prefix_hash) is int and type(key.model_version) is str
        assert type(key.tokenizer_version) is str and (key.layer is None or type(key.layer) is int)
    assert make(directory).load() == entries  # compacted on load: the same entries again


@pytest.mark.parametrize("layout", [["layout", 2 * CHUNK], None, ["put", 2, 9, list(KEY)], "layout"])
def test_a_log_of_another_layout_or_none_is_not_used(tmp_path, layout):
    write_log(tmp_path, [["put", 2, 9, list(KEY)]], layout)
    assert make(tmp_path).load() == {}
    assert (tmp_path / INDEX_FILE).read_bytes() == msgpack.packb(LAYOUT)  # rewritten, empty, in this layout


def test_slots_past_the_end_of_the_data_file_hold_nothing(tmp_path):
    write_log(tmp_path, [["put", 0, 9, list(KEY)], ["put", 1, 9, [8, "m", "t"]], ["put", 2, 9, [9, "m", "t"]]])
    assert make(tmp_path).load(data_bytes=2 * CHUNK + 100) == {0: (KEY, 9), 1: (ChunkKey(8, "m", "t"), 9)}
    assert make(tmp_path).load() == {0: (KEY, 9), 1: (ChunkKey(8, "m", "t"), 9)}  # the log kept only those


def test_a_directory_that_cannot_hold_l3_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"l3_nvme.path: .*file/l3 cannot hold the L3 tier"):
        lock_directory(tmp_path / "file" / "l3")
