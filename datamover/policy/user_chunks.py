"""The caller's buffers as cache chunks: cut into page-sized rows, prepared with the cache's Agent (registered
for the one call when they were not), released after it, and their CRC32Cs computed when a put stores them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..agents import Agent, Prepared
from ..descriptors import DescList, MemType
from ..descriptors.buffers import host_view
from ..errors import NotRegistered


def prepare_user(agent: Agent, buf: Any, n: int, page: int) -> tuple[Prepared, Any]:
    """The caller's buffer cut into n chunks, prepared (registered for this call if it was not). A DescList is
    taken as it is: one chunk a row, in memory the caller registered with this cache's agent."""
    if isinstance(buf, DescList):
        descs = buf
    elif isinstance(buf, list | tuple):
        descs = DescList.from_buffers(buf)
    else:
        descs = DescList.blocks(buf, page)
    if len(descs) < n or (descs.length[:n] != page).any():
        raise ValueError(f"buffer holds {len(descs)} chunk(s) of {page} bytes; {n} needed")
    try:
        return agent.prepare(descs), None
    except NotRegistered:
        if isinstance(buf, DescList):
            raise
    regs: list[Any] = []  # one by one: if one cannot be registered (it overlaps another), none stays registered
    try:
        for part in buf if isinstance(buf, list | tuple) else [buf]:
            regs.append(agent.register_memory(part))
        return agent.prepare(descs), regs
    except BaseException:
        release_user(agent, regs)
        raise


def release_user(agent: Agent, reg: Any) -> None:
    """Deregister what `prepare_user` registered for the call (nothing when it registered nothing)."""
    if reg:
        agent.deregister_memory(reg)


def chunk_crcs(buf: Any, n: int, page: int) -> list[int]:
    """The CRC32C of each of the first n chunks of the caller's buffer (device tensors are copied to the host)."""
    import crc32c

    if isinstance(buf, DescList):
        if buf.mem_type != MemType.DRAM:
            raise ValueError("CRC32C of chunks in device memory needs them as tensors, not descriptors")
        return [crc32c.crc32c(host_view(int(a), page)) for a in buf.addr[:n]]
    parts = buf if isinstance(buf, list | tuple) else [buf]
    host = []
    for p in parts:
        if type(p).__module__.startswith("torch"):
            p = p.detach().cpu().numpy()
        host.append(np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8))
    flat = host[0] if len(host) == 1 else np.concatenate(host)
    return [crc32c.crc32c(flat[i * page : (i + 1) * page]) for i in range(n)]
