"""The binding agent's registrations: DRAM/VRAM regions, files by descriptor, objects by key."""

from __future__ import annotations

import fcntl
import os
from collections import Counter
from typing import Any

import numpy as np

from ...agents import Registration
from ...descriptors import DescList, MemType
from ._dlists import nixlRegDList
from ._errors import nixl_errors, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError
from ._types import nixl_status_t


class MemoryMixin:
    """registerMem, deregisterMem, queryMem, and the FILE/OBJ translation transfers need."""

    agent: Any
    _regs: dict[tuple[MemType, int, int, int], Registration | None]  # None: a zero-length DRAM/VRAM row
    _region_refs: dict[tuple[MemType, int, int, int], int]  # DRAM/VRAM rows: registerMem calls not yet undone
    _core_refs: dict[int, int]  # core registration id: the DRAM/VRAM row registrations it serves
    _files: dict[int, Registration]
    _obj_keys: dict[int, str]
    _obj_bucket: str | None
    _events: Any

    def registerMem(self, descs: nixlRegDList, backends: Any = ()) -> nixl_status_t:
        """Register every descriptor (files by fd, objects by key); a failure registers nothing.

        ``backends`` is accepted: datamover registers with every backend that
        moves the memory type.
        """
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"registerMem takes a nixlRegDList, got {type(descs).__name__}")
        mem = descs.descs.mem_type
        if mem == MemType.OBJ:
            self._register_objects(descs)
        elif mem == MemType.FILE:
            self._register_files(descs)
        else:
            self._register_regions(descs)
        self._events.memory(registered=descs.descs.nbytes)
        return nixl_status_t.NIXL_SUCCESS

    def _register_regions(self, descs: nixlRegDList) -> None:
        """DRAM/VRAM rows, each one NIXL registration, as NIXL's UCX takes them: a region registered again, or
        one inside a region registered already, is counted against the core registration that covers it (the
        core refuses overlap) instead of being registered again; a zero-length row is an entry with no region.
        Each ``deregisterMem`` of a row undoes one ``registerMem`` of it; the core registration goes with the
        last row it serves."""
        mem = descs.descs.mem_type
        done: list[tuple[MemType, int, int, int]] = []
        try:
            with nixl_errors():
                for i, (addr, length, dev) in enumerate(descs.descs):
                    key = (mem, addr, length, dev)
                    if key not in self._region_refs:
                        r = None if length == 0 else self._covering(key)
                        if r is None and length > 0:
                            r = self.agent.register_memory(descs.descs[i : i + 1])
                        self._regs[key] = r
                    self._region_refs[key] = self._region_refs.get(key, 0) + 1
                    if self._regs[key] is not None:
                        rid = self._regs[key].id
                        self._core_refs[rid] = self._core_refs.get(rid, 0) + 1
                    done.append(key)
        except BaseException:
            self._release_regions(reversed(done))
            raise

    def _covering(self, key: tuple[MemType, int, int, int]) -> Registration | None:
        """The core registration (of this facade's DRAM/VRAM rows) that holds the row ``key``, if any."""
        mem, addr, length, dev = key
        for r in self._regs.values():
            if r is not None and r.mem_type == mem and r.dev == dev and r.addr <= addr and addr + length <= r.end:
                return r
        return None

    def _release_regions(self, keys: Any) -> None:
        """Undo one registration of each DRAM/VRAM row; core registrations no row needs any more go."""
        gone: list[Registration] = []
        for key in keys:
            r = self._regs.get(key)
            left = self._region_refs[key] - 1
            if left:
                self._region_refs[key] = left
            else:
                del self._region_refs[key], self._regs[key]
            if r is not None:
                self._core_refs[r.id] -= 1
                if not self._core_refs[r.id]:
                    del self._core_refs[r.id]
                    gone.append(r)
        if gone:
            self.agent.deregister_memory(gone)

    def _register_files(self, descs: nixlRegDList) -> None:
        """FILE rows are (offset, len, fd, metaInfo): register each fd's file up to its furthest row.

        The file is never extended (NIXL's POSIX plugin does not touch it): a READ past its end fails
        (nixlBackendError), a WRITE past it grows the file.
        """
        ends: dict[int, int] = {}
        for off, length, fd in descs.descs:
            ends[fd] = max(ends.get(fd, 0), off + length)
        for fd in ends:
            if fd in self._files:
                raise nixlInvalidParamError(f"file descriptor {fd} is already registered")
        made: list[tuple[int, Registration]] = []
        try:
            for fd, end in ends.items():
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                    direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
                except OSError as exc:
                    raise nixlInvalidParamError(f"file descriptor {fd} is not open: {exc.strerror}") from None
                with nixl_errors():
                    r = self.agent.register_file(path, size=end, direct=direct, create=False, extend=False)
                made.append((fd, r))
                self._files[fd] = r
        except BaseException:
            for fd, r in made:
                self._files.pop(fd, None)
                self.agent.deregister_memory(r)
            raise
        for off, length, fd in descs.descs:
            self._regs[(MemType.FILE, off, length, fd)] = self._files[fd]

    def _register_objects(self, descs: nixlRegDList) -> None:
        """OBJ rows are (offset, len, devId, key): devId names the object metaInfo gives (else str(devId))."""
        bucket = self._obj_bucket or os.environ.get("AWS_DEFAULT_BUCKET")
        if not bucket:
            raise nixlInvalidParamError("OBJ registration needs a bucket: create_backend('OBJ', {'bucket': ...})")
        keys: dict[int, str] = {}
        for (_, _, dev), meta in zip(descs.descs, descs.meta):
            key = os.fsdecode(meta) if meta else str(dev)
            if keys.get(dev, key) != key or (dev in self._obj_keys and self._obj_keys[dev] != key):
                raise nixlInvalidParamError(f"devId {dev} names two objects")
            keys[dev] = key
        with nixl_errors():
            r = self.agent.register_objects(bucket, keys=list(dict.fromkeys(keys.values())))
        self._obj_keys.update(keys)
        for a, n, d in descs.descs:
            self._regs[(MemType.OBJ, a, n, d)] = r

    def _registrations_of(self, descs: nixlRegDList) -> list[Registration]:
        """The registrations behind a list's descriptors; nixlNotFoundError names the first one not registered."""
        mem = descs.descs.mem_type
        keys = [(mem, a, n, d) for a, n, d in descs.descs]
        missing = [k for k in keys if k not in self._regs]
        if missing:
            _, a, n, d = missing[0]
            raise nixlNotFoundError(f"{mem} descriptor ({a:#x}, {n}, {d}) was not registered through this agent")
        regs = (self._regs[k] for k in keys)
        return list({id(r): r for r in regs if r is not None}.values())

    def deregisterMem(self, descs: nixlRegDList, backends: Any = ()) -> nixl_status_t:
        """Deregister what ``registerMem`` registered: a DRAM/VRAM row undoes one registration of it, a file or
        object registration goes as a whole."""
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"deregisterMem takes a nixlRegDList, got {type(descs).__name__}")
        mem = descs.descs.mem_type
        if mem in (MemType.DRAM, MemType.VRAM):
            keys = [(mem, a, n, d) for a, n, d in descs.descs]
            wanted = Counter(keys)
            short = [k for k, c in wanted.items() if self._region_refs.get(k, 0) < c]
            if short:
                _, a, n, d = short[0]
                raise nixlNotFoundError(f"{mem} descriptor ({a:#x}, {n}, {d}) was not registered through this agent")
            with nixl_errors():
                self._release_regions(keys)
            self._events.memory(deregistered=descs.descs.nbytes)
            return nixl_status_t.NIXL_SUCCESS
        regs = self._registrations_of(descs)
        for k, r in list(self._regs.items()):
            if any(r is x for x in regs):
                del self._regs[k]
                if k[0] == MemType.OBJ:
                    self._obj_keys.pop(k[3], None)
        for fd, r in list(self._files.items()):
            if any(r is x for x in regs):
                del self._files[fd]
        with nixl_errors():
            self.agent.deregister_memory(regs)
        self._events.memory(deregistered=descs.descs.nbytes)
        return nixl_status_t.NIXL_SUCCESS

    def queryMem(self, descs: nixlRegDList, backend: Any) -> list[dict[str, str] | None]:
        """For FILE descriptors, each file's size, mode and mtime by the path in metaInfo (None if absent), as
        decimal strings (NIXL's POSIX plugin: mode "33188", not "0o100644")."""
        self._backend_name(backend)  # type: ignore[attr-defined]
        if descs.descs.mem_type != MemType.FILE:
            raise nixlNotSupportedError(f"queryMem supports FILE descriptors only, got {descs.descs.mem_type}")
        out: list[dict[str, str] | None] = []
        for meta in descs.meta:
            try:
                st = os.stat(os.fsdecode(meta))
            except (OSError, ValueError):
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))})
        return out

    def _own_side(self, descs: DescList) -> DescList:
        """This agent's descriptors in datamover's form: FILE rows carry the file's id, not the caller's fd,
        and OBJ rows index the list's own key table instead of naming a devId."""
        if descs.mem_type == MemType.OBJ and len(descs):
            devs, inverse = np.unique(descs.dev, return_inverse=True)
            missing = [int(d) for d in devs.tolist() if int(d) not in self._obj_keys]
            if missing:
                i = int(np.flatnonzero(descs.dev == missing[0])[0])
                raise nixlNotFoundError(f"descriptor {i}: object devId {missing[0]} is not registered")
            keys = [self._obj_keys[int(d)] for d in devs.tolist()]
            return DescList.from_columns(descs.addr, descs.length, inverse.reshape(-1), MemType.OBJ, keys=keys)
        if descs.mem_type != MemType.FILE or len(descs) == 0:
            return descs
        fds = np.fromiter(self._files.keys(), dtype=np.int64, count=len(self._files))
        ids = np.fromiter((r.dev for r in self._files.values()), dtype=np.int64, count=len(self._files))
        order = np.argsort(fds)
        fds, ids = fds[order], ids[order]
        pos = np.searchsorted(fds, descs.dev)
        ok = pos < fds.shape[0]
        ok[ok] = fds[pos[ok]] == descs.dev[ok]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise nixlNotFoundError(f"descriptor {i}: file descriptor {int(descs.dev[i])} is not registered")
        return DescList.from_columns(descs.addr, descs.length, ids[pos], MemType.FILE)
