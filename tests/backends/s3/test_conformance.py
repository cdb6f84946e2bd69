"""s3 passes the conformance kit: DRAM <-> OBJ against a real moto_server on loopback.

The kit addresses one remote region by (offset, length). ``ObjectBuffer`` maps
that onto an object store the way a KV-cache tier uses one: each remote
descriptor (offset, length) of the region is its own object, keyed by its
offset and length, written whole (object offset 0). So the kit's 4096
permuted blocks are 4096 objects, and a block landing in the wrong place is an
object holding the wrong bytes. A range outside the region names a key outside
the registered prefix, which the agent refuses as unregistered.

Two kit tests do not carry over and are overridden with their object-store
equivalents: overlapping destinations (distinct keys never overlap; two
writes of the same key do) and odd offsets (a WRITE is a whole object; odd
offsets are ranged READs inside one object).
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from datamover import Agent, DescList, XferState
from datamover.backends.s3 import CRC_META, crc32c_b64
from datamover.errors import InvalidDescriptor, OverlappingDestination
from datamover.testing import BackendConformance, HostBuffer, random_bytes
from datamover.testing.s3server import S3Server

MiB = 1 << 20
_prefixes = itertools.count()

# small parts keep multipart and split reads in the default run: S3's minimum part is 5 MiB
TEST_PARAMS = {
    "concurrency": 8,
    "part_size": 5 * MiB,
    "multipart_threshold": 8 * MiB,
    "read_part_size": 4 * MiB,
    "max_attempts": 2,
    "connect_timeout": 2.0,
    "read_timeout": 10.0,
}


class ObjectBuffer:
    """A region of ``nbytes`` held as objects, one per remote descriptor; read and written with boto3 directly.

    Objects are written the way the backend documents its format: the whole
    object's CRC32C in ``x-amz-meta-crc32c`` and S3's own CRC32C header.
    """

    def __init__(self, agent: Agent, client: Any, bucket: str, nbytes: int) -> None:
        self.client = client
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

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        off = np.atleast_1d(np.asarray(offsets, dtype=np.int64))
        ln = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
        off, ln = np.broadcast_arrays(off, ln)
        keys = [self.key(o, n) for o, n in zip(off.tolist(), ln.tolist())]
        return DescList.objects(self.registration, ln, 0, keys=keys)

    def put(self, key: str, data: bytes) -> None:
        crc = crc32c_b64(data)
        self.client.put_object(
            Bucket=self.bucket, Key=key, Body=data, Metadata={CRC_META: crc}, ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc,
        )  # fmt: skip

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def _covering(self, offset: int, nbytes: int) -> list[tuple[int, int, str]]:
        """Known segments inside [offset, offset + nbytes), the exact one if there is one, else non-overlapping."""
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
        buf = bytearray(nbytes)  # never-written bytes read as zeros, like fresh memory
        segs = self._covering(offset, nbytes)
        with ThreadPoolExecutor(8) as pool:
            blobs = list(pool.map(lambda s: self.get(s[2]), segs))
        for (o, n, _), blob in zip(segs, blobs):
            if blob is not None:
                assert len(blob) == n, f"object for [{o}, +{n}) holds {len(blob)} bytes"
                buf[o - offset : o - offset + n] = blob
        return bytes(buf)

    def write(self, offset: int, data: bytes) -> None:
        self.key(offset, len(data))
        end = offset + len(data)
        jobs = []
        for (o, n), k in list(self.segments.items()):
            if o >= end or o + n <= offset:
                continue
            if o >= offset and o + n <= end:
                jobs.append((k, data[o - offset : o - offset + n]))
            else:  # a segment straddling the written range keeps its other bytes
                old = bytearray(self.get(k) or bytes(n))
                lo, hi = max(o, offset), min(o + n, end)
                old[lo - o : hi - o] = data[lo - offset : hi - offset]
                jobs.append((k, bytes(old)))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: self.put(*j), jobs))


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="conformance") as srv:
        yield srv


class TestS3(BackendConformance):
    backend = "s3"
    # 12 MiB: a multipart upload of 3 parts (5+5+2) and a split read of 3 ranged GETs
    sizes = (1, 4096, 12345, 1 * MiB, 12 * MiB)
    batch_count = 512
    big = 8 * MiB

    @pytest.fixture
    def agent(self, server):
        with Agent("s3-test", {"backends": {"s3": server.config(**TEST_PARAMS)}}) as agent:
            yield agent

    @pytest.fixture
    def make_remote(self, agent, server):
        client = server.client()
        return lambda n: ObjectBuffer(agent, client, server.bucket, n)

    def test_overlapping_destinations_refused(self, agent, peer, make_local, make_remote):
        """Distinct keys never overlap; two WRITE descriptors for the same key do, and are refused untouched."""
        local, remote = make_local(8192), make_remote(8192)
        local.write(0, random_bytes(8192, 3))
        key = remote.key(0, 100)
        other = remote.key(100, 100)
        before = remote.read(0, 200)
        dst = DescList.objects(remote.registration, [100, 100, 100], 0, keys=[key, other, key])
        with pytest.raises(OverlappingDestination) as info:
            agent.transfer("WRITE", local.descs([0, 1000, 5000], [100, 100, 100]), dst, backends="s3")
        assert info.value.index == 2
        assert remote.read(0, 200) == before, "a refused transfer touched the destination"

    def test_roundtrip_odd_offsets(self, agent, peer, make_local, make_remote):
        """A WRITE is a whole object; odd offsets are ranged READs inside it, landing at odd local offsets."""
        size = 10_007 + max(self.offsets)
        local, remote = make_local(size + 8), make_remote(size)
        data = random_bytes(size, 100)
        remote.write(0, data)
        obj = remote.key(0, size)
        for k, off in enumerate(self.offsets):
            n = size - off - k
            dst = 1 + k
            local.write(0, bytes(size + 8))
            src = DescList.objects(remote.registration, [n], [off], keys=[obj])
            xfer = agent.transfer("READ", local.descs([dst], [n]), src, backends="s3")
            assert xfer.wait() == XferState.DONE
            got = local.read(0, size + 8)
            assert got[dst : dst + n] == data[off : off + n], f"ranged READ at offset {off} returned wrong bytes"
            assert got[:dst] == bytes(dst) and got[dst + n :] == bytes(size + 8 - dst - n), "READ wrote outside"


def test_write_with_offset_refused(server):
    """S3 has no partial overwrite: a WRITE at a non-zero object offset is refused when the transfer is made."""
    with Agent("s3-offset", {"backends": {"s3": server.config(**TEST_PARAMS)}}) as agent:
        buf = HostBuffer(agent, 4096)
        reg = agent.register_objects(server.bucket, prefix="offset/")
        dst = DescList.objects(reg, [100, 100], [0, 7], keys=["offset/a", "offset/b"])
        with pytest.raises(InvalidDescriptor) as info:
            agent.transfer("WRITE", buf.descs([0, 100], [100, 100]), dst, backends="s3")
        assert info.value.index == 1 and "offset 0" in str(info.value) and "offset/b" in str(info.value)
