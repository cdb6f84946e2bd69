"""The binding agent's registrations: DRAM/VRAM regions, files by descriptor, objects by key."""

from __future__ import annotations

import fcntl
import os
from typing import Any

import numpy as np

from ...agents import Registration
from ...descriptors import DescList, MemType
from ...errors import InvalidDescriptor
from ._dlists import nixlRegDList
from ._errors import nixl_errors, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError
from ._types import nixl_status_t


class MemoryMixin:
    """registerMem, deregisterMem, queryMem, and the FILE/OBJ translation transfers need."""

    agent: Any
    _regs: dict[tuple[MemType, int, int, int], Registration]
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
            raise nixlInvalidParamError(f"registerMem takes a nixlRegDList, got {type(descs).__name__}")
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
        mem = descs.descs.mem_type
        made: list[Registration] = []
        try:
            with nixl_errors():
                for i, (addr, length, dev) in enumerate(descs.descs):
                    key = (mem, addr, length, dev)
                    if key in self._regs:
                        raise InvalidDescriptor(f"[{addr:#x}, +{length}) on dev {dev} is already registered", index=i)
                    r = self.agent.register_memory(descs.descs[i : i + 1])
                    made.append(r)
                    self._regs[key] = r
        except BaseException:
            for r in made:
                self._regs.pop((r.mem_type, r.addr, r.length, r.dev), None)
            self.agent.deregister_memory(made)
            raise

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
        return list({id(self._regs[k]): self._regs[k] for k in keys}.values())

    def deregisterMem(self, descs: nixlRegDList, backends: Any = ()) -> nixl_status_t:
        """Deregister what ``registerMem`` registered; a file or object registration goes as a whole."""
        if not isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError(f"deregisterMem takes a nixlRegDList, got {type(descs).__name__}")
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
        """For FILE descriptors, each file's size, mode and mtime by the path in metaInfo (None if absent)."""
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
            out.append({"size": str(st.st_size), "mode": oct(st.st_mode), "mtime": str(int(st.st_mtime))})
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
