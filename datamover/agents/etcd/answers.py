"""The etcd gateway's JSON answers, parsed before use: range answers, watch-stream events, key-values and values.

An answer comes from another process and is hostile until checked: one that is not what the gateway sends is
InvalidMetadata naming the key, and a value is bounded (MAX_BLOB_BYTES) before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ...errors import InvalidMetadata
from ..metadata import MAX_BLOB_BYTES


def parse_range(body: bytes, key: str) -> tuple[dict | None, int]:
    """A range answer for ``key``: its key-value (None: absent) and revision; InvalidMetadata if it is not one."""
    what = f"etcd range of {key}"
    doc = json_object(body, what)
    revision = as_revision(checked_field(doc, "header", dict, what, {}).get("revision"), f"{what}: header.revision")
    kvs = checked_field(doc, "kvs", list, what, [])
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
    result = checked_field(json_object(line, what), "result", dict, what, {})
    if result.get("canceled"):
        raise ConnectionError(f"etcd cancelled the watch: {result.get('cancel_reason') or 'compacted'}")
    out = []
    for ev in checked_field(result, "events", list, what, []):
        if not isinstance(ev, dict):
            raise InvalidMetadata(f"{what}: an event that is not a JSON object")
        kind = ev.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise InvalidMetadata(f"{what}: an event of type {str(kind)[:32]!r}")
        kv = _kv(checked_field(ev, "kv", dict, what, {}), key, what, with_key=kind == "PUT")
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
    if (with_key or "key" in kv) and kv.get("key") != key_b64(key):
        raise InvalidMetadata(f"{what}: a key-value of another key")
    checked_field(kv, "value", str, what, "")
    for name in ("mod_revision", "create_revision", "version"):
        if name in kv:
            as_revision(kv[name], f"{what}: {name}")
    return kv


def json_object(data: bytes, what: str) -> dict:
    """The JSON object ``data`` holds; InvalidMetadata (naming ``what``) for anything else."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nested too deep
        raise InvalidMetadata(f"{what}: not JSON ({type(exc).__name__}: {str(exc)[:100]})") from None
    if not isinstance(doc, dict):
        raise InvalidMetadata(f"{what}: {type(doc).__name__}, not a JSON object")
    return doc


def checked_field(doc: dict, name: str, kind: type, what: str, default: Any) -> Any:
    """``doc[name]`` (``default`` when absent), InvalidMetadata unless it is a ``kind``."""
    value = doc.get(name, default)
    if not isinstance(value, kind):
        raise InvalidMetadata(f"{what}: {name} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def as_revision(value: Any, what: str) -> int:
    """An int64 of the gateway (a decimal string, or a number): >= 0."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        return int(value)
    if type(value) is int and 0 <= value < 1 << 63:
        return value
    raise InvalidMetadata(f"{what}: {str(value)[:32]!r} is not a revision")


def _check(value: Any, key: str) -> bytes:
    """A decoded value within the bound of a blob, as bytes."""
    if isinstance(value, str):
        value = value.encode("latin-1")
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"etcd value at {key} is not a metadata blob")
    return bytes(value)


def key_b64(key: str) -> str:
    """A key as the gateway spells it: base64."""
    return base64.b64encode(key.encode()).decode()
