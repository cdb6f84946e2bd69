"""s3 beyond the kit: multipart boundaries, integrity, typed errors, faults, configuration, concurrency.

Every test talks to a real moto_server on loopback over HTTP. Faults are
injected either for real (the server frozen with SIGSTOP or killed) or
through botocore's own event hooks (a dropped connection, a 503), never by
replacing boto3 calls.
"""

from __future__ import annotations

import base64
import errno
import os
import threading
import time
import zlib

import numpy as np
import pytest

from datamover import Agent, DescList, XferState
from datamover.backends.s3 import CRC_META, crc32c_b64
from datamover.errors import ChecksumMismatch, InvalidParameter, ObjectStoreError
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server, free_port

MiB = 1 << 20
P = 5 * MiB  # S3's smallest part, the part size these tests use
FAST = {"max_attempts": 2, "connect_timeout": 1.0, "read_timeout": 5.0, "concurrency": 4}


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="extras") as srv:
        yield srv


@pytest.fixture(scope="module")
def auth_server():
    with S3Server(bucket="private", auth=True) as srv:
        yield srv


def make_agent(server: S3Server, name: str = "s3-extra", **params) -> Agent:
    return Agent(name, {"backends": {"s3": server.config(**{**FAST, **params})}})


def objects(agent: Agent, bucket: str, keys: list[str], lengths, offsets=0) -> DescList:
    reg = agent.register_objects(bucket, keys=sorted(set(keys)))
    return DescList.objects(reg, lengths, offsets, keys=keys)


def write(agent: Agent, bucket: str, keys: list[str], sizes: list[int], seed: int = 0):
    """WRITE ``keys`` (one object per size) from a fresh host buffer; returns (buffer, offsets, datas)."""
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    buf = HostBuffer(agent, max(1, int(sum(sizes))))
    datas = [random_bytes(s, seed + i) for i, s in enumerate(sizes)]
    for o, d in zip(offs.tolist(), datas):
        buf.write(o, d)
    xfer = agent.transfer("WRITE", buf.descs(offs, sizes), objects(agent, bucket, keys, sizes), backends="s3")
    assert xfer.wait() == XferState.DONE
    return buf, offs, datas


def wait_error(xfer, limit: float) -> BaseException:
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        xfer.wait()
    assert time.monotonic() - t0 < limit, "the failing transfer took too long to report"
    assert xfer.state == XferState.ERR
    return info.value


# -- multipart boundaries and native checksums ----------------------------------
def test_multipart_boundaries(server):
    """P-1 and P go as one PUT; P+1, 2P-1, 2P, 2P+1 as multipart uploads of 2, 2, 2, 3 parts; all read back split."""
    sizes = [P - 1, P, P + 1, 2 * P - 1, 2 * P, 2 * P + 1]
    want_parts = [None, None, 2, 2, 2, 3]
    keys = [f"mp/{s}" for s in sizes]
    client = server.client()
    params = {"part_size": P, "multipart_threshold": P, "read_part_size": P, "concurrency": 6}
    with make_agent(server, **params) as agent:
        buf, offs, datas = write(agent, server.bucket, keys, sizes, seed=10)
        for key, data, parts in zip(keys, datas, want_parts):
            got = client.get_object(Bucket=server.bucket, Key=key, ChecksumMode="ENABLED")
            assert got["Body"].read() == data, f"{key} does not hold the bytes written"
            assert got["Metadata"][CRC_META] == crc32c_b64(data), "whole-object CRC32C not in metadata"
            native = got.get("ChecksumCRC32C", "")
            if parts is None:
                assert native == crc32c_b64(data), f"{key}: single PUT without S3's CRC32C ({native!r})"
            else:
                assert native.endswith(f"-{parts}"), f"{key}: expected a {parts}-part upload, got {native!r}"
        assert not client.list_multipart_uploads(Bucket=server.bucket, Prefix="mp/").get("Uploads")
        buf.array[:] = 0
        src = objects(agent, server.bucket, keys, sizes)
        assert agent.transfer("READ", buf.descs(offs, sizes), src, backends="s3").wait() == XferState.DONE
        for o, data in zip(offs.tolist(), datas):
            assert buf.read(o, len(data)) == data, "split READ returned wrong bytes"


# -- integrity -------------------------------------------------------------------
def corrupt(client, bucket: str, key: str, at: int) -> None:
    """Flip one byte of an object, keeping its metadata (the stored CRC32C): bit rot the backend did not see."""
    old = client.get_object(Bucket=bucket, Key=key)
    data = bytearray(old["Body"].read())
    data[at] ^= 0x5A
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data), Metadata=old["Metadata"])


def test_corrupted_object_caught(server):
    client = server.client()
    sizes = [4096, 100_000, 4096]
    keys = ["rot/a", "rot/b", "rot/c"]
    with make_agent(server) as agent:
        buf, offs, _ = write(agent, server.bucket, keys, sizes, seed=20)
        corrupt(client, server.bucket, "rot/b", 77_777)
        buf.array[:] = 0xEE
        src = objects(agent, server.bucket, keys, sizes)
        err = wait_error(agent.transfer("READ", buf.descs(offs, sizes), src, backends="s3"), 30)
        assert isinstance(err, ChecksumMismatch), err
        assert err.index == 1 and err.key == "rot/b" and err.bucket == server.bucket
        assert "rot/b" in str(err) and "CRC32C" in str(err)
        middle = buf.read(int(offs[1]), sizes[1])
        assert middle == b"\xee" * sizes[1], "bytes that failed the CRC32C reached the destination"


@pytest.mark.parametrize("read_part_size", [4 * MiB, 16 * MiB], ids=["split-ranged-gets", "one-get"])
def test_corrupted_large_object_zeroed(server, read_part_size):
    """Large reads land first (parallel ranges, or chunk by chunk); on a CRC32C mismatch the destination is zeroed."""
    client = server.client()
    size = 12 * MiB
    key = f"rot/big-{read_part_size}"
    with make_agent(server, part_size=P, multipart_threshold=P, read_part_size=read_part_size) as agent:
        buf, _, _ = write(agent, server.bucket, [key], [size], seed=30)
        buf.array[:] = 0
        src = objects(agent, server.bucket, [key], [size])
        assert agent.transfer("READ", buf.descs([0], [size]), src, backends="s3").wait() == XferState.DONE
        assert buf.read(0, size) == random_bytes(size, 30), "an intact object did not read back"
        corrupt(client, server.bucket, key, size - 3)
        buf.array[:] = 1
        err = wait_error(agent.transfer("READ", buf.descs([0], [size]), src, backends="s3"), 30)
        assert isinstance(err, ChecksumMismatch) and err.index == 0
        assert not buf.array.any(), "unverified bytes were left in the destination"


def test_foreign_objects(server):
    """Objects written without our metadata: S3's own whole-object CRC32C or CRC32 verifies them, or nothing does."""
    plain = server.client(request_checksum_calculation="when_required")
    data = random_bytes(5000, 40)
    bad_crc32c = crc32c_b64(b"something else")
    bad_crc32 = base64.b64encode(zlib.crc32(b"something else").to_bytes(4, "big")).decode()
    cases = {
        "foreign/crc32c": ({"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": crc32c_b64(data)}, True),
        "foreign/crc32": ({"ChecksumAlgorithm": "CRC32"}, True),  # botocore computes it, botocore checks it
        # moto stores a client's checksum without checking it: bytes that do not match their S3 checksum
        "foreign/bad-crc32c": ({"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": bad_crc32c}, False),
        "foreign/bad-crc32": ({"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": bad_crc32}, False),
        "foreign/none": ({}, False),
    }
    for key, (kw, _) in cases.items():
        plain.put_object(Bucket=server.bucket, Key=key, Body=data, **kw)
    with make_agent(server) as agent:
        buf = HostBuffer(agent, 5000)
        for key, (_, good) in cases.items():
            buf.array[:] = 7
            src = objects(agent, server.bucket, [key], [5000])
            xfer = agent.transfer("READ", buf.descs([0], [5000]), src, backends="s3")
            if good:
                assert xfer.wait() == XferState.DONE and buf.read(0, 5000) == data, key
                continue
            err = wait_error(xfer, 30)
            assert isinstance(err, ChecksumMismatch) and err.key == key, (key, err)
            assert buf.read(0, 5000) == bytes([7]) * 5000, f"{key}: unverified bytes reached the destination"
        assert "no checksum" in str(err)
        part = objects(agent, server.bucket, ["foreign/none"], [100], [10])
        assert agent.transfer("READ", buf.descs([0], [100]), part, backends="s3").wait() == XferState.DONE
        assert buf.read(0, 100) == data[10:110], "a ranged read needs no checksum"
    with make_agent(server, require_checksum=False) as agent:
        buf = HostBuffer(agent, 5000)
        src = objects(agent, server.bucket, ["foreign/none"], [5000])
        assert agent.transfer("READ", buf.descs([0], [5000]), src, backends="s3").wait() == XferState.DONE
        assert buf.read(0, 5000) == data


def test_prefix_read(server):
    """A READ at offset 0 shorter than the object returns its first bytes (unverified, like any partial read)."""
    with make_agent(server) as agent:
        _, _, (data,) = write(agent, server.bucket, ["prefix/x"], [3 * MiB], seed=45)
        buf = HostBuffer(agent, 2 * MiB)
        for n in (10, 2 * MiB):
            src = objects(agent, server.bucket, ["prefix/x"], [n])
            assert agent.transfer("READ", buf.descs([0], [n]), src, backends="s3").wait() == XferState.DONE
            assert buf.read(0, n) == data[:n]
        write(agent, server.bucket, ["prefix/y"], [100])  # the pool's connections still work


# -- typed errors ----------------------------------------------------------------
def test_missing_bucket(server):
    with make_agent(server) as agent:
        buf = HostBuffer(agent, 100)
        for op in ("WRITE", "READ"):
            dst = objects(agent, "no-such-bucket", ["k"], [100])
            err = wait_error(agent.transfer(op, buf.descs([0], [100]), dst, backends="s3"), 30)
            assert isinstance(err, ObjectStoreError), err
            assert (err.status, err.code, err.bucket, err.key) == (404, "NoSuchBucket", "no-such-bucket", "k")
            assert err.errno == errno.ENOENT and "no-such-bucket" in str(err) and "404" in str(err)


def test_missing_key_and_short_reads(server):
    with make_agent(server) as agent:
        buf = HostBuffer(agent, 4096)
        write(agent, server.bucket, ["short/a"], [1000])
        cases = [("short/none", 0, 100, 404, "NoSuchKey"), ("short/a", 900, 200, 206, "ShortRead")]
        cases.append(("short/a", 2000, 10, 416, "InvalidRange"))
        for key, off, n, status, code in cases:
            src = objects(agent, server.bucket, ["short/b", key], [1, n], [0, off])
            write(agent, server.bucket, ["short/b"], [1])
            err = wait_error(agent.transfer("READ", buf.descs([0, 10], [1, n]), src, backends="s3"), 30)
            assert isinstance(err, ObjectStoreError), err
            assert (err.index, err.status, err.code, err.key) == (1, status, code, key)
            assert key in str(err) and server.bucket in str(err)


def test_unreachable_endpoint():
    params = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "access_key_id": "a", "secret_access_key": "b"}
    with Agent("s3-nowhere", {"backends": {"s3": {**FAST, **params, "max_attempts": 1}}}) as agent:
        buf = HostBuffer(agent, 100)
        dst = objects(agent, "bucket", ["k"], [100])
        err = wait_error(agent.transfer("WRITE", buf.descs([0], [100]), dst, backends="s3"), 10)
        assert isinstance(err, ObjectStoreError), err
        assert err.status is None and err.code == "EndpointConnectionError" and err.errno == errno.ECONNREFUSED
        assert "unreachable" in str(err) and err.bucket == "bucket" and err.key == "k"


def test_wrong_credentials(auth_server):
    right = auth_server.config(**FAST)
    with Agent("s3-right", {"backends": {"s3": right}}) as agent:
        write(agent, auth_server.bucket, ["auth/ok"], [100])  # the keys the server issued do work
    for change, code in (
        ({"secret_access_key": "wrong"}, "SignatureDoesNotMatch"),
        ({"access_key_id": "AKIA0"}, "InvalidAccessKeyId"),
    ):
        with Agent("s3-wrong", {"backends": {"s3": {**right, **change}}}) as agent:
            buf = HostBuffer(agent, 100)
            for op in ("WRITE", "READ"):
                dst = objects(agent, auth_server.bucket, ["auth/ok"], [100])
                err = wait_error(agent.transfer(op, buf.descs([0], [100]), dst, backends="s3"), 30)
                assert isinstance(err, ObjectStoreError), err
                assert (err.status, err.code, err.key, err.bucket) == (403, code, "auth/ok", auth_server.bucket)
                assert err.errno == errno.EACCES and "access denied" in str(err)
    assert auth_server.client().get_object(Bucket=auth_server.bucket, Key="auth/ok")["ContentLength"] == 100


# -- faults mid-transfer ---------------------------------------------------------
def test_dropped_connection_aborts_multipart(server):
    """A connection dropped on part 2 (every retry): typed error, upload aborted, the old object intact."""
    from botocore.exceptions import ConnectionClosedError

    client = server.client()
    key = "drop/obj"
    with make_agent(server, part_size=P, multipart_threshold=P) as agent:
        _, _, (old,) = write(agent, server.bucket, [key], [1000], seed=50)
        calls = []

        def drop(request, **_):
            if "partNumber=2" in request.url:
                calls.append(request.url)
                raise ConnectionClosedError(endpoint_url=request.url)

        agent.backend("s3").client.meta.events.register("before-send.s3.UploadPart", drop)
        size = 3 * P
        buf = HostBuffer(agent, size)
        buf.write(0, random_bytes(size, 51))
        dst = objects(agent, server.bucket, [key], [size])
        err = wait_error(agent.transfer("WRITE", buf.descs([0], [size]), dst, backends="s3"), 30)
        assert isinstance(err, ObjectStoreError) and err.status is None and err.key == key, err
        assert "UploadPart 2" in str(err) and len(calls) == 2, "retries not as configured (max_attempts=2)"
    assert client.get_object(Bucket=server.bucket, Key=key)["Body"].read() == old, "a half-written object is visible"
    assert not client.list_multipart_uploads(Bucket=server.bucket, Prefix=key).get("Uploads"), "upload not aborted"


def test_throttling_retried(server):
    """A 503 SlowDown on the first attempt of every PUT is retried by botocore and the transfer completes."""
    from botocore.awsrequest import AWSResponse

    class Raw:
        def stream(self, **_):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    seen: set[str] = set()

    def throttle(request, **_):
        if request.url not in seen:
            seen.add(request.url)
            return AWSResponse(request.url, 503, {}, Raw())
        return None

    with make_agent(server, max_attempts=3) as agent:
        agent.backend("s3").client.meta.events.register("before-send.s3.PutObject", throttle)
        keys = [f"slow/{i}" for i in range(8)]
        _, _, datas = write(agent, server.bucket, keys, [1000] * 8, seed=60)
    client = server.client()
    assert len(seen) == 8
    for key, data in zip(keys, datas):
        assert client.get_object(Bucket=server.bucket, Key=key)["Body"].read() == data


def test_server_frozen_mid_upload():
    """SIGSTOP mid multipart upload: typed error within the timeouts; after SIGCONT no partial object exists."""
    with S3Server(bucket="frozen") as srv:
        params = {"part_size": P, "multipart_threshold": P, "concurrency": 2, "read_timeout": 1.0, "max_attempts": 1}
        with make_agent(srv, **params) as agent:
            first_part = threading.Event()
            agent.backend("s3").client.meta.events.register("after-call.s3.UploadPart", lambda **_: first_part.set())
            size = 6 * P
            buf = HostBuffer(agent, size)
            buf.write(0, random_bytes(size, 70))
            dst = objects(agent, srv.bucket, ["frozen/obj"], [size])
            xfer = agent.transfer("WRITE", buf.descs([0], [size]), dst, backends="s3")
            assert first_part.wait(30), "no part was uploaded"
            srv.pause()
            try:
                err = wait_error(xfer, 20)
            finally:
                srv.resume()
            assert isinstance(err, ObjectStoreError) and err.status is None, err
            assert err.key == "frozen/obj" and err.bucket == "frozen"
            client = srv.client()
            time.sleep(0.5)  # let the thawed server drain what was queued
            with pytest.raises(client.exceptions.ClientError) as info:
                client.head_object(Bucket=srv.bucket, Key="frozen/obj")
            assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404, "a partial object is visible"
            write(agent, srv.bucket, ["frozen/after"], [1000])  # the backend recovers once the server does


def test_server_killed_mid_batch():
    """The server process killed during a batch of objects: typed error, no hang."""
    with S3Server(bucket="killed") as srv:
        with make_agent(srv, concurrency=4, read_timeout=2.0) as agent:
            puts, held, gate = [], threading.Event(), threading.Event()
            events = agent.backend("s3").client.meta.events
            events.register("after-call.s3.PutObject", lambda **_: puts.append(1))

            def hold(**_):  # after 10 objects every PUT waits until the server is gone: the batch is mid-flight
                if len(puts) >= 10:
                    held.set()
                    gate.wait(30)

            events.register("before-send.s3.PutObject", hold)
            n, bs = 400, 64 << 10
            buf = HostBuffer(agent, n * bs)
            keys = [f"kill/{i}" for i in range(n)]
            xfer = agent.transfer(
                "WRITE", buf.descs(np.arange(n) * bs, bs), objects(agent, srv.bucket, keys, bs), backends="s3"
            )
            assert held.wait(30), "the batch never reached its tenth object"
            srv.stop()
            gate.set()
            err = wait_error(xfer, 20)
            assert isinstance(err, ObjectStoreError) and err.status is None, err
            assert err.bucket == "killed" and err.key.startswith("kill/") and err.index is not None
            assert 10 <= len(puts) < n


# -- configuration ---------------------------------------------------------------
def test_config_from_environment(auth_server, monkeypatch):
    """Nothing in the backend config: endpoint, region and keys come from AWS_* variables."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL", auth_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", auth_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", auth_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with Agent("s3-env", {"backends": {"s3": {"addressing_style": "path"}}}) as agent:
        desc = agent.backend("s3").describe()
        assert desc["endpoint"] == auth_server.endpoint_url and desc["region"] == "eu-west-3"
        _, _, (data,) = write(agent, auth_server.bucket, ["env/x"], [3000], seed=80)
    assert auth_server.client().get_object(Bucket=auth_server.bucket, Key="env/x")["Body"].read() == data


def test_config_from_files(auth_server, monkeypatch, tmp_path):
    """A named profile: region and endpoint from ~/.aws/config, keys from ~/.aws/credentials."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / "config").write_text(
        f"[profile dm]\nregion = ap-south-1\nendpoint_url = {auth_server.endpoint_url}\n"
        "s3 =\n    addressing_style = path\n"
    )
    (tmp_path / "credentials").write_text(
        f"[dm]\naws_access_key_id = {auth_server.access_key}\naws_secret_access_key = {auth_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    with Agent("s3-files", {"backends": {"s3": {"profile": "dm"}}}) as agent:
        assert agent.backend("s3").describe()["region"] == "ap-south-1"
        _, _, (data,) = write(agent, auth_server.bucket, ["files/x"], [3000], seed=81)
    assert auth_server.client().get_object(Bucket=auth_server.bucket, Key="files/x")["Body"].read() == data


def test_bad_params_refused():
    with pytest.raises(ValueError, match="part_size"):
        Agent("s3-bad", {"backends": {"s3": {"part_size": 1 << 20}}}).backend("s3")
    with pytest.raises(ValueError, match="unknown parameter"):
        Agent("s3-bad", {"backends": {"s3": {"endpoint": "x"}}}).backend("s3")


@pytest.mark.parametrize(
    "name, value", [("endpoint_url", "not a url"), ("region", "us east 1!"), ("concurrency", 0), ("read_timeout", -1)]
)
def test_bad_params_refused_naming_the_parameter(name, value):
    """Before, these escaped the first transfer as a ValueError or a botocore error, naming nothing."""
    params = {name: value, "access_key_id": "a", "secret_access_key": "b"}
    with pytest.raises(InvalidParameter, match=name) as info:
        Agent("s3-bad", {"backends": {"s3": params}}).backend("s3")
    assert info.value.backend == "s3"


@pytest.mark.parametrize(
    "name, env, value", [("retry_mode", "AWS_RETRY_MODE", "bogus"), ("max_attempts", "AWS_MAX_ATTEMPTS", "many")]
)
def test_bad_retry_settings_from_the_environment_refused(monkeypatch, name, env, value):
    """Before, botocore's InvalidRetryModeError (or int()'s ValueError) escaped when the backend started."""
    monkeypatch.setenv(env, value)
    params = {"endpoint_url": "http://127.0.0.1:1", "access_key_id": "a", "secret_access_key": "b"}
    with pytest.raises(InvalidParameter, match=f"{name} .*{value}") as info:
        Agent("s3-bad", {"backends": {"s3": params}}).backend("s3")
    assert info.value.backend == "s3"


# -- concurrency -----------------------------------------------------------------
def test_bounded_concurrency(server):
    """Many small objects run concurrently, never more at once than ``concurrency``."""
    lock = threading.Lock()
    state = {"now": 0, "max": 0}

    def enter(**_):
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])

    def leave(**_):
        with lock:
            state["now"] -= 1

    with make_agent(server, concurrency=3) as agent:
        events = agent.backend("s3").client.meta.events
        events.register("before-call.s3.PutObject", enter)
        events.register("after-call.s3.PutObject", leave)
        write(agent, server.bucket, [f"conc/{i}" for i in range(60)], [2000] * 60, seed=90)
    assert 2 <= state["max"] <= 3, state


def test_server_without_native_checksums(server):
    """A server refusing x-amz-checksum-crc32c (400): the backend drops the header, CRC32C stays in metadata."""
    from botocore.awsrequest import AWSResponse

    class Raw:
        def stream(self, **_):
            yield b"<Error><Code>InvalidArgument</Code><Message>x-amz-checksum-crc32c is not supported"
            yield b"</Message></Error>"

    refused = []

    def refuse(request, **_):
        if "x-amz-checksum-crc32c" in request.headers or "x-amz-checksum-algorithm" in request.headers:
            refused.append(request.url)
            return AWSResponse(request.url, 400, {}, Raw())
        return None

    client = server.client()
    with make_agent(server, part_size=P, multipart_threshold=P) as agent:
        events = agent.backend("s3").client.meta.events
        for op in ("PutObject", "CreateMultipartUpload", "UploadPart"):
            events.register(f"before-send.s3.{op}", refuse)
        write(agent, server.bucket, ["plain/a"], [1000], seed=94)
        assert len(refused) == 1
        keys = ["plain/a", "plain/b", "plain/big"]
        buf, offs, datas = write(agent, server.bucket, keys, [1000, 2000, P + 10], seed=95)
        assert len(refused) == 1, "the header was sent again after the server refused it"
        for key, data in zip(keys, datas):
            got = client.get_object(Bucket=server.bucket, Key=key, ChecksumMode="ENABLED")
            assert got["Body"].read() == data and got["Metadata"][CRC_META] == crc32c_b64(data)
            assert "ChecksumCRC32C" not in got
        buf.array[:] = 0
        src = objects(agent, server.bucket, keys, [1000, 2000, P + 10])
        assert agent.transfer("READ", buf.descs(offs, [1000, 2000, P + 10]), src, backends="s3").wait() == "DONE"
        assert [buf.read(int(o), len(d)) for o, d in zip(offs, datas)] == datas


@pytest.mark.parametrize("style", ["path", "virtual"])
def test_addressing_style(server, style):
    """Path-style requests name the bucket in the path; virtual-hosted ones in the host name."""
    from urllib.parse import urlsplit

    seen = []

    def resolve(request, **_):
        # no DNS for <bucket>.localhost here: send to 127.0.0.1, keep the Host header (what DNS would do)
        url = urlsplit(request.url)
        seen.append((url.netloc, url.path))
        request.headers["Host"] = url.netloc
        request.url = request.url.replace(url.hostname, "127.0.0.1", 1)

    endpoint = server.endpoint_url.replace("127.0.0.1", "localhost")
    with make_agent(server, endpoint_url=endpoint, addressing_style=style) as agent:
        agent.backend("s3").client.meta.events.register("before-send.s3", resolve)
        buf, _, (data,) = write(agent, server.bucket, ["style/x"], [3000], seed=99)
        buf.array[:] = 0
        src = objects(agent, server.bucket, ["style/x"], [3000])
        assert agent.transfer("READ", buf.descs([0], [3000]), src, backends="s3").wait() == XferState.DONE
        assert buf.read(0, 3000) == data
    port = server.port
    if style == "virtual":
        assert seen == [(f"{server.bucket}.localhost:{port}", "/style/x")] * 2
    else:
        assert seen == [(f"localhost:{port}", f"/{server.bucket}/style/x")] * 2
    assert server.client().get_object(Bucket=server.bucket, Key="style/x")["Body"].read() == data
