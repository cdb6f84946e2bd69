"""A peer's packed UCX remote keys parsed by us before ``ucp_ep_rkey_unpack`` sees them.

UCX 1.21 unpacks a key without knowing its length (``ucp_ep_rkey_unpack`` passes 0,
src/ucp/core/ucp_rkey.c) and hands each memory domain's bytes to the component the
peer's address gave that domain, which reads its own fixed layout whatever size the key
gave it. The shared-memory components then map what those bytes name: posix opens
``/proc/<pid>/fd/<fd>`` for any pid and fd and mmaps the length the key gives, sysv
``shmat``s any segment id (``uct_posix_rkey_unpack`` in src/uct/sm/mm/posix/mm_posix.c,
``uct_sysv_rkey_unpack`` in src/uct/sm/mm/sysv/mm_sysv.c); a put or get through such a key
then touches this process's memory wherever the peer's offsets point. Our agents register
memory (they never allocate it through UCX), so their keys name no such domain: a key that
does is refused, as is one whose layout does not end at its last byte.
``RkeyCheck(address).check`` raises InvalidMetadata naming the peer, the region and the reason.
"""

from __future__ import annotations

import struct

from ...errors import InvalidMetadata
from .address import Address
from .segments import crc16

_MD_BITS = 64
_SYS_DEV_UNKNOWN = 0xFF
_DISTANCE = 3  # ucp_rkey_packed_distance_t: sys_dev, latency, bandwidth
# ucs_memory_type_t values a key for each of our memory types may carry
_MEM_TYPES = {"DRAM": frozenset({0}), "VRAM": frozenset({1, 2})}  # host; cuda, cuda managed
# components whose unpack maps the segment the key names
MAPPING = {crc16(n): n for n in ("posix", "sysv", "xpmem")}
# components whose keys are empty (rkey_packed_size 0, uct_md_base_md_query): any byte there is not theirs
_EMPTY = {crc16(n): n for n in ("self", "tcp", "cma", "cuda_copy")}


class RkeyCheck:
    """The keys one peer may send, judged by the memory domains its UCX worker address names."""

    def __init__(self, address: Address) -> None:
        self._mapping: dict[int, str] = {}
        self._empty: set[int] = set()
        others: set[int] = set()
        for t in address.transports:
            if t.csum in MAPPING:
                self._mapping.setdefault(t.md, MAPPING[t.csum])
            elif t.csum in _EMPTY:
                self._empty.add(t.md)
            else:
                others.add(t.md)
        self._empty -= others  # a domain that also carries another transport may be unpacked by that one

    def check(self, who: str, rid: int, mem: str, key: bytes) -> None:
        """Raise InvalidMetadata unless ``key`` is laid out as ``ucp_rkey_pack`` writes it and maps nothing."""
        try:
            self._walk(mem, key)
        except InvalidMetadata as exc:
            raise InvalidMetadata(f"{who} sent an unusable rkey for region {rid}: {exc.reason}") from None

    def _walk(self, mem: str, key: bytes) -> None:
        if len(key) < 9:
            raise InvalidMetadata(f"{len(key)} bytes, shorter than its memory domain map and type")
        md_map, mem_type = struct.unpack_from("<QB", key)
        if mem_type not in _MEM_TYPES.get(mem, ()):
            raise InvalidMetadata(f"memory type {mem_type} in a key for {mem} memory")
        p = 9
        for md in range(_MD_BITS):
            if not md_map >> md & 1:
                continue
            if p >= len(key):
                raise InvalidMetadata(f"it ends before memory domain {md}'s size")
            size = key[p]
            if p + 1 + size > len(key):
                raise InvalidMetadata(f"memory domain {md}'s {size} bytes run past its end")
            if md in self._mapping:
                raise InvalidMetadata(
                    f"it names memory domain {md}, {self._mapping[md]} shared memory: UCX would map the segment "
                    "it names (an agent's registered memory never has such a key)"
                )
            if md in self._empty and size:
                raise InvalidMetadata(f"memory domain {md} carries {size} bytes where its keys are empty")
            p += 1 + size
        if not md_map:
            if p != len(key):
                raise InvalidMetadata(f"{len(key) - p} bytes after an empty memory domain map")
            return
        if p >= len(key):
            raise InvalidMetadata("it ends before its system device")
        sys_dev = key[p]
        p += 1
        if sys_dev == _SYS_DEV_UNKNOWN:
            if p != len(key):
                raise InvalidMetadata(f"{len(key) - p} bytes after its last field")
            return
        if mem == "DRAM":  # registered host memory has no system device (ucp_memh_t.sys_dev unknown)
            raise InvalidMetadata(f"system device {sys_dev:#x} in a key for {mem} memory")
        # the device distances: UCX reads them until a terminator byte (it does not know where the key ends)
        while p < len(key) and key[p] != _SYS_DEV_UNKNOWN:
            p += _DISTANCE
        if p != len(key) - 1:
            raise InvalidMetadata("its device distances do not end with the terminator as its last byte")
