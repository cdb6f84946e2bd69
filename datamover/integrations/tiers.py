"""What the engine adapters share: the tier config built from an engine's options, and engine keys as ChunkKeys.

An engine hands its adapter a `kv_cache_tiered` section (a mapping, or the path of a YAML file holding one); the
adapter fixes `l1_hbm.page_size_bytes` to the size of one engine chunk, since the engine, not the user, decides it.
Sections the user leaves out take the adapter defaults: the engine's own KV cache is the fastest tier, so L1 is off
and chunks go to host DRAM (L2) first; L3 (NVMe), L4 (a pool) and the policy are whatever the section says.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..policy.config import ROOT, ConfigError, TierConfig, parse_config, read_yaml, with_overrides

ADAPTER_DEFAULTS: dict[str, dict[str, Any]] = {
    "l1_hbm": {"enabled": False},
    "l2_dram": {"pinned_pool_gb": 1.0},
}


def _section(options: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if isinstance(options, str | os.PathLike):
        data = read_yaml(options) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(str(options), f"expected a mapping with a {ROOT} key, got {type(data).__name__}")
    else:
        data = dict(options)
    if ROOT in data:
        if set(data) != {ROOT}:
            raise ConfigError(str(next(k for k in data if k != ROOT)), f"unknown top-level key (expected {ROOT})")
        data = data[ROOT] or {}
    if not isinstance(data, Mapping):
        raise ConfigError(ROOT, f"expected a mapping, got {type(data).__name__}")
    return copy.deepcopy(dict(data))


def build_config(
    options: Mapping[str, Any] | str | os.PathLike[str] | None, chunk_bytes: int, engine: str
) -> TierConfig:
    """The TierConfig for an adapter whose engine moves chunks of `chunk_bytes`, from the user's section (or None)."""
    data = _section(options)
    for name, defaults in ADAPTER_DEFAULTS.items():
        section = data.setdefault(name, {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"{ROOT}.{name}", f"expected a mapping, got {type(section).__name__}")
        for key, value in defaults.items():
            section.setdefault(key, value)
    l1 = data["l1_hbm"]
    given = l1.get("page_size_bytes")
    if given is not None and given != chunk_bytes:
        raise ConfigError(
            f"{ROOT}.l1_hbm.page_size_bytes",
            f"{engine} moves chunks of {chunk_bytes} bytes; leave page_size_bytes out (the adapter sets it)",
        )
    if chunk_bytes <= 0 or chunk_bytes % 4096:
        raise ConfigError(
            f"{ROOT}.l1_hbm.page_size_bytes",
            f"{engine} chunks are {chunk_bytes} bytes, not a multiple of 4096: datamover's tiers store page-aligned "
            "chunks (choose a block size or page size that makes them so)",
        )
    l1["page_size_bytes"] = chunk_bytes
    return parse_config({ROOT: data}, source=engine)


def per_rank(config: TierConfig, part: str) -> TierConfig:
    """`config` with this rank's own L3 directory (`part` under l3_nvme.path) and, for a private L4 bucket, its own
    key prefix (`part/` after l4_pool.prefix): ranks and replicas never share an index or evict each other's
    chunks. A shared Mooncake pool is left as it is (sharing is its point)."""
    tiers: dict[str, Any] = {}
    if config.l3_nvme.enabled:
        tiers["l3_nvme"] = {"path": str(Path(config.l3_nvme.path) / part)}
    if config.l4_pool.enabled and config.l4_pool.backend == "s3":
        tiers["l4_pool"] = {"prefix": f"{config.l4_pool.prefix}{part}/"}
    return with_overrides(config, **tiers) if tiers else config


def key_hash(key: bytes | str) -> int:
    """A 64-bit integer for an engine's block key (bytes or str), the same in every process."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def namespace(engine: str, **parts: Any) -> str:
    """The ChunkKey model_version of an adapter: the engine and everything that changes the bytes of a chunk
    (model, dtype, layout, chunk size, rank), so that chunks of another configuration never match."""
    return engine + "".join(f"|{k}={parts[k]}" for k in sorted(parts))


__all__ = ["ADAPTER_DEFAULTS", "build_config", "key_hash", "namespace", "per_rank"]
