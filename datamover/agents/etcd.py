"""Metadata exchange through etcd: publish under a kept-alive lease, fetch with a watch.

An agent's blob lives at ``/<namespace>/agents/<name>``, attached to a lease
with a short TTL that a thread refreshes. When the agent dies the refreshes
stop, the lease expires, etcd deletes the key, and peers watching it drop
the agent. Uses etcd3gw (etcd's v3 JSON gateway), imported lazily; reads of
keys and watches speak the gateway directly. Every answer is read within a
bound (``MAX_WATCH_LINE``) and parsed before use: a gateway answering too
much or garbage is InvalidMetadata naming the key, never an allocation of
whatever size it sends.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

from ..errors import BackendUnavailable, InvalidMetadata, RemoteDisconnected, RemoteRefused
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.etcd")

#: the longest watch-stream line taken: one event carrying the largest blob, base64 (4 bytes per 3), with room for
#: the JSON around it (key, revisions, header)
MAX_WATCH_LINE = 4 * -(-MAX_BLOB_BYTES // 3) + (64 << 10)
#: how long ``EtcdPublisher.close`` (and so unpublish, and closing the agent) waits for etcd to confirm the revoke
CLOSE_TIMEOUT_S = 5.0


def agent_key(namespace: str, name: str) -> str:
    if not namespace or "/" in name:
        raise ValueError(f"bad etcd namespace {namespace!r} or agent name {name!r}")
    return f"/{namespace.strip('/')}/agents/{name}"


def connect(endpoints: str | Sequence[str], timeout: float = 5.0) -> Any:
    """An etcd3gw client for the first endpoint that answers ('http://host:port' or 'host:port')."""
    try:
        import etcd3gw
    except ImportError as exc:
        raise BackendUnavailable(f"etcd exchange needs etcd3gw ({exc}); pip install etcd3gw") from None
    eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    errors = []
    for ep in eps:
        url = urlparse(ep if "://" in ep else f"http://{ep}")
        client = etcd3gw.Etcd3Client(host=url.hostname or "127.0.0.1", port=url.port or 2379, timeout=timeout)
        client.session.hooks["response"].append(_read_within_bound)
        try:
            client.status()
            return client
        except Exception as exc:
            errors.append(f"{ep}: {type(exc).__name__}: {exc}")
    raise RemoteDisconnected("no etcd endpoint answers: " + "; ".join(errors))


class EtcdPublisher:
    """Keeps ``provider()`` at the agent's key under a lease of ``ttl`` seconds, refreshed every ttl/3.

    The constructor grants the lease and puts the first blob itself (its
    errors are the caller's). After that two threads of its own do every
    etcd call: one keeps the lease alive, the other puts the latest blob that
    ``update`` handed it, so a put etcd holds never delays a keepalive (the
    key does not lapse while etcd answers keepalives). ``update`` (after memory was registered, say) only
    makes the new blob and returns: it never waits for etcd, so a slow or
    unreachable etcd never stalls a registration, nor the agent's lock it is
    made under. Blobs handed over while a put is on its way are coalesced:
    the next put carries the latest, whatever came between (latest wins).

    It survives etcd going away and coming back: a put that failed is logged
    and tried again at the lease's rhythm (every ttl/3) until it lands, and a
    lease etcd no longer knows is replaced, the blob put again under the new
    one. ``generation`` counts the blobs made, ``published_generation`` is the
    one in etcd under the current lease (-1: none known to be), ``pending``
    says the latest is not in etcd yet, ``last_error`` is why the last put
    failed (None once one landed), and ``wait_published`` waits for the blob
    current at its call. Every answer of the gateway (grant, put, keepalive,
    revoke) is read within a bound and checked: one not understood is
    InvalidMetadata naming the key, an HTTP error RemoteRefused, etcd out of
    reach RemoteDisconnected.
    """

    def __init__(
        self, endpoints: str | Sequence[str], namespace: str, name: str, provider: Callable[[], bytes], ttl: float = 5.0
    ) -> None:
        self.client = connect(endpoints)
        self.key = agent_key(namespace, name)
        self.ttl = max(2, round(ttl))
        self._name = name
        self._provider = provider
        # guards what follows; never held across an etcd call (update() takes it under the agent's lock)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False  # once set, nothing is put or granted again (see close)
        self._blob = b""  # the latest blob made by update(): what the put thread puts
        self._generation = 0  # blobs made so far; the latest is this one
        self._put_generation = -1  # the generation of the blob in etcd under the current lease; -1: none known
        self._retry_at = 0.0  # no put before this (monotonic): a failed one waits for the lease's rhythm
        self.last_error: BaseException | None = None  # why the last put failed; None once one landed
        self.lease, granted = self._grant()
        self._interval = min(self.ttl, granted) / 3
        try:
            self._blob, self._generation = provider(), 1
            self._put(self.lease, self._blob)
        except BaseException:
            self._revoke(self.lease)  # nothing was published under it
            raise
        self._put_generation = 1
        self._threads = (
            threading.Thread(target=self._keep_alive, name=f"dm-etcd-lease-{name}", daemon=True),
            threading.Thread(target=self._put_pending, name=f"dm-etcd-put-{name}", daemon=True),
        )
        for t in self._threads:
            t.start()

    # -- what the agent sees -----------------------------------------------------------
    def update(self) -> None:
        """Hand the put thread the current blob (after registering memory, say) and return at once.

        Never waits for etcd: the put thread puts it (or a later one) when etcd answers. The blob is made here
        (``provider()``, which takes the agent's lock: the agent calls this under it, which also keeps the blobs
        in the order of their generations); the threads never call ``provider``, so they never wait for the
        agent's lock. Nothing once closed.
        """
        with self._cond:
            if self._closed:
                return
        blob = self._provider()
        with self._cond:
            if self._closed or blob == self._blob:  # the latest blob already: nothing new to put
                return
            self._blob = blob
            self._generation += 1
            self._cond.notify_all()

    @property
    def generation(self) -> int:
        """How many blobs were made (the first by the constructor): the latest is of this generation."""
        return self._generation

    @property
    def published_generation(self) -> int:
        """The generation of the blob in etcd under the current lease; -1 when none is known to be there (a put
        failed since etcd went away, or the lease was replaced and the blob not put again yet)."""
        return self._put_generation

    @property
    def pending(self) -> bool:
        """Whether the latest blob is not (yet) known to be in etcd."""
        with self._cond:
            return self._put_generation < self._generation

    def wait_published(self, timeout: float | None) -> bool:
        """Wait (up to ``timeout`` s; None: no bound) until the blob current at this call, or a later one, is in
        etcd; True if it is, False if not within the timeout or once closed. ``timeout=0`` only looks."""
        with self._cond:
            target = self._generation
            self._cond.wait_for(lambda: self._closed or self._put_generation >= target, timeout)
            return not self._closed and self._put_generation >= target

    # -- the publisher's threads ---------------------------------------------------------
    def _keep_alive(self) -> None:
        """The lease thread: refresh the lease every interval, whatever the put thread waits on."""
        while True:
            with self._cond:
                next_refresh = time.monotonic() + self._interval
                while not self._closed and (left := next_refresh - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    return
            try:
                self._refresh()
            except Exception as exc:  # etcd briefly away: keep trying; what did not land is put again later
                log.warning("etcd lease refresh for %s failed: %s", self.key, exc)

    def _put_pending(self) -> None:
        """The put thread: put the latest blob whenever one is not in etcd (after a failed put, not before the
        lease's rhythm says)."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._put_generation < self._generation:
                        left = self._retry_at - time.monotonic()
                        if left <= 0:
                            put = self.lease, self._blob, self._generation
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
            self._put_latest(*put)

    def _put_latest(self, lease: Any, blob: bytes, generation: int) -> None:
        """Put ``blob`` (of ``generation``) under ``lease``; a failure is logged and tried again at the lease's
        rhythm, with the latest blob by then."""
        try:
            self._put(lease, blob)
        except Exception as exc:
            with self._cond:
                self.last_error = exc
                if lease is self.lease:  # else replaced since: put again at once, under the new one
                    self._retry_at = time.monotonic() + self._interval
                closed = self._closed
            if closed:  # refused under the revoked lease, as it should be
                log.debug("etcd put of %s after close failed: %s", self.key, exc)
                return
            log.warning("etcd put of %s failed (%s); putting the latest blob again in %.1f s", self.key, exc,
                        self._interval)  # fmt: skip
            return
        with self._cond:
            again = self.last_error is not None
            if lease is self.lease:
                self._put_generation = max(self._put_generation, generation)
            self.last_error = None
            self._cond.notify_all()
        if again:
            log.info("republished %s to etcd", self.key)

    def _refresh(self) -> None:
        """Keep the lease alive; one etcd no longer knows is replaced (the blob put again under the new one)."""
        with self._cond:
            lease = self.lease
        try:
            alive = self._keepalive_once(lease) > 0
        except InvalidMetadata:
            raise  # an answer not understood says nothing of the lease: keep it, try again at the next refresh
        except Exception:
            with self._cond:  # put again once etcd answers (at the next refresh's rhythm, not at once)
                self._put_generation = -1
                self._retry_at = time.monotonic() + self._interval
                self._cond.notify_all()
            self._call("/maintenance/status", {}, "etcd status")  # raises while etcd is away; answers when only
            alive = False  # the lease is gone
        if alive:
            return
        with self._cond:
            if self._closed:
                return
        log.info("etcd lost the lease of %s; publishing under a new one", self.key)
        new, granted = self._grant()
        with self._cond:
            closed = self._closed
            if not closed:
                self.lease, self._interval = new, min(self.ttl, granted) / 3
                self._put_generation, self._retry_at = -1, 0.0  # the blob is put again under it, now
                self._cond.notify_all()
        if closed:  # closed while the grant was on its way: close revoked the lease it saw, not this one
            self._revoke(new)

    def _call(self, path: str, body: dict, what: str) -> dict:
        return gateway_call(self.client, path, body, what)

    def _grant(self) -> tuple[Any, int]:
        """A new lease of ``ttl`` s and the TTL etcd granted; InvalidMetadata for an answer that is not a lease."""
        from etcd3gw.lease import Lease

        what = f"etcd lease grant for {self.key}"
        doc = self._call("/lease/grant", {"TTL": self.ttl, "ID": 0}, what)
        lease_id = _revision(doc.get("ID"), f"{what}: ID")
        granted = _revision(doc.get("TTL"), f"{what}: TTL")
        if lease_id == 0 or granted == 0:  # lease 0 is no lease: a key put under it would never expire
            raise InvalidMetadata(f"{what}: lease {lease_id} of {granted} s is not a lease")
        return Lease(lease_id, client=self.client), granted

    def _put(self, lease: Any, blob: bytes) -> None:
        body = {"key": _b64(self.key), "value": base64.b64encode(blob).decode(), "lease": lease.id}
        self._call("/kv/put", body, f"etcd put of {self.key}")

    def _keepalive_once(self, lease: Any) -> int:
        """The TTL etcd gives ``lease`` now that it was kept alive; 0 when etcd no longer knows it."""
        what = f"etcd lease keepalive for {self.key}"
        result = _field(self._call("/lease/keepalive", {"ID": lease.id}, what), "result", dict, what, None)
        return _revision(result.get("TTL", 0), f"{what}: TTL")

    def _revoke(self, lease: Any) -> None:
        try:
            self._call("/kv/lease/revoke", {"ID": lease.id}, f"etcd lease revoke for {self.key}")
        except Exception as exc:
            log.debug("revoking lease: %s", exc)

    def close(self, revoke: bool = True, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the threads and revoke the lease, so the key disappears now rather than after the TTL.

        Never waits for a put or refresh in flight: once the lease is revoked, etcd refuses a put still on its way
        (or deletes the key with the lease, had it landed), and the threads put or grant nothing once closed. The
        revoke is waited for at most ``timeout`` s: unconfirmed by then, the key goes when the lease expires (a TTL
        after the last keepalive etcd took). ``revoke=False`` leaves the key to expire with its lease, as when the
        agent dies. Once called, ``wait_published`` says False.
        """
        with self._cond:
            self._closed = True  # before reading the lease to revoke: a refresh granting one now sees it, revokes it
            self._cond.notify_all()
            lease = self.lease
        if not revoke:
            return
        revoking = threading.Thread(
            target=self._revoke, args=(lease,), name=f"dm-etcd-revoke-{self._name}", daemon=True
        )
        revoking.start()
        revoking.join(timeout)
        if revoking.is_alive():
            log.warning("etcd did not confirm the revoke of %s's lease within %g s; the key goes when it expires",
                        self.key, timeout)  # fmt: skip

    def wait_stopped(self, timeout: float | None) -> bool:
        """After ``close``: wait up to ``timeout`` s for the threads to end the etcd calls they were in; True once
        they have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def gateway_call(client: Any, path: str, body: dict, what: str) -> dict:
    """POST ``body`` to the gateway's ``path`` and return its answer, read within MAX_WATCH_LINE bytes: a JSON object
    (InvalidMetadata otherwise); RemoteDisconnected when etcd is out of reach or answers 5xx, RemoteRefused for
    another HTTP error (a lease etcd does not know, say)."""
    import requests  # etcd3gw's, as is the client

    try:
        resp = client.session.post(client.get_url(path), json=body, stream=True, timeout=client.timeout)
    except requests.RequestException as exc:
        raise RemoteDisconnected(f"{what}: {type(exc).__name__}: {exc}") from exc
    try:
        if resp.status_code != 200:
            why = next(resp.iter_content(chunk_size=512), b"").decode(errors="replace")
            error = RemoteDisconnected if resp.status_code >= 500 else RemoteRefused
            raise error(f"{what}: the gateway answered HTTP {resp.status_code} {resp.reason}: {why}")
        data = _read_body(resp, MAX_WATCH_LINE, what)
    except requests.RequestException as exc:
        raise RemoteDisconnected(f"{what}: {type(exc).__name__}: {exc}") from exc
    finally:
        resp.close()
    return _json_object(data, what)


def fetch(client: Any, namespace: str, name: str, timeout: float = 10.0) -> bytes:
    """The blob at the agent's key, waiting up to ``timeout`` s (with a watch) for it to appear.

    Reads the key, then watches it from the revision after that read (a put in between is in the watch). A watch
    stream that ends early (etcd restarting) is opened again the same way. InvalidMetadata for an answer over its
    bound, one that is not what the gateway sends, or a value over MAX_BLOB_BYTES; RemoteDisconnected when the key
    did not appear in time.
    """
    key = agent_key(namespace, name)
    deadline = time.monotonic() + timeout
    value, revision = read_key(client, key)
    if value is not None:
        return value
    waiter = _PutWaiter(client, key, revision + 1, deadline)
    t = threading.Thread(target=waiter.run, name=f"dm-etcd-fetch-{name}", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    waiter.stop()
    if waiter.value is not None:
        return waiter.value
    if isinstance(waiter.error, InvalidMetadata):
        raise waiter.error
    why = f" (last: {type(waiter.error).__name__}: {waiter.error})" if waiter.error is not None else ""
    raise RemoteDisconnected(f"agent {name!r} did not appear in etcd at {key} within {timeout:g} s{why}")


class _PutWaiter:
    """Watches ``key`` from ``start`` until a PUT brings its value, the deadline, or ``stop()``; a stream that ends
    is opened again from a fresh read of the key."""

    def __init__(self, client: Any, key: str, start: int, deadline: float) -> None:
        self.client, self.key, self.start, self.deadline = client, key, start, deadline
        self.value: bytes | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._resp: Any = None

    def run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                self._watch()
                return
            except InvalidMetadata as exc:
                self.error = exc
                return
            except Exception as exc:  # the stream ended or failed (etcd restarting): read again, watch again
                if self._stopped.is_set():  # stop() shut the stream down
                    return
                self.error = exc
                if self._stopped.wait(backoff):
                    return
                backoff = min(backoff * 2, 1.0)
                try:
                    value, revision = read_key(self.client, self.key)
                except InvalidMetadata as exc2:
                    self.error = exc2
                    return
                except Exception as exc2:
                    self.error = exc2
                    continue
                if value is not None:
                    self.value = value
                    return
                self.start = revision + 1

    def _watch(self) -> None:
        body = {"create_request": {"key": _b64(self.key), "start_revision": self.start}}
        left = max(0.1, self.deadline - time.monotonic())
        resp = self.client.session.post(
            self.client.get_url("/watch"), json=body, stream=True, timeout=(self.client.timeout, left)
        )
        with self._lock:
            if self._stopped.is_set():
                resp.close()
                return
            self._resp = resp
        try:
            resp.raise_for_status()
            what = f"etcd watch of {self.key}"
            for line in split_lines(resp.iter_content(chunk_size=1 << 20), MAX_WATCH_LINE, what):
                for kind, kv in watch_events(line, self.key):
                    if kind == "PUT" and "value" in kv:  # an empty value is no blob: wait for the next
                        self.value = kv_value(kv, self.key)
                        return
            raise ConnectionError("the watch stream ended")
        finally:
            with self._lock:
                self._resp = None
            resp.close()

    def stop(self) -> None:
        """End the wait: a read blocked on the watch stream is woken (its socket shut down under it)."""
        with self._lock:
            self._stopped.set()
            resp = self._resp
        if resp is not None:
            _shutdown(resp)


def read_key(client: Any, key: str) -> tuple[bytes | None, int]:
    """The value at ``key`` (None: absent) and the store's revision when it was read; see ``read_range``."""
    kv, revision = read_range(client, key)
    return (None if kv is None else kv_value(kv, key)), revision


def read_range(client: Any, key: str) -> tuple[dict | None, int]:
    """The key-value of ``key`` as the gateway sent it (None: absent) and the revision of the read: the answer read
    within MAX_WATCH_LINE bytes and checked (InvalidMetadata otherwise)."""
    import requests  # etcd3gw's, as is the client

    what = f"etcd range of {key}"
    try:
        resp = client.session.post(
            client.get_url("/kv/range"), json={"key": _b64(key)}, stream=True, timeout=client.timeout
        )
    except requests.RequestException as exc:
        raise RemoteDisconnected(f"{what}: {type(exc).__name__}: {exc}") from exc
    try:
        if resp.status_code != 200:
            raise RemoteDisconnected(f"{what}: the gateway answered HTTP {resp.status_code} {resp.reason}")
        body = _read_body(resp, MAX_WATCH_LINE, what)
    finally:
        resp.close()
    return parse_range(body, key)


def parse_range(body: bytes, key: str) -> tuple[dict | None, int]:
    """A range answer for ``key``: its key-value (None: absent) and revision; InvalidMetadata if it is not one."""
    what = f"etcd range of {key}"
    doc = _json_object(body, what)
    revision = _revision(_field(doc, "header", dict, what, {}).get("revision"), f"{what}: header.revision")
    kvs = _field(doc, "kvs", list, what, [])
    if len(kvs) > 1:
        raise InvalidMetadata(f"{what}: {len(kvs)} key-values for one key")
    if not kvs:
        return None, revision
    return _kv(kvs[0], key, what), revision


def watch_events(line: bytes, key: str) -> list[tuple[str, dict]]:
    """The (PUT or DELETE, key-value) events of one watch-stream line for ``key``; ConnectionError when etcd
    cancelled the watch, InvalidMetadata for a line that is not what the gateway sends."""
    if not line.strip():  # the gateway may send an empty line
        return []
    what = f"etcd watch of {key}"
    result = _field(_json_object(line, what), "result", dict, what, {})
    if result.get("canceled"):
        raise ConnectionError(f"etcd cancelled the watch: {result.get('cancel_reason') or 'compacted'}")
    out = []
    for ev in _field(result, "events", list, what, []):
        if not isinstance(ev, dict):
            raise InvalidMetadata(f"{what}: an event that is not a JSON object")
        kind = ev.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise InvalidMetadata(f"{what}: an event of type {str(kind)[:32]!r}")
        kv = _kv(_field(ev, "kv", dict, what, {}), key, what, with_key=kind == "PUT")
        out.append((kind, kv))
    return out


def kv_value(kv: dict, key: str) -> bytes:
    """The value of a checked key-value (see ``parse_range``), decoded: base64 within the bound of a blob."""
    encoded = kv.get("value", "")
    if len(encoded) > 4 * -(-MAX_BLOB_BYTES // 3):
        raise InvalidMetadata(f"etcd value at {key}: over {MAX_BLOB_BYTES} bytes; not a metadata blob")
    try:
        value = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidMetadata(f"etcd value at {key}: not base64") from None
    return _check(value, key)


def _kv(kv: Any, key: str, what: str, with_key: bool = True) -> dict:
    """``kv`` checked: a JSON object for ``key`` whose value (if any) is a string and revisions are revisions."""
    if not isinstance(kv, dict):
        raise InvalidMetadata(f"{what}: a key-value that is not a JSON object")
    if (with_key or "key" in kv) and kv.get("key") != _b64(key):
        raise InvalidMetadata(f"{what}: a key-value of another key")
    _field(kv, "value", str, what, "")
    for name in ("mod_revision", "create_revision", "version"):
        if name in kv:
            _revision(kv[name], f"{what}: {name}")
    return kv


def _json_object(data: bytes, what: str) -> dict:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nested too deep
        raise InvalidMetadata(f"{what}: not JSON ({type(exc).__name__}: {str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise InvalidMetadata(f"{what}: {type(doc).__name__}, not a JSON object")
    return doc


def _field(doc: dict, name: str, kind: type, what: str, default: Any) -> Any:
    value = doc.get(name, default)
    if not isinstance(value, kind):
        raise InvalidMetadata(f"{what}: {name} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _revision(value: Any, what: str) -> int:
    """An int64 of the gateway (a decimal string, or a number): >= 0."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        return int(value)
    if type(value) is int and 0 <= value < 1 << 63:
        return value
    raise InvalidMetadata(f"{what}: {str(value)[:32]!r} is not a revision")


def _check(value: Any, key: str) -> bytes:
    if isinstance(value, str):
        value = value.encode("latin-1")
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"etcd value at {key} is not a metadata blob")
    return bytes(value)


def _read_within_bound(resp: Any, *, stream: bool = False, **_: Any) -> None:
    """A requests response hook: the body of an answer not streamed is read here, refused past MAX_WATCH_LINE bytes
    (requests would read whatever size the gateway sends, before etcd3gw parses it)."""
    if stream:
        return
    try:
        body = _read_body(resp, MAX_WATCH_LINE, f"etcd answer from {resp.url}")
    except BaseException:
        resp.close()
        raise
    resp._content = body  # what requests' Response.content returns from now on


def _read_body(resp: Any, most: int, what: str) -> bytes:
    """The body of a requests response, refused (InvalidMetadata) once past ``most`` bytes, or at once when its
    Content-Length says it will be."""
    declared = resp.headers.get("Content-Length", "")
    if declared.isdigit():
        _refuse_over(int(declared), most, what, "an answer")
    body = bytearray()
    for chunk in resp.iter_content(chunk_size=1 << 20):
        body += chunk
        _refuse_over(len(body), most, what, "an answer")
    return bytes(body)


class EtcdWatch:
    """Calls ``on_change(blob)`` when the key is rewritten and ``on_delete()`` when it goes (lease expired).

    The watch outlives etcd restarts and dropped streams: each (re)connection
    reads the key first (so a change or a deletion made while no stream was
    open is delivered, even if etcd compacted it away) and watches from the
    revision after that read; a stream idle for ``idle_s`` is reopened the
    same way, which also notices a connection that died silently. Speaks the
    v3 JSON gateway itself (etcd3gw's watch iterator never ends when the
    stream does). A stream line over ``max_line`` bytes is refused and the
    watch reopened.
    """

    def __init__(
        self,
        client: Any,
        namespace: str,
        name: str,
        on_change: Callable[[bytes], None],
        on_delete: Callable[[], None],
        *,
        retry_s: float = 0.2,
        idle_s: float = 30.0,
        max_line: int = MAX_WATCH_LINE,
    ) -> None:
        self.key = agent_key(namespace, name)
        self._max_line = max_line
        self._client = client
        self._on_change, self._on_delete = on_change, on_delete
        self._retry_s, self._idle_s = retry_s, idle_s
        self._present = True  # the caller loaded the key just before watching
        self._mod_revision = -1  # of the value delivered last
        self._resp: Any = None
        self._stop = threading.Event()
        self.reconnects = 0
        self._thread = threading.Thread(target=self._pump, name=f"dm-etcd-watch-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        backoff = self._retry_s
        while not self._stop.is_set():
            try:
                start = self._sync()
                backoff = self._retry_s
                self._stream(start)
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.info("etcd watch of %s interrupted (%s: %s); re-watching", self.key, type(exc).__name__, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            self.reconnects += 1

    def _post(self, path: str, body: dict, **kw: Any) -> Any:
        return self._client.session.post(self._client.get_url(path), json=body, **kw)

    def _sync(self) -> int:
        """Read the key, deliver what changed since the last event; the revision to watch from."""
        kv, revision = read_range(self._client, self.key)
        if kv is not None:
            self._deliver("PUT", kv)
        elif self._present:
            self._deliver("DELETE", {})
        return revision + 1

    def _stream(self, start: int) -> None:
        body = {"create_request": {"key": _b64(self.key), "start_revision": start}}
        self._resp = resp = self._post("/watch", body, stream=True, timeout=(self._client.timeout, self._idle_s))
        try:
            resp.raise_for_status()
            for line in split_lines(resp.iter_content(chunk_size=1 << 20), self._max_line, f"etcd watch of {self.key}"):
                if self._stop.is_set():
                    return
                if not line.strip():
                    continue
                for kind, kv in watch_events(line, self.key):
                    self._deliver(kind, kv)
            raise ConnectionError("the watch stream ended")
        finally:
            self._resp = None
            resp.close()

    def _deliver(self, kind: str, kv: dict) -> None:
        try:
            if kind == "DELETE":
                if self._present:
                    self._present = False
                    self._on_delete()
                return
            rev = int(kv.get("mod_revision", 0))
            if rev <= self._mod_revision and self._present:
                return  # seen already (a re-read after reconnecting)
            self._present, self._mod_revision = True, rev
            if "value" in kv:
                self._on_change(kv_value(kv, self.key))
        except Exception as exc:  # a bad update must not end the watch
            log.warning("etcd watch of %s: %s", self.key, exc)

    def close(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            _shutdown(resp)
        self._thread.join(5)


def split_lines(chunks: Iterable[bytes], most: int, what: str = "the etcd watch") -> Iterator[bytes]:
    """The newline-ended lines of a stream read in chunks, each byte scanned once (requests' iter_lines copied a
    long line's pending part again at every chunk); InvalidMetadata once a line passes ``most`` bytes."""
    buf = bytearray()
    for chunk in chunks:
        scan, begin = len(buf), 0  # the bytes before ``scan`` hold no newline
        buf += chunk
        while (end := buf.find(b"\n", scan)) >= 0:
            _refuse_over(end - begin, most, what)
            yield bytes(buf[begin:end])
            begin = scan = end + 1
        del buf[:begin]
        _refuse_over(len(buf), most, what)
    if buf:
        yield bytes(buf)


def _refuse_over(n: int, most: int, what: str, unit: str = "a watch stream line") -> None:
    if n > most:
        raise InvalidMetadata(f"{what}: {unit} of over {most} bytes; at most {most} accepted")


def _b64(key: str) -> str:
    return base64.b64encode(key.encode()).decode()


def _shutdown(resp: Any) -> None:
    """Wake a thread blocked reading a streamed response: shut its socket down under it."""
    try:
        fd = resp.raw._fp.fileno()
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    except Exception as exc:
        log.debug("shutting the watch stream down: %s", exc)
    try:
        resp.close()
    except Exception as exc:
        log.debug("closing the watch stream: %s", exc)
