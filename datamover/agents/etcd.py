"""Metadata exchange through etcd: publish under a kept-alive lease, fetch with a watch.

An agent's blob lives at ``/<namespace>/agents/<name>``, attached to a lease
with a short TTL that a thread refreshes. When the agent dies the refreshes
stop, the lease expires, etcd deletes the key, and peers watching it drop
the agent. Uses etcd3gw (etcd's v3 JSON gateway), imported lazily.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from ..errors import BackendUnavailable, InvalidMetadata, RemoteDisconnected
from .metadata import MAX_BLOB_BYTES

log = logging.getLogger("datamover.etcd")


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
    """Keeps ``provider()`` at the agent's key under a lease of ``ttl`` seconds, refreshed every ttl/3."""

    def __init__(
        self, endpoints: str | Sequence[str], namespace: str, name: str, provider: Callable[[], bytes], ttl: float = 5.0
    ) -> None:
        self.client = connect(endpoints)
        self.key = agent_key(namespace, name)
        self.ttl = max(2, round(ttl))
        self._provider = provider
        self._lock = threading.Lock()
        self.lease = self.client.lease(self.ttl)
        self.update()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name=f"dm-etcd-{name}", daemon=True)
        self._thread.start()

    def update(self) -> None:
        """Publish the current blob again (after registering memory, say)."""
        with self._lock:
            self.client.put(self.key, self._provider(), lease=self.lease)

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.lease.refresh() <= 0:
                    with self._lock:
                        self.lease = self.client.lease(self.ttl)
                    self.update()
            except Exception as exc:  # etcd briefly away: keep trying until the lease is really gone
                log.warning("etcd lease refresh for %s failed: %s", self.key, exc)

    def close(self) -> None:
        """Stop refreshing and revoke the lease, so the key disappears now rather than after the TTL."""
        self._stop.set()
        self._thread.join(self.ttl)
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
    """Calls ``on_change(blob)`` when the key is rewritten and ``on_delete()`` when it goes (lease expired)."""

    def __init__(
        self, client: Any, namespace: str, name: str, on_change: Callable[[bytes], None], on_delete: Callable[[], None]
    ) -> None:
        self.key = agent_key(namespace, name)
        self._events, self._cancel = client.watch(self.key)
        self._on_change, self._on_delete = on_change, on_delete
        self._thread = threading.Thread(target=self._pump, name=f"dm-etcd-watch-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for ev in self._events:
                try:
                    if ev.get("type") == "DELETE":
                        self._on_delete()
                    elif "value" in ev.get("kv", {}):
                        self._on_change(_check(ev["kv"]["value"], self.key))
                except Exception as exc:  # a bad update must not end the watch
                    log.warning("etcd watch of %s: %s", self.key, exc)
        except Exception as exc:
            log.debug("etcd watch of %s ended: %s", self.key, exc)

    def close(self) -> None:
        try:
            self._cancel()
        except Exception as exc:
            log.debug("cancelling watch: %s", exc)
