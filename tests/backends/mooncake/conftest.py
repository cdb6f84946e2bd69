"""A real Mooncake Store for this package's tests: one mooncake_master on loopback per module, and the
object buffer the conformance kit reads and writes through plain ``MooncakeDistributedStore`` calls."""

from __future__ import annotations

import itertools
import struct
from typing import Any

import numpy as np
import pytest

from datamover import Agent, DescList
from datamover.backends.mooncake import MAGIC
from datamover.testing.mooncake import MooncakeMaster, mooncake_available

_prefixes = itertools.count()


def pack(payload: bytes, crc: int | None = None, length: int | None = None, magic: int = MAGIC) -> bytes:
    """An object in datamover's format (payload, then magic, CRC32C, length), built by hand."""
    import crc32c

    crc = crc32c.crc32c(payload) if crc is None else crc
    return payload + struct.pack("<IIQ", magic, crc, len(payload) if length is None else length)


def unpack(blob: bytes) -> bytes:
    """The payload of an object in datamover's format, its trailer checked."""
    import crc32c

    magic, crc, length = struct.unpack("<IIQ", blob[-16:])
    payload = blob[:-16]
    assert magic == MAGIC and length == len(payload) and crc == crc32c.crc32c(payload), "bad trailer"
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
def master():
    ok, reason = mooncake_available()
    if not ok:
        pytest.skip(reason)
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def raw(master):
    r = RawStore(master)
    yield r
    r.close()


class ObjectBuffer:
    """A region of ``nbytes`` held as pool objects, one per remote descriptor (as a KV tier uses a pool).

    Each remote descriptor (offset, length) is its own object ``conformance/bufN/offset+length``, written
    whole; a range outside the region names a key outside the registered prefix.
    """

    def __init__(self, agent: Agent, raw: RawStore, nbytes: int, bucket: str = "conformance") -> None:
        self.raw = raw
        self.bucket = bucket
        self.nbytes = nbytes
        self.prefix = f"buf{next(_prefixes)}/"
        self.registration = agent.register_objects(bucket, prefix=self.prefix)
        self.segments: dict[tuple[int, int], str] = {}

    def key(self, offset: int, length: int) -> str:
        if offset < 0 or offset + length > self.nbytes:
            return f"unregistered/{self.prefix}{offset}+{length}"
        name = self.segments.get((offset, length))
        if name is None:
            name = self.segments[(offset, length)] = f"{self.prefix}{offset:012d}+{length}"
        return name

    def pool_key(self, offset: int, length: int) -> str:
        return f"{self.bucket}/{self.key(offset, length)}"

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        off = np.atleast_1d(np.asarray(offsets, dtype=np.int64))
        ln = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
        off, ln = np.broadcast_arrays(off, ln)
        keys = [self.key(o, n) for o, n in zip(off.tolist(), ln.tolist())]
        return DescList.objects(self.registration, ln, 0, keys=keys)

    def _covering(self, offset: int, nbytes: int) -> list[tuple[int, int, str]]:
        if (offset, nbytes) in self.segments:
            return [(offset, nbytes, self.segments[(offset, nbytes)])]
        inside = sorted((o, n, k) for (o, n), k in self.segments.items() if o >= offset and o + n <= offset + nbytes)
        out, reach = [], offset
        for o, n, k in inside:
            if o >= reach:
                out.append((o, n, k))
                reach = o + n
        return out

    def read(self, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        for o, n, k in self._covering(offset, nbytes):
            blob = self.raw.get(f"{self.bucket}/{k}")
            if blob is not None:
                payload = unpack(blob)
                assert len(payload) == n, f"object for [{o}, +{n}) holds {len(payload)} bytes"
                buf[o - offset : o - offset + n] = payload
        return bytes(buf)

    def write(self, offset: int, data: bytes) -> None:
        self.key(offset, len(data))
        end = offset + len(data)
        for (o, n), k in list(self.segments.items()):
            if o >= end or o + n <= offset:
                continue
            if o >= offset and o + n <= end:
                blob = data[o - offset : o - offset + n]
            else:
                old = self.raw.get(f"{self.bucket}/{k}")
                cur = bytearray(unpack(old) if old else bytes(n))
                lo, hi = max(o, offset), min(o + n, end)
                cur[lo - o : hi - o] = data[lo - offset : hi - offset]
                blob = bytes(cur)
            self.raw.store.remove(f"{self.bucket}/{k}", True)
            self.raw.put(f"{self.bucket}/{k}", pack(blob))
