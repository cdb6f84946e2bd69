"""The L3 index: which chunk (and its CRC32C) each slot of the L3 data file holds, kept across restarts.

An append-only log of msgpack records, `["put", slot, crc, key]` and `["del", slot]`. It is read back when a
cache starts (a torn or damaged tail ends the log; what came before it is kept), compacted to one `put` per
live slot at start and at close, and appended to after every operation that stored or freed L3 slots, made
durable as `l3_nvme.fsync_mode` says (the chunk data file first, then the log).
"""

from __future__ import annotations

import logging
import os
from io import BufferedWriter
from pathlib import Path

import msgpack

from .keys import ChunkKey
from .slabs import DATA_FILE

log = logging.getLogger("datamover.kvcache")

INDEX_FILE = "index.log"


class L3Index:
    """The index log of the L3 tier under `directory`."""

    def __init__(self, directory: str | Path, capacity: int, fsync_mode: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / INDEX_FILE
        self.capacity = capacity
        self.fsync_mode = fsync_mode
        self._file: BufferedWriter | None = None
        self._pending: list[list] = []

    def load(self) -> dict[int, tuple[ChunkKey, int]]:
        """The live entries of the log on disk (slot -> (key, crc)); the log is then compacted to them."""
        entries: dict[int, tuple[ChunkKey, int]] = {}
        slot_of: dict[ChunkKey, int] = {}
        if self.path.exists():
            with open(self.path, "rb") as f:
                try:
                    for record in msgpack.Unpacker(f, raw=False):  # a torn last record ends the stream
                        if record[0] == "put" and record[1] < self.capacity:
                            key = ChunkKey(*record[3])
                            entries.pop(slot_of.get(key, -1), None)  # a key lives in one slot: the latest
                            entries[record[1]] = (key, record[2])
                            slot_of[key] = record[1]
                        elif record[0] == "del":
                            entries.pop(record[1], None)
                except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
                    log.warning(
                        "l3_nvme: index %s unreadable past a damaged record (%s); the rest is kept", self.path, exc
                    )
        self.rewrite(entries)
        return entries

    def rewrite(self, entries: dict[int, tuple[ChunkKey, int]]) -> None:
        """Replace the log by one put per entry (atomically: written aside, fsynced, renamed), then append."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for slot, (key, crc) in entries.items():
                f.write(msgpack.packb(["put", slot, crc, list(key)]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self._file is not None:
            self._file.close()
        self._file = open(self.path, "ab")

    def stored(self, slot: int, crc: int, key: ChunkKey) -> None:
        """Record that `slot` now holds `key` (appended at the next `sync`)."""
        self._pending.append(["put", slot, crc, list(key)])

    def freed(self, slot: int) -> None:
        """Record that `slot` holds nothing now (appended at the next `sync`)."""
        self._pending.append(["del", slot])

    def sync(self) -> None:
        """Append the pending records and make them (and the chunk data) durable per fsync_mode."""
        if not self._pending or self._file is None:
            return
        f = self._file
        f.write(b"".join(msgpack.packb(r) for r in self._pending))
        f.flush()
        self._pending.clear()
        if self.fsync_mode != "none":
            data = os.open(self.directory / DATA_FILE, os.O_RDONLY)
            try:
                sync = os.fsync if self.fsync_mode == "fsync" else os.fdatasync
                sync(data)
                sync(f.fileno())
            finally:
                os.close(data)

    def close(self, entries: dict[int, tuple[ChunkKey, int]]) -> None:
        """Compact the log to `entries` (the live slots) and close it."""
        self.rewrite(entries)
        if self._file is not None:
            self._file.close()
            self._file = None
