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
        """A stable 32-hex-digit name for the key (file and object names in L3/L4), the same in every process."""
        text = f"{self.prefix_hash}|{self.model_version}|{self.tokenizer_version}|{self.layer}"
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def chunk_keys(
    prefix_hashes: Iterable[int], model_version: str, tokenizer_version: str, layer: int | None = None
) -> list[ChunkKey]:
    """Keys for a request's chunks in prompt order (one per block hash, as in a Mooncake trace's `hash_ids`)."""
    return [ChunkKey(int(h), model_version, tokenizer_version, layer) for h in prefix_hashes]
