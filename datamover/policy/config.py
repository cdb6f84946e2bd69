"""The tier configuration (`kv_cache_tiered:` YAML): schema, documented defaults, and validation that names the key.

Every field is declared once below with its default and a one-line doc; `default_config_yaml()` prints them all.
Validation rejects unknown keys, wrong types, values out of range and capacities that do not fit, and every
message starts with the dotted path of the offending key, e.g. `kv_cache_tiered.l2_dram.pinned_pool_gb`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shutil
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, shown
from ..telemetry.config import (
    SPAN_FIELDS,
    AlertRule,
    BurnRateAlerts,
    ObservabilityConfig,
    parse_alert_rules,
    parse_span_fields,
)

GIB = 1 << 30
#: the largest size in GiB a config takes: 2**64 bytes (a larger one overflowed to a float infinity in bytes)
MAX_GB = float(1 << 34)
ROOT = "kv_cache_tiered"
TIER_NAMES = ("l1_hbm", "l2_dram", "l3_nvme", "l4_pool")


def _f(default: Any, doc: str, **checks: Any) -> Any:
    """A config field: its (immutable) default, its documentation, and optional checks (choices, ge, gt, le)."""
    return field(default=default, metadata={"doc": doc, **checks})


@dataclass(frozen=True)
class L1Config:
    """L1: GPU HBM (without a GPU, a host DRAM arena stands in for it and the cache says so)."""

    enabled: bool = _f(True, "keep an L1 tier")
    page_size_bytes: int = _f(65536, "bytes of one KV chunk; every tier stores and moves whole chunks", gt=0)
    block_pool_size: int = _f(8192, "L1 capacity in chunks", gt=0)
    device: str = _f(
        "auto",
        "where L1 lives: cuda, dram (a stand-in arena), or auto (cuda if usable)",
        choices=("auto", "cuda", "dram"),
    )
    high_watermark: float = _f(
        1.0, "start evicting when occupancy would exceed this fraction of capacity", gt=0.0, le=1.0
    )
    low_watermark: float = _f(
        1.0, "evict down to this fraction (below high_watermark: demote in batches)", gt=0.0, le=1.0
    )


@dataclass(frozen=True)
class L2Config:
    """L2: pinned host DRAM."""

    enabled: bool = _f(True, "keep an L2 tier")
    pinned_pool_gb: float = _f(1.0, "L2 capacity in GiB (the pinned host pool)", gt=0.0, le=MAX_GB)
    swap_threshold_pages: int = _f(512, "most chunks demoted from L1 to L2 in one transfer", gt=0)
    hysteresis_cooldown_s: float = _f(
        5.0, "a chunk used or placed less than this ago is demoted only as a last resort (every tier)", ge=0.0
    )
    high_watermark: float = _f(
        1.0, "start evicting when occupancy would exceed this fraction of capacity", gt=0.0, le=1.0
    )
    low_watermark: float = _f(1.0, "evict down to this fraction of capacity", gt=0.0, le=1.0)


@dataclass(frozen=True)
class L3Config:
    """L3: local NVMe, one file per chunk under `path`."""

    enabled: bool = _f(False, "keep an L3 tier")
    path: str = _f("/var/tmp/datamover/l3", "directory holding the chunk files and the index")
    capacity_gb: float = _f(16.0, "L3 capacity in GiB", gt=0.0, le=MAX_GB)
    fsync_mode: str = _f("fdatasync", "durability of each chunk write", choices=("none", "fsync", "fdatasync"))
    crc32c_check: bool = _f(
        True, "store a CRC32C per chunk and check it on every read from L3 or L4 (a mismatch is a miss)"
    )
    chunk_size_tokens: int = _f(16, "tokens per chunk (token_range in spans, cost per token)", gt=0)
    high_watermark: float = _f(
        1.0, "start evicting when occupancy would exceed this fraction of capacity", gt=0.0, le=1.0
    )
    low_watermark: float = _f(1.0, "evict down to this fraction of capacity", gt=0.0, le=1.0)


@dataclass(frozen=True)
class L4Config:
    """L4: a remote pool: S3-compatible objects, or a Mooncake Store pool that instances share."""

    enabled: bool = _f(False, "keep an L4 tier")
    backend: str = _f(
        "s3",
        "s3: an S3-compatible object store, private to this instance; mooncake: a Mooncake Store pool shared by "
        "every instance on the same master (lookups see chunks other instances put)",
        choices=("s3", "mooncake"),
    )
    endpoint: str = _f("", "s3: endpoint URL of the store; empty means the backend's default")
    bucket: str = _f("datamover-kv", "bucket (s3) or key namespace (mooncake) holding the chunks")
    prefix: str = _f(
        "kv/",
        "s3: key prefix of this instance's chunk objects and L4 index, ending in '/' (the engine adapters add "
        "each rank's part, as they do to l3_nvme.path); refused for mooncake (the pool's keys are shared)",
    )
    replica_count: int = _f(
        1, "copies of each chunk written (s3: one object each; mooncake: memory replicas on distinct clients)", ge=1
    )
    capacity_gb: float = _f(
        1024.0,
        "L4 capacity in GiB (mooncake: chunks this instance indexes; the pool evicts by itself)",
        gt=0.0,
        le=MAX_GB,
    )
    metadata_service_url: str = _f(
        "",
        "mooncake: the transfer engine's metadata service (http://host:port/metadata, etcd://host:port, or "
        "P2PHANDSHAKE when empty); refused for s3",
    )
    master_server_addr: str = _f(
        "", "mooncake: host:port of mooncake_master (empty: $MOONCAKE_MASTER, else 127.0.0.1:50051); refused for s3"
    )
    master_admin_url: str = _f(
        "",
        "mooncake: the master's HTTP admin endpoint (http://host:metrics_port), so drain finds every key held "
        "only by this instance; empty: drain covers the chunks this instance knows; refused for s3",
    )
    segment_gb: float = _f(
        0.0,
        "mooncake: memory this instance lends to the pool, GiB (0: lends none); refused for s3",
        ge=0.0,
        le=MAX_GB,
    )
    placement_locality: bool = _f(
        False, "mooncake: the first replica of a chunk goes to this instance's own memory; refused for s3"
    )
    cross_region: bool = _f(False, "replicate chunks across regions: refused (neither backend does it)")
    p99_latency_budget_ms: float = _f(
        0.0, "mooncake: budget for the p99 of pool lookups; stats() and the bench report against it (0: none)", ge=0.0
    )
    publish_on_put: bool = _f(
        True, "mooncake: a put also writes its chunks to the pool at once, so other instances find them"
    )
    high_watermark: float = _f(
        1.0, "start evicting when occupancy would exceed this fraction of capacity", gt=0.0, le=1.0
    )
    low_watermark: float = _f(1.0, "evict down to this fraction of capacity", gt=0.0, le=1.0)


#: L4 fields that only the mooncake backend uses, and their values when unset
_MOONCAKE_ONLY = {
    "metadata_service_url": "",
    "master_server_addr": "",
    "master_admin_url": "",
    "segment_gb": 0.0,
    "placement_locality": False,
    "p99_latency_budget_ms": 0.0,
}


def _check_l4(obj: L4Config, path: str) -> None:
    """Each L4 field is honoured by the chosen backend or refused with the reason, never ignored."""
    if obj.cross_region:
        why = (
            "a Mooncake master serves one cluster and places replicas inside it"
            if obj.backend == "mooncake"
            else "replicate the bucket with S3's cross-region replication, not from the client"
        )
        raise ConfigError(f"{path}.cross_region", f"cross-region replication is not supported: {why}")
    if obj.backend == "s3":
        for name, unset in _MOONCAKE_ONLY.items():
            if getattr(obj, name) != unset:
                raise ConfigError(f"{path}.{name}", "only the mooncake backend uses it (l4_pool.backend is s3)")
        if not re.fullmatch(r"[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/", obj.prefix) or len(obj.prefix) > 512:
            raise ConfigError(
                f"{path}.prefix", f"{shown(obj.prefix)} is not a key prefix: S3-safe names joined by '/', ending in '/'"
            )
        return
    if obj.prefix != "kv/":
        raise ConfigError(f"{path}.prefix", "the mooncake pool's keys are shared: <bucket>/kv/<digest>")
    if obj.endpoint:
        raise ConfigError(f"{path}.endpoint", "the mooncake backend reaches its pool through master_server_addr")
    for name in ("metadata_service_url", "master_admin_url"):
        url = getattr(obj, name)
        ok = (
            url.startswith(("http://", "https://"))
            if name == "master_admin_url"
            else url == "P2PHANDSHAKE" or url.startswith(("http://", "https://", "etcd://"))
        )
        if url and not ok:
            raise ConfigError(f"{path}.{name}", f"{url!r} is not a URL the backend understands")


@dataclass(frozen=True)
class PolicyConfig:
    """Placement and eviction."""

    name: str = _f(
        "default",
        "eviction policy of every tier: default (adaptive), lru, lfu, arc, s3fifo, wtinylfu, lecar, scored, "
        "or a registered plug-in",
    )
    half_life_s: float = _f(
        300.0, "scored policy only: a chunk's score (decayed use count) halves after this long unused", gt=0.0
    )
    history_factor: float = _f(
        8.0, "scored policy only: remember the scores of this many evicted chunks per resident chunk", ge=0.0
    )
    admission: bool = _f(
        True,
        "scored policy only: admit a new chunk into a full tier only if it outscores the chunk it would "
        "replace; otherwise it goes to the next tier",
    )
    promote_on_hit: bool = _f(True, "copy a chunk found in a lower tier up to L1")
    write_mode: str = _f(
        "write_back",
        "write_back: a chunk goes to the next tier when demoted; write_through: at once",
        choices=("write_back", "write_through"),
    )


@dataclass(frozen=True)
class CostConfig:
    """The cost model c = c1*h1 + c2*h2 + c3*h3 + c4*h4 + c_miss*miss, per chunk access, in nanoseconds."""

    l1_ns: float = _f(100.0, "cost of an L1 hit", ge=0.0)
    l2_ns: float = _f(100_000.0, "cost of an L2 hit", ge=0.0)
    l3_ns: float = _f(1_000_000.0, "cost of an L3 hit", ge=0.0)
    l4_ns: float = _f(30_000_000.0, "cost of an L4 hit", ge=0.0)
    miss_ns: float = _f(50_000_000.0, "cost of a miss: prefill (recompute) of one chunk", ge=0.0)


@dataclass(frozen=True)
class TierConfig:
    """The whole `kv_cache_tiered:` section."""

    l1_hbm: L1Config = field(default_factory=L1Config, metadata={"doc": "L1 tier"})
    l2_dram: L2Config = field(default_factory=L2Config, metadata={"doc": "L2 tier"})
    l3_nvme: L3Config = field(default_factory=L3Config, metadata={"doc": "L3 tier"})
    l4_pool: L4Config = field(default_factory=L4Config, metadata={"doc": "L4 tier"})
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={"doc": "placement and eviction"})
    cost: CostConfig = field(default_factory=CostConfig, metadata={"doc": "cost model"})
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig, metadata={"doc": "telemetry"})

    def tier(self, name: str) -> L1Config | L2Config | L3Config | L4Config:
        """The section of tier `name` (one of TIER_NAMES)."""
        return getattr(self, name)

    def enabled_tiers(self) -> list[str]:
        """Names of the enabled tiers, fastest first."""
        return [name for name in TIER_NAMES if self.tier(name).enabled]

    def capacity_chunks(self, name: str) -> int:
        """Capacity of tier `name` in chunks of `l1_hbm.page_size_bytes`."""
        page = self.l1_hbm.page_size_bytes
        if name == "l1_hbm":
            return self.l1_hbm.block_pool_size
        gb = self.l2_dram.pinned_pool_gb if name == "l2_dram" else self.tier(name).capacity_gb
        return int(gb * GIB) // page

    def cost_ns(self) -> tuple[float, float, float, float, float]:
        """(c1, c2, c3, c4, c_miss) in ns."""
        c = self.cost
        return c.l1_ns, c.l2_ns, c.l3_ns, c.l4_ns, c.miss_ns

    def check_fits(self, gpu_bytes: int | None = None) -> None:
        """Check that the enabled tiers fit this machine: L1 in GPU memory (or host RAM when it stands in on
        DRAM), L1+L2 in host RAM, L3 on its file system. Raise ConfigError naming the key that does not fit."""
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        l1_bytes = self.l1_hbm.block_pool_size * self.l1_hbm.page_size_bytes if self.l1_hbm.enabled else 0
        l2_bytes = int(self.l2_dram.pinned_pool_gb * GIB) if self.l2_dram.enabled else 0
        on_gpu = gpu_bytes is not None and self.l1_hbm.device != "dram"
        if on_gpu and l1_bytes > gpu_bytes:
            raise ConfigError(
                f"{ROOT}.l1_hbm.block_pool_size",
                f"{l1_bytes / GIB:.2f} GiB of L1 does not fit in {gpu_bytes / GIB:.2f} GiB of GPU memory",
            )
        host = l2_bytes + (0 if on_gpu else l1_bytes)
        if host > ram:
            key = "l2_dram.pinned_pool_gb" if l2_bytes else "l1_hbm.block_pool_size"
            raise ConfigError(
                f"{ROOT}.{key}", f"{host / GIB:.2f} GiB of host tiers does not fit in {ram / GIB:.2f} GiB of RAM"
            )
        if self.l3_nvme.enabled:
            path = Path(self.l3_nvme.path)
            probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
            free = shutil.disk_usage(probe).free + _used_bytes(path)
            if self.l3_nvme.capacity_gb * GIB > free:
                raise ConfigError(
                    f"{ROOT}.l3_nvme.capacity_gb",
                    f"{self.l3_nvme.capacity_gb} GiB does not fit: {free / GIB:.2f} GiB available under {probe}",
                )


def _used_bytes(path: Path) -> int:
    """Bytes already held under `path` (they count as available to the L3 tier that owns them)."""
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise ConfigError(path, f"expected a finite number, got {shown(value)}")
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {shown(value)}")
    return value


def _check_limits(meta: typing.Mapping[str, Any], value: Any, path: str) -> None:
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(path, f"{shown(value)} is not one of {', '.join(map(str, meta['choices']))}")
    for key, bad, words in (
        ("gt", lambda v, b: v <= b, "greater than"),
        ("ge", lambda v, b: v < b, "at least"),
        ("le", lambda v, b: v > b, "at most"),
    ):
        if key in meta and bad(value, meta[key]):
            raise ConfigError(path, f"must be {words} {meta[key]}, got {value}")


def _build(cls: type, data: Any, path: str) -> Any:
    """Build dataclass `cls` from a YAML mapping, checking keys, types and limits; missing keys take defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {type(data).__name__} {shown(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            raise ConfigError(f"{path}.{key}", f"unknown key{hint}")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            continue
        where, value, tp = f"{path}.{name}", data[name], hints[name]
        if is_dataclass(tp):
            kwargs[name] = _build(typing.cast(type, tp), value, where)
        elif name == "span_fields":
            kwargs[name] = parse_span_fields(value, where)
        elif typing.get_origin(tp) is tuple:
            kwargs[name] = parse_alert_rules(value, where, name)
        else:
            kwargs[name] = _check_scalar(tp, value, where)
            _check_limits(f.metadata, kwargs[name], where)
    obj = cls(**kwargs)
    _check_section(obj, path)
    return obj


def _check_section(obj: Any, path: str) -> None:
    """Checks across fields of one section: file paths, watermarks in order, capacities that hold a chunk."""
    for name in ("path", "span_path"):
        value = getattr(obj, name, None)
        if isinstance(value, str) and (not value.strip() or "\0" in value):
            # an empty path was the working directory (L3 wrote its chunks there); a NUL, os's ValueError
            raise ConfigError(f"{path}.{name}", f"{shown(value)} is not a file path")
    if hasattr(obj, "low_watermark") and obj.low_watermark > obj.high_watermark:
        raise ConfigError(f"{path}.low_watermark", f"{obj.low_watermark} is above high_watermark {obj.high_watermark}")
    if isinstance(obj, L1Config) and obj.page_size_bytes % 4096:
        raise ConfigError(
            f"{path}.page_size_bytes",
            f"{obj.page_size_bytes} is not a multiple of 4096 (chunks must be page-aligned for O_DIRECT)",
        )
    if isinstance(obj, L4Config) and obj.enabled and not obj.bucket:
        raise ConfigError(f"{path}.bucket", "an enabled L4 pool needs a bucket")
    if isinstance(obj, L4Config):
        _check_l4(obj, path)
    if isinstance(obj, TierConfig):
        page = obj.l1_hbm.page_size_bytes
        for name, key in (("l2_dram", "pinned_pool_gb"), ("l3_nvme", "capacity_gb"), ("l4_pool", "capacity_gb")):
            if obj.tier(name).enabled and obj.capacity_chunks(name) < 1:
                raise ConfigError(f"{path}.{name}.{key}", f"holds no chunk of {page} bytes (l1_hbm.page_size_bytes)")
        if not obj.enabled_tiers():
            raise ConfigError(path, "no tier is enabled")


def parse_config(data: Any, source: str = "<config>") -> TierConfig:
    """Validate a loaded YAML document (`{kv_cache_tiered: {...}}`) and return the TierConfig."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, f"expected a mapping with a {ROOT} key, got {type(data).__name__}")
    for key in data:
        if key != ROOT:
            raise ConfigError(str(key), f"unknown top-level key (expected {ROOT})")
    return _build(TierConfig, data.get(ROOT), ROOT)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *base, whose keys the mapping may override
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                twice = key in seen
            except TypeError:  # unhashable: the base class says so
                break
            if twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{shown(key)} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The document of a YAML config file. Syntax errors and keys given twice are ConfigErrors with the line and
    column; a file that is not UTF-8, nests too deeply or holds a value YAML cannot build (a 5,000-digit integer,
    February 30th) is a ConfigError naming the file."""
    try:
        return yaml.load(Path(path).read_text(), Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(where, f"not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text: byte {exc.object[exc.start]:#x} at offset {exc.start}") from None
    except RecursionError:
        raise ConfigError(str(path), "not a tier config: YAML nested too deeply") from None
    except ValueError as exc:  # what YAML's int and timestamp constructors raise
        raise ConfigError(str(path), f"a value YAML cannot build: {exc}") from None


def load_config(path: str | os.PathLike[str] | None = None) -> TierConfig:
    """Read and validate a tier config file (errors as `read_yaml` and `parse_config` say); None gives the
    documented defaults."""
    if path is None:
        return TierConfig()
    return parse_config(read_yaml(path), str(path))


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def _dump(obj: Any, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    for f in fields(obj):
        value, doc = getattr(obj, f.name), f.metadata.get("doc", "")
        if is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {doc}")
            _dump(value, indent + 1, lines)
        elif isinstance(value, tuple) and value and isinstance(value[0], AlertRule):
            lines.append(f"{pad}{f.name}:  # {doc}")
            lines += [f"{pad}  - {{window: {r.window}, threshold: {r.threshold:g}}}" for r in value]
        elif isinstance(value, tuple):
            lines.append(f"{pad}{f.name}: [{', '.join(value)}]  # {doc}")
        else:
            lines.append(f"{pad}{f.name}: {_yaml_value(value)}  # {doc}")


def default_config_yaml() -> str:
    """Every field with its default and its documentation, as a YAML file that load_config accepts."""
    lines = [f"{ROOT}:"]
    _dump(TierConfig(), 1, lines)
    return "\n".join(lines) + "\n"


def with_overrides(config: TierConfig, **sections: dict[str, Any]) -> TierConfig:
    """A copy of `config` with fields of some sections replaced, e.g. with_overrides(c, l1_hbm={"block_pool_size": 8}),
    validated like a file."""
    data: dict[str, Any] = {}
    for f in fields(config):
        section = getattr(config, f.name)
        data[f.name] = {g.name: _plain(getattr(section, g.name)) for g in fields(section)}
    for name, values in sections.items():
        if name not in data:
            raise ConfigError(f"{ROOT}.{name}", "unknown section")
        data[name].update(values)
    return parse_config({ROOT: data})


def checked_config(config: Any) -> TierConfig:
    """``config`` validated as a file is: a TierConfig (which code may have built with any values), a mapping
    (the YAML document, ``{kv_cache_tiered: {...}}``) or None (the defaults); anything else is a ConfigError."""
    if config is None:
        return TierConfig()
    if isinstance(config, TierConfig):
        return parse_config({ROOT: _plain(config)})
    if isinstance(config, dict):
        return parse_config(config)
    raise ConfigError(ROOT, f"expected a TierConfig or a mapping, got {type(config).__name__}")


def _plain(value: Any) -> Any:
    """A config value back in YAML-document form (for re-validation)."""
    if is_dataclass(value):
        return {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
    if isinstance(value, tuple):
        return [{"window": v.window, "threshold": v.threshold} if isinstance(v, AlertRule) else v for v in value]
    return value


__all__ = [
    "SPAN_FIELDS",
    "TIER_NAMES",
    "AlertRule",
    "BurnRateAlerts",
    "ConfigError",
    "CostConfig",
    "L1Config",
    "L2Config",
    "L3Config",
    "L4Config",
    "ObservabilityConfig",
    "PolicyConfig",
    "TierConfig",
    "checked_config",
    "default_config_yaml",
    "load_config",
    "parse_config",
    "read_yaml",
    "with_overrides",
]
