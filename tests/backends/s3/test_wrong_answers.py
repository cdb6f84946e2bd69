"""s3 GETs answered with other bytes than asked for, by a proxy in front of moto: a 206 for another range, a 200
with the whole object where a range was asked, an answer without Content-Length (chunked, as some gateways send),
a body cut short in one part of a merged row. None may end DONE holding the wrong bytes."""

from __future__ import annotations

import pytest
from botocore import response

from datamover import Agent, DescList, XferState
from datamover.backends.s3.checksums import crc32c_b64
from datamover.errors import ChecksumMismatch, ObjectStoreError
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server

from .fault_proxy import FaultProxy

MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="answers") as srv:
        yield srv


def _agent(server, proxy: FaultProxy, **params) -> Agent:
    cfg = server.config(**{"max_attempts": 1, "read_timeout": 10.0, **params})
    cfg["endpoint_url"] = proxy.endpoint_url
    return Agent("s3-answers", {"backends": {"s3": cfg}})


def _keep(method, headers, status, body):
    return body, False, {}


def _range_rewrite(how: str):
    """Ask the store for bytes 0-499 instead (a 206 for another range), or for no range at all (a 200)."""

    def rewrite(method: str, headers: dict[str, str]) -> dict[str, str]:
        for k in [k for k in headers if k.lower() == "range"]:
            if method == "GET":
                if how == "shifted":
                    headers[k] = "bytes=0-499"
                else:
                    del headers[k]
        return headers

    return rewrite


@pytest.mark.parametrize(
    "how, off, n, chunked",
    [("shifted", 500, 500, False), ("ignored", 500, 1000, False), ("ignored", 500, 500, True)],
    ids=["206-other-range", "200-same-length", "200-chunked"],
)
def test_a_ranged_get_answered_with_other_bytes_fails(server, how, off, n, chunked):
    data = random_bytes(1000, 3)
    server.client().put_object(Bucket=server.bucket, Key="r/o", Body=data)
    proxy = FaultProxy(server.endpoint_url, _keep, _range_rewrite(how), lambda m, h: chunked and m == "GET")
    try:
        with _agent(server, proxy) as agent:
            reg = agent.register_objects(server.bucket, keys=["r/o"])
            buf = HostBuffer(agent, n)
            xfer = agent.transfer("READ", buf.descs([0], [n]), DescList.objects(reg, [n], [off], keys=["r/o"]))
            with pytest.raises(ObjectStoreError) as info:
                xfer.wait()
            assert info.value.code == "RangeIgnored" and info.value.key == "r/o", str(info.value)
            assert info.value.index == 0
    finally:
        proxy.close()


@pytest.mark.parametrize("size, n", [(4000, 1000), (4000, 4000), (8 * MiB, 2 * MiB), (3 * MiB, 3 * MiB)])
def test_chunked_answers_to_whole_and_prefix_reads(server, monkeypatch, size, n):
    """A plain GET answered chunked: the first ``n`` bytes land and no more than one byte past them is read."""
    data = random_bytes(size, 2)
    key = f"c/{size}-{n}"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data, Metadata={"crc32c": crc32c_b64(data)})
    asked: list[int | None] = []
    real_read = response.StreamingBody.read

    def read(self, amt=None):
        asked.append(amt)
        return real_read(self, amt)

    monkeypatch.setattr(response.StreamingBody, "read", read)
    proxy = FaultProxy(server.endpoint_url, _keep, chunked=lambda m, h: m == "GET")
    try:
        with _agent(server, proxy, read_part_size=64 * MiB) as agent:
            reg = agent.register_objects(server.bucket, keys=[key])
            buf = HostBuffer(agent, n)
            xfer = agent.transfer("READ", buf.descs([0], [n]), DescList.objects(reg, [n], 0, keys=[key]))
            assert xfer.wait() == XferState.DONE
            assert buf.read(0, n) == data[:n]
    finally:
        proxy.close()
    assert None not in asked and all(a <= n + 1 for a in asked), f"read a chunked body unbounded: {asked}"


@pytest.mark.parametrize("size", [4000, 3 * MiB])
def test_a_chunked_answer_of_a_shorter_object_is_a_short_read(server, size):
    data = random_bytes(size, 4)
    key = f"c/short-{size}"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data, Metadata={"crc32c": crc32c_b64(data)})
    proxy = FaultProxy(server.endpoint_url, _keep, chunked=lambda m, h: m == "GET")
    try:
        with _agent(server, proxy, read_part_size=64 * MiB) as agent:
            reg = agent.register_objects(server.bucket, keys=[key])
            n = size + 100
            buf = HostBuffer(agent, n)
            xfer = agent.transfer("READ", buf.descs([0], [n]), DescList.objects(reg, [n], 0, keys=[key]))
            with pytest.raises(ObjectStoreError) as info:
                xfer.wait()
            assert info.value.code == "ShortRead", str(info.value)
    finally:
        proxy.close()


def test_a_body_cut_short_names_the_merged_descriptor_it_was_in(server):
    part = 64 << 10
    data = random_bytes(3 * part, 4)
    server.client().put_object(Bucket=server.bucket, Key="m/o", Body=data)

    def cut_third(method, headers, status, body):
        rng = headers.get("range", "")
        if method == "GET" and rng.startswith("bytes=") and int(rng[6:].split("-")[0]) // part == 2:
            return body[: len(body) // 2], True, {}
        return body, False, {}

    proxy = FaultProxy(server.endpoint_url, cut_third)
    try:
        with _agent(server, proxy, read_part_size=part, concurrency=1) as agent:
            reg = agent.register_objects(server.bucket, keys=["m/o"])
            buf = HostBuffer(agent, 3 * part)
            offs = [0, part, 2 * part]
            xfer = agent.transfer(
                "READ", buf.descs(offs, [part] * 3), DescList.objects(reg, [part] * 3, offs, keys=["m/o"] * 3)
            )
            assert len(xfer.request.local) == 1 and len(xfer.request.plan.tasks) == 3, "not merged and split"
            with pytest.raises(ObjectStoreError) as info:
                xfer.wait()
            assert info.value.index == 2, str(info.value)
    finally:
        proxy.close()


@pytest.mark.parametrize("size", [4000, 2 * MiB])
def test_a_checksum_header_that_is_not_base64_is_a_checksum_mismatch(server, size):
    data = random_bytes(size, 1)
    key = f"g/{size}"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32")

    def garble(method, headers, status, body):
        return body, False, {"x-amz-checksum-crc32": "!!!notbase64"} if method == "GET" else {}

    proxy = FaultProxy(server.endpoint_url, garble)
    try:
        with _agent(server, proxy, read_part_size=64 * MiB) as agent:
            reg = agent.register_objects(server.bucket, keys=[key])
            buf = HostBuffer(agent, size)
            buf.write(0, b"\xee" * size)
            xfer = agent.transfer("READ", buf.descs([0], [size]), DescList.objects(reg, [size], 0, keys=[key]))
            with pytest.raises(ChecksumMismatch) as info:
                xfer.wait()
            assert (info.value.bucket, info.value.key, info.value.index) == (server.bucket, key, 0), str(info.value)
            assert buf.read(0, size) != data, "the unverified bytes were kept"
    finally:
        proxy.close()
