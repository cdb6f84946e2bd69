"""A real Mooncake Store for this package's tests: one mooncake_master on loopback per module, and the
object buffer the conformance kit reads and writes through plain ``MooncakeDistributedStore`` calls."""

from __future__ import annotations

import struct

import pytest

from datamover import Agent
from datamover.backends.mooncake import MAGIC
from datamover.testing import ObjectBuffer
from datamover.testing.mooncake import MooncakeMaster


def pack(key: str, payload: bytes, crc: int | None = None, length: int | None = None, magic: int = MAGIC) -> bytes:
    """Object ``key`` in datamover's format (payload, then magic, CRC32C of key and payload, length), by hand."""
    import crc32c

    crc = crc32c.crc32c(key.encode() + payload) if crc is None else crc
    return payload + struct.pack("<IIQ", magic, crc, len(payload) if length is None else length)


def unpack(key: str, blob: bytes) -> bytes:
    """The payload of object ``key`` in datamover's format, its trailer checked."""
    import crc32c

    magic, crc, length = struct.unpack("<IIQ", blob[-16:])
    payload = blob[:-16]
    assert magic == MAGIC and length == len(payload), "bad trailer"
    assert crc == crc32c.crc32c(key.encode() + payload), "bad CRC32C (or an object written for another key)"
    return payload


class RawStore:
    """A plain Mooncake client (lending no memory) that reads and writes objects without the backend."""

    def __init__(self, master: MooncakeMaster) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", master.metadata_url, 0, 64 << 20, "tcp", "", master.master_addr)
        assert rc == 0, rc

    def put(self, key: str, blob: bytes) -> None:
        assert self.store.put(key, blob) == 0

    def get(self, key: str) -> bytes | None:
        """The object's bytes, None when the pool does not hold it (a failed transfer is asked again)."""
        for _ in range(3):
            blob = self.store.get(key)
            if blob or self.store.is_exist(key) != 1:
                break
        return bytes(blob) if blob else None

    def close(self) -> None:
        self.store.close()


@pytest.fixture(scope="module")
def raw(mooncake_master):
    r = RawStore(mooncake_master)
    yield r
    r.close()


class PoolObjects(ObjectBuffer):
    """The kit's remote: one pool object ``bucket/bufN/offset+length`` per remote descriptor, in datamover's
    format, read and written through a plain Mooncake client."""

    def __init__(self, agent: Agent, raw: RawStore, nbytes: int, bucket: str = "conformance") -> None:
        super().__init__(agent, bucket, nbytes)
        self.raw = raw

    def pool_key(self, offset: int, length: int) -> str:
        return f"{self.bucket}/{self.key(offset, length)}"

    def put_object(self, key: str, data: bytes) -> None:
        self.raw.store.remove(f"{self.bucket}/{key}", True)  # Mooncake keeps the first object under a key
        self.raw.put(f"{self.bucket}/{key}", pack(f"{self.bucket}/{key}", data))

    def get_object(self, key: str) -> bytes | None:
        blob = self.raw.get(f"{self.bucket}/{key}")
        return None if blob is None else unpack(f"{self.bucket}/{key}", blob)
