"""s3 passes the conformance kit: DRAM <-> OBJ against a real moto_server on loopback.

The kit addresses one remote region by (offset, length). ``S3Objects`` maps
that onto an object store the way a KV-cache tier uses one: each remote
descriptor (offset, length) of the region is its own object, keyed by its
offset and length, written whole (object offset 0). So the kit's 4096
permuted blocks are 4096 objects, and a block landing in the wrong place is an
object holding the wrong bytes. A range outside the region names a key outside
the registered prefix, which the agent refuses as unregistered.

The kit is ``ObjectStoreConformance``: two kit tests become their
object-store equivalents there, overlapping destinations (distinct keys never
overlap; two writes of the same key do) and odd offsets (a WRITE is a whole
object; odd offsets are ranged READs inside one object).
"""

from __future__ import annotations

from typing import Any

import pytest

from datamover import Agent, DescList
from datamover.backends.s3 import CRC_META, crc32c_b64
from datamover.errors import InvalidDescriptor
from datamover.testing import HostBuffer, ObjectBuffer, ObjectStoreConformance
from datamover.testing.s3server import S3Server

MiB = 1 << 20

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


class S3Objects(ObjectBuffer):
    """The kit's remote: one S3 object per remote descriptor, read and written with boto3 directly.

    Objects are written the way the backend documents its format: the whole
    object's CRC32C in ``x-amz-meta-crc32c`` and S3's own CRC32C header.
    """

    threads = 8

    def __init__(self, agent: Agent, client: Any, bucket: str, nbytes: int) -> None:
        super().__init__(agent, bucket, nbytes)
        self.client = client

    def put_object(self, key: str, data: bytes) -> None:
        crc = crc32c_b64(data)
        self.client.put_object(
            Bucket=self.bucket, Key=key, Body=data, Metadata={CRC_META: crc}, ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=crc,
        )  # fmt: skip

    def get_object(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="conformance") as srv:
        yield srv


class TestS3(ObjectStoreConformance):
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
        return lambda n: S3Objects(agent, client, server.bucket, n)


def test_write_with_offset_refused(server):
    """S3 has no partial overwrite: a WRITE at a non-zero object offset is refused when the transfer is made."""
    with Agent("s3-offset", {"backends": {"s3": server.config(**TEST_PARAMS)}}) as agent:
        buf = HostBuffer(agent, 4096)
        reg = agent.register_objects(server.bucket, prefix="offset/")
        dst = DescList.objects(reg, [100, 100], [0, 7], keys=["offset/a", "offset/b"])
        with pytest.raises(InvalidDescriptor) as info:
            agent.transfer("WRITE", buf.descs([0, 100], [100, 100]), dst, backends="s3")
        assert info.value.index == 1 and "offset 0" in str(info.value) and "offset/b" in str(info.value)
