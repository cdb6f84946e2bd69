"""An agent's own memory: registering and deregistering regions, and finding the region of each descriptor."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ..descriptors import DescList, MemType, RegionTable, Registration, buffer_info
from ..errors import InvalidDescriptor, NotRegistered, TransferStateError
from .backend_set import BackendSet


class Registry:
    """The registrations of one agent (``owner``) and the RegionTable over them.

    Each registration is handed to every running backend that serves its memory
    type (and undone there if one refuses). ``on_change`` runs after every
    (de)registration, under the agent's lock.
    """

    def __init__(self, owner: str, lock: threading.RLock, backends: BackendSet, on_change: Callable[[], None]) -> None:
        self._owner = f"agent {owner!r}"
        self._lock = lock
        self._backends = backends
        self._on_change = on_change
        self._next_id = 1
        self._regs: dict[int, Registration] = {}
        #: registrations by id: a live, read-only view
        self.regions: Mapping[int, Registration] = MappingProxyType(self._regs)
        #: the lookup table over ``regions``; a new object after each (de)registration
        self.table = RegionTable()
        #: set when the agent closes: transfers posted from then on are refused
        self.closed = False
        #: bumped when a region goes or the agent closes: a post checks its regions only when it moved
        self.generation = 0
        self._transfers: set[weakref.ref] = set()  # every live Transfer made on these regions
        self._going: set[int] = set()  # regions being deregistered: waiting for the transfers on them

    # -- registering ---------------------------------------------------------
    def register(self, x: Any) -> Registration | list[Registration]:
        """A buffer (or each buffer of a list, or each row of a DescList), made addressable. Several are registered
        all or none: when one is refused, those registered before it are given back and the error raised."""
        if isinstance(x, DescList):
            items = [(int(a), int(n), x.mem_type, int(d), x.owners) for a, n, d in x]
            regs = self._all_or_none([lambda item=item: self._register_region(*item) for item in items])
            return regs[0] if len(regs) == 1 else regs
        if isinstance(x, (list, tuple)):
            return self._all_or_none([lambda b=b: self.register(b) for b in x])  # type: ignore[misc]
        info = buffer_info(x)
        return self._register_region(info.addr, info.nbytes, info.mem_type, info.dev, info.owner)

    def _all_or_none(self, makers: list[Any]) -> list[Any]:
        """Run each registration of ``makers``; if one raises, undo those done (nested lists too) and re-raise."""
        done: list[Any] = []
        try:
            for make in makers:
                done.append(make())
        except BaseException:
            for reg in reversed(done):
                try:
                    self.deregister(reg)
                except Exception:  # the first error is the one the caller hears of
                    pass
            raise
        return done

    def _register_region(self, addr: int, nbytes: int, mem: MemType, dev: int, owner: Any) -> Registration:
        if mem not in (MemType.DRAM, MemType.VRAM):
            raise InvalidDescriptor(
                f"register_memory takes DRAM or VRAM memory, got {mem}; use register_file / register_objects"
            )
        if nbytes <= 0:
            raise InvalidDescriptor("cannot register an empty buffer")
        with self._lock:
            other = self.table.overlapping(mem, dev, addr, nbytes)
            if other is not None:
                raise InvalidDescriptor(f"[{addr:#x}, +{nbytes}) overlaps region {other} already registered")
            return self._add(Registration(self._new_id(), mem, addr, nbytes, dev, owner=owner))

    def register_file(
        self, path: str | os.PathLike, size: int | None, direct: bool, create: bool, *, extend: bool = True
    ) -> Registration:
        """A file registered for FILE descriptors over ``[0, size)``; ``size`` extends it if shorter and ``extend``."""
        path = os.fspath(path)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise InvalidDescriptor(f"cannot open {path!r}: {exc.strerror}") from exc
        try:
            current = os.fstat(fd).st_size
            if size is not None:
                if size < 0:
                    raise InvalidDescriptor(f"file size must be >= 0, got {size}")
                if current < size and extend:
                    os.ftruncate(fd, size)
            length = current if size is None else int(size)
        finally:
            os.close(fd)
        with self._lock:
            rid = self._new_id()
            return self._add(Registration(rid, MemType.FILE, 0, length, rid, path=path, direct=bool(direct)))

    def register_objects(self, bucket: str, keys: Iterable[str] | None, prefix: str | None) -> Registration:
        """The listed ``keys`` of ``bucket``, or every key under ``prefix`` (neither: the whole bucket)."""
        if not isinstance(bucket, str) or not bucket:
            raise InvalidDescriptor("bucket must be a non-empty string")
        key_list = None if keys is None else [str(k) for k in keys]
        with self._lock:
            rid = self._new_id()
            extra = {"bucket": bucket, "keys": key_list, "prefix": prefix or ""}
            return self._add(Registration(rid, MemType.OBJ, 0, 0, rid, extra=extra))

    def _new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _add(self, reg: Registration) -> Registration:
        done: list[str] = []
        running = self._backends.running
        try:
            for name, inst in running.items():
                if reg.mem_type in inst.mem_types():
                    reg.handles[name] = inst.register(reg)
                    done.append(name)
        except BaseException:
            for name in done:
                running[name].deregister(reg, reg.handles.pop(name))
            raise
        self._regs[reg.id] = reg
        self._changed()
        return reg

    def deregister(self, reg: Registration | Iterable[Registration]) -> None:
        """Undo a registration (or several) in every backend that holds it, once no transfer in flight uses it:
        a post from now on is refused, and one in flight is waited for (to its deadline, where it times out)."""
        if not isinstance(reg, Registration):
            for r in reg:
                self.deregister(r)
            return
        with self._lock:
            if self._regs.get(reg.id) is not reg or reg.id in self._going:
                raise NotRegistered(f"region {reg.id} is not registered with {self._owner}")
            # going: new transfers no longer find it and posts refuse it, while the backends still see it
            # (``regions``) for the transfers in flight on it
            self._going.add(reg.id)
            self.generation += 1
            self._changed()
        try:
            for t in self._live():  # outside the lock: a transfer may need it to finish
                if reg.id in t.request.own_regions:
                    t.settle()
        except BaseException:
            with self._lock:
                self._going.discard(reg.id)
                self._changed()
            raise
        with self._lock:
            for name, handle in list(reg.handles.items()):
                inst = self._backends.running.get(name)
                if inst is not None:
                    inst.deregister(reg, handle)
            reg.handles.clear()
            del self._regs[reg.id]
            self._going.discard(reg.id)
            self._changed()

    def deregister_all(self) -> None:
        """Undo every registration (closing the agent)."""
        with self._lock:
            for reg in [r for r in self._regs.values() if r.id not in self._going]:
                self.deregister(reg)

    # -- transfers on these regions ---------------------------------------------
    def track(self, transfer: Any) -> None:
        """Remember a transfer made on these regions, for as long as it lives (TransferTracker)."""
        refs = self._transfers
        refs.add(weakref.ref(transfer, refs.discard))

    def close(self) -> None:
        """Refuse every post from now on (the agent is closing)."""
        self.closed = True
        self.generation += 1

    def check_live(self, regions: tuple[int, ...], backend: str) -> None:
        """Refuse a post whose regions were deregistered since its transfer was made, or once the agent closed
        (TransferTracker; a post's bytes would go to memory or a file no longer the caller's)."""
        if self.closed:
            raise TransferStateError(f"{self._owner} is closed", backend=backend)
        regs, going = self._regs, self._going
        for rid in regions:
            if rid not in regs or rid in going:
                raise NotRegistered(
                    f"region {rid} was deregistered from {self._owner} after this transfer was made", backend=backend
                )

    def abort_all(self, reason: str) -> None:
        """Cut every transfer in flight on these regions short and wait for each to stop (closing the agent)."""
        for t in self._live():
            if t.in_flight:
                t.abort(reason)

    def _live(self) -> list[Any]:
        """The transfers still alive (a snapshot: a collection may drop some from the set meanwhile)."""
        while True:
            try:
                refs = list(self._transfers)
                break
            except RuntimeError:  # the set changed size during the copy: copy again
                continue
        return [t for t in (r() for r in refs) if t is not None]

    def _changed(self) -> None:
        live = (r for r in self._regs.values() if r.id not in self._going)
        self.table = RegionTable((r.mem_type, r.dev, r.addr, r.length, r.id) for r in live)
        self._on_change()

    def check_registered(self, regs: Iterable[Registration]) -> list[Registration]:
        """``regs`` as a list, each checked to be one of these registrations (NotRegistered if not)."""
        out = list(regs)
        for r in out:
            if self._regs.get(r.id) is not r:
                raise NotRegistered(f"{r!r} is not registered with {self._owner}")
        return out

    # -- finding descriptors ---------------------------------------------------
    def lookup(self, descs: DescList) -> np.ndarray:
        """The region id of every descriptor (NotRegistered naming the first outside all regions)."""
        if descs.mem_type == MemType.OBJ:
            return self._lookup_objects(descs)
        return self.table.lookup(descs, owner=self._owner)

    def _lookup_objects(self, descs: DescList) -> np.ndarray:
        """Region id per OBJ row: the registration covering each key (one Python step per distinct key)."""
        if len(descs) == 0:
            return np.zeros(0, dtype=np.int64)
        keys = descs.keys or ()
        if int(descs.dev.max()) >= len(keys):
            i = int(np.flatnonzero(descs.dev >= len(keys))[0])
            raise InvalidDescriptor(f"key index {int(descs.dev[i])} is outside the list's {len(keys)} keys", index=i)
        regs = [r for r in self._regs.values() if r.mem_type == MemType.OBJ and r.id not in self._going]
        key_reg = np.full(len(keys), -1, dtype=np.int64)
        for k, key in enumerate(keys):
            for r in regs:
                listed = r.extra["keys"]
                if (listed is not None and key in r.extra.setdefault("key_set", frozenset(listed))) or (
                    listed is None and key.startswith(r.extra["prefix"])
                ):
                    key_reg[k] = r.id
                    break
        out = key_reg[descs.dev]
        if (out < 0).any():
            i = int(np.flatnonzero(out < 0)[0])
            raise NotRegistered(f"object key {keys[int(descs.dev[i])]!r} is in no registered bucket or prefix", index=i)
        return out
