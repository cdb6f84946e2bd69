"""Metadata exchange through a real etcd on loopback: publish under a lease, fetch with a watch, expiry."""

import logging
import threading
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.errors import RemoteDisconnected
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.services import EtcdServer, etcd_binary

ok, why = backend_status("ucx")
pytestmark = [
    pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}"),
    pytest.mark.skipif(etcd_binary() is None, reason="etcd server binary not installed (apt-get install etcd-server)"),
]
UCX = {"backends": {"ucx": {}}}


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server.endpoint


@pytest.fixture
def ns():
    return f"test-{uuid.uuid4().hex[:8]}"


def _until(cond, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def test_publish_fetch_transfer_and_incremental_update(etcd, ns):
    with RemotePeer("decode-e", UCX) as peer, Agent("prefill-e", UCX) as agent:
        first = RemoteBuffer(peer, 4096)
        key = peer.call("publish", etcd, ns, 3.0)
        assert key == f"/{ns}/agents/decode-e"
        assert agent.fetch_remote("decode-e", etcd=etcd, namespace=ns, timeout=5) == "decode-e"
        local = HostBuffer(agent, 8192)
        data = random_bytes(8192, 1)
        local.write(0, data)
        assert agent.transfer("WRITE", local.descs([0], [4096]), first.descs([0], [4096]), "decode-e").wait()
        assert first.read(0, 4096) == data[:4096]
        # memory registered later is republished; the watch brings it here without an explicit refresh
        second = RemoteBuffer(peer, 4096)
        assert _until(lambda: any(r[2] == second.addr for r in agent.remote_metadata("decode-e").regions), 10)
        xfer = agent.transfer("WRITE", local.descs([4096], [4096]), second.descs([0], [4096]), "decode-e")
        assert xfer.wait() == XferState.DONE and second.read(0, 4096) == data[4096:]
        assert agent.refresh_remote("decode-e") == "decode-e"


def test_fetch_waits_for_the_peer_to_appear(etcd, ns, monkeypatch):
    import json

    import datamover.agents.etcd as etcd_mod
    import datamover.agents.etcd.watch as watch_mod

    waiting, real_events = threading.Event(), watch_mod.watch_events

    def watch_events(line, key):
        out = real_events(line, key)
        if key == etcd_mod.agent_key(ns, "late") and line.strip() and json.loads(line)["result"].get("created"):
            waiting.set()  # etcd opened the fetch's watch (from the revision after its read found nothing)
        return out

    monkeypatch.setattr(watch_mod, "watch_events", watch_events)  # the fetch's watch reads its lines through it
    with Agent("late-init", UCX) as agent:
        got = {}

        def fetch():
            try:
                got["name"] = agent.fetch_remote("late", etcd=etcd, namespace=ns, timeout=20)
            except Exception as exc:
                got["error"] = exc

        t = threading.Thread(target=fetch)
        t.start()
        assert waiting.wait(30), got  # known point: the fetch is waiting on its watch
        assert t.is_alive(), got
        with Agent("late", UCX) as late:
            late.publish(etcd, ns, ttl=3)
            t.join(20)
            assert got == {"name": "late"}
            late.unpublish()
            # unpublishing revokes the lease: the watcher drops the peer at once
            assert _until(lambda: "late" not in agent.remotes, 5)


def test_fetch_times_out(etcd, ns):
    with Agent("lonely", UCX) as agent:
        t0 = time.monotonic()
        with pytest.raises(RemoteDisconnected, match="did not appear"):
            agent.fetch_remote("nobody", etcd=etcd, namespace=ns, timeout=1.0)
        assert time.monotonic() - t0 < 30  # it returned (a generous bound: only a hang fails it)


def test_killed_agent_expires_and_is_invalidated(etcd, ns):
    ttl = 3.0  # refreshed every second: a loaded machine has 2 s of slack before the key could lapse
    with Agent("watcher", UCX) as agent:
        peer = RemotePeer("doomed", UCX)
        try:
            peer.call("publish", etcd, ns, ttl)
            agent.fetch_remote("doomed", etcd=etcd, namespace=ns, timeout=5)
            time.sleep(ttl * 1.5)  # refreshes keep the key alive past one TTL
            assert "doomed" in agent.remotes
            t0 = time.monotonic()
            peer.kill()
            assert _until(lambda: "doomed" not in agent.remotes, ttl + 30), "lease did not expire"
            assert time.monotonic() - t0 <= ttl + 30  # the lease expired (a bound only a hang exceeds)
            with pytest.raises(RemoteDisconnected, match="did not appear"):
                agent.fetch_remote("doomed", etcd=etcd, namespace=ns, timeout=0.5)
        finally:
            peer.close()


def test_unreachable_etcd(ns):
    with Agent("no-etcd", UCX) as agent:
        with pytest.raises(RemoteDisconnected, match="no etcd endpoint"):
            agent.publish("http://127.0.0.1:1", ns)


def _expected_lines(data: bytes) -> list[bytes]:
    *lines, last = data.split(b"\n")
    return lines + ([last] if last else [])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"\n")), st.lists(st.integers(1, 40), max_size=20))
def test_split_lines_is_split_on_newlines_and_refuses_a_line_over_the_bound(data, cuts):
    from datamover.agents.etcd import split_lines
    from datamover.errors import InvalidMetadata

    bounds = sorted({0, len(data), *(c * 7 % (len(data) + 1) for c in cuts)})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    most = 16
    lines = _expected_lines(data)
    if any(len(line) > most for line in lines):
        with pytest.raises(InvalidMetadata, match="at most 16"):
            list(split_lines(chunks, most))
    else:
        assert list(split_lines(chunks, most)) == lines


def test_split_lines_refuses_a_stream_that_never_ends_its_line_once_past_the_bound():
    from datamover.agents.etcd import split_lines
    from datamover.errors import InvalidMetadata

    read = []

    def endless():
        while True:
            read.append(4096)
            yield b"x" * 4096

    with pytest.raises(InvalidMetadata, match="at most 65536"):
        list(split_lines(endless(), 1 << 16))
    assert sum(read) <= (1 << 16) + 4096  # the old reader buffered for as long as the gateway sent


def test_a_watch_refuses_a_line_over_its_bound_re_watches_and_delivers_on(etcd, ns):
    from datamover.agents.etcd import EtcdWatch, agent_key, connect

    client = connect(etcd)
    key = agent_key(ns, "peer")
    client.put(key, b"v0")
    changes, plain = [], []
    watch = EtcdWatch(client, ns, "peer", on_change=changes.append, on_delete=lambda: None, max_line=4096)
    default = EtcdWatch(client, ns, "peer", on_change=plain.append, on_delete=lambda: None)
    try:
        # the first reads are done: what follows comes through the streams
        assert _until(lambda: changes == [b"v0"] and plain == [b"v0"], 10), (changes, plain)
        big = b"b" * 8192  # its event's line is over 4096 bytes
        client.put(key, big)
        assert _until(lambda: changes[-1:] == [big], 10), "the refused line's value was not read again"
        assert watch.reconnects >= 1
        mib = bytes(range(256)) * 4096  # 1 MiB, under the default bound: taken from the stream as it is
        client.put(key, mib)
        assert _until(lambda: plain == [b"v0", big, mib], 10)
        assert default.reconnects == 0
    finally:
        watch.close()
        default.close()


def test_a_key_holding_another_agents_metadata_replaces_nobody(etcd, ns):
    """alice's key rewritten with a blob naming bob: the watch refuses it (bob stays the one this agent loaded), and
    a fetch of a key naming bob refuses it without touching bob (it used to load the forgery, then forget bob)."""
    import numpy as np

    from datamover.agents.etcd import agent_key, connect
    from datamover.agents.metadata import encode_metadata
    from datamover.descriptors import MemType
    from datamover.errors import InvalidMetadata

    memcpy = {"backends": {"memcpy": {}}}
    forged_bob = encode_metadata("bob", {}, [(MemType.DRAM, 0, 1 << 30, 1 << 20, 9)])
    with Agent("me", memcpy) as me, Agent("alice", memcpy) as alice, Agent("bob", memcpy) as bob:
        bob.register_memory(np.zeros(4096, np.uint8))
        me.add_remote(bob.metadata())
        real_bob = me.remote_metadata("bob")
        alice.publish(etcd, ns, ttl=5)
        assert me.fetch_remote("alice", etcd=etcd, namespace=ns, timeout=5) == "alice"
        connect(etcd).put(agent_key(ns, "alice"), forged_bob)
        alice.register_memory(np.zeros(4096, np.uint8))  # republished after the forgery: seen once it was handled
        assert _until(lambda: len(me.remote_metadata("alice").regions) == 1, 10)
        assert me.remote_metadata("bob") is real_bob
        connect(etcd).put(agent_key(ns, "carol"), forged_bob)
        with pytest.raises(InvalidMetadata, match="etcd key of 'carol' holds the metadata of 'bob'"):
            me.fetch_remote("carol", etcd=etcd, namespace=ns, timeout=5)
        assert me.remote_metadata("bob") is real_bob
        alice.unpublish()


def test_a_watch_reads_the_key_within_a_bound_too(etcd, ns, monkeypatch, caplog):
    """The watch's first read of the key (and each re-read after a dropped stream) is bounded like its lines: a
    value past the bound is refused, not read whole into memory."""
    import datamover.agents.etcd as etcd_mod
    import datamover.agents.etcd.gateway as gateway_mod

    client = etcd_mod.connect(etcd)
    key = etcd_mod.agent_key(ns, "peer")
    client.put(key, b"r" * 8192)
    monkeypatch.setattr(gateway_mod, "MAX_WATCH_LINE", 4096)
    caplog.set_level(logging.INFO, logger="datamover.etcd")
    changes = []
    watch = etcd_mod.EtcdWatch(client, ns, "peer", on_change=changes.append, on_delete=lambda: None)
    try:
        assert _until(lambda: "etcd range of" in caplog.text, 10), caplog.text
        assert changes == []
    finally:
        watch.close()


def test_fetch_reads_a_present_key_and_waits_on_its_watch_for_an_absent_one(etcd, ns, monkeypatch):
    """The normal path of fetch against a real etcd, through its own bounded reads: a present value as it was put
    (every byte value, 1 MiB), and one put while the fetch waits on its watch (opened from the revision after its
    read found nothing)."""
    import json

    import datamover.agents.etcd as etcd_mod
    import datamover.agents.etcd.watch as watch_mod

    client = etcd_mod.connect(etcd)
    value = bytes(range(256)) * 4096
    client.put(etcd_mod.agent_key(ns, "here"), value)
    assert etcd_mod.fetch(client, ns, "here", timeout=5) == value

    opened, real_events = threading.Event(), watch_mod.watch_events

    def watch_events(line, key):
        if line.strip() and json.loads(line)["result"].get("created"):
            opened.set()
        return real_events(line, key)

    monkeypatch.setattr(watch_mod, "watch_events", watch_events)
    got = {}
    t = threading.Thread(target=lambda: got.update(value=etcd_mod.fetch(client, ns, "later", timeout=30)))
    t.start()
    assert opened.wait(30), "the fetch never opened its watch"
    client.put(etcd_mod.agent_key(ns, "later"), b"later-blob")
    t.join(30)
    assert got == {"value": b"later-blob"}


def test_remove_remote_of_a_watched_peer_stops_its_watch(etcd, ns):
    """remove_remote of a peer fetched from etcd left its watch running: the peer's next publish (memory it
    registered) loaded it again, as if never removed. Now the watch stops with it, and fetch_remote watches anew;
    an expired lease (the peer may come back) still keeps the watch."""
    import numpy as np

    from datamover.agents.etcd import read_key
    from datamover.agents.metadata import decode_metadata

    memcpy = {"backends": {"memcpy": {}}}
    with Agent("me", memcpy) as me, Agent("pub", memcpy) as pub:
        pub.publish(etcd, ns, ttl=5)
        me.fetch_remote("pub", etcd=etcd, namespace=ns, timeout=5)
        watching = [t for t in threading.enumerate() if t.name == "dm-etcd-watch-pub"]
        assert len(watching) == 1
        me.remove_remote("pub")
        assert not watching[0].is_alive()  # stopped by remove_remote, before it returned
        pub.register_memory(np.zeros(4096, np.uint8))  # republished: in etcd, with nobody here to load it
        assert pub.metadata_published(10)
        published, _ = read_key(pub._peers.publisher.client, pub._peers.publisher.key)
        assert published is not None and len(decode_metadata(published).regions) == 1
        assert "pub" not in me.remotes
        with pytest.raises(KeyError):
            me.remove_remote("pub")
        me.fetch_remote("pub", etcd=etcd, namespace=ns, timeout=5)  # watched again
        pub.register_memory(np.zeros(4096, np.uint8))
        assert _until(lambda: len(me.remote_metadata("pub").regions) == 2, 10)
        pub.unpublish()  # the key goes: the peer is dropped, and its watch waits for it to come back
        assert _until(lambda: "pub" not in me.remotes, 10)
        pub.publish(etcd, ns, ttl=5)
        assert _until(lambda: "pub" in me.remotes, 10)
        pub.unpublish()


def test_registrations_while_etcd_holds_a_put_return_and_the_latest_blob_lands(etcd, ns, monkeypatch):
    """Before, each registration put the blob to etcd itself, under the agent's lock: a slow etcd stalled every one
    (and every agent call taking the lock). Now ten registrations made while the first one's put is held return at
    once; once it is let go, one more put carries all ten regions, ``metadata_published`` says it is in etcd, and a
    peer watching the key sees every region."""
    import numpy as np

    from datamover.agents.etcd import read_key
    from datamover.agents.metadata import decode_metadata
    from datamover.testing.waiting import HeldOnce

    memcpy = {"backends": {"memcpy": {}}}
    bufs = [np.zeros(4096 * (i + 1), np.uint8) for i in range(10)]
    with Agent("me", memcpy) as me, Agent("pub", memcpy) as pub:
        pub.publish(etcd, ns, ttl=5)
        me.fetch_remote("pub", etcd=etcd, namespace=ns, timeout=5)
        publisher = pub._peers.publisher
        blobs: list[bytes] = []
        hold = HeldOnce("the first republish")
        real_put = hold.wrap(publisher._put)

        def put(lease, blob):
            blobs.append(blob)
            return real_put(lease, blob)

        monkeypatch.setattr(publisher, "_put", put)
        done = threading.Event()
        first = threading.Thread(target=lambda: (pub.register_memory(bufs[0]), done.set()), daemon=True)
        first.start()
        try:
            assert hold.reached.wait(30)  # known point: the republish waits, and will until the test lets it go
            assert done.wait(5), "register_memory waited for etcd"
            rest = threading.Event()
            t = threading.Thread(target=lambda: ([pub.register_memory(b) for b in bufs[1:]], rest.set()), daemon=True)
            t.start()
            assert rest.wait(10), "registrations waited for etcd"
            assert not pub.metadata_published(0)
        finally:
            hold.go.set()
        assert pub.metadata_published(10)
        assert [len(decode_metadata(b).regions) for b in blobs] == [1, 10]
        published, _ = read_key(publisher.client, publisher.key)
        assert published is not None and len(decode_metadata(published).regions) == 10
        assert _until(lambda: len(me.remote_metadata("pub").regions) == 10, 10)
        pub.unpublish()
        assert not pub.metadata_published(0)


def test_publishing_again_keeps_the_key_and_its_lease(etcd, ns):
    """NIXL's sendLocalMD to etcd may be called again (the facade publishes each time): the blob is put again under
    the same lease, the key never deleted meanwhile (before: the old lease was revoked and a new one granted, so
    every peer watching the key saw the agent go and dropped it)."""
    from datamover.agents.etcd import connect

    with Agent("again", UCX) as agent:
        key = agent.publish(etcd, ns, 3.0)
        client = connect(etcd)
        first = client.get(key, metadata=True)[0][1]
        HostBuffer(agent, 4096)
        assert agent.publish(etcd, ns, 3.0) == key
        assert agent.metadata_published(10)
        now = client.get(key, metadata=True)[0][1]
        assert now["create_revision"] == first["create_revision"] and now["lease"] == first["lease"]
        assert int(now["mod_revision"]) > int(first["mod_revision"])  # the new region went in


def test_a_region_registered_while_publish_runs_reaches_etcd(etcd, ns, monkeypatch):
    """A registration made while publish() made and put its first blob (before the publisher was in place) found
    no publisher to hand its blob to: the region stayed out of etcd until some later change."""
    from datamover.agents import decode_metadata
    from datamover.agents import etcd as etcd_mod
    from datamover.agents.etcd import connect

    real = etcd_mod.EtcdPublisher.__init__
    late: list = []

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)  # the first blob is in etcd: now a registration on another thread
        t = threading.Thread(target=lambda: late.append(HostBuffer(agent, 4096)))
        t.start()
        t.join(10)

    monkeypatch.setattr(etcd_mod.EtcdPublisher, "__init__", init)
    with Agent("racer", UCX) as agent:
        key = agent.publish(etcd, ns, 3.0)
        assert late and agent.metadata_published(10)
        blob = connect(etcd).get(key)[0]
        addrs = {r[2] for r in decode_metadata(blob).regions}
        assert late[0].array.ctypes.data in addrs, "the region registered during publish() is not in etcd"


def test_close_while_a_put_is_held_returns_at_once_and_the_put_never_lands(etcd, ns, monkeypatch):
    """Agent.close waited for a put etcd held, up to the lease's TTL (600 s here), under the agent's lock (every
    other agent call waited with it). Now close revokes the lease and returns; the held put, sent once the test lets
    it go (after close returned), is refused by etcd: its lease is gone, and the key with it."""
    import numpy as np

    from datamover.agents.etcd import connect, read_key
    from datamover.testing.waiting import HeldOnce

    memcpy = {"backends": {"memcpy": {}}}
    agent = Agent("pub", memcpy)
    hold = HeldOnce("the republish")
    try:
        key = agent.publish(etcd, ns, ttl=600)
        publisher = agent._peers.publisher
        monkeypatch.setattr(publisher, "_put", hold.wrap(publisher._put))
        agent.register_memory(np.zeros(4096, np.uint8))
        assert hold.reached.wait(30)  # known point: the republish waits, before it is sent, until the test lets it go
        closing = threading.Thread(target=agent.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "close waited for the held put"
        assert read_key(connect(etcd), key)[0] is None  # revoked: the key went with the lease
        hold.go.set()
        assert hold.returned.wait(30)  # the put was sent, after close returned
        assert read_key(connect(etcd), key)[0] is None, "a put landed after close returned"
    finally:
        hold.go.set()
        agent.close()


def test_a_put_held_past_the_ttl_does_not_let_the_key_vanish(etcd, ns, monkeypatch):
    """The publisher's one thread kept the lease alive and put the blobs: a put held past about 2/3 of the TTL let
    the lease lapse, the key vanished and the watching peer dropped an agent alive and well. Now keepalives go on
    while the put is held: the key stays (watched for twice the TTL), and the blob lands once the put is let go."""
    import numpy as np

    from datamover.agents.etcd import connect, read_key
    from datamover.testing.waiting import HeldOnce

    memcpy = {"backends": {"memcpy": {}}}
    ttl = 3
    hold = HeldOnce("the republish")
    with Agent("me", memcpy) as me, Agent("pub", memcpy) as pub:
        try:
            key = pub.publish(etcd, ns, ttl=ttl)
            me.fetch_remote("pub", etcd=etcd, namespace=ns, timeout=5)
            publisher = pub._peers.publisher
            monkeypatch.setattr(publisher, "_put", hold.wrap(publisher._put))
            pub.register_memory(np.zeros(4096, np.uint8))
            assert hold.reached.wait(30)  # known point: the republish waits until the test lets it go
            client, held_at = connect(etcd), time.monotonic()
            while time.monotonic() - held_at < 2 * ttl:  # the lease's whole life twice over
                assert read_key(client, key)[0] is not None, "the key vanished while a put was held"
                assert "pub" in me.remotes, "the watching peer dropped a live agent"
                time.sleep(0.1)
            hold.go.set()
            assert pub.metadata_published(10)
            assert _until(lambda: len(me.remote_metadata("pub").regions) == 1, 10)
        finally:
            hold.go.set()


def test_a_fetch_that_ends_after_close_starts_no_watch(etcd, ns, monkeypatch):
    """fetch_remote reads etcd without the agent's lock; one that returns after close() started a watch nobody
    would stop (a thread and an etcd stream for as long as the process lived). Now it starts none."""
    from datamover.agents import etcd as etcd_mod

    memcpy = {"backends": {"memcpy": {}}}
    real_fetch = etcd_mod.fetch
    reached, go = threading.Event(), threading.Event()

    def held_fetch(*args, **kwargs):
        blob = real_fetch(*args, **kwargs)
        reached.set()
        assert go.wait(30)
        return blob

    with Agent("pub2", memcpy) as pub:
        pub.publish(etcd, ns, ttl=5)
        me = Agent("me2", memcpy)
        monkeypatch.setattr(etcd_mod, "fetch", held_fetch)
        result: list = []

        def fetch() -> None:
            try:
                result.append(me.fetch_remote("pub2", etcd=etcd, namespace=ns, timeout=5))
            except Exception as exc:  # what it says once closed is not the point; the watch is
                result.append(exc)

        t = threading.Thread(target=fetch)
        t.start()
        try:
            assert reached.wait(30)
            me.close()
        finally:
            go.set()
            t.join(30)
        assert result and not t.is_alive()
        watching = [t for t in threading.enumerate() if t.name == "dm-etcd-watch-pub2"]
        assert not watching, "a watch started after close()"
        pub.unpublish()


def test_a_publish_that_ends_after_close_leaves_no_publisher(etcd, ns, monkeypatch):
    """publish() makes its publisher (lease, first put) without the agent's lock; one that finished after close()
    had unpublished was installed anyway: its threads kept the key alive, so peers never saw the agent go. Now
    close waits for it and revokes its lease."""
    from datamover.agents.etcd import gateway
    from datamover.agents.etcd import publisher as publisher_mod
    from datamover.agents.peers import Peers

    memcpy = {"backends": {"memcpy": {}}}
    real_put, real_unpublish = publisher_mod.EtcdPublisher._put, Peers.unpublish
    reached, go, unpublishing = threading.Event(), threading.Event(), threading.Event()

    def unpublish(self, *args, **kwargs):
        unpublishing.set()
        return real_unpublish(self, *args, **kwargs)

    def held_put(self, lease, blob):
        real_put(self, lease, blob)
        if not reached.is_set():  # the constructor's first put: held once it landed
            reached.set()
            assert go.wait(30)

    monkeypatch.setattr(publisher_mod.EtcdPublisher, "_put", held_put)
    monkeypatch.setattr(Peers, "unpublish", unpublish)
    me = Agent("late-pub", memcpy)
    result: list = []

    def publish() -> None:
        try:
            result.append(me.publish(etcd, ns, ttl=60))
        except Exception as exc:
            result.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    closing = threading.Thread(target=me.close)
    try:
        assert reached.wait(30)
        closing.start()
        assert unpublishing.wait(30)  # close has come to unpublishing (before, it found nothing to unpublish)
    finally:
        go.set()
        t.join(30)
        closing.join(30)
    assert result and not t.is_alive() and not closing.is_alive()
    assert not [x for x in threading.enumerate() if x.name.startswith("dm-etcd-") and x.name.endswith("late-pub")]
    client = gateway.connect(etcd)
    blob, _ = gateway.read_key(client, gateway.agent_key(ns, "late-pub"))
    assert blob is None, "the key of a closed agent stayed in etcd"
