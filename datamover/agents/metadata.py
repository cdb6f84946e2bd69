"""Agent metadata: the msgpack blob peers exchange to reach each other's memory.

Schema (version 1): a map with ``schema`` (int), ``name`` (str), ``backends``
(map of backend name -> connection info map) and ``regions`` (list of
``[mem_type, dev, start, length, region_id]``), and optionally ``partial``
(true: the blob carries only some regions, to be merged into what the peer
already knows, as NIXL's partial metadata is). Decoding is strict: any blob
that is truncated, mistyped, oversized or inconsistent raises InvalidMetadata.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ..descriptors import MemType, RegionTable
from ..errors import AuthenticationError, InvalidDescriptor, InvalidMetadata

SCHEMA_VERSION = 1
MAX_BLOB_BYTES = 64 << 20
MAX_REGIONS = 1 << 20
MAX_NAME_LEN = 256
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class AgentMetadata:
    """A decoded, validated metadata blob."""

    name: str
    backends: dict[str, dict[str, Any]]
    regions: tuple[tuple[MemType, int, int, int, int], ...]
    table: RegionTable
    partial: bool = False


def encode_metadata(name: str, backends: Mapping[str, Mapping[str, Any]], regions, partial: bool = False) -> bytes:
    """Pack an agent's name, backend connection info and regions (``partial``: some of its regions only)."""
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "backends": {k: dict(v) for k, v in backends.items()},
        "regions": [[m.value, int(d), int(s), int(n), int(r)] for m, d, s, n, r in regions],
    }
    if partial:
        doc["partial"] = True
    return msgpack.packb(doc, use_bin_type=True)


def decode_metadata(blob: bytes) -> AgentMetadata:
    """Unpack and validate a blob; raises InvalidMetadata saying what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise InvalidMetadata(f"metadata must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"metadata blob of {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
    try:
        doc = msgpack.unpackb(
            bytes(blob), raw=False, strict_map_key=True, max_bin_len=MAX_BLOB_BYTES,
            max_str_len=MAX_BLOB_BYTES, max_array_len=MAX_REGIONS * 5, max_map_len=MAX_REGIONS,
        )  # fmt: skip
    except Exception as exc:
        raise InvalidMetadata(f"metadata is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidMetadata(f"metadata must be a map, got {type(doc).__name__}")
    schema = doc.get("schema")
    if type(schema) is not int:
        raise InvalidMetadata("metadata has no integer 'schema' version")
    if schema != SCHEMA_VERSION:
        raise InvalidMetadata(f"metadata schema version {schema} is not supported (this is {SCHEMA_VERSION})")
    unknown = set(doc) - {"schema", "name", "backends", "regions", "partial"}
    if unknown:
        raise InvalidMetadata(f"metadata has unknown field(s) {sorted(map(str, unknown))}")
    name = doc.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise InvalidMetadata(f"metadata 'name' must be a non-empty string of at most {MAX_NAME_LEN} characters")
    backends = doc.get("backends")
    if not isinstance(backends, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) and all(isinstance(kk, str) for kk in v) for k, v in backends.items()
    ):
        raise InvalidMetadata("metadata 'backends' must map backend names to maps with string keys")
    partial = doc.get("partial", False)
    if type(partial) is not bool:
        raise InvalidMetadata("metadata 'partial' must be a boolean")
    raw_regions = doc.get("regions")
    if not isinstance(raw_regions, list):
        raise InvalidMetadata("metadata 'regions' must be a list")
    if len(raw_regions) > MAX_REGIONS:
        raise InvalidMetadata(f"metadata has {len(raw_regions)} regions; at most {MAX_REGIONS} are accepted")
    regions = []
    for i, r in enumerate(raw_regions):
        if not (isinstance(r, list) and len(r) == 5 and isinstance(r[0], str)):
            raise InvalidMetadata(f"region {i} must be [mem_type, dev, start, length, id]")
        if not all(type(v) is int and 0 <= v <= _INT64_MAX for v in r[1:]):
            raise InvalidMetadata(f"region {i} has a field that is not an integer in 0..2**63-1")
        try:
            mem = MemType.parse(r[0])
        except ValueError as exc:
            raise InvalidMetadata(f"region {i}: {exc}") from None
        if r[2] > _INT64_MAX - r[3]:
            raise InvalidMetadata(f"region {i}: start + length overflows int64")
        regions.append((mem, r[1], r[2], r[3], r[4]))
    if len({r[4] for r in regions}) != len(regions):
        raise InvalidMetadata("metadata has duplicate region ids")
    try:
        table = RegionTable(regions)
    except InvalidDescriptor as exc:
        raise InvalidMetadata(f"metadata regions are inconsistent: {exc.reason}") from None
    return AgentMetadata(name=name, backends=backends, regions=tuple(regions), table=table, partial=partial)


SIGNED_MAGIC = b"DMS1"
_MAC_LEN = 32


def sign_metadata(blob: bytes, secret: bytes) -> bytes:
    """Wrap a blob with an HMAC-SHA256 over it, for agents configured with a shared secret."""
    return SIGNED_MAGIC + hmac.new(secret, blob, hashlib.sha256).digest() + blob


def open_metadata(blob: bytes, secret: bytes | None) -> bytes:
    """Check and strip the signature; raises AuthenticationError when the secrets disagree."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise InvalidMetadata(f"metadata must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    signed = blob.startswith(SIGNED_MAGIC)
    if secret is None:
        if signed:
            raise AuthenticationError("metadata is signed with a shared secret this agent does not have")
        return blob
    if not signed or len(blob) < len(SIGNED_MAGIC) + _MAC_LEN:
        raise AuthenticationError("metadata is not signed; this agent requires the shared secret")
    mac, inner = blob[len(SIGNED_MAGIC) : len(SIGNED_MAGIC) + _MAC_LEN], blob[len(SIGNED_MAGIC) + _MAC_LEN :]
    if not hmac.compare_digest(mac, hmac.new(secret, inner, hashlib.sha256).digest()):
        raise AuthenticationError("metadata signature does not match (wrong secret or tampered blob)")
    return inner
