"""Agent: the user's handle on registered memory, peers and transfers, and its backends' ``BackendHost``.

The work is done by one part per job, each in its own module: ``BackendSet``
(backend_set.py) starts and chooses backends, ``Registry`` (registry.py) owns
this agent's regions, ``Peers`` (peers.py) the peers' metadata and its
exchange, ``TransferMaker`` (maker.py) makes transfers, ``Notifications``
(notifications.py) is the inbox. The Agent wires them together.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ..backends import get_backend_class
from ..backends.base import Backend, clock
from ..descriptors import RegionTable, Registration
from ..errors import NotRegistered, UnsupportedTransfer
from .backend_set import BackendSet
from .config import AgentConfig
from .etcd import CLOSE_TIMEOUT_S
from .maker import Prepared, TransferMaker
from .metadata import AgentMetadata
from .notifications import InboxLimits, Notifications
from .peers import Peers
from .registry import Registry
from .transfer import Transfer

__all__ = ["Agent", "Prepared"]


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
        self._lock = threading.RLock()  # one lock for backends, regions and peers: they change together
        self._closed = False
        self._backends = BackendSet(self, cfg, self._lock)
        self._registry = Registry(name, self._lock, self._backends, on_change=self._regions_changed)
        self._peers = Peers(name, cfg, self._lock, self._backends, self._registry, on_change=self._peers_changed)
        self._maker = TransferMaker(self, cfg, self._registry, self._peers, self._backends)
        self._inbox = Notifications(InboxLimits.from_config(cfg.extra.get("inbox", {})))
        self._peers.listen()

    def _regions_changed(self) -> None:
        self._maker.forget()
        self._peers.metadata_changed()

    def _peers_changed(self) -> None:
        self._maker.forget()

    # -- backends ----------------------------------------------------------
    def enabled_backends(self) -> list[str]:
        """Backend names this agent may use, in preference order."""
        return self._backends.enabled()

    def backend(self, name: str) -> Backend:
        """The running instance of backend ``name``, started on first use."""
        return self._backends.get(name)

    # -- registration ------------------------------------------------------
    def register_memory(self, x: Any) -> Registration | list[Registration]:
        """Make a buffer (or each buffer of a list, or each row of a DescList) addressable."""
        return self._registry.register(x)

    def register_file(
        self,
        path: str | os.PathLike,
        size: int | None = None,
        direct: bool = True,
        create: bool = True,
        *,
        extend: bool = True,
    ) -> Registration:
        """Register a file for FILE descriptors; ``size`` extends it if shorter (unless ``extend`` is False).

        FILE descriptors address ``[0, size)`` of it (the current size when
        ``size`` is None). ``direct`` asks for O_DIRECT where the filesystem
        allows it. With ``extend=False`` the file is left as it is: a write
        past its end grows it, a read past its end fails (the NIXL facade's
        registration, as NIXL's POSIX plugin never touches the file).
        """
        return self._registry.register_file(path, size, direct, create, extend=extend)

    def register_objects(
        self, bucket: str, keys: Iterable[str] | None = None, prefix: str | None = None
    ) -> Registration:
        """Make objects of ``bucket`` addressable: the listed ``keys``, or every key under ``prefix``.

        With neither, the whole bucket is addressable. OBJ descriptors name
        objects through their list's key table; offsets are not bounded here
        because objects may not exist until written.
        """
        return self._registry.register_objects(bucket, keys, prefix)

    def deregister_memory(self, reg: Registration | Iterable[Registration]) -> None:
        """Undo a registration (or several); its memory is no longer addressable."""
        self._registry.deregister(reg)

    @property
    def registrations(self) -> dict[int, Registration]:
        """This agent's registrations by id (a copy)."""
        return dict(self._registry.regions)

    # -- what backends see (BackendHost) -------------------------------------
    @property
    def regions(self) -> Mapping[int, Registration]:
        """This agent's registrations by id: a live, read-only view."""
        return self._registry.regions

    @property
    def region_table(self) -> RegionTable:
        """The lookup table over ``regions``; a new object after each (de)registration."""
        return self._registry.table

    @property
    def secret(self) -> bytes | None:
        """The shared secret of metadata and control connections (the config's), if any."""
        return self.config.secret

    @property
    def timeout_s(self) -> float:
        """The config's default bound on a transfer, in seconds."""
        return float(self.config.timeout_s)

    def deliver_notification(self, peer: str, message: bytes) -> None:
        """Queue ``message`` from ``peer`` for ``get_notifications``/``wait_notification`` (BackendHost)."""
        self._inbox.deliver(peer, message)

    # -- descriptors and transfers -----------------------------------------
    def prepare(self, descs: Any, agent: str | None = None) -> Prepared:
        """Validate descriptors once (vectorized) against their owner's registered memory."""
        return self._maker.prepare(descs, agent)

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
        return self._maker.make_transfer(op, local, local_idx, remote, remote_idx, notify, backends, timeout)

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
        chosen for a pair of memory types is remembered, and the same lists
        passed again (or small lists built anew with the same rows) reuse the
        last transfer's checks and plan.
        """
        return self._maker.transfer(op, local, remote, agent, notify, backends, timeout)

    # -- metadata and peers ------------------------------------------------
    def metadata(self, registrations: Iterable[Registration] | None = None, *, connection: bool = True) -> bytes:
        """This agent's metadata blob: name, remote backends' connection info, regions.

        With ``registrations``, a partial blob of those regions only (and, unless
        ``connection`` is False, the connection info), which a peer merges into
        what it already knows of this agent instead of replacing it.
        """
        return self._peers.metadata(registrations, connection=connection)

    def add_remote(self, blob: bytes) -> str:
        """Load (or refresh) a peer from its metadata blob; returns its name. Connects lazily.

        A partial blob (``metadata(registrations)``) adds its regions and
        connection info to what is known of the peer; a full one replaces it.
        """
        return self._peers.add(blob)

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it."""
        self._peers.remove(name)

    @property
    def remotes(self) -> list[str]:
        return self._peers.names

    def remote_metadata(self, name: str) -> AgentMetadata:
        """The decoded metadata last loaded for peer ``name``."""
        return self._peers[name]

    # -- metadata exchange: side channel and etcd ----------------------------
    @property
    def listen_address(self) -> tuple[str, int] | None:
        """(host, port) of this agent's metadata side channel, when ``listen_port`` was set."""
        return self._peers.listen_address

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
        return self._peers.fetch(where, port, etcd, namespace, timeout, watch)

    def send_metadata(self, host: str, port: int, timeout: float = 5.0, blob: bytes | None = None) -> None:
        """Push this agent's metadata (or ``blob``, e.g. a partial one) to a peer's side channel,
        which loads it as if it had fetched it."""
        self._peers.send_metadata(host, port, timeout, blob)

    def invalidate_at(self, host: str, port: int, timeout: float = 5.0) -> None:
        """Ask the peer listening at (host, port) to forget this agent (signed when a secret is set)."""
        self._peers.invalidate_at(host, port, timeout)

    def refresh_remote(self, name: str) -> str:
        """Fetch peer ``name``'s metadata again from where it came (side channel or etcd)."""
        return self._peers.refresh(name)

    def publish(self, etcd: Any, namespace: str = "datamover", ttl: float = 5.0) -> str:
        """Keep this agent's metadata in etcd under a lease of ``ttl`` s; returns the key.

        The blob is in etcd when this returns (its errors are raised here). The
        lease is refreshed by a thread while the agent lives, and that thread
        republishes the blob after memory is registered or deregistered, so
        watching peers see new regions: a registration hands it the new blob
        and returns without waiting for etcd (blobs made while a put is on its
        way are coalesced into the next put, the latest wins; a failed put is
        logged and tried again every ttl/3). ``metadata_published`` waits for
        the new regions to be in etcd.
        """
        return self._peers.publish(etcd, namespace, ttl)

    def metadata_published(self, timeout: float | None = 10.0) -> bool:
        """Wait until this agent's metadata as of this call (every registration made before it) is in etcd.

        True once it is; False if it is not within ``timeout`` s (etcd slow or
        away: the publisher keeps trying, each failure logged), or when the
        agent does not publish (never published, unpublished, closed).
        ``timeout=0`` only looks, ``None`` waits without bound. Call it before
        telling a peer to use regions just registered, as NIXL users send their
        local metadata.
        """
        return self._peers.metadata_published(timeout)

    def unpublish(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Revoke the lease now: the key disappears and watching peers drop this agent.

        Never waits for a put in flight (etcd refuses it once the lease is revoked), and for etcd to confirm the
        revoke at most ``timeout`` s, never under the agent's lock: unconfirmed by then, the key goes when the
        lease expires. The publisher puts nothing once this is called.
        """
        self._peers.unpublish(timeout)

    # -- notifications -----------------------------------------------------
    def get_notifications(self) -> dict[str, list[bytes]]:
        """Drain every notification received, by sender."""
        return self._inbox.drain()

    def wait_notification(
        self, prefix: bytes = b"", timeout: float = 10.0, peer: str | None = None
    ) -> tuple[str, bytes]:
        """Wait for (and remove) the first notification starting with ``prefix``; returns (sender, message)."""
        return self._inbox.wait(prefix, timeout, peer)

    @property
    def notifications_dropped(self) -> dict[str, int]:
        """By sender, the notifications dropped (oldest first) to keep the inbox within its limits (config
        ``extra["inbox"]``: ``max_per_sender``, ``max_sender_bytes``, ``max_messages``, ``max_bytes``)."""
        return self._inbox.dropped_by_sender()

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` without data (to itself when ``peer`` is this agent)."""
        if peer == self.name:
            self.deliver_notification(self.name, message)
            return
        meta = self._peers.get(peer)
        if meta is None:
            raise NotRegistered(f"unknown remote agent {peer!r}; load its metadata with add_remote() first")
        for name in meta.backends:
            if name in self._backends.enabled() and get_backend_class(name).supports_notifications:
                self._backends.get(name).send_notification(peer, bytes(message))
                return
        raise UnsupportedTransfer(f"no enabled backend carries notifications to {peer!r}")

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Cut transfers in flight short (each ERR, TransferAborted), stop backends and drop registrations; the
        agent is unusable afterwards. Unpublishes from etcd as ``unpublish()`` does (waiting at most 5 s)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._registry.close()  # posts from now on are refused
        # outside the lock: the watches, the side channel and etcd are waited for, and a post in flight may need it
        self._peers.close()
        self._registry.abort_all(f"agent {self.name!r} closed")
        with self._lock:
            self._registry.deregister_all()
            self._backends.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, backends={list(self._backends.running)}, regions={len(self._registry.regions)})"
