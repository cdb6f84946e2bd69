"""s3: a short read of contiguous descriptors the agent merged into one GET names the descriptor past the end."""

import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import ObjectStoreError
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="merged") as srv:
        yield srv


def test_a_short_merged_read_names_the_descriptor_past_the_end(server):
    with Agent("s3-merged", {"backends": {"s3": server.config(max_attempts=2, read_timeout=5.0)}}) as agent:
        server.client().put_object(Bucket=server.bucket, Key="m/a", Body=random_bytes(1000, 1))
        reg = agent.register_objects(server.bucket, keys=["m/a"])
        buf = HostBuffer(agent, 1200)
        # three contiguous 400-byte descriptors on both sides: one 1200-byte GET of a 1000-byte object
        src = DescList.objects(reg, [400, 400, 400], [0, 400, 800], keys=["m/a"] * 3)
        xfer = agent.transfer("READ", buf.descs([0, 400, 800], [400, 400, 400]), src, backends="s3")
        assert len(xfer.request.local) == 1, "the descriptors were not merged; the test checks nothing"
        with pytest.raises(ObjectStoreError) as info:
            xfer.wait()
        assert xfer.state == XferState.ERR
        assert info.value.code == "ShortRead" and info.value.index == 2, str(info.value)
