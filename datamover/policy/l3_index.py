"""The L3 index: which chunk (and its CRC32C) each slot of the L3 data file holds, kept across restarts.

An append-only log of msgpack records: first `["layout", chunk_bytes]` (the size of a slot of the data file), then
`["put", slot, crc, key]` (crc nil: written without `crc32c_check`) and `["del", slot]`. It is read back when a
cache starts (a torn or damaged tail ends the log; what came before it is kept; a `put` whose key is no chunk key
is skipped and its slot dropped; a log of another layout, or none, is not used: its slots are other bytes of the
file, which `crc32c_check: false` would serve unchecked), compacted to one `put` per live slot at start and at
close, and appended to after every operation that stored or freed L3 slots, made durable as `l3_nvme.fsync_mode`
says (the chunk data file first, then the log; without `crc32c_check`, the records of slots freed go first, before
new chunks overwrite them). A log that cannot be written is removed; a record msgpack cannot pack is left out (a
`put` then becomes a `del` of its slot).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from io import BufferedWriter
from pathlib import Path

import msgpack

from ..errors import ConfigError
from .keys import ChunkKey, key_from_fields
from .slabs import DATA_FILE

log = logging.getLogger("datamover.kvcache")

INDEX_FILE = "index.log"
LOCK_FILE = "lock"


def lock_directory(directory: str | Path) -> int:
    """Hold the L3 directory for this cache (an exclusive lock, released when the returned fd is closed): two
    caches on one directory would overwrite each other's chunks and index. ConfigError if another holds it."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError("kv_cache_tiered.l3_nvme.path", f"{path} cannot hold the L3 tier: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            "kv_cache_tiered.l3_nvme.path",
            f"{path} is in use by another cache (pid {holder}); give each cache a directory of its own",
        ) from None
    except OSError as exc:  # a file system without locks: go on, as before there was a lock
        log.warning("l3_nvme: cannot lock %s (%s): make sure no other cache uses it", path, exc)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class UnreadableKey(ValueError):
    """A well-formed `put` record whose key is not a chunk key: `slot` was overwritten by a chunk that cannot be
    named, so it holds nothing usable (the record is skipped, the log goes on)."""

    def __init__(self, slot: int, reason: str) -> None:
        super().__init__(f"slot {slot}: {reason}")
        self.slot = slot


def parse_record(record: object) -> tuple[int, tuple[ChunkKey, int] | None]:
    """(slot, (key, crc)) of a `put` record, (slot, None) of a `del`; UnreadableKey for a put whose key is no
    chunk key, ValueError for anything else (a damaged log: every field is checked before the cache trusts it,
    a slot from it becomes a file offset)."""
    if not isinstance(record, list) or not record:
        raise ValueError(f"not a record: {record!r:.80}")
    slot = record[1] if len(record) > 1 else None
    if type(slot) is not int or slot < 0:
        raise ValueError(f"slot {slot!r:.40} is not a slot number")
    if record[0] == "del" and len(record) == 2:
        return slot, None
    if record[0] != "put" or len(record) != 4:
        raise ValueError(f"not a put or del record: {record!r:.80}")
    crc, fields = record[2], record[3]
    if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
        raise ValueError(f"CRC32C {crc!r:.40} out of range")
    try:
        return slot, (key_from_fields(fields), crc)
    except ValueError as exc:
        raise UnreadableKey(slot, str(exc)) from None


class L3Index:
    """The index log of the L3 tier under `directory`."""

    def __init__(self, directory: str | Path, capacity: int, fsync_mode: str, chunk_bytes: int) -> None:
        self.directory = Path(directory)
        self.path = self.directory / INDEX_FILE
        self.capacity = capacity
        self.chunk_bytes = chunk_bytes
        self.fsync_mode = fsync_mode
        self._file: BufferedWriter | None = None
        self._pending: list[list] = []

    def load(self, data_bytes: int | None = None) -> dict[int, tuple[ChunkKey, int]]:
        """The live entries of the log on disk (slot -> (key, crc)); the log is then compacted to them. With
        `data_bytes`, the data file's size as found: slots past its end hold nothing (the file was cut short)."""
        entries: dict[int, tuple[ChunkKey, int]] = {}
        slot_of: dict[ChunkKey, int] = {}
        skipped = 0
        if self.path.exists():
            with open(self.path, "rb") as f:
                records = msgpack.Unpacker(f, raw=False)  # a torn last record ends the stream
                try:
                    layout = next(records, None)
                    if layout is not None and layout != ["layout", self.chunk_bytes]:
                        log.warning(
                            "l3_nvme: index %s is not of this layout (%.80r, this is %d-byte chunks): not used",
                            self.path, layout, self.chunk_bytes,
                        )  # fmt: skip
                        records = iter(())
                    for record in records:
                        try:
                            slot, entry = parse_record(record)
                        except UnreadableKey as exc:
                            skipped += 1
                            entries.pop(exc.slot, None)
                            continue
                        if entry is not None:
                            if slot >= self.capacity:  # the tier is smaller than when it was written
                                continue
                            key = entry[0]
                            old = slot_of.get(key, -1)  # a key lives in one slot: the latest
                            if entries.get(old, (None,))[0] == key:  # not if that slot was freed or reused since
                                del entries[old]
                            entries[slot] = entry
                            slot_of[key] = slot
                        else:
                            entries.pop(slot, None)
                except (ValueError, msgpack.UnpackException) as exc:
                    log.warning(
                        "l3_nvme: index %s unreadable past a damaged record (%s); the rest is kept", self.path, exc
                    )
        if skipped:
            log.warning("l3_nvme: %d records of index %s name no chunk key: their slots dropped", skipped, self.path)
        if data_bytes is not None:
            gone = [slot for slot in entries if (slot + 1) * self.chunk_bytes > data_bytes]
            if gone:
                log.warning(
                    "l3_nvme: %d chunks of index %s lie past the end of the data file (%d bytes): dropped",
                    len(gone), self.path, data_bytes,
                )  # fmt: skip
                for slot in gone:
                    del entries[slot]
        self.rewrite(entries)
        return entries

    def rewrite(self, entries: dict[int, tuple[ChunkKey, int]]) -> None:
        """Replace the log by one put per entry (atomically: the chunk data made durable, the log written aside,
        fsynced, renamed, the rename made durable), then append."""
        if self.fsync_mode != "none" and (self.directory / DATA_FILE).exists():
            self._sync_data()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(["layout", self.chunk_bytes]))
            for slot, (key, crc) in entries.items():
                f.write(_pack(["put", slot, crc, list(key)], self.path))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _sync_directory(self.directory)
        if self._file is not None:
            self._file.close()
        self._file = open(self.path, "ab")

    def stored(self, slot: int, crc: int | None, key: ChunkKey) -> None:
        """Record that `slot` now holds `key` (appended at the next `sync`; nothing once the log is given up)."""
        if self._file is not None:
            self._pending.append(["put", slot, crc, list(key)])

    def freed(self, slot: int) -> None:
        """Record that `slot` holds nothing now (appended at the next `sync`; nothing once the log is given up)."""
        if self._file is not None:
            self._pending.append(["del", slot])

    def sync(self) -> None:
        """Append the pending records and make them (and the chunk data) durable per fsync_mode. A log that cannot
        be written (a full or failing disk) is removed and not written again this run: the next start is cold,
        never misled by a log that stopped partway (a record lost could name a slot since reused)."""
        if self._file is None:
            self._pending.clear()
            return
        if not self._pending:
            return
        f = self._file
        records = b"".join(_pack(r, self.path) for r in self._pending)
        self._pending.clear()
        try:
            if self.fsync_mode != "none":  # the chunks first: no durable record may name bytes not on disk
                self._sync_data()
            f.write(records)
            f.flush()
            if self.fsync_mode != "none":
                (os.fsync if self.fsync_mode == "fsync" else os.fdatasync)(f.fileno())
        except OSError as exc:
            self._give_up(exc)

    def _sync_data(self) -> None:
        """Make the chunk data file durable (any descriptor of it will do: the one the posix backend writes
        through is its registration's)."""
        data = os.open(self.directory / DATA_FILE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            (os.fsync if self.fsync_mode == "fsync" else os.fdatasync)(data)
        finally:
            os.close(data)

    def _give_up(self, exc: OSError) -> None:
        log.warning("l3_nvme: index %s cannot be written (%s): removed; L3 starts cold next time", self.path, exc)
        self._pending.clear()
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # what is still buffered cannot be written either
                file.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self, entries: dict[int, tuple[ChunkKey, int]]) -> None:
        """Compact the log to `entries` (the live slots) and close it; if that cannot be written, there is no log
        (as after a failed `sync`)."""
        try:
            self.rewrite(entries)
        except OSError as exc:
            self._give_up(exc)
        if self._file is not None:
            self._file.close()
            self._file = None

    def release(self) -> None:
        """Close the log without writing to it (a cache that failed to start); nothing after `close`."""
        self._pending.clear()
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # nothing of it is buffered but what a failed write left
                file.close()


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a file system that cannot fsync a directory is left as it is)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def _pack(record: list, path: Path) -> bytes:
    """A record as msgpack. One msgpack cannot hold (a key field out of its range or of no type it knows) is
    logged and left out; a `put` becomes a `del` of its slot, which no longer holds what the log said before."""
    try:
        return msgpack.packb(record)
    except (TypeError, OverflowError, ValueError) as exc:
        log.warning("l3_nvme: index %s cannot record %.80r (%s): left out", path, record, exc)
    if record[0] == "put":
        with contextlib.suppress(TypeError, OverflowError, ValueError):
            return msgpack.packb(["del", record[1]])
    return b""
