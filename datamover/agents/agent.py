"""Agent: registers memory, validates descriptors, picks a backend and makes transfers."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ..backends import backend_names, backend_status, get_backend_class
from ..backends.base import Backend, Op, TransferRequest, clock
from ..descriptors import DescList, MemType, RegionTable, Registration, buffer_info
from ..descriptors.coalesce import coalesce_runs, first_overlap, take_runs
from ..errors import (
    AuthenticationError,
    BackendUnavailable,
    InvalidDescriptor,
    InvalidMetadata,
    LengthMismatch,
    NotificationTimeout,
    NotRegistered,
    OverlappingDestination,
    UnsupportedTransfer,
)
from . import peer_auth
from .config import AgentConfig
from .metadata import AgentMetadata, agent_ident, decode_metadata, encode_metadata, open_metadata, sign_metadata
from .transfer import Transfer

log = logging.getLogger("datamover.agent")


class Prepared:
    """A validated descriptor list: what ``make_transfer`` indexes into.

    ``agent`` is the owner's name (None for this agent); ``regions`` the
    region id of every descriptor, looked up once here.
    """

    __slots__ = ("agent", "descs", "regions")

    def __init__(self, descs: DescList, agent: str | None, regions: np.ndarray) -> None:
        self.descs = descs
        self.agent = agent
        self.regions = regions

    def __len__(self) -> int:
        return len(self.descs)

    def __repr__(self) -> str:
        return f"Prepared({self.descs!r}, agent={self.agent!r})"


def _as_desclist(x: Any) -> DescList:
    return x if isinstance(x, DescList) else DescList.from_buffers(x)


def _index_array(idx: Any, n: int, what: str) -> np.ndarray:
    arr = np.arange(n, dtype=np.int64) if idx is None else np.asarray(idx)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidDescriptor(f"{what} indices must be a 1-D integer array")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        bad = int(np.flatnonzero((arr < 0) | (arr >= n))[0])
        raise InvalidDescriptor(f"{what} index {int(arr[bad])} is out of range for {n} prepared descriptors", index=bad)
    return arr


class Agent:
    """A transfer agent: owns registered memory and moves bytes through backends.

    ``config`` is an AgentConfig or a dict of the same shape; keyword
    overrides (e.g. ``listen_port=0``) replace its fields. The Agent is its
    backends' ``BackendHost``: ``regions``, ``region_table``, ``secret``,
    ``timeout_s``, ``deliver_notification`` and ``clock`` are what they see.
    """

    #: the clock of every deadline (BackendHost)
    clock = staticmethod(clock)

    def __init__(self, name: str, config: AgentConfig | Mapping[str, Any] | None = None, **overrides: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("agent name must be a non-empty string")
        cfg = AgentConfig.from_any(config)
        if overrides:
            cfg = AgentConfig.from_any({**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, **overrides})
        self.name = name
        self.config = cfg
        self._lock = threading.RLock()
        self._next_id = 1
        self._regs: dict[int, Registration] = {}
        self._regions = MappingProxyType(self._regs)
        self._table = RegionTable()
        self._backends: dict[str, Backend] = {}
        # (local, remote, to a peer, backends asked for) -> the backend that moves it
        self._chosen: dict[tuple, Backend] = {}
        self._oneshot: dict[tuple, _OneShot] = {}  # transfer()'s last transfer per (lists, op, ...), see there
        self._oneshot_lock = threading.Lock()
        self._enabled: list[str] | None = None
        self._remotes: dict[str, AgentMetadata] = {}
        self._notif_cond = threading.Condition()
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False
        self._sources: dict[str, tuple] = {}  # peer -> where its metadata came from, for refresh_remote
        self._watches: dict[str, Any] = {}
        self._publisher: Any = None
        self._side: Any = None
        self._token = os.urandom(peer_auth.TOKEN_BYTES)  # proves to peers that a PUSH or DROP comes from this agent
        self._push_budget = peer_auth.PushBudget(**cfg.extra.get("push_budget", {}))
        if cfg.listen_port is not None:
            from .side_channel import MetadataServer, SideChannelLimits

            host = str(cfg.extra.get("listen_host", "127.0.0.1"))
            limits = SideChannelLimits(**cfg.extra.get("side_channel", {}))
            self._side = MetadataServer(
                self.metadata, host=host, port=int(cfg.listen_port), on_push=self._pushed, on_drop=self._dropped,
                limits=limits,
            )  # fmt: skip

    # -- backends ----------------------------------------------------------
    def enabled_backends(self) -> list[str]:
        """Backend names this agent may use, in preference order."""
        if self._enabled is None:
            if self.config.backends is not None:
                self._enabled = list(self.config.backends)
            else:
                self._enabled = [n for n in backend_names() if backend_status(n)[0]]
        return self._enabled

    def backend(self, name: str) -> Backend:
        """The running instance of backend ``name``, started on first use."""
        with self._lock:
            inst = self._backends.get(name)
            if inst is not None:
                return inst
            if name not in self.enabled_backends():
                raise BackendUnavailable(f"backend {name!r} is not enabled in this agent's config", backend=name)
            ok, reason = backend_status(name)
            if not ok:
                raise BackendUnavailable(reason, backend=name)
            cls = get_backend_class(name)
            params = (self.config.backends or {}).get(name, {})
            inst = cls(self, params)
            try:
                for reg in self._regs.values():
                    if reg.mem_type in cls.mem_types():
                        reg.handles[name] = inst.register(reg)
            except BaseException:
                inst.close()
                raise
            self._backends[name] = inst
            return inst

    def _choose_backend(self, local: MemType, remote: MemType, remote_agent: bool, only: Any) -> Backend:
        key = (local, remote, remote_agent, only if only is None or isinstance(only, str) else tuple(only))
        inst = self._chosen.get(key)
        if inst is None:
            inst = self._chosen[key] = self._pick_backend(local, remote, remote_agent, only)
        return inst

    def _pick_backend(self, local: MemType, remote: MemType, remote_agent: bool, only: Any) -> Backend:
        names = self.enabled_backends() if only is None else ([only] if isinstance(only, str) else list(only))
        unusable = []
        for name in names:
            try:
                cls = get_backend_class(name)
            except Exception as exc:
                unusable.append(f"{name} ({exc})")
                continue
            if not cls.moves(local, remote, remote_agent):
                continue
            ok, reason = backend_status(name)
            if ok:
                return self.backend(name)
            unusable.append(f"{name} ({reason})")
        where = "to a remote agent" if remote_agent else "within this agent"
        msg = f"no enabled backend moves {local} -> {remote} {where}; tried {', '.join(names) or 'none'}"
        if unusable:
            msg += "; unusable here: " + "; ".join(unusable)
        raise UnsupportedTransfer(msg)

    # -- registration ------------------------------------------------------
    def register_memory(self, x: Any) -> Registration | list[Registration]:
        """Make a buffer (or each buffer of a list, or each row of a DescList) addressable."""
        if isinstance(x, DescList):
            items = [(int(a), int(n), x.mem_type, int(d), x.owners) for a, n, d in x]
            regs = [self._register_region(*item) for item in items]
            return regs[0] if len(regs) == 1 else regs
        if isinstance(x, (list, tuple)):
            return [self.register_memory(b) for b in x]  # type: ignore[misc]
        info = buffer_info(x)
        return self._register_region(info.addr, info.nbytes, info.mem_type, info.dev, info.owner)

    def _register_region(self, addr: int, nbytes: int, mem: MemType, dev: int, owner: Any) -> Registration:
        if mem not in (MemType.DRAM, MemType.VRAM):
            raise InvalidDescriptor(
                f"register_memory takes DRAM or VRAM memory, got {mem}; use register_file / register_objects"
            )
        if nbytes <= 0:
            raise InvalidDescriptor("cannot register an empty buffer")
        with self._lock:
            other = self._table.overlapping(mem, dev, addr, nbytes)
            if other is not None:
                raise InvalidDescriptor(f"[{addr:#x}, +{nbytes}) overlaps region {other} already registered")
            reg = Registration(self._new_id(), mem, addr, nbytes, dev, owner=owner)
            return self._add_registration(reg)

    def register_file(
        self, path: str | os.PathLike, size: int | None = None, direct: bool = True, create: bool = True
    ) -> Registration:
        """Register a file for FILE descriptors; ``size`` extends it if shorter.

        FILE descriptors address ``[0, size)`` of it (the current size when
        ``size`` is None). ``direct`` asks for O_DIRECT where the filesystem
        allows it.
        """
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
                if current < size:
                    os.ftruncate(fd, size)
            length = current if size is None else int(size)
        finally:
            os.close(fd)
        with self._lock:
            rid = self._new_id()
            reg = Registration(rid, MemType.FILE, 0, length, rid, path=path, direct=bool(direct))
            return self._add_registration(reg)

    def register_objects(
        self, bucket: str, keys: Iterable[str] | None = None, prefix: str | None = None
    ) -> Registration:
        """Make objects of ``bucket`` addressable: the listed ``keys``, or every key under ``prefix``.

        With neither, the whole bucket is addressable. OBJ descriptors name
        objects through their list's key table; offsets are not bounded here
        because objects may not exist until written.
        """
        if not isinstance(bucket, str) or not bucket:
            raise InvalidDescriptor("bucket must be a non-empty string")
        key_list = None if keys is None else [str(k) for k in keys]
        with self._lock:
            rid = self._new_id()
            reg = Registration(
                rid, MemType.OBJ, 0, 0, rid, extra={"bucket": bucket, "keys": key_list, "prefix": prefix or ""}
            )
            return self._add_registration(reg)

    def _new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _add_registration(self, reg: Registration) -> Registration:
        done: list[str] = []
        try:
            for name, inst in self._backends.items():
                if reg.mem_type in inst.mem_types():
                    reg.handles[name] = inst.register(reg)
                    done.append(name)
        except BaseException:
            for name in done:
                self._backends[name].deregister(reg, reg.handles.pop(name))
            raise
        self._regs[reg.id] = reg
        self._rebuild_table()
        self._metadata_changed()
        return reg

    def deregister_memory(self, reg: Registration | Iterable[Registration]) -> None:
        """Undo a registration (or several); its memory is no longer addressable."""
        if not isinstance(reg, Registration):
            for r in reg:
                self.deregister_memory(r)
            return
        with self._lock:
            if self._regs.get(reg.id) is not reg:
                raise NotRegistered(f"region {reg.id} is not registered with agent {self.name!r}")
            for name, handle in list(reg.handles.items()):
                inst = self._backends.get(name)
                if inst is not None:
                    inst.deregister(reg, handle)
            reg.handles.clear()
            del self._regs[reg.id]
            self._rebuild_table()
            self._metadata_changed()

    def _rebuild_table(self) -> None:
        self._oneshot.clear()
        self._table = RegionTable((r.mem_type, r.dev, r.addr, r.length, r.id) for r in self._regs.values())

    @property
    def registrations(self) -> dict[int, Registration]:
        """This agent's registrations by id (a copy)."""
        return dict(self._regs)

    # -- what backends see (BackendHost) -------------------------------------
    @property
    def regions(self) -> Mapping[int, Registration]:
        """This agent's registrations by id: a live, read-only view."""
        return self._regions

    @property
    def region_table(self) -> RegionTable:
        """The lookup table over ``regions``; a new object after each (de)registration."""
        return self._table

    @property
    def secret(self) -> bytes | None:
        """The shared secret of metadata and control connections (the config's), if any."""
        return self.config.secret

    @property
    def timeout_s(self) -> float:
        """The config's default bound on a transfer, in seconds."""
        return float(self.config.timeout_s)

    # -- descriptors and transfers -----------------------------------------
    def prepare(self, descs: Any, agent: str | None = None) -> Prepared:
        """Validate descriptors once (vectorized) against their owner's registered memory."""
        descs = _as_desclist(descs)
        if agent is None or agent == self.name:
            return Prepared(descs, None, self._lookup(descs))
        return Prepared(descs, agent, self._lookup_remote(descs, agent))

    def _lookup_remote(self, descs: DescList, agent: str) -> np.ndarray:
        meta = self._remotes.get(agent)
        if meta is None:
            raise NotRegistered(f"unknown remote agent {agent!r}; load its metadata with add_remote() first")
        try:
            return meta.table.lookup(descs, owner=f"agent {agent!r}")
        except NotRegistered as exc:
            raise NotRegistered(
                f"{exc.reason} (as of its metadata loaded here; if it registered memory since, refresh: "
                f"add_remote() its new metadata or refresh_remote({agent!r}))",
                index=exc.index,
                backend=exc.backend,
            ) from None

    def _lookup(self, descs: DescList) -> np.ndarray:
        if descs.mem_type == MemType.OBJ:
            return self._lookup_objects(descs)
        return self._table.lookup(descs, owner=f"agent {self.name!r}")

    def _lookup_objects(self, descs: DescList) -> np.ndarray:
        """Region id per OBJ row: the registration covering each key (one Python step per distinct key)."""
        if len(descs) == 0:
            return np.zeros(0, dtype=np.int64)
        keys = descs.keys or ()
        if int(descs.dev.max()) >= len(keys):
            i = int(np.flatnonzero(descs.dev >= len(keys))[0])
            raise InvalidDescriptor(f"key index {int(descs.dev[i])} is outside the list's {len(keys)} keys", index=i)
        regs = [r for r in self._regs.values() if r.mem_type == MemType.OBJ]
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

    def make_transfer(
        self,
        op: str,
        local: Prepared,
        local_idx: Any,
        remote: Prepared,
        remote_idx: Any,
        notify: bytes = b"",
        backends: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        """Build a transfer from index arrays into prepared lists; O(1) Python calls per descriptor batch.

        ``timeout`` (seconds, default the config's ``timeout_s``) bounds each post.
        """
        op = Op.parse(op)
        if local.agent is not None:
            raise InvalidDescriptor("the local list was prepared for a remote agent")
        li = _index_array(local_idx, len(local), "local")
        ri = _index_array(remote_idx, len(remote), "remote")
        if li.shape[0] != ri.shape[0]:
            raise LengthMismatch(f"{li.shape[0]} local descriptor(s) but {ri.shape[0]} remote")
        ldescs = local.descs if li.shape[0] == len(local) and _is_identity(li) else local.descs[li]
        rdescs = remote.descs if ri.shape[0] == len(remote) and _is_identity(ri) else remote.descs[ri]
        return self._make(
            op, ldescs, local.regions[li], rdescs, remote.regions[ri], remote.agent, notify, backends, timeout
        )

    def _make(
        self,
        op: Op,
        ldescs: DescList,
        lreg: np.ndarray,
        rdescs: DescList,
        rreg: np.ndarray,
        remote_agent: str | None,
        notify: bytes,
        backends: str | list[str] | None,
        timeout: float | None,
        one_region: bool = False,
    ) -> Transfer:
        """The transfer of validated, looked-up descriptors: what ``make_transfer`` and ``transfer`` share.

        ``one_region``: each side lies in one region on one device (lets coalescing skip those checks).
        """
        n = len(ldescs)
        if len(rdescs) != n:
            raise LengthMismatch(f"{n} local descriptor(s) but {len(rdescs)} remote")
        diff = ldescs.length != rdescs.length
        if diff.any():
            i = int(np.flatnonzero(diff)[0])
            raise LengthMismatch(
                f"local length {int(ldescs.length[i])} != remote length {int(rdescs.length[i])}", index=i
            )
        backend = self._choose_backend(ldescs.mem_type, rdescs.mem_type, remote_agent is not None, backends)
        pair = first_overlap(rdescs if op is Op.WRITE else ldescs)
        if pair is not None:
            raise OverlappingDestination(
                f"destination overlaps destination descriptor {pair[0]}", index=pair[1], backend=backend.name
            )
        starts, lengths = coalesce_runs(ldescs, rdescs, lreg, rreg, one_region=one_region)
        req = TransferRequest(
            op=op,
            local=take_runs(ldescs, starts, lengths),
            remote=take_runs(rdescs, starts, lengths),
            remote_agent=remote_agent,
            local_regions=lreg[starts],
            remote_regions=rreg[starts],
            registrations=self._regions,
            first_index=starts,
            caller_lengths=ldescs.length if starts.shape[0] < len(ldescs) else None,
            notify=bytes(notify),
            timeout=float(self.config.timeout_s if timeout is None else timeout),
        )
        req.plan = backend.plan(req)
        return Transfer(self, backend, req, descriptors=n)

    def transfer(
        self,
        op: str,
        local: Any,
        remote: Any,
        agent: str | None = None,
        notify: bytes = b"",
        backends: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        """One-shot: validate both sides, make the transfer and post it.

        The same machinery as ``prepare`` + ``make_transfer`` without what a
        one-shot does not need (Prepared lists, index arrays); the backend
        chosen for a pair of memory types is remembered.
        """
        op = Op.parse(op)
        remote_agent = None if agent is None or agent == self.name else agent
        table = self._table
        meta = None if remote_agent is None else self._remotes.get(remote_agent)
        key = None
        if type(local) is DescList and type(remote) is DescList:
            # the same (immutable) lists again, against the same regions and peer metadata: the last
            # transfer's validation, coalescing, backend and plan still hold
            only = backends if backends is None or isinstance(backends, str) else tuple(backends)
            key = (id(local), id(remote), op, remote_agent, only, bytes(notify), timeout)
            with self._oneshot_lock:
                hit = self._oneshot.get(key)
                if (
                    hit is not None
                    and hit.local() is local
                    and hit.remote() is remote
                    and hit.table is table
                    and hit.meta is meta
                ):
                    x = hit.last.fork()
                    if x is not None:
                        hit.last = x
                        return x.post()
        ldescs, rdescs = _as_desclist(local), _as_desclist(remote)
        lrid = table.lookup_one(ldescs)
        if remote_agent is None:
            rrid = table.lookup_one(rdescs)
        else:
            rrid = None if meta is None else meta.table.lookup_one(rdescs)
        one_region = lrid is not None and rrid is not None
        if one_region:  # each side inside one region: nothing more to look up
            lreg, rreg = np.full(len(ldescs), lrid, dtype=np.int64), np.full(len(rdescs), rrid, dtype=np.int64)
        else:
            lreg = self._lookup(ldescs)
            rreg = self._lookup(rdescs) if remote_agent is None else self._lookup_remote(rdescs, remote_agent)
        x = self._make(op, ldescs, lreg, rdescs, rreg, remote_agent, notify, backends, timeout, one_region)
        if key is not None:
            entry = _OneShot(local, remote, table, meta, x)
            with self._oneshot_lock:
                if table is self._table:
                    if len(self._oneshot) >= _ONESHOT_CACHE:
                        self._oneshot.pop(next(iter(self._oneshot)))
                    self._oneshot[key] = entry
        return x.post()

    # -- metadata and peers ------------------------------------------------
    def metadata(self, registrations: Iterable[Registration] | None = None, *, connection: bool = True) -> bytes:
        """This agent's metadata blob: name, remote backends' connection info, regions.

        With ``registrations``, a partial blob of those regions only (and, unless
        ``connection`` is False, the connection info), which a peer merges into
        what it already knows of this agent instead of replacing it.
        """
        with self._lock:
            partial = registrations is not None
            infos = {}
            for name in self.enabled_backends() if connection else ():
                try:
                    cls = get_backend_class(name)
                except Exception:
                    continue
                if cls.supports_remote and backend_status(name)[0]:
                    infos[name] = self.backend(name).connection_info()
            regs = self._regs.values() if registrations is None else list(registrations)
            for r in regs:
                if self._regs.get(r.id) is not r:
                    raise NotRegistered(f"{r!r} is not registered with agent {self.name!r}")
            regions = [(r.mem_type, r.dev, r.addr, r.length, r.id) for r in regs]
            blob = encode_metadata(self.name, infos, regions, ident=agent_ident(self._token), partial=partial)
            return sign_metadata(blob, self.config.secret) if self.config.secret else blob

    def add_remote(self, blob: bytes) -> str:
        """Load (or refresh) a peer from its metadata blob; returns its name. Connects lazily.

        A partial blob (``metadata(registrations)``) adds its regions and
        connection info to what is known of the peer; a full one replaces it.
        """
        return self._load_remote(decode_metadata(open_metadata(blob, self.config.secret)))

    def _load_remote(self, meta: AgentMetadata) -> str:
        if meta.name == self.name:
            raise InvalidMetadata(f"metadata is this agent's own ({self.name!r})")
        with self._lock:
            old = self._remotes.get(meta.name)
            if meta.partial and old is not None:
                meta = _merge_metadata(old, meta)
            # backends check their connection info first, so a bad blob changes nothing
            for name, info in meta.backends.items():
                if name in self.enabled_backends() and backend_status(name)[0]:
                    self.backend(name).add_remote(meta.name, info)
            self._remotes[meta.name] = meta
            self._oneshot.clear()
        return meta.name

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it."""
        with self._lock:
            if self._remotes.pop(name, None) is None:
                raise KeyError(f"unknown remote agent {name!r}")
            self._oneshot.clear()
            for inst in self._backends.values():
                inst.remove_remote(name)

    # -- metadata exchange: side channel and etcd ----------------------------
    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(host, port) of this agent's metadata side channel, when ``listen_port`` was set."""
        return None if self._side is None else self._side.address

    def fetch_remote(
        self,
        where: str,
        port: int | None = None,
        *,
        etcd: Any = None,
        namespace: str = "datamover",
        timeout: float = 10.0,
        watch: bool = True,
    ) -> str:
        """Load a peer's metadata from its side channel (``where``=host, ``port``) or from etcd.

        With ``etcd`` (endpoint or list of endpoints), ``where`` is the peer's
        name: its blob is read (waiting up to ``timeout`` s for it to appear)
        and, with ``watch``, kept current; when its lease expires the peer is
        removed. Returns the peer's name.
        """
        if etcd is None:
            from .side_channel import fetch_metadata

            if port is None:
                raise ValueError("fetch_remote(host, port) needs the side channel's port, or etcd=...")
            name = self.add_remote(fetch_metadata(where, port, timeout=timeout))
            self._sources[name] = ("tcp", where, int(port))
            return name
        from . import etcd as etcd_mod

        client = etcd_mod.connect(etcd, timeout=timeout)
        name = self.add_remote(etcd_mod.fetch(client, namespace, where, timeout=timeout))
        if name != where:
            self.remove_remote(name)
            raise InvalidMetadata(f"etcd key of {where!r} holds the metadata of {name!r}")
        self._sources[name] = ("etcd", client, namespace)
        if watch and name not in self._watches:
            self._watches[name] = etcd_mod.EtcdWatch(
                client, namespace, name, on_change=self._remote_changed, on_delete=lambda: self._remote_expired(name)
            )
        return name

    def send_metadata(self, host: str, port: int, timeout: float = 5.0, blob: bytes | None = None) -> None:
        """Push this agent's metadata (or ``blob``, e.g. a partial one) to a peer's side channel,
        which loads it as if it had fetched it."""
        from .side_channel import PUSH, send_request

        send_request(host, port, PUSH, self.metadata() if blob is None else blob, timeout=timeout, proof=self._token)

    def invalidate_at(self, host: str, port: int, timeout: float = 5.0) -> None:
        """Ask the peer listening at (host, port) to forget this agent (signed when a secret is set)."""
        from .side_channel import DROP, send_request

        send_request(host, port, DROP, peer_auth.drop_payload(self.name, self._token, self.config.secret),
                     timeout=timeout)  # fmt: skip

    def _pushed(self, blob: bytes, proof: bytes) -> None:
        """A peer's PUSH: within the push budget, and replacing a known peer only with its token or the secret."""
        meta = decode_metadata(open_metadata(blob, self.config.secret), max_regions=self._push_budget.max_regions)
        with self._lock:
            peer_auth.check_replacement(self._remotes.get(meta.name), proof, signed=bool(self.config.secret))
            self._push_budget.check(meta, set(self._remotes))
            self._load_remote(meta)
            self._push_budget.kept_as(meta)

    def _dropped(self, payload: bytes) -> None:
        name, token = peer_auth.parse_drop(payload, self.config.secret)
        with self._lock:
            known = self._remotes.get(name)
            if known is None:
                return
            if token is not None and not peer_auth.proves(known, token):
                raise AuthenticationError(f"DROP of {name!r} does not carry its identity token")
            log.info("agent %r asked to be forgotten", name)
            self.remove_remote(name)

    def refresh_remote(self, name: str) -> str:
        """Fetch peer ``name``'s metadata again from where it came (side channel or etcd)."""
        src = self._sources.get(name)
        if src is None:
            raise KeyError(f"no side channel or etcd source known for {name!r}; call add_remote() with a new blob")
        if src[0] == "tcp":
            from .side_channel import fetch_metadata

            return self.add_remote(fetch_metadata(src[1], src[2]))
        from . import etcd as etcd_mod

        return self.add_remote(etcd_mod.fetch(src[1], src[2], name, timeout=self.config.timeout_s))

    def _remote_changed(self, blob: bytes) -> None:
        self.add_remote(blob)

    def _remote_expired(self, name: str) -> None:
        log.info("agent %r left etcd (its lease expired or it unpublished); removing it", name)
        with self._lock:
            if name in self._remotes:
                self.remove_remote(name)

    def publish(self, etcd: Any, namespace: str = "datamover", ttl: float = 5.0) -> str:
        """Keep this agent's metadata in etcd under a lease of ``ttl`` s; returns the key.

        The lease is refreshed by a thread while the agent lives; registering
        memory republishes the blob, so watching peers see new regions.
        """
        from .etcd import EtcdPublisher

        if self._publisher is not None:
            self._publisher.close()
        self._publisher = EtcdPublisher(etcd, namespace, self.name, self.metadata, ttl=ttl)
        return self._publisher.key

    def unpublish(self) -> None:
        """Revoke the lease now: the key disappears and watching peers drop this agent."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None

    def _metadata_changed(self) -> None:
        if self._publisher is not None:
            try:
                self._publisher.update()
            except Exception as exc:  # registration must not fail because etcd is away
                log.warning("republishing metadata to etcd failed: %s", exc)

    @property
    def remotes(self) -> list[str]:
        return list(self._remotes)

    def remote_metadata(self, name: str) -> AgentMetadata:
        """The decoded metadata last loaded for peer ``name``."""
        return self._remotes[name]

    # -- notifications -----------------------------------------------------
    def deliver_notification(self, peer: str, message: bytes) -> None:
        """Queue ``message`` from ``peer`` for ``get_notifications``/``wait_notification`` (BackendHost)."""
        with self._notif_cond:
            self._notifs.setdefault(peer, []).append(bytes(message))
            self._notif_cond.notify_all()

    def get_notifications(self) -> dict[str, list[bytes]]:
        """Drain every notification received, by sender."""
        with self._notif_cond:
            out, self._notifs = self._notifs, {}
        return out

    def wait_notification(
        self, prefix: bytes = b"", timeout: float = 10.0, peer: str | None = None
    ) -> tuple[str, bytes]:
        """Wait for (and remove) the first notification starting with ``prefix``; returns (sender, message)."""
        deadline = time.monotonic() + timeout

        def take() -> tuple[str, bytes] | None:
            for sender, msgs in self._notifs.items():
                if peer is not None and sender != peer:
                    continue
                for k, m in enumerate(msgs):
                    if m.startswith(prefix):
                        del msgs[k]
                        if not msgs:
                            del self._notifs[sender]
                        return sender, m
            return None

        with self._notif_cond:
            while True:
                got = take()
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotificationTimeout(f"no notification starting with {prefix!r} within {timeout:g} s")
                self._notif_cond.wait(left)

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` without data (to itself when ``peer`` is this agent)."""
        if peer == self.name:
            self.deliver_notification(self.name, message)
            return
        if peer not in self._remotes:
            raise NotRegistered(f"unknown remote agent {peer!r}; load its metadata with add_remote() first")
        for name in self._remotes[peer].backends:
            if name in self.enabled_backends() and get_backend_class(name).supports_notifications:
                self.backend(name).send_notification(peer, bytes(message))
                return
        raise UnsupportedTransfer(f"no enabled backend carries notifications to {peer!r}")

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Stop backends and drop registrations; the agent is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._watches.values():
                w.close()
            self._watches.clear()
            if self._side is not None:
                self._side.close()
            self.unpublish()
            for reg in list(self._regs.values()):
                self.deregister_memory(reg)
            for inst in self._backends.values():
                try:
                    inst.close()
                except Exception as exc:  # closing must go on for the other backends
                    log.warning("closing backend %s failed: %s", inst.name, exc)
            self._backends.clear()
            self._chosen.clear()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, backends={list(self._backends)}, regions={len(self._regs)})"


def _merge_metadata(old: AgentMetadata, new: AgentMetadata) -> AgentMetadata:
    """``old`` with a partial blob's regions (same id: the new one wins) and connection info added."""
    regions = {r[4]: r for r in old.regions}
    regions.update({r[4]: r for r in new.regions})
    backends = {**old.backends, **new.backends}
    blob = encode_metadata(
        old.name, backends, list(regions.values()), ident=new.ident or old.ident, partial=old.partial
    )
    return decode_metadata(blob)


class _OneShot:
    """``Agent.transfer``'s memory of one call: the lists (weakly), what they were checked against, its transfer."""

    __slots__ = ("last", "local", "meta", "remote", "table")

    def __init__(self, local: DescList, remote: DescList, table: RegionTable, meta: Any, last: Transfer) -> None:
        self.local, self.remote = weakref.ref(local), weakref.ref(remote)
        self.table, self.meta, self.last = table, meta, last


#: how many distinct (lists, op, peer, ...) calls ``Agent.transfer`` remembers
_ONESHOT_CACHE = 64


def _is_identity(idx: np.ndarray) -> bool:
    return idx.shape[0] == 0 or (int(idx[0]) == 0 and bool((np.diff(idx) == 1).all()))
