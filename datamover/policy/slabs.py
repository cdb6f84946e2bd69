"""The storage of each cache tier: a slab of fixed-size slots, one chunk each, registered with the Agent.

L1 is a GPU tensor (or, without a usable GPU, a host DRAM arena standing in for HBM, which the cache's notes
say), L2 a pinned host arena, L3 one file under `l3_nvme.path`, L4 objects in an S3 bucket; the host staging
area that reads from L3/L4 land in is a slab too. A slab knows nothing of keys: the plan (`plan.py`) maps
chunks to slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..agents import Agent, Prepared
from ..backends import backend_status
from ..descriptors import DescList, MemType, Registration, aligned_empty
from ..errors import BackendUnavailable
from .config import TierConfig

DATA_FILE = "chunks.dat"


@dataclass
class Slab:
    """One tier's storage: its memory type, the prepared slot descriptors, a host view of its slots if any."""

    name: str
    mem: MemType
    capacity: int
    prepared: Prepared | None = None  # None for OBJ (descriptors are made per batch from object keys)
    host: np.ndarray | None = None  # (capacity, page) uint8 view for host arenas
    owner: Any = None  # keeps the arena alive
    # what the slab registered with the Agent, given back by `release`
    reg: Registration | list[Registration] | None = None

    def release(self, agent: Agent) -> None:
        """Deregister what the slab registered (on an Agent that outlives the cache; once)."""
        reg, self.reg = self.reg, None
        if reg is not None:
            agent.deregister_memory(reg)


def backend_params(config: TierConfig) -> dict[str, dict]:
    """The backends (and their parameters) the cache's own Agent needs for the slabs `config` enables."""
    l4 = config.l4_pool
    params: dict[str, dict] = {"memcpy": {}, "posix": {}}
    if backend_status("cuda")[0]:
        params["cuda"] = {}
    if l4.enabled and l4.backend == "mooncake":
        params["mooncake"] = {
            "master_server_addr": l4.master_server_addr or None,
            "metadata_server": l4.metadata_service_url or None,
            "global_segment_size": int(l4.segment_gb * (1 << 30)),
            "replica_count": l4.replica_count,
            "preferred_segment": "local" if l4.placement_locality else "",
            "write_mode": "keep",  # a chunk key names its content: the first copy in the pool is the copy
        }
    elif l4.enabled:
        params["s3"] = {"endpoint_url": l4.endpoint or None}
    return params


def gpu_reason() -> str | None:
    """None if L1 can live on a GPU here, else why not."""
    ok, reason = backend_status("cuda")
    if not ok:
        return reason
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def gpu_bytes() -> int:
    """Memory of the current CUDA device."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def host_slab(agent: Agent, name: str, capacity: int, page: int, pinned: bool = False) -> Slab:
    """A host DRAM arena of `capacity` slots (page-locked by torch when `pinned` and a GPU is usable)."""
    arena = None
    if pinned and gpu_reason() is None:
        import torch

        arena = torch.empty(capacity * page, dtype=torch.uint8, pin_memory=True)
        host = arena.numpy()
    else:
        host = aligned_empty(capacity * page)
    reg = agent.register_memory(host)
    prepared = agent.prepare(DescList.blocks(host, page))
    return Slab(name, MemType.DRAM, capacity, prepared, host.reshape(capacity, page), arena or host, reg)


def make_slab(agent: Agent, config: TierConfig, name: str, notes: list[str]) -> Slab:
    """The slab of tier `name` as `config` sizes it; what stands in for what is appended to `notes`."""
    cap = config.capacity_chunks(name)
    page = config.l1_hbm.page_size_bytes
    if name == "l1_hbm":
        why = gpu_reason() if config.l1_hbm.device != "dram" else "l1_hbm.device is dram"
        if why is None:
            import torch

            arena = torch.empty(cap * page, dtype=torch.uint8, device="cuda")
            reg = agent.register_memory(arena)
            prepared = agent.prepare(DescList.blocks(arena, page))
            notes.append(f"l1_hbm: {cap} chunks on {torch.cuda.get_device_name()}")
            return Slab(name, MemType.VRAM, cap, prepared, None, arena, reg)
        if config.l1_hbm.device == "cuda":
            raise BackendUnavailable(f"l1_hbm.device is cuda but L1 cannot live on a GPU here: {why}", backend="cuda")
        notes.append(f"l1_hbm: a host DRAM arena of {cap} chunks stands in for HBM ({why})")
        return host_slab(agent, name, cap, page)
    if name == "l2_dram":
        return host_slab(agent, name, cap, page, pinned=True)
    if name == "l3_nvme":
        directory = Path(config.l3_nvme.path)
        directory.mkdir(parents=True, exist_ok=True)
        reg = agent.register_file(directory / DATA_FILE, size=cap * page, direct=True)
        offsets = np.arange(cap, dtype=np.int64) * page
        prepared = agent.prepare(DescList.file(reg, offsets, page))
        return Slab(name, MemType.FILE, cap, prepared, None, reg, reg)
    l4 = config.l4_pool
    reg = agent.register_objects(l4.bucket, prefix="kv/" if l4.backend == "mooncake" else l4.prefix)
    return Slab(name, MemType.OBJ, cap, None, None, reg, reg)
