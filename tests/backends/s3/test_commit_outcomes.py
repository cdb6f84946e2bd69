"""s3 after a timeout, a lost answer or an outage (issue 14, item 7).

Faults are injected through botocore's event hooks at a known call (CompleteMultipartUpload, PutObject), and a
pause the test holds stands for a slow server: nothing is raced against a sleep.
"""

from __future__ import annotations

import threading
import types

import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import ObjectStoreError, TransferTimeout
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.s3server import S3Server

MiB = 1 << 20
P = 5 * MiB
MODES = ["standard", "adaptive", "legacy"]  # botocore's retry modes


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="outcomes") as srv:
        yield srv


def _agent(server, **params):
    cfg = {"max_attempts": 2, "connect_timeout": 1.0, "read_timeout": 5.0, "concurrency": 4, **params}
    return Agent("s3-outcomes", {"backends": {"s3": server.config(**cfg)}})


def _multipart(agent, server, key, seed, timeout=30.0):
    size = 2 * P
    buf = HostBuffer(agent, size)
    data = random_bytes(size, seed)
    buf.write(0, data)
    reg = agent.register_objects(server.bucket, keys=[key])
    dst = DescList.objects(reg, [size], 0, keys=[key])
    return agent.transfer("WRITE", buf.descs([0], [size]), dst, backends="s3", timeout=timeout), data


def _body(server, key):
    return server.client().get_object(Bucket=server.bucket, Key=key)["Body"].read()


def _pending(server, key):
    return server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=key).get("Uploads") or []


def test_a_timeout_during_complete_reports_the_object_committed(server):
    key = "out/slow-complete"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=b"old")
    entered, gate = threading.Event(), threading.Event()

    def slow_server(request, **_):
        entered.set()
        gate.wait(30)  # the test holds CompleteMultipartUpload until the transfer has timed out

    with _agent(server, part_size=P, multipart_threshold=P) as agent:
        agent.backend("s3").client.meta.events.register("before-send.s3.CompleteMultipartUpload", slow_server)
        # the parts must be up before the deadline, so that it passes while the test holds the complete: 5 s
        # leave a loaded machine room (moto is a Python server on the same cores)
        xfer, data = _multipart(agent, server, key, 1, timeout=5.0)
        assert entered.wait(30), "CompleteMultipartUpload was never sent"
        with pytest.raises(TransferTimeout) as info:
            xfer.wait()
        gate.set()
        xfer.release()  # returns once the backend settled what it started
        assert info.value.outcomes == {0: "committed"}
    assert _body(server, key) == data and not _pending(server, key)


def test_a_complete_whose_answer_is_lost_is_found_committed(server):
    from botocore.exceptions import ReadTimeoutError

    key = "out/lost-answer"

    def lose_answer(http_response, **_):
        raise ReadTimeoutError(endpoint_url="http://s3")  # the server did complete; its answer never came

    with _agent(server, part_size=P, multipart_threshold=P, max_attempts=1) as agent:
        agent.backend("s3").client.meta.events.register("after-call.s3.CompleteMultipartUpload", lose_answer)
        xfer, data = _multipart(agent, server, key, 2)
        assert xfer.wait() == XferState.DONE
    assert _body(server, key) == data


def test_a_complete_that_never_arrived_is_aborted_and_reported(server):
    from botocore.exceptions import ConnectionClosedError

    key = "out/never-arrived"
    server.client().put_object(Bucket=server.bucket, Key=key, Body=b"old")

    def drop(request, **_):
        raise ConnectionClosedError(endpoint_url=request.url)

    with _agent(server, part_size=P, multipart_threshold=P) as agent:
        agent.backend("s3").client.meta.events.register("before-send.s3.CompleteMultipartUpload", drop)
        xfer, _ = _multipart(agent, server, key, 3)
        with pytest.raises(ObjectStoreError) as info:
            xfer.wait()
        assert info.value.outcomes == {0: "aborted"}
    assert _body(server, key) == b"old" and not _pending(server, key)


def test_retries_do_not_run_out_after_an_outage(server):
    """Dozens of calls fail in an outage (botocore's retry quota would be spent); then one dropped connection."""
    from botocore.exceptions import ConnectionClosedError

    state = {"outage": True, "dropped": False}

    def network(request, **_):
        if state["outage"]:
            raise ConnectionClosedError(endpoint_url=request.url)
        if not state["dropped"]:
            state["dropped"] = True
            raise ConnectionClosedError(endpoint_url=request.url)

    with _agent(server, max_attempts=2) as agent:
        client = agent.backend("s3").client
        client.meta.events.register("before-send.s3.PutObject", network)
        for i in range(40):  # 40 calls x 1 retry x 14 = 560: more than botocore's whole quota of 500
            with pytest.raises(ConnectionClosedError):
                client.put_object(Bucket=server.bucket, Key=f"out/outage-{i}", Body=b"x")
        state["outage"] = False
        data = random_bytes(MiB, 4)
        one = HostBuffer(agent, MiB)
        one.write(0, data)
        reg1 = agent.register_objects(server.bucket, keys=["out/after-outage"])
        xfer = agent.transfer(
            "WRITE", one.descs([0], [MiB]), DescList.objects(reg1, [MiB], 0, keys=["out/after-outage"]), backends="s3"
        )
        assert xfer.wait() == XferState.DONE, "one dropped connection after the outage failed the transfer"
        assert state["dropped"]
    assert _body(server, "out/after-outage") == data


def test_release_of_a_multi_object_write_says_what_it_committed_and_aborted(server, monkeypatch):
    """release() (no timeout) cuts a 4-object WRITE short at a known point: object 0 (multipart) and object 2 (a
    PUT) are committed, object 1's parts are held by the test until the release cancels, object 3 never starts.
    The caller learns each from ``release()``, ``error`` and ``outcomes`` once RELEASED."""
    from datamover.backends.base import Completion
    from datamover.errors import TransferAborted

    keys = ["rel/a-multipart", "rel/b-held", "rel/c-put", "rel/d-never"]
    sizes = [2 * P, 2 * P, MiB, MiB]
    for k in keys:
        server.client().put_object(Bucket=server.bucket, Key=k, Body=b"old")
    committed_a, put_c, held_b, cancelled = (threading.Event() for _ in range(4))
    cancel = Completion.cancel

    def cancel_and_tell(self, error=None):
        cancel(self, error)
        cancelled.set()

    monkeypatch.setattr(Completion, "cancel", cancel_and_tell)

    def hold_b(request, **_):
        if "/rel/b-held" in request.url:
            held_b.set()
            assert cancelled.wait(30), "release() never cancelled"

    def after_complete(http_response, **_):
        committed_a.set()

    def after_put(params, **_):
        if params.get("Key") == "rel/c-put":
            put_c.set()
            assert cancelled.wait(30), "release() never cancelled"  # the runner holds: object 3 never starts

    with _agent(server, part_size=P, multipart_threshold=P, concurrency=3) as agent:
        events = agent.backend("s3").client.meta.events
        events.register("before-send.s3.UploadPart", hold_b)
        events.register("after-call.s3.CompleteMultipartUpload", after_complete)
        events.register("before-parameter-build.s3.PutObject", after_put)
        total = sum(sizes)
        offs = [0, sizes[0], sizes[0] + sizes[1], sizes[0] + sizes[1] + sizes[2]]
        buf = HostBuffer(agent, total)
        data = random_bytes(total, 5)
        buf.write(0, data)
        reg = agent.register_objects(server.bucket, keys=keys)
        xfer = agent.transfer(
            "WRITE", buf.descs(offs, sizes), DescList.objects(reg, sizes, 0, keys=keys), backends="s3", timeout=60
        )
        assert committed_a.wait(30) and held_b.wait(30), "the WRITE never reached the point the test holds"
        err = xfer.release()
        assert xfer.state == XferState.RELEASED
        assert isinstance(err, TransferAborted) and xfer.error is err
        expected = {0: "committed", 1: "aborted", 2: "committed", 3: "untouched"}
        assert err.outcomes == expected and xfer.outcomes == expected
    assert _body(server, keys[0]) == data[: sizes[0]]
    assert _body(server, keys[1]) == b"old" and not _pending(server, keys[1])
    assert _body(server, keys[2]) == data[offs[2] : offs[3]] and _body(server, keys[3]) == b"old"


def test_a_put_refused_after_a_lost_answer_is_unknown_not_aborted(server, monkeypatch):
    """Attempt 1 of a PUT reaches the store (which stores the object) and its answer is lost; attempt 2 is refused
    with a 503. Before, the HTTP status on the final error made the row "aborted" while the object held the new
    bytes; only a call refused on its single attempt is "aborted"."""
    from botocore import httpsession
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ReadTimeoutError

    key = "out/refused-retry"
    real_send = httpsession.URLLib3Session.send
    attempts: list[str] = []

    class _Raw:
        def stream(self, **_):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def send(self, request):
        if request.method == "PUT" and request.url.endswith(f"/{key}"):
            attempts.append(request.url)
            if len(attempts) == 1:
                real_send(self, request)
                raise ReadTimeoutError(endpoint_url=request.url)
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Raw())
        return real_send(self, request)

    monkeypatch.setattr(httpsession.URLLib3Session, "send", send)
    with _agent(server) as agent:
        buf = HostBuffer(agent, 4096)
        data = random_bytes(4096, 5)
        buf.write(0, data)
        reg = agent.register_objects(server.bucket, keys=[key])
        xfer = agent.transfer("WRITE", buf.descs([0], [4096]), DescList.objects(reg, [4096], 0, keys=[key]))
        with pytest.raises(ObjectStoreError) as info:
            xfer.wait()
        assert info.value.status == 503 and len(attempts) == 2
        assert xfer.outcomes == {0: "unknown"}
    monkeypatch.undo()
    assert _body(server, key) == data


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("end", ["release", "timeout"])
def test_no_retry_is_sent_after_err_and_release_says_unknown(server, monkeypatch, end, mode):
    """Attempt 1 of a PUT is held (a stalled store) until the transfer is ERR (or ``release`` returned), then gets
    no answer. Before, botocore sent attempt 2 after that, committing the object behind the caller's back, and
    ``release`` returned with no outcomes; now no retry is sent and the row is "unknown" from ERR on. Legacy mode
    was still retried so."""
    from botocore import httpsession
    from botocore.exceptions import ReadTimeoutError

    key = f"out/no-retry-after-{end}-{mode}"
    real_send = httpsession.URLLib3Session.send
    reached, ended = threading.Event(), threading.Event()
    attempts: list[bool] = []  # whether each attempt was sent after ERR

    def send(self, request):
        if request.method == "PUT" and request.url.endswith(f"/{key}"):
            attempts.append(ended.is_set())
            if len(attempts) == 1:
                reached.set()
                assert ended.wait(60)
                raise ReadTimeoutError(endpoint_url=request.url)
        return real_send(self, request)

    monkeypatch.setattr(httpsession.URLLib3Session, "send", send)
    with _agent(server, max_attempts=3, retry_mode=mode) as agent:
        buf = HostBuffer(agent, 4096)
        buf.write(0, random_bytes(4096, 6))
        reg = agent.register_objects(server.bucket, keys=[key])
        objs = DescList.objects(reg, [4096], 0, keys=[key])
        xfer = agent.transfer("WRITE", buf.descs([0], [4096]), objs, backends="s3", timeout=1.0)
        assert reached.wait(60), "the PUT was never sent"
        if end == "release":
            xfer.release()
        else:
            with pytest.raises(TransferTimeout):
                xfer.wait()
        told = xfer.outcomes
        ended.set()
        assert xfer._completion.wait(60), "the WRITE's worker never stopped"
        assert told == {0: "unknown"}, told
        assert xfer.outcomes == {0: "unknown"}
        xfer.release()
    assert attempts == [False], f"attempts sent after ERR: {attempts.count(True)}"
    assert server.client().list_objects_v2(Bucket=server.bucket, Prefix=key).get("KeyCount") == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_create_whose_answer_was_lost_leaves_no_pending_upload(server, monkeypatch, mode):
    """The first CreateMultipartUpload reaches the store and its answer is lost. Before, botocore sent it again and
    the upload the first one started stayed pending forever (legacy mode still did); now it is aborted, and an older
    upload of the same key (another writer's, started before this transfer) is left alone. moto stamps every upload
    2010-11-10, so the listing is given real start times: now for uploads started by this transfer."""
    from datetime import datetime, timezone

    from botocore import httpsession
    from botocore.exceptions import ReadTimeoutError

    key = f"out/lost-create-{mode}"
    other = server.client().create_multipart_upload(Bucket=server.bucket, Key=key)["UploadId"]
    real_send = httpsession.URLLib3Session.send
    creates: list[str] = []

    def send(self, request):
        if request.method == "POST" and request.url.endswith(f"/{key}?uploads"):
            creates.append(request.url)
            if len(creates) == 1:
                real_send(self, request)
                raise ReadTimeoutError(endpoint_url=request.url)
        return real_send(self, request)

    def real_start_times(parsed, **_):
        for upload in parsed.get("Uploads") or []:
            if upload["UploadId"] != other:
                upload["Initiated"] = datetime.now(timezone.utc)

    monkeypatch.setattr(httpsession.URLLib3Session, "send", send)
    with _agent(server, part_size=P, multipart_threshold=P, max_attempts=3, retry_mode=mode) as agent:
        agent.backend("s3").settle_client().meta.events.register("after-call.s3.ListMultipartUploads", real_start_times)
        xfer, data = _multipart(agent, server, key, 7)
        assert xfer.wait() == XferState.DONE
    monkeypatch.undo()
    assert len(creates) == 2
    assert _body(server, key) == data
    assert [u["UploadId"] for u in _pending(server, key)] == [other]
    server.client().abort_multipart_upload(Bucket=server.bucket, Key=key, UploadId=other)


class _Refusal:
    """The body of an S3 error answer (botocore's raw response)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def stream(self, **_):
        yield f"<Error><Code>{self.code}</Code><Message>refused</Message></Error>".encode()


def _refuse_first_put(monkeypatch, key: str, status: int, headers: dict[str, str]) -> list[float]:
    """Answer the first PUT of ``key`` with ``status`` (nothing stored), send the others; returns their send times."""
    from botocore import httpsession
    from botocore.awsrequest import AWSResponse

    from datamover.backends.base import clock

    real_send = httpsession.URLLib3Session.send
    sent: list[float] = []

    def send(self, request):
        if request.method == "PUT" and request.url.endswith(f"/{key}"):
            sent.append(clock())
            if len(sent) == 1:
                code = "SlowDown" if status == 503 else "InternalError"
                return AWSResponse(request.url, status, {"Content-Type": "application/xml", **headers}, _Refusal(code))
        return real_send(self, request)

    monkeypatch.setattr(httpsession.URLLib3Session, "send", send)
    return sent


@pytest.mark.parametrize("mode", MODES)
def test_no_retry_whose_backoff_ends_past_the_deadline(server, monkeypatch, mode):
    """Attempt 1 of a PUT is refused with a 503 whose backoff (botocore's: at least 5 s) ends past the transfer's
    3 s deadline. Before, botocore slept it out and sent the retry after the transfer was ERR, committing the object
    behind the caller's back (every mode); now the store's refusal fails the transfer at once and nothing is stored."""
    from botocore import retryhandler

    monkeypatch.setattr(retryhandler, "random", types.SimpleNamespace(random=lambda: 10.0))  # legacy: 10 s
    key = f"out/backoff-past-deadline-{mode}"
    sent = _refuse_first_put(monkeypatch, key, 503, {"x-amz-retry-after": "10000"})  # standard, adaptive: >= 5 s
    with _agent(server, max_attempts=3, retry_mode=mode) as agent:
        buf = HostBuffer(agent, 4096)
        buf.write(0, random_bytes(4096, 8))
        reg = agent.register_objects(server.bucket, keys=[key])
        xfer = agent.transfer(
            "WRITE", buf.descs([0], [4096]), DescList.objects(reg, [4096], 0, keys=[key]), backends="s3", timeout=3.0
        )
        with pytest.raises(ObjectStoreError) as info:
            xfer.wait()
        deadline = xfer.request.deadline
        assert info.value.status == 503 and xfer.outcomes == {0: "aborted"}
        xfer.release()
    assert [t >= deadline for t in sent] == [False], "a retry was sent past the deadline"
    assert server.client().list_objects_v2(Bucket=server.bucket, Prefix=key).get("KeyCount") == 0


def test_a_retry_held_past_the_deadline_is_not_sent(server, monkeypatch):
    """Attempt 1 of a PUT is refused with a 500; its retry is then held just before it is sent (as adaptive mode's
    rate limiter holds one) until the transfer is ERR. Before, it was sent then, committing the object after ERR;
    now it is not sent and the row is "unknown" (attempt 1 was sent)."""
    key = "out/retry-held"
    sent = _refuse_first_put(monkeypatch, key, 500, {})
    reached, ended = threading.Event(), threading.Event()

    def hold(request, **_):
        if request.url.endswith(f"/{key}") and request.context["retries"]["attempt"] == 2:
            reached.set()
            assert ended.wait(60)

    with _agent(server, max_attempts=3, retry_mode="adaptive") as agent:
        # on the operation's own event: before the backend's check, which is on "before-send", last
        agent.backend("s3").client.meta.events.register("before-send.s3.PutObject", hold)
        buf = HostBuffer(agent, 4096)
        buf.write(0, random_bytes(4096, 9))
        reg = agent.register_objects(server.bucket, keys=[key])
        xfer = agent.transfer(
            "WRITE", buf.descs([0], [4096]), DescList.objects(reg, [4096], 0, keys=[key]), backends="s3", timeout=2.0
        )
        assert reached.wait(60), "the retry was never made"
        with pytest.raises(TransferTimeout):
            xfer.wait()
        ended.set()
        assert xfer._completion.wait(60), "the WRITE's worker never stopped"
        assert xfer.outcomes == {0: "unknown"}
        xfer.release()
    assert len(sent) == 1, f"retries sent after ERR: {len(sent) - 1}"
    assert server.client().list_objects_v2(Bucket=server.bucket, Prefix=key).get("KeyCount") == 0
