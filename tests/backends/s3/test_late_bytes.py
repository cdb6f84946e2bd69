"""s3 READs that time out or are released while a GET body is being read into the caller's memory: what the
destination holds when ERR is seen (or ``release`` returned) is what it holds after; no byte lands later.

The fault is the first read of the response body (``readinto`` of a streamed GET, or ``read`` of a small one
copied after it is verified) held at a known point until the test lets it go; a watcher thread polls the
transfer's state until its deadline has turned it ERR. Nothing waits for a fixed time. moto_server on loopback.
"""

from __future__ import annotations

import numpy as np
import pytest
from botocore import httpchecksum, response

from datamover import Agent, DescList, XferState
from datamover.errors import TransferTimeout
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server
from datamover.testing.waiting import HeldOnce, cut_short

MiB = 1 << 20
SIZES = {"streamed": 3 * MiB, "small": 64 << 10}  # above and below the backend's verify-before-copy size


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="late") as srv:
        yield srv


@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("size", list(SIZES))
def test_an_s3_read_cut_short_lands_nothing_after_err(server, monkeypatch, size, end):
    n = SIZES[size]
    key = f"late/{size}-{end}"
    data = random_bytes(n, 11)
    server.client().put_object(Bucket=server.bucket, Key=key, Body=data)
    cfg = server.config(max_attempts=1, concurrency=2, part_size=64 * MiB, multipart_threshold=64 * MiB)
    with Agent("s3-late", {"backends": {"s3": cfg}}) as agent:
        buf = HostBuffer(agent, n)
        buf.array[:] = 0xAA
        reg = agent.register_objects(server.bucket, keys=[key])
        held = HeldOnce("the body read")
        name = "readinto" if size == "streamed" else "read"
        for cls in (response.StreamingBody, httpchecksum.StreamingChecksumBody):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, held.wrap(vars(cls)[name]))
        objs = DescList.objects(reg, [n], 0, keys=[key])
        xfer = agent.transfer("READ", buf.descs([0], [n]), objs, backends="s3", timeout=0.5)
        assert held.reached.wait(60), "the GET never reached its body"
        changed = cut_short(xfer, xfer._completion, end, buf.array.tobytes, held)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"
        monkeypatch.undo()
        assert agent.transfer("READ", buf.descs([0], [n]), objs, backends="s3").wait() == XferState.DONE
        assert buf.array.tobytes() == data


@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("kind", ["put", "multipart"])
def test_an_s3_write_cut_short_sends_nothing_read_after_err(server, monkeypatch, kind, end):
    """A PUT's copy of its body out of the caller's memory (its CRC32C, first) is held while the deadline passes
    or ``release`` runs (a multipart upload's: the whole object's, before its CreateMultipartUpload); at ERR the
    caller refills its buffer. The object may still be committed after ERR (the
    upload was under way; ``release`` says so), but only with the bytes read before ERR. Before, ERR came at
    once and the held copy then read the refilled buffer: the object was committed holding it."""
    from datamover.backends.s3 import run as s3_run

    n = 64 << 10 if kind == "put" else 11 * MiB
    key = f"late/write-{kind}-{end}"
    data = random_bytes(n, 12)
    cfg = server.config(max_attempts=1, concurrency=1, part_size=5 * MiB, multipart_threshold=8 * MiB)
    with Agent("s3-late-w", {"backends": {"s3": cfg}}) as agent:
        buf = HostBuffer(agent, n)
        buf.array[:] = np.frombuffer(data, np.uint8)
        reg = agent.register_objects(server.bucket, keys=[key])
        held = HeldOnce("the body's copy")
        monkeypatch.setattr(s3_run, "crc32c_b64", held.wrap(s3_run.crc32c_b64))
        objs = DescList.objects(reg, [n], 0, keys=[key])
        xfer = agent.transfer("WRITE", buf.descs([0], [n]), objs, backends="s3", timeout=0.5)
        assert held.reached.wait(60), "the PUT never reached its body"

        def reuse() -> None:
            buf.array[:] = 0xBB

        cut_short(xfer, xfer._completion, end, bytes, held, reuse)
        xfer.release()  # waits for the upload under way
        try:
            stored = server.client().get_object(Bucket=server.bucket, Key=key)["Body"].read()
        except server.client().exceptions.NoSuchKey:
            stored = None
        assert stored is None or stored == data, f"{stored.count(0xBB)} bytes of the refilled buffer were committed"
        assert xfer.outcomes[0] == "committed" if stored is not None else xfer.outcomes[0] in ("aborted", "untouched")


def test_an_s3_read_body_stalled_past_the_fence_lands_nowhere(server, monkeypatch):
    """The socket read of a GET body is held until ``release`` has returned, past the fence's wait (FENCE_S, set
    to 0 here: the fence gives up at once, as after 10 s of a stalled store). Before, the socket read straight into
    the caller's buffer, so the late bytes landed there after ``release``; now they land in the worker's own buffer
    and are never copied."""
    from urllib3 import response as u3

    from datamover.backends import fence

    monkeypatch.setattr(fence, "FENCE_S", 0.0)
    n = 3 * MiB
    key = "late/stalled-past-fence"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=random_bytes(n, 13))
    held = HeldOnce("the socket read of the body")
    real = u3.HTTPResponse.readinto
    held_read = held.wrap(real)
    monkeypatch.setattr(
        u3.HTTPResponse, "readinto", lambda self, b: (held_read if len(b) >= MiB // 2 else real)(self, b)
    )
    cfg = server.config(max_attempts=1, read_part_size=64 * MiB, require_checksum=False)
    with Agent("s3-late-fence", {"backends": {"s3": cfg}}) as agent:
        buf = HostBuffer(agent, n)
        buf.array[:] = 0xAA
        reg = agent.register_objects(server.bucket, keys=[key])
        xfer = agent.transfer("READ", buf.descs([0], [n]), DescList.objects(reg, [n], 0, keys=[key]), timeout=2.0)
        assert held.reached.wait(60), "the GET never reached its body"
        xfer.release()
        at_release = buf.array.copy()
        held.go.set()
        assert held.returned.wait(60)
        assert xfer._completion.wait(60), "the READ's worker never stopped"
        changed = int(np.count_nonzero(buf.array != at_release))
        assert changed == 0, f"{changed} bytes of a READ reached the caller after release() returned"
