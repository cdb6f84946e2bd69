"""s3 READs whose answers are damaged on the wire, by a proxy in front of moto at a known request: a row split
into ranged GETs whose one part came back with a flipped byte and another cut short (or with another ETag: the
object changed) must not keep the flipped part once the READ has failed (the whole-row check that would have
caught it never ran)."""

import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import ChecksumMismatch, ObjectStoreError
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server

from .fault_proxy import FaultProxy

PART = 64 << 10


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="damaged") as srv:
        yield srv


def _agent(server, proxy: FaultProxy) -> Agent:
    cfg = server.config(max_attempts=1, read_timeout=10.0, read_part_size=PART, concurrency=1)
    cfg["endpoint_url"] = proxy.endpoint_url
    return Agent("s3-damaged", {"backends": {"s3": cfg}})


def _damage(flip: int | None, cut: int | None, etag: int | None = None):
    """Flip a byte of the GET of part ``flip``, cut the GET of part ``cut`` after half its body, answer the GET
    of part ``etag`` with another ETag (the object changed between two parts)."""

    def rule(method: str, headers: dict[str, str], status: int, body: bytes) -> tuple[bytes, bool, dict]:
        rng = headers.get("range", "")
        if method != "GET" or not rng.startswith("bytes="):
            return body, False, {}
        part = int(rng[6:].split("-")[0]) // PART
        if part == flip:
            body = body[:10] + bytes([body[10] ^ 0xFF]) + body[11:]
        if part == cut:
            return body[: len(body) // 2], True, {}
        return body, False, {"etag": '"0123456789abcdef0123456789abcdef"'} if part == etag else {}

    return rule


@pytest.mark.parametrize(
    "flip, cut, etag",
    [(1, 2, None), (None, 2, None), (1, None, None), (1, None, 2)],
    ids=["flip+cut", "cut", "flip", "flip+changed"],
)
def test_a_failed_read_in_parts_keeps_no_unverified_part(server, flip, cut, etag):
    data = random_bytes(3 * PART, 7)
    server.client().put_object(Bucket=server.bucket, Key="o", Body=b"")
    proxy = FaultProxy(server.endpoint_url, _damage(flip, cut, etag))
    try:
        with _agent(server, proxy) as agent:
            reg = agent.register_objects(server.bucket, keys=["o"])
            buf = HostBuffer(agent, 3 * PART)
            buf.write(0, data)
            obj = DescList.objects(reg, [3 * PART], 0, keys=["o"])
            assert agent.transfer("WRITE", buf.descs([0], [3 * PART]), obj).wait() == XferState.DONE
            buf.write(0, b"\xee" * (3 * PART))
            xfer = agent.transfer("READ", buf.descs([0], [3 * PART]), obj)
            assert len(xfer.request.plan.tasks) == 3, "the row was not split into parts; the test checks nothing"
            with pytest.raises(ObjectStoreError if cut is not None or etag is not None else ChecksumMismatch) as info:
                xfer.wait()
            assert info.value.index == 0, str(info.value)
            got = buf.read(0, 3 * PART)
            wrong = sum(a != b and a != 0xEE for a, b in zip(got, data))
            assert got == bytes(3 * PART), (
                f"after the failed READ the row holds {wrong} bytes that are neither the object's nor untouched, "
                f"{got.count(0xEE)} untouched; it should hold zeros"
            )
    finally:
        proxy.close()
