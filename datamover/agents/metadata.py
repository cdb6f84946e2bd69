"""Agent metadata: the msgpack blob peers exchange to reach each other's memory.

Schema (version 1): a map with ``schema`` (int), ``name`` (str), ``backends``
(map of backend name -> connection info map), ``regions`` (list of
``[mem_type, dev, start, length, region_id]``), optionally ``ident``, the
agent's public identity (32 bytes, see ``agent_ident``), and optionally ``partial``
(true: the blob carries only some regions, to be merged into what the peer already
knows, as NIXL's partial metadata is). Decoding is strict: any blob
that is truncated, mistyped, oversized or inconsistent raises InvalidMetadata.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..descriptors import MemType, RegionTable
from ..errors import AuthenticationError, InvalidDescriptor, InvalidMetadata

SCHEMA_VERSION = 1
MAX_BLOB_BYTES = 64 << 20
MAX_REGIONS = 1 << 20
#: lists and maps a blob may hold besides one per region (the document, its backends' maps, their values)
_SPARE_CONTAINERS = 1024
MAX_NAME_LEN = 256
#: the most bytes the ``backends`` section (every backend's connection info) may take, encoded: real sections are
#: a few hundred bytes (ucx: a worker address, typically under 2 KiB, a host and a port); this leaves room for ucx's
#: own 64 KiB bound on a worker address
MAX_BACKENDS_BYTES = 96 << 10
#: the most keys and elements in the ``backends`` section, all levels together, and how deep it may nest (the
#: section's map, a backend's map, a value that is a list or map of plain values)
MAX_BACKENDS_ITEMS = 256
MAX_BACKENDS_DEPTH = 3
#: what one key or element of a decoded ``backends`` section is counted to keep besides its encoded bytes
_ITEM_NBYTES = 64
_INT64_MAX = (1 << 63) - 1
_IDENT_LEN = 32


@dataclass(frozen=True)
class AgentMetadata:
    """A decoded, validated metadata blob.

    Regions are kept as numpy columns (``table`` and ``rows``), about 64 bytes
    a region; ``regions`` builds the tuples on first use. ``ident`` is the
    SHA-256 of the peer's private token (see ``agent_ident``), or None.
    """

    name: str
    backends: dict[str, dict[str, Any]]
    table: RegionTable
    rows: np.ndarray = field(repr=False)  # (N, 4) int64: dev, start, length, id
    mem_types: tuple[MemType, ...] = field(repr=False)  # per row, via ``mem_codes``
    mem_codes: np.ndarray = field(repr=False)
    ident: bytes | None = None
    partial: bool = False
    backends_nbytes: int = 0  # what ``backends`` keeps, roughly (see ``MAX_BACKENDS_BYTES``)

    @functools.cached_property
    def regions(self) -> tuple[tuple[MemType, int, int, int, int], ...]:
        types = self.mem_types
        return tuple((types[c], d, s, n, r) for c, (d, s, n, r) in zip(self.mem_codes.tolist(), self.rows.tolist()))

    @property
    def nbytes(self) -> int:
        """What this metadata keeps in memory, roughly (for budgets)."""
        return int(self.rows.nbytes + self.mem_codes.nbytes) + self.table.nbytes + self.backends_nbytes


def agent_ident(token: bytes) -> bytes:
    """The public identity an agent publishes for its private ``token``: proof of the token proves the agent."""
    return hashlib.sha256(b"datamover-ident\0" + bytes(token)).digest()


def encode_metadata(
    name: str, backends: Mapping[str, Mapping[str, Any]], regions, ident: bytes | None = None, partial: bool = False
) -> bytes:
    """Pack an agent's name, backend connection info, regions and (optionally) its public identity;
    ``partial``: the regions are some of the agent's only."""
    doc = {
        "schema": SCHEMA_VERSION,
        "name": name,
        "backends": {k: dict(v) for k, v in backends.items()},
        "regions": [[m.value, int(d), int(s), int(n), int(r)] for m, d, s, n, r in regions],
    }
    if ident is not None:
        doc["ident"] = bytes(ident)
    if partial:
        doc["partial"] = True
    return msgpack.packb(doc, use_bin_type=True)


def decode_metadata(blob: bytes, max_regions: int = MAX_REGIONS) -> AgentMetadata:
    """Unpack and validate a blob; raises InvalidMetadata saying what is wrong.

    ``max_regions`` bounds the region count before the regions are unpacked
    (msgpack refuses longer arrays), for blobs from peers on a budget.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise InvalidMetadata(f"metadata must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_BLOB_BYTES:
        raise InvalidMetadata(f"metadata blob of {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
    max_regions = min(int(max_regions), MAX_REGIONS)
    # lists and maps as msgpack builds them, innermost first: a blob is its regions' rows and a few maps, and
    # bytes alone bound containers badly (8 MiB of empty lists are 8M Python lists, about 600 MB)
    containers = max_regions + _SPARE_CONTAINERS

    def count(container: Any) -> Any:
        nonlocal containers
        containers -= 1
        if containers < 0:
            raise ValueError(f"more than {max_regions + _SPARE_CONTAINERS} lists and maps")
        return container

    try:
        doc = msgpack.unpackb(
            bytes(blob), raw=False, strict_map_key=True, max_bin_len=MAX_BLOB_BYTES,
            max_str_len=MAX_BLOB_BYTES, max_array_len=max(max_regions, 5), max_map_len=MAX_BACKENDS_ITEMS,
            object_hook=count, list_hook=count,
        )  # fmt: skip
    except Exception as exc:
        if "max_array_len" in str(exc):
            raise InvalidMetadata(
                f"metadata has an array longer than {max_regions}: at most {max_regions} regions are accepted"
            ) from None
        if "max_map_len" in str(exc):  # the only maps are the document's and its 'backends' section's
            raise InvalidMetadata(
                f"metadata has a map of more than {MAX_BACKENDS_ITEMS} keys: 'backends' holds at most that many"
            ) from None
        raise InvalidMetadata(f"metadata is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidMetadata(f"metadata must be a map, got {type(doc).__name__}")
    schema = doc.get("schema")
    if type(schema) is not int:
        raise InvalidMetadata("metadata has no integer 'schema' version")
    if schema != SCHEMA_VERSION:
        raise InvalidMetadata(f"metadata schema version {schema} is not supported (this is {SCHEMA_VERSION})")
    unknown = set(doc) - {"schema", "name", "backends", "regions", "ident", "partial"}
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
    backends_nbytes = _backends_nbytes(backends)
    ident = doc.get("ident")
    if ident is not None and not (isinstance(ident, bytes) and len(ident) == _IDENT_LEN):
        raise InvalidMetadata(f"metadata 'ident' must be {_IDENT_LEN} bytes")
    partial = doc.get("partial", False)
    if type(partial) is not bool:
        raise InvalidMetadata("metadata 'partial' must be a boolean")
    raw_regions = doc.get("regions")
    if not isinstance(raw_regions, list):
        raise InvalidMetadata("metadata 'regions' must be a list")
    if len(raw_regions) > max_regions:
        raise InvalidMetadata(f"metadata has {len(raw_regions)} regions; at most {max_regions} are accepted")
    codes, types, rows = _region_columns(raw_regions)
    try:
        table = RegionTable.from_columns(types, codes, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3])
    except InvalidDescriptor as exc:
        raise InvalidMetadata(f"metadata regions are inconsistent: {exc.reason}") from None
    return AgentMetadata(
        name=name,
        backends=backends,
        table=table,
        rows=rows,
        mem_types=types,
        mem_codes=codes,
        ident=ident,
        partial=partial,
        backends_nbytes=backends_nbytes,
    )


def _backends_nbytes(backends: dict) -> int:
    """Refuse a ``backends`` section past its bounds (items, depth, encoded bytes); what it keeps, roughly."""
    items, stack = 0, [(backends, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_BACKENDS_DEPTH:
            raise InvalidMetadata(f"metadata 'backends' nests deeper than {MAX_BACKENDS_DEPTH} levels")
        items += len(value)
        if items > MAX_BACKENDS_ITEMS:
            raise InvalidMetadata(f"metadata 'backends' has more than {MAX_BACKENDS_ITEMS} keys and elements")
        stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    size = len(msgpack.packb(backends, use_bin_type=True))
    if size > MAX_BACKENDS_BYTES:
        raise InvalidMetadata(f"metadata 'backends' of {size} bytes; at most {MAX_BACKENDS_BYTES} accepted")
    return size + items * _ITEM_NBYTES


def _region_columns(raw: list) -> tuple[np.ndarray, tuple[MemType, ...], np.ndarray]:
    """Validate ``[mem_type, dev, start, length, id]`` entries column-wise; (type codes, types, int64 rows)."""
    n = len(raw)
    if n == 0:
        return np.zeros(0, np.int8), (), np.zeros((0, 4), np.int64)
    if {type(r) for r in raw} != {list} or {len(r) for r in raw} != {5}:
        i = next(i for i, r in enumerate(raw) if type(r) is not list or len(r) != 5)
        raise InvalidMetadata(f"region {i} must be [mem_type, dev, start, length, id]")
    cols = list(zip(*raw))
    if {type(v) for v in cols[0]} != {str}:
        i = next(i for i, v in enumerate(cols[0]) if type(v) is not str)
        raise InvalidMetadata(f"region {i} must be [mem_type, dev, start, length, id]")
    out = np.empty((n, 4), dtype=np.int64)
    for k, col in enumerate(cols[1:]):
        bad = {type(v) for v in col} != {int}
        if not bad:
            try:
                out[:, k] = np.fromiter(col, dtype=np.int64, count=n)
            except OverflowError:
                bad = True
        if bad or (out[:, k] < 0).any():
            i = next(i for i, v in enumerate(col) if type(v) is not int or not 0 <= v <= _INT64_MAX)
            raise InvalidMetadata(f"region {i} has a field that is not an integer in 0..2**63-1")
    names = {}
    for i, v in enumerate(cols[0]):
        if v not in names:
            try:
                names[v] = MemType.parse(v)
            except ValueError as exc:
                raise InvalidMetadata(f"region {i}: {exc}") from None
    types = tuple(dict.fromkeys(names.values()))
    code_of = {v: types.index(m) for v, m in names.items()}
    codes = np.fromiter((code_of[v] for v in cols[0]), dtype=np.int8, count=n)
    over = out[:, 1] > _INT64_MAX - out[:, 2]
    if over.any():
        raise InvalidMetadata(f"region {int(np.flatnonzero(over)[0])}: start + length overflows int64")
    ids = np.sort(out[:, 3])
    if (ids[1:] == ids[:-1]).any():
        raise InvalidMetadata("metadata has duplicate region ids")
    return codes, types, out


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
