"""etcd fetch against a hostile or broken v3 JSON gateway: an in-process HTTP server answers what each test says.

Every answer is read within a bound and parsed before use (InvalidMetadata naming the key), never read whole.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("etcd3gw")

import datamover.agents.etcd as etcd_mod
import datamover.agents.etcd.answers as answers_mod
import datamover.agents.etcd.gateway as gateway_mod
from datamover.errors import InvalidMetadata, RemoteDisconnected
from datamover.testing.waiting import HeldOnce

KEY = etcd_mod.agent_key("ns", "peer")
B64KEY = base64.b64encode(KEY.encode()).decode()
#: what the gateway may send in all, in the tests of answers over the bound: twice the bound we set, and more
SENT = 128 << 20
BOUND = 64 << 10

Answer = Callable[["_Handler", dict], None]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: Gateway

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # etcd3gw's API discovery
        self.send(b'{"etcdserver":"3.5.0","etcdcluster":"3.5.0"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        path = self.path.removeprefix("/v3/")
        self.gateway.requests.append((path, body))
        answer = self.gateway.answers.get(path)
        if answer is None:
            self.send(b'{"header":{"revision":"5"}}')
        else:
            answer(self, body)

    def send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def stream(self, pieces: Iterator[bytes], length: int | None = None) -> None:
        """Send ``pieces`` (chunked, or as a body of ``length``), counting what the client took, until it hangs up."""
        self.send_response(200)
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        self.end_headers()
        try:
            for piece in filter(None, pieces):  # (an empty chunk would end a chunked body)
                self.wfile.write(piece if length is not None else b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                self.gateway.sent += len(piece)
        except OSError:  # the client hung up: what it refused stops here
            pass
        self.close_connection = True


class Gateway:
    """A fake etcd gateway on loopback: ``answers`` maps a v3 path ("kv/range", "watch", ...) to how it answers."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, dict]] = []
        self.sent = 0
        handler = type("Handler", (_Handler,), {"gateway": self})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def gateway():
    made: list[Gateway] = []

    def make(**answers: Answer) -> Gateway:
        g = Gateway({k.replace("_", "/"): v for k, v in answers.items()})
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def _blocks(total: int, head: bytes = b"") -> Iterator[bytes]:
    yield head
    for _ in range(total >> 20):
        yield b"A" * (1 << 20)


def _absent(handler: _Handler, _: dict) -> None:
    handler.send(b'{"header":{"revision":"5"}}')


def _range_of(value: bytes, key: str = B64KEY) -> bytes:
    kv = {"key": key, "value": base64.b64encode(value).decode(), "mod_revision": "4"}
    return json.dumps({"header": {"revision": "5"}, "kvs": [kv]}).encode()


def _event_line(value: bytes) -> bytes:
    kv = {"key": B64KEY, "value": base64.b64encode(value).decode(), "mod_revision": "6"}
    return json.dumps({"result": {"header": {"revision": "6"}, "events": [{"kv": kv}]}}).encode() + b"\n"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_range_answer_over_the_bound_is_refused_before_it_is_read(gateway, monkeypatch, declared):
    """Before, etcd3gw read the whole answer (a 400 MiB value: 1.6 GiB of peak memory) and only then was the value
    refused; now an answer declared longer than the bound is refused unread, and a chunked one once past it."""
    monkeypatch.setattr(gateway_mod, "MAX_WATCH_LINE", BOUND)
    head = b'{"header":{"revision":"5"},"kvs":[{"key":"' + B64KEY.encode() + b'","value":"'
    g = gateway(kv_range=lambda h, _: h.stream(_blocks(SENT, head), len(head) + SENT if declared else None))
    client = etcd_mod.connect(g.endpoint)
    with pytest.raises(InvalidMetadata, match=f"etcd range of {KEY}: an answer of over {BOUND} bytes"):
        etcd_mod.fetch(client, "ns", "peer", timeout=5)
    assert g.sent < SENT // 4, f"the client took {g.sent >> 20} MiB of a {SENT >> 20} MiB answer"


def test_a_plain_answer_over_the_bound_is_refused_when_connecting(gateway, monkeypatch):
    """etcd3gw's own calls (status here) are read within the bound too (a response hook on its session)."""
    monkeypatch.setattr(gateway_mod, "MAX_WATCH_LINE", BOUND)
    g = gateway(maintenance_status=lambda h, _: h.stream(_blocks(SENT)))
    with pytest.raises(RemoteDisconnected, match=f"InvalidMetadata: etcd answer from .* over {BOUND} bytes"):
        etcd_mod.connect(g.endpoint)
    assert g.sent < SENT // 4, f"the client took {g.sent >> 20} MiB of a {SENT >> 20} MiB answer"


_BAD_RANGES = {
    "not JSON": b'{"header": {"revision": "5"}, "kvs": [',
    "not an object": b"[1, 2]",
    "kvs not a list": b'{"header": {"revision": "5"}, "kvs": "nope"}',
    "kv not an object": b'{"header": {"revision": "5"}, "kvs": [7]}',
    "no revision": b'{"kvs": []}',
    "bad revision": b'{"header": {"revision": "-1"}}',
    "two kvs": _range_of(b"x").replace(b'"kvs": [', b'"kvs": [{"key": "' + B64KEY.encode() + b'"}, '),
    "another key": _range_of(b"blob", key=base64.b64encode(b"/ns/agents/other").decode()),
    "value not a string": _range_of(b"x").replace(b'"eA=="', b"12"),
    "value not base64": _range_of(b"x").replace(b'"eA=="', b'"!!not base64!!"'),
    "nested too deep": b"[" * 100_000,
    "not UTF-8": b'{"header": {"revision": "5\xff"}}',
}


@pytest.mark.parametrize("body", _BAD_RANGES.values(), ids=_BAD_RANGES.keys())
def test_a_garbled_range_answer_is_invalid_metadata_naming_the_key(gateway, body):
    """Before: requests' JSONDecodeError, AttributeError, binascii.Error, RecursionError, or another key's value
    taken as this one's."""
    g = gateway(kv_range=lambda h, _: h.send(body))
    client = etcd_mod.connect(g.endpoint)
    with pytest.raises(InvalidMetadata, match=f"etcd (range|value) (of|at) {KEY}"):
        etcd_mod.fetch(client, "ns", "peer", timeout=5)


def test_a_value_over_the_blob_bound_is_refused_before_it_is_decoded(gateway, monkeypatch):
    monkeypatch.setattr(answers_mod, "MAX_BLOB_BYTES", 3000)
    g = gateway(kv_range=lambda h, _: h.send(_range_of(b"v" * 3003)))
    with pytest.raises(InvalidMetadata, match=f"etcd value at {KEY}: over 3000 bytes"):
        etcd_mod.fetch(etcd_mod.connect(g.endpoint), "ns", "peer", timeout=5)


def test_the_watch_of_an_absent_key_starts_after_the_read_and_delivers_the_put(gateway):
    g = gateway(
        kv_range=_absent, watch=lambda h, _: h.stream(iter([b'{"result":{"created":true}}\n', _event_line(b"blob")]))
    )
    assert etcd_mod.fetch(etcd_mod.connect(g.endpoint), "ns", "peer", timeout=5) == b"blob"
    watches = [body for path, body in g.requests if path == "watch"]
    assert watches == [{"create_request": {"key": B64KEY, "start_revision": 6}}]


@pytest.mark.parametrize(
    "stream",
    [
        pytest.param(lambda: _blocks(SENT), id="a line that never ends"),
        pytest.param(lambda: iter([b'{"result": {"events": [{"kv": 3}]}}\n']), id="a garbled event"),
        pytest.param(lambda: iter([b"<html>busy</html>\n"]), id="not JSON"),
    ],
)
def test_a_watch_stream_over_the_bound_or_garbled_fails_the_fetch_at_once(gateway, monkeypatch, stream):
    """Before, etcd3gw's watch read each chunk whole and died on a bad line in its own thread: the fetch waited its
    whole timeout, then said the agent did not appear."""
    monkeypatch.setattr(gateway_mod, "MAX_WATCH_LINE", BOUND)
    g = gateway(kv_range=_absent, watch=lambda h, _: h.stream(stream()))
    with pytest.raises(InvalidMetadata, match=f"etcd watch of {KEY}"):
        etcd_mod.fetch(etcd_mod.connect(g.endpoint), "ns", "peer", timeout=60)
    assert g.sent < SENT // 4


def test_a_watch_stream_that_ends_is_opened_again_after_a_fresh_read(gateway):
    reads = []

    def kv_range(h: _Handler, _: dict) -> None:
        reads.append(1)
        h.send(_range_of(b"late") if len(reads) == 2 else b'{"header":{"revision":"5"}}')

    g = gateway(kv_range=kv_range, watch=lambda h, _: h.stream(iter([b'{"result":{"created":true}}\n'])))
    assert etcd_mod.fetch(etcd_mod.connect(g.endpoint), "ns", "peer", timeout=30) == b"late"
    assert len(reads) == 2


def test_a_fetch_of_a_key_that_never_appears_times_out(gateway):
    stalled = threading.Event()

    def watch(h: _Handler, _: dict) -> None:
        h.stream(iter([b'{"result":{"created":true}}\n']))
        stalled.wait(30)  # an open stream with nothing on it

    g = gateway(kv_range=_absent, watch=watch)
    try:
        with pytest.raises(RemoteDisconnected, match="did not appear"):
            etcd_mod.fetch(etcd_mod.connect(g.endpoint), "ns", "peer", timeout=0.5)
    finally:
        stalled.set()


# -- the publisher: its lease, puts and keepalives ----------------------------------------
PUB_KEY = etcd_mod.agent_key("ns", "pub")


def _granted(h: _Handler, _: dict) -> None:
    h.send(b'{"header":{"revision":"5"},"ID":"7","TTL":"600"}')


def _paths(g: Gateway) -> list[str]:
    return [path for path, _ in g.requests]


MEMCPY = {"backends": {"memcpy": {}}}


def _kept(h: _Handler, _: dict) -> None:
    h.send(b'{"header":{"revision":"5"},"result":{"ID":"7","TTL":"600"}}')


def _until(cond: Callable[[], object], timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _HeldPut:
    """A kv/put answer that holds the first put after ``arm()`` (``held`` set once it arrived) until ``go``."""

    def __init__(self) -> None:
        self.held, self.go = threading.Event(), threading.Event()
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    def __call__(self, h: _Handler, _: dict) -> None:
        hold, self._armed = self._armed, False
        if hold:
            self.held.set()
            self.go.wait(30)
        h.send(b'{"header":{"revision":"6"}}')


class _Call:
    """``fn(*args)`` in a thread of its own: ``done`` is set once it returned (``value``) or raised (``error``)."""

    def __init__(self, fn: Callable, *args: object) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self._fn, self._args = fn, args
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            self.value = self._fn(*self._args)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


def _puts_after(g: Gateway, start: int) -> list[int]:
    """The number of regions in each blob put from request ``start`` on."""
    from datamover.agents.metadata import decode_metadata

    return [
        len(decode_metadata(base64.b64decode(body["value"])).regions)
        for path, body in g.requests[start:]
        if path == "kv/put"
    ]


_BAD_GRANTS = {
    "no ID": b'{"header":{"revision":"5"},"TTL":"5"}',
    "lease 0 (a key that never expires)": b'{"ID":"0","TTL":"5"}',
    "ID not a number": b'{"ID":"x7","TTL":"5"}',
    "TTL 0": b'{"ID":"7","TTL":"0"}',
    "not JSON": b"<html>busy</html>",
    "not an object": b"[7]",
}


@pytest.mark.parametrize("body", _BAD_GRANTS.values(), ids=_BAD_GRANTS.keys())
def test_a_garbled_lease_grant_fails_publish_typed_and_puts_nothing(gateway, body):
    """Before: KeyError, ValueError or requests' JSONDecodeError out of publish, or (lease 0) the blob put with no
    lease at all, a key etcd keeps after the agent is gone."""
    from datamover import Agent

    g = gateway(lease_grant=lambda h, _: h.send(body))
    with Agent("pub", {"backends": {"memcpy": {}}}) as agent:
        with pytest.raises(InvalidMetadata, match=f"etcd lease grant for {PUB_KEY}"):
            agent.publish(g.endpoint, "ns")
        assert agent._peers.publisher is None
    assert "kv/put" not in _paths(g)


def test_a_refused_put_fails_publish_typed_and_revokes_the_lease(gateway):
    """Before: etcd3gw's own exception out of publish, and the lease granted for the refused put left to expire."""
    from datamover import Agent
    from datamover.errors import RemoteRefused

    def refuse(h: _Handler, _: dict) -> None:
        body = b'{"error":"etcdserver: request is too large","code":3}'
        h.send_response(400)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    g = gateway(lease_grant=_granted, kv_put=refuse)
    with Agent("pub", {"backends": {"memcpy": {}}}) as agent:
        with pytest.raises(RemoteRefused, match=f"etcd put of {PUB_KEY}: .*HTTP 400"):
            agent.publish(g.endpoint, "ns")
    assert ("kv/lease/revoke", {"ID": 7}) in g.requests


@pytest.mark.parametrize(
    "body",
    [b"<html>busy</html>", b'{"result":{"ID":"7","TTL":"soon"}}', b'{"result":[1]}', b"{}"],
    ids=["not JSON", "TTL not a number", "result not an object", "no result"],
)
def test_a_keepalive_answer_not_understood_is_invalid_metadata_and_keeps_the_lease(gateway, body):
    """Before: KeyError or ValueError taken for etcd being away; as the gateway answered status, the lease was taken
    for lost and a new one granted and the blob put again at every refresh (watchers reloading the peer each time).
    """
    from datamover.agents.etcd import EtcdPublisher

    g = gateway(lease_grant=_granted, lease_keepalive=lambda h, _: h.send(body))
    pub = EtcdPublisher(g.endpoint, "ns", "pub", lambda: b"blob", ttl=600)  # its own refreshes are 200 s away
    try:
        before = len(g.requests)
        with pytest.raises(InvalidMetadata, match=f"etcd lease keepalive for {PUB_KEY}"):
            pub._refresh()
        assert _paths(g)[before:] == ["lease/keepalive"]
        assert pub.lease.id == 7
    finally:
        pub.close()


def test_nothing_is_published_after_close_returned(gateway):
    """close() while a refresh is on its way (etcd slow): it used to find the lease gone once the answer came, and
    grant a new lease and put the blob again after close had returned, the key back in etcd, a dead agent watched
    peers load again; and an update() after close put the blob again under the revoked lease."""
    from datamover.agents.etcd import EtcdPublisher

    in_keepalive, answer = threading.Event(), threading.Event()

    def keepalive(h: _Handler, _: dict) -> None:
        in_keepalive.set()
        answer.wait(30)
        h.send(b'{"result":{"ID":"7"}}')  # etcd no longer knows the lease (close revoked it meanwhile)

    g = gateway(lease_grant=lambda h, _: h.send(b'{"ID":"7","TTL":"2"}'), lease_keepalive=keepalive)
    pub = EtcdPublisher(g.endpoint, "ns", "pub", lambda: b"blob", ttl=2)
    assert in_keepalive.wait(30)  # known point: a refresh waits on etcd
    pub.close()  # revokes; the refresh on its way grants nothing once it is answered
    closed_at = len(g.requests)
    answer.set()
    assert pub.wait_stopped(30)
    pub.update()  # a registration after close (the agent's publisher closed, not yet dropped)
    after = _paths(g)[closed_at:]
    assert "kv/put" not in after and "lease/grant" not in after, after


def test_a_failed_publish_leaves_no_closed_publisher_behind(gateway):
    """publish() again to an etcd out of reach: the earlier publisher was closed, the new one never made, and the
    agent kept the closed one: every registration after that put the blob again under its revoked lease."""
    import numpy as np

    from datamover import Agent
    from datamover.errors import RemoteDisconnected

    g = gateway(lease_grant=_granted)
    with Agent("pub", {"backends": {"memcpy": {}}}) as agent:
        agent.publish(g.endpoint, "ns")
        with pytest.raises(RemoteDisconnected, match="no etcd endpoint"):
            agent.publish("http://127.0.0.1:1", "ns")
        assert agent._peers.publisher is None
        revoked_at = _paths(g).index("kv/lease/revoke")
        agent.register_memory(np.zeros(4096, np.uint8))
        assert "kv/put" not in _paths(g)[revoked_at:]


def test_a_republish_by_the_keepalive_and_a_registration_at_once_do_not_deadlock(gateway):
    """The keepalive's republish (after etcd was away) took the publisher's lock, then the agent's to make the blob;
    register_memory took the agent's lock, then (republishing) the publisher's: each waited for the other forever,
    and the agent with them. Now a registration only hands the publisher the new blob, and the publisher's thread
    puts without the agent's lock: it puts while a registration holds that lock."""
    import numpy as np

    from datamover import Agent
    from datamover.agents.metadata import decode_metadata

    g = gateway(lease_grant=_granted, lease_keepalive=_kept)
    agent = Agent("pub", MEMCPY)
    agent.publish(g.endpoint, "ns", ttl=600)  # its own refreshes are 200 s away
    pub = agent._peers.publisher
    registering, go = threading.Event(), threading.Event()
    update = pub.update

    def republish() -> None:  # the registration's republish, parked under the agent's lock
        registering.set()
        go.wait(30)
        update()

    pub.update = republish
    register = threading.Thread(target=agent.register_memory, args=(np.zeros(4096, np.uint8),))
    register.start()
    assert registering.wait(30)  # known point: register_memory holds the agent's lock, about to republish
    with pub._cond:  # a put failed while etcd was away: the publisher's thread puts again, now
        pub._put_generation = -1
        pub._cond.notify_all()
    put_again = _until(lambda: _paths(g).count("kv/put") == 2, 30)
    go.set()
    register.join(30)
    deadlocked = register.is_alive()
    if not deadlocked:  # (a deadlocked agent cannot be closed)
        assert agent.metadata_published(30)
        agent.close()
    assert not deadlocked and put_again
    puts = [body for path, body in g.requests if path == "kv/put"]
    assert len(puts) == 3  # publish, then the keepalive's and the registration's, in that order
    assert [len(decode_metadata(base64.b64decode(p["value"])).regions) for p in puts] == [0, 0, 1]


# -- republishing after a registration: never waits for etcd ---------------------------
def test_a_registration_returns_while_etcd_holds_its_republish(gateway):
    """Before, register_memory put the blob to etcd itself, under the agent's lock: an etcd that took its time (each
    request bounded at about 5 s, longer for a gateway answering a byte at a time) stalled the registration and
    every agent call that takes the lock (add_remote here) for as long. Now the registration hands the new blob to
    the publisher's thread and returns; ``metadata_published`` says when it is in etcd."""
    import numpy as np

    from datamover import Agent

    hold = _HeldPut()
    g = gateway(lease_grant=_granted, lease_keepalive=_kept, kv_put=hold)
    agent, other = Agent("pub", MEMCPY), Agent("other", MEMCPY)
    try:
        agent.publish(g.endpoint, "ns", ttl=600)
        published_at = len(g.requests)
        hold.arm()
        registered = _Call(agent.register_memory, np.zeros(4096, np.uint8))
        assert hold.held.wait(30)  # known point: the republish waits on etcd, and will until the test lets it go
        assert registered.done.wait(5), "register_memory waited for etcd"
        assert registered.error is None, registered.error
        loaded = _Call(agent.add_remote, other.metadata())
        assert loaded.done.wait(5), "add_remote waited for etcd: the agent's lock was held across the put"
        assert loaded.value == "other", loaded.error
        assert not agent.metadata_published(0)  # the put is on its way, not in etcd yet
        waiting = _Call(agent.metadata_published, 30)
        assert not waiting.done.wait(0.2)  # (only a wrong answer, True before the put landed, fails this)
        hold.go.set()
        assert waiting.done.wait(30) and waiting.value is True
        assert _puts_after(g, published_at) == [1]
    finally:
        hold.go.set()
        agent.close()
        other.close()


def test_a_burst_of_registrations_is_coalesced_into_the_latest_blob(gateway):
    """Ten registrations while etcd holds the first one's put: each returns at once, and once etcd answers one more
    put carries all ten regions (before: ten puts, one after the other, each under the agent's lock)."""
    import numpy as np

    from datamover import Agent

    hold = _HeldPut()
    g = gateway(lease_grant=_granted, lease_keepalive=_kept, kv_put=hold)
    agent = Agent("pub", MEMCPY)
    bufs = [np.zeros(4096 * (i + 1), np.uint8) for i in range(10)]
    try:
        agent.publish(g.endpoint, "ns", ttl=600)
        published_at = len(g.requests)
        hold.arm()
        first = _Call(agent.register_memory, bufs[0])
        assert hold.held.wait(30)
        assert first.done.wait(5), "register_memory waited for etcd"
        rest = _Call(lambda: [agent.register_memory(b) for b in bufs[1:]])
        assert rest.done.wait(10), "registrations waited for etcd"
        assert rest.error is None, rest.error
        hold.go.set()
        assert agent.metadata_published(30)
        assert _puts_after(g, published_at) == [1, 10]
    finally:
        hold.go.set()
        agent.close()


def test_close_while_a_put_is_held_puts_nothing_after(gateway):
    """A registration's put held by etcd, a newer blob waiting behind it, and the agent closed: close revokes
    the lease and returns without waiting for the put in flight, and once etcd answers the held put nothing more
    is put or granted; a caller waiting for the blob to be published is told it was not."""
    import numpy as np

    from datamover import Agent

    hold = _HeldPut()
    g = gateway(lease_grant=lambda h, _: h.send(b'{"ID":"7","TTL":"2"}'), lease_keepalive=_kept, kv_put=hold)
    agent = Agent("pub", MEMCPY)
    try:
        agent.publish(g.endpoint, "ns", ttl=2)
        pub = agent._peers.publisher
        hold.arm()
        first = _Call(agent.register_memory, np.zeros(4096, np.uint8))
        assert hold.held.wait(30)
        assert first.done.wait(5), "register_memory waited for etcd"
        second = _Call(agent.register_memory, np.zeros(8192, np.uint8))  # its blob waits behind the held put
        assert second.done.wait(5), "register_memory waited for etcd"
        waiting = _Call(agent.metadata_published, 60)
        closing = _Call(agent.close)
        assert closing.done.wait(30), "close hung on the held put"
        assert closing.error is None, closing.error
        closed_at = len(g.requests)
        assert waiting.done.wait(5) and waiting.value is False
        assert ("kv/lease/revoke", {"ID": 7}) in g.requests
        hold.go.set()
        assert pub.wait_stopped(30)
        after = _paths(g)[closed_at:]
        assert "kv/put" not in after and "lease/grant" not in after, after
    finally:
        hold.go.set()
        agent.close()


def _hold_requests(monkeypatch: pytest.MonkeyPatch, client: object, path: str) -> HeldOnce:
    """The first request ``client`` sends to the gateway's ``path`` waits, before it is sent, until ``go``."""
    session = client.session  # type: ignore[attr-defined]
    real = session.post
    held = (hold := HeldOnce(f"the {path} request")).wrap(real)
    monkeypatch.setattr(session, "post", lambda url, *a, **kw: (held if url.endswith(path) else real)(url, *a, **kw))
    return hold


def test_close_waits_for_etcd_without_the_agents_lock(gateway, monkeypatch):
    """Agent.close revoked the etcd lease (after waiting up to a TTL for a put in flight) under the agent's lock:
    while etcd took its time, every other agent call (add_remote here, registration, prepare) waited with it. Now
    close waits for etcd with the lock let go: add_remote returns while the revoke is held."""
    import numpy as np

    from datamover import Agent

    g = gateway(lease_grant=_granted, lease_keepalive=_kept)
    agent, other = Agent("pub", MEMCPY), Agent("other", MEMCPY)
    hold = None
    try:
        agent.publish(g.endpoint, "ns", ttl=600)
        agent.register_memory(np.zeros(4096, np.uint8))
        assert agent.metadata_published(30)
        hold = _hold_requests(monkeypatch, agent._peers.publisher.client, "/kv/lease/revoke")
        closing = _Call(agent.close)
        assert hold.reached.wait(30)  # known point: close waits on etcd's revoke, and will until the test lets it go
        loaded = _Call(agent.add_remote, other.metadata())
        assert loaded.done.wait(5), "add_remote waited for close's revoke: the agent's lock was held across it"
        assert loaded.error is None and loaded.value == "other", loaded.error
        hold.go.set()
        assert closing.done.wait(30) and closing.error is None, closing.error
        assert ("kv/lease/revoke", {"ID": 7}) in g.requests
    finally:
        if hold is not None:
            hold.go.set()
        agent.close()
        other.close()


def test_unpublish_waits_for_etcd_at_most_its_timeout(gateway, monkeypatch):
    """unpublish (and close) waited for a put or refresh in flight up to the lease's TTL (600 s here), then for the
    revoke as long as etcd took: nothing bounded them but etcd. Now each waits at most its timeout; the publisher is
    gone at once (nothing is put after) and the key goes with the lease if etcd never confirms the revoke."""
    import numpy as np

    from datamover import Agent

    hold_put = _HeldPut()
    g = gateway(lease_grant=_granted, lease_keepalive=_kept, kv_put=hold_put)
    agent = Agent("pub", MEMCPY)
    hold = None
    try:
        agent.publish(g.endpoint, "ns", ttl=600)
        hold = _hold_requests(monkeypatch, agent._peers.publisher.client, "/kv/lease/revoke")
        hold_put.arm()
        agent.register_memory(np.zeros(4096, np.uint8))
        assert hold_put.held.wait(30)  # known point: etcd holds the republish
        unpublishing = _Call(agent.unpublish, 0.5)
        assert hold.reached.wait(30)  # and the revoke, until the test lets them go
        assert unpublishing.done.wait(10), "unpublish waited for etcd past its timeout"
        assert unpublishing.error is None, unpublishing.error
        assert agent._peers.publisher is None and not agent.metadata_published(0)
    finally:
        hold_put.go.set()
        if hold is not None:
            hold.go.set()
        agent.close()


def test_keepalives_go_on_while_a_put_is_held(gateway, monkeypatch):
    """One thread kept the lease alive and put the blobs: while a put waited on etcd no keepalive was sent, and a put
    held past the TTL let the lease lapse (the key gone, every watching peer dropping a live agent). Now the lease is
    kept alive on a thread of its own: keepalives go on, every ttl/3, while the put is held."""
    import numpy as np

    from datamover import Agent

    g = gateway(lease_grant=lambda h, _: h.send(b'{"ID":"7","TTL":"2"}'), lease_keepalive=_kept)
    agent = Agent("pub", MEMCPY)
    hold = None
    try:
        agent.publish(g.endpoint, "ns", ttl=2)
        hold = _hold_requests(monkeypatch, agent._peers.publisher.client, "/kv/put")
        agent.register_memory(np.zeros(4096, np.uint8))
        assert hold.reached.wait(30)  # known point: the republish waits, before it is sent, until the test lets it go
        held_at = len(g.requests)
        kept = _until(lambda: _paths(g)[held_at:].count("lease/keepalive") >= 3, 30)
        assert kept, "no keepalive was sent while a put was held"
        hold.go.set()
        assert agent.metadata_published(30)
    finally:
        if hold is not None:
            hold.go.set()
        agent.close()


def test_a_refused_republish_is_retried_at_the_lease_rhythm_and_visible_until_it_lands(gateway, caplog):
    """etcd refusing the put of a new blob (5xx, etcd busy): the registration is not failed, the failure is logged,
    ``metadata_published`` says False, and the publisher's thread puts again at the lease's rhythm until it lands."""
    import logging

    import numpy as np

    from datamover import Agent

    failing, failed = threading.Event(), threading.Event()

    def put(h: _Handler, _: dict) -> None:
        if failing.is_set():
            failed.set()
            body = b'{"error":"etcdserver: too many requests","code":14}'
            h.send_response(503)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        h.send(b'{"header":{"revision":"6"}}')

    caplog.set_level(logging.WARNING, logger="datamover.etcd")
    g = gateway(lease_grant=lambda h, _: h.send(b'{"ID":"7","TTL":"2"}'), lease_keepalive=_kept, kv_put=put)
    agent = Agent("pub", MEMCPY)
    try:
        agent.publish(g.endpoint, "ns", ttl=2)
        published_at = len(g.requests)
        failing.set()
        agent.register_memory(np.zeros(4096, np.uint8))
        assert failed.wait(30)  # known point: the put was refused
        assert _until(lambda: "HTTP 503" in caplog.text, 30), caplog.text
        assert not agent.metadata_published(0)
        failing.clear()
        assert agent.metadata_published(30)
        assert _puts_after(g, published_at)[-1] == 1
    finally:
        agent.close()


# -- parsing (no gateway) -------------------------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
_fields = st.sampled_from(["header", "revision", "kvs", "key", "value", "mod_revision", "result", "events", "kv"])
_docs = st.recursive(
    _json,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_fields | st.just(B64KEY), inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(_docs)
def test_any_json_answer_parses_or_is_invalid_metadata(doc):
    body = json.dumps(doc).encode()
    for parse in (lambda: etcd_mod.parse_range(body, KEY), lambda: etcd_mod.watch_events(body, KEY)):
        try:
            parse()
        except (InvalidMetadata, ConnectionError):  # ConnectionError: a watch etcd cancelled
            pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, (1 << 63) - 1), st.sampled_from([str, int]))
def test_a_well_formed_range_answer_gives_its_value_and_revision(value, revision, spelled):
    kv = {"key": B64KEY, "value": base64.b64encode(value).decode(), "mod_revision": "3", "version": "1"}
    body = json.dumps({"header": {"revision": spelled(revision)}, "kvs": [kv]}).encode()
    got, rev = etcd_mod.parse_range(body, KEY)
    assert rev == revision and etcd_mod.kv_value(got, KEY) == value
