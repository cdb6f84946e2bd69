"""Metadata exchange through etcd: publish under a kept-alive lease, fetch with a watch.

An agent's blob lives at ``/<namespace>/agents/<name>``, attached to a lease
with a short TTL that a thread refreshes. When the agent dies the refreshes
stop, the lease expires, etcd deletes the key, and peers watching it drop
the agent. Uses etcd3gw (etcd's v3 JSON gateway), imported lazily.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

from ..errors import BackendUnavailable, InvalidMetadata, RemoteDisconnected
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.etcd")

#: the longest watch-stream line taken: one event carrying the largest blob, base64 (4 bytes per 3), with room for
#: the JSON around it (key, revisions, header)
MAX_WATCH_LINE = 4 * -(-MAX_BLOB_BYTES // 3) + (64 << 10)


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
        try:
            client.status()
            return client
        except Exception as exc:
            errors.append(f"{ep}: {type(exc).__name__}: {exc}")
    raise RemoteDisconnected("no etcd endpoint answers: " + "; ".join(errors))


class EtcdPublisher:
    """Keeps ``provider()`` at the agent's key under a lease of ``ttl`` seconds, refreshed every ttl/3.

    It survives etcd going away and coming back: a publish that failed (etcd
    down while memory was registered, say) is retried at every refresh until
    it lands, and a lease etcd no longer knows is replaced, the blob put
    again under the new one.
    """

    def __init__(
        self, endpoints: str | Sequence[str], namespace: str, name: str, provider: Callable[[], bytes], ttl: float = 5.0
    ) -> None:
        self.client = connect(endpoints)
        self.key = agent_key(namespace, name)
        self.ttl = max(2, round(ttl))
        self._provider = provider
        self._lock = threading.Lock()
        self._dirty = False  # the last put did not land: put again once etcd answers
        self.lease = self.client.lease(self.ttl)
        self.update()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name=f"dm-etcd-{name}", daemon=True)
        self._thread.start()

    def update(self) -> None:
        """Publish the current blob again (after registering memory, say); retried by the keepalive if it fails."""
        with self._lock:
            try:
                self.client.put(self.key, self._provider(), lease=self.lease)
            except Exception:
                self._dirty = True
                raise
            self._dirty = False

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._refresh()
            except Exception as exc:  # etcd briefly away: keep trying; what did not land is put again later
                log.warning("etcd lease refresh for %s failed: %s", self.key, exc)

    def _refresh(self) -> None:
        try:
            alive = self.lease.refresh() > 0
        except Exception:
            with self._lock:
                self._dirty = True
            self.client.status()  # raises while etcd is away; answers when only the lease is gone
            alive = False
        if not alive:
            log.info("etcd lost the lease of %s; publishing under a new one", self.key)
            with self._lock:
                self.lease = self.client.lease(self.ttl)
                self._dirty = True
        if self._dirty:
            self.update()
            log.info("republished %s to etcd", self.key)

    def close(self, revoke: bool = True) -> None:
        """Stop refreshing and revoke the lease, so the key disappears now rather than after the TTL.

        ``revoke=False`` leaves the key to expire with its lease, as when the agent dies.
        """
        self._stop.set()
        self._thread.join(self.ttl)
        if not revoke:
            return
        try:
            self.lease.revoke()
        except Exception as exc:
            log.debug("revoking lease: %s", exc)


def fetch(client: Any, namespace: str, name: str, timeout: float = 10.0) -> bytes:
    """The blob at the agent's key, waiting up to ``timeout`` s (with a watch) for it to appear."""
    key = agent_key(namespace, name)
    deadline = time.monotonic() + timeout
    got = client.get(key)
    if got:
        return _check(got[0], key)
    events, cancel = client.watch(key)
    box: list[bytes] = []

    def pump() -> None:
        for ev in events:
            if ev.get("type", "PUT") == "PUT" and "value" in ev.get("kv", {}):
                box.append(ev["kv"]["value"])
                return

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        got = client.get(key)  # it may have appeared between the get and the watch
        if got:
            return _check(got[0], key)
        t.join(max(0.0, deadline - time.monotonic()))
    finally:
        cancel()
    if not box:
        raise RemoteDisconnected(f"agent {name!r} did not appear in etcd at {key} within {timeout:g} s")
    return _check(box[0], key)


def _check(value: Any, key: str) -> bytes:
    if isinstance(value, str):
        value = value.encode("latin-1")
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"etcd value at {key} is not a metadata blob")
    return bytes(value)


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
        resp = self._post("/kv/range", {"key": _b64(self.key)}, stream=True, timeout=self._client.timeout)
        try:
            resp.raise_for_status()
            body = bytearray()
            for chunk in resp.iter_content(chunk_size=1 << 20):
                body += chunk
                _refuse_over(len(body), MAX_WATCH_LINE, f"etcd range of {self.key}")
        finally:
            resp.close()
        doc = json.loads(body)
        kvs = doc.get("kvs") or []
        if kvs:
            self._deliver("PUT", kvs[0])
        elif self._present:
            self._deliver("DELETE", {})
        return int(doc["header"]["revision"]) + 1

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
                result = json.loads(line).get("result") or {}
                if result.get("canceled"):
                    raise ConnectionError(f"etcd cancelled the watch: {result.get('cancel_reason', 'compacted')}")
                for ev in result.get("events") or ():
                    self._deliver(ev.get("type", "PUT"), ev.get("kv") or {})
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
                self._on_change(_check(base64.b64decode(kv["value"]), self.key))
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


def _refuse_over(n: int, most: int, what: str) -> None:
    if n > most:
        raise InvalidMetadata(f"{what}: a watch stream line of over {most} bytes; at most {most} accepted")


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
