"""Chunk keys: what identifies a cached KV chunk, so that a chunk computed by another model never matches."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import NamedTuple


class ChunkKey(NamedTuple):
    """One KV chunk: the hash of the token prefix it ends, the versions that produced it, and the layer if layer-wise.

    Equality covers every field, so a chunk written under another model or tokenizer version is a different key
    and can never be returned for this one.
    """

    prefix_hash: int
    model_version: str
    tokenizer_version: str
    layer: int | None = None

    def digest(self) -> str:
        """A stable 32-hex-digit name for the key (file and object names in L3/L4), the same in every process.

        Each field is length-prefixed, so no two keys hash the same text (fields joined by a separator did:
        ``("m|x", "t")`` and ``("m", "x|t")`` named one object, and one chunk's bytes were served for the other).
        """
        layer = "" if self.layer is None else self.layer
        fields = (str(f).encode("utf-8", "surrogatepass") for f in (self.prefix_hash, *self[1:3], layer))
        text = b"".join(b"%d:%s" % (len(b), b) for b in fields)
        return hashlib.blake2b(text, digest_size=16).hexdigest()


def key_from_fields(fields: object) -> ChunkKey:
    """The ChunkKey of a list of its fields as stored (``list(key)``, the layer optional); ValueError for anything
    else, naming it (an index read back from disk or a bucket is checked field by field before it is trusted)."""
    if not isinstance(fields, list) or len(fields) not in (3, 4):
        raise ValueError(f"key {fields!r:.80} is not a chunk key")
    prefix, model, tokenizer, layer = (*fields, None) if len(fields) == 3 else fields
    if type(prefix) is not int or type(model) is not str or type(tokenizer) is not str:
        raise ValueError(f"key {fields!r:.80} is not a chunk key")
    if layer is not None and type(layer) is not int:
        raise ValueError(f"key {fields!r:.80}: layer {layer!r:.20} is not a layer number")
    return ChunkKey(prefix, model, tokenizer, layer)


def chunk_keys(
    prefix_hashes: Iterable[int], model_version: str, tokenizer_version: str, layer: int | None = None
) -> list[ChunkKey]:
    """Keys for a request's chunks in prompt order (one per block hash, as in a Mooncake trace's `hash_ids`)."""
    return [ChunkKey(int(h), model_version, tokenizer_version, layer) for h in prefix_hashes]
