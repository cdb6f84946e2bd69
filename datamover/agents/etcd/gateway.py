"""The etcd v3 JSON gateway: a client, the agents' keys, and every call and read bounded.

Uses etcd3gw's client (imported lazily) for its session; reads of keys and the calls of the publisher speak the
gateway directly. Every answer is read within a bound (``MAX_WATCH_LINE``) before it is parsed: a gateway answering
too much is InvalidMetadata naming the key, never an allocation of whatever size it sends.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

from ...errors import BackendUnavailable, InvalidMetadata, RemoteDisconnected, RemoteRefused
from ..metadata import MAX_BLOB_BYTES
from .answers import json_object, key_b64, kv_value, parse_range

log = logging.getLogger("datamover.etcd")

#: the longest watch-stream line taken: one event carrying the largest blob, base64 (4 bytes per 3), with room for
#: the JSON around it (key, revisions, header)
MAX_WATCH_LINE = 4 * -(-MAX_BLOB_BYTES // 3) + (64 << 10)


def agent_key(namespace: str, name: str) -> str:
    """The etcd key of agent ``name``'s metadata in ``namespace``."""
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
    return json_object(data, what)


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
            client.get_url("/kv/range"), json={"key": key_b64(key)}, stream=True, timeout=client.timeout
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


def shutdown_stream(resp: Any) -> None:
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
