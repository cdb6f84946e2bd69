"""Reading a peer's key: ``fetch`` its blob (waiting for it to appear) and ``EtcdWatch`` it (kept current).

Both read the key, then watch it from the revision after that read, so a put in between is in the watch; a stream
that ends (etcd restarting) is opened again the same way. Speaks the gateway directly (etcd3gw's watch iterator
never ends when the stream does); every line is bounded and parsed before use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import InvalidMetadata, RemoteDisconnected
from . import gateway
from .answers import key_b64, kv_value, watch_events
from .gateway import MAX_WATCH_LINE, agent_key, read_key, read_range, shutdown_stream, split_lines

log = logging.getLogger("datamover.etcd")


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
        body = {"create_request": {"key": key_b64(self.key), "start_revision": self.start}}
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
            for line in split_lines(resp.iter_content(chunk_size=1 << 20), gateway.MAX_WATCH_LINE, what):
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
            shutdown_stream(resp)


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
        body = {"create_request": {"key": key_b64(self.key), "start_revision": start}}
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
            shutdown_stream(resp)
        self._thread.join(5)
