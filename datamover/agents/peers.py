"""The peers an agent knows: their metadata, how it is exchanged (side channel, etcd), and this agent's own."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..descriptors import DescList, Registration
from ..errors import AuthenticationError, InvalidMetadata, NotRegistered, TransferStateError
from . import peer_auth
from .backend_set import BackendSet
from .config import AgentConfig
from .etcd import CLOSE_TIMEOUT_S
from .metadata import AgentMetadata, agent_ident, decode_metadata, encode_metadata, open_metadata, sign_metadata
from .registry import Registry

log = logging.getLogger("datamover.agent")


class Peers:
    """Remote agents' metadata by name, kept current from where it came, and this agent's own blob.

    Loading a peer hands its connection info to the backends first, so a bad
    blob changes nothing. ``server`` is the metadata side channel (when the
    config has ``listen_port``, from ``listen``), ``publisher`` the etcd lease (after
    ``publish``). ``on_change`` runs whenever a peer is loaded or forgotten.
    """

    def __init__(
        self,
        name: str,
        config: AgentConfig,
        lock: threading.RLock,
        backends: BackendSet,
        registry: Registry,
        on_change: Callable[[], None],
    ) -> None:
        self._name = name
        self._config = config
        self._lock = lock
        self._backends = backends
        self._registry = registry
        self._on_change = on_change
        self._remotes: dict[str, AgentMetadata] = {}
        self.generation = 0  # moves whenever a peer's metadata is loaded or forgotten (see check_current)
        self._sources: dict[str, tuple] = {}  # peer -> where its metadata came from, for refresh
        self._watches: dict[str, tuple[Any, threading.Event]] = {}  # peer -> its etcd watch, and the event that
        # cuts the watch off from the peer table (set by remove_remote, under the lock)
        self._closed = False  # set by close (under the lock): no watch starts after it, nothing is published
        self._publishing = threading.Lock()  # publish and unpublish one at a time (each may wait for etcd)
        self.publisher: Any = None
        self._published_as: tuple | None = None  # (etcd, namespace, ttl) of the publisher
        self.server: Any = None
        self._token = os.urandom(peer_auth.TOKEN_BYTES)  # proves to peers that a PUSH or DROP comes from this agent
        self._push_budget = peer_auth.PushBudget(**config.extra.get("push_budget", {}))

    def listen(self) -> None:
        """Start the metadata side channel, when the config has ``listen_port`` (once the agent is built)."""
        if self._config.listen_port is None or self.server is not None:
            return
        from .side_channel import MetadataServer, SideChannelLimits

        extra = self._config.extra
        limits = SideChannelLimits(**extra.get("side_channel", {}))
        self.server = MetadataServer(
            self.metadata, host=str(extra.get("listen_host", "127.0.0.1")), port=int(self._config.listen_port),
            on_push=self._pushed, on_drop=self._dropped, limits=limits,
        )  # fmt: skip

    # -- this agent's metadata -------------------------------------------------
    def metadata(self, registrations: Iterable[Registration] | None = None, *, connection: bool = True) -> bytes:
        """This agent's blob (all regions, or a partial one of ``registrations``), signed with the secret."""
        with self._lock:
            infos = self._backends.connection_infos() if connection else {}
            partial = registrations is not None
            reg = self._registry
            regs = reg.regions.values() if registrations is None else reg.check_registered(registrations)
            regions = [(r.mem_type, r.dev, r.addr, r.length, r.id) for r in regs]
            blob = encode_metadata(self._name, infos, regions, ident=agent_ident(self._token), partial=partial)
            return sign_metadata(blob, self._config.secret) if self._config.secret else blob

    def metadata_changed(self) -> None:
        """Hand the new blob to the etcd publisher after a (de)registration (under the agent's lock): its thread
        puts it; nothing here waits for etcd (see ``metadata_published``)."""
        if self.publisher is not None:
            try:
                self.publisher.update()
            except Exception as exc:  # registration must not fail because the blob could not be made
                log.warning("making the metadata blob to publish to etcd failed: %s", exc)

    def metadata_published(self, timeout: float | None) -> bool:
        """Whether the blob as of this call is in etcd, waiting up to ``timeout`` s; see Agent.metadata_published."""
        publisher = self.publisher
        return publisher is not None and publisher.wait_published(timeout)

    # -- known peers -------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._remotes)

    def get(self, name: str) -> AgentMetadata | None:
        """Peer ``name``'s metadata, or None if unknown."""
        return self._remotes.get(name)

    def __getitem__(self, name: str) -> AgentMetadata:
        return self._remotes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._remotes

    def add(self, blob: bytes) -> str:
        """Load (or refresh, or for a partial blob extend) a peer from its blob; returns its name."""
        return self.load(decode_metadata(open_metadata(blob, self._config.secret)))

    def load(self, meta: AgentMetadata) -> str:
        """Load decoded metadata: a partial one merges into what is known of the same process (``ident``), a full
        one, or one of another process, replaces it."""
        if meta.name == self._name:
            raise InvalidMetadata(f"metadata is this agent's own ({self._name!r})")
        with self._lock:
            old = self._remotes.get(meta.name)
            # a partial blob of another process of the peer (it restarted) replaces what the earlier one published
            if meta.partial and old is not None and old.ident == meta.ident:
                meta = _merge_metadata(old, meta)
            # the table first: a post of descriptors checked against another process of the peer is refused from
            # here on (it reads the generation), before a backend holds this process's connection info
            self._remotes[meta.name] = meta
            self.generation += 1
            taken: list[tuple[str, Any]] = []
            try:
                for name, info in meta.backends.items():
                    if self._backends.usable(name):
                        inst = self._backends.get(name)
                        inst.add_remote(meta.name, info)
                        taken.append((name, inst))
            except BaseException:
                self._restore(meta.name, old, taken)  # a bad blob changes nothing
                raise
            self._on_change()
        return meta.name

    def _restore(self, peer: str, old: AgentMetadata | None, taken: list[tuple[str, Any]]) -> None:
        """Undo a load a backend refused: the earlier metadata back in the table, and each backend that took the
        new connection info given the earlier one back (or, where it had none, told to forget the peer)."""
        if old is None:
            self._remotes.pop(peer, None)
        else:
            self._remotes[peer] = old
        self.generation += 1
        for name, inst in taken:
            try:
                if old is not None and name in old.backends:
                    inst.add_remote(peer, old.backends[name])
                else:
                    inst.remove_remote(peer)
            except Exception as exc:  # the others are restored still; this one's state is logged
                log.warning("restoring %s's connection info of %r after a refused load failed: %s", name, peer, exc)

    def remove(self, name: str, *, unwatch: bool = True) -> None:
        """Forget a peer and disconnect every backend from it (KeyError if unknown); with ``unwatch``, also stop
        watching its etcd key (else its next publish would load it again) and forget where it came from."""
        watch = None
        with self._lock:
            if unwatch:
                self._sources.pop(name, None)
                entry = self._watches.pop(name, None)
                if entry is not None:
                    watch, cut = entry
                    cut.set()  # a delivery already on its way loads nothing now
            if self._remotes.pop(name, None) is None:
                if watch is None:
                    raise KeyError(f"unknown remote agent {name!r}")
            else:
                self.generation += 1
                self._on_change()
                for inst in self._backends.running.values():
                    inst.remove_remote(name)
        if watch is not None:
            watch.close()  # outside the lock: its thread may be waiting for it

    def check_current(self, agent: str, ident: bytes | None, backend: str | None = None) -> None:
        """Refuse descriptors checked against metadata of another process of ``agent`` than the one its metadata
        here describes (it restarted: the old process's addresses may be the new one's memory), or of an agent no
        longer loaded here."""
        meta = self._remotes.get(agent)
        if meta is None:
            raise NotRegistered(
                f"agent {agent!r} is no longer loaded here (removed, or its lease expired): add_remote() its metadata, "
                "prepare the remote descriptors, and make the transfer, again",
                backend=backend,
            )
        if meta.ident != ident:
            raise NotRegistered(
                f"the remote descriptors were checked against the metadata of an earlier process of agent {agent!r}, "
                "which its metadata loaded here no longer describes (it restarted): prepare them, and make the "
                "transfer, again",
                backend=backend,
            )

    def lookup(self, descs: DescList, agent: str) -> np.ndarray:
        """The region id of every descriptor in peer ``agent``'s memory, as its metadata here says."""
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

    # -- exchange: side channel and etcd -----------------------------------------
    @property
    def listen_address(self) -> tuple[str, int] | None:
        return None if self.server is None else self.server.address

    def fetch(self, where: str, port: int | None, etcd: Any, namespace: str, timeout: float, watch: bool) -> str:
        """Load a peer from its side channel (host, port) or etcd (``where`` its name); see Agent.fetch_remote."""
        if etcd is None:
            from .side_channel import fetch_metadata

            if port is None:
                raise ValueError("fetch_remote(host, port) needs the side channel's port, or etcd=...")
            name = self.add(fetch_metadata(where, port, timeout=timeout))
            self._sources[name] = ("tcp", where, int(port))
            return name
        from . import etcd as etcd_mod

        client = etcd_mod.connect(etcd, timeout=timeout)
        name = self._add_keyed(where, etcd_mod.fetch(client, namespace, where, timeout=timeout))
        with self._lock:
            self._sources[name] = ("etcd", client, namespace)
            if watch and not self._closed and name not in self._watches:  # closed meanwhile: nobody would stop it
                cut = threading.Event()
                self._watches[name] = etcd_mod.EtcdWatch(
                    client, namespace, name, on_change=lambda blob: self._watched(name, cut, blob),
                    on_delete=lambda: self._expired(name, cut),
                ), cut  # fmt: skip
        return name

    def _watched(self, name: str, cut: threading.Event, blob: bytes) -> None:
        """A blob peer ``name``'s watch delivered: loaded, unless remove_remote stopped that watch meanwhile."""
        with self._lock:
            if not cut.is_set():
                self._add_keyed(name, blob)

    def _add_keyed(self, name: str, blob: bytes) -> str:
        """Load a blob read at peer ``name``'s etcd key; one naming another agent is refused before it replaces it."""
        meta = decode_metadata(open_metadata(blob, self._config.secret))
        if meta.name != name:
            raise InvalidMetadata(f"etcd key of {name!r} holds the metadata of {meta.name!r}; refused")
        return self.load(meta)

    def refresh(self, name: str) -> str:
        """Fetch peer ``name``'s metadata again from where it came."""
        src = self._sources.get(name)
        if src is None:
            raise KeyError(f"no side channel or etcd source known for {name!r}; call add_remote() with a new blob")
        if src[0] == "tcp":
            from .side_channel import fetch_metadata

            return self.add(fetch_metadata(src[1], src[2], timeout=self._config.timeout_s))
        from . import etcd as etcd_mod

        return self._add_keyed(name, etcd_mod.fetch(src[1], src[2], name, timeout=self._config.timeout_s))

    def send_metadata(self, host: str, port: int, timeout: float, blob: bytes | None) -> None:
        """PUSH this agent's metadata (or ``blob``) to the side channel at (host, port)."""
        from .side_channel import PUSH, send_request

        send_request(host, port, PUSH, self.metadata() if blob is None else blob, timeout=timeout, proof=self._token)

    def invalidate_at(self, host: str, port: int, timeout: float) -> None:
        """DROP this agent at the side channel at (host, port)."""
        from .side_channel import DROP, send_request

        send_request(host, port, DROP, peer_auth.drop_payload(self._name, self._token, self._config.secret),
                     timeout=timeout)  # fmt: skip

    def _pushed(self, blob: bytes, proof: bytes) -> None:
        """A peer's PUSH: within the push budget, and replacing a known peer only with its token or the secret."""
        meta = decode_metadata(open_metadata(blob, self._config.secret), max_regions=self._push_budget.max_regions)
        with self._lock:
            peer_auth.check_replacement(self._remotes.get(meta.name), proof, signed=bool(self._config.secret))
            self._push_budget.check(meta, set(self._remotes))
            self.load(meta)
            self._push_budget.kept_as(meta)

    def _dropped(self, payload: bytes) -> None:
        name, token = peer_auth.parse_drop(payload, self._config.secret)
        with self._lock:
            known = self._remotes.get(name)
            if known is None:
                return
            if token is not None and not peer_auth.proves(known, token):
                raise AuthenticationError(f"DROP of {name!r} does not carry its identity token")
            log.info("agent %r asked to be forgotten", name)
            self.remove(name, unwatch=False)

    def _expired(self, name: str, cut: threading.Event) -> None:
        """Peer ``name``'s key went (lease expired, or it unpublished): forgotten, its watch kept for its return."""
        with self._lock:
            if name in self._remotes and not cut.is_set():
                log.info("agent %r left etcd (its lease expired or it unpublished); removing it", name)
                self.remove(name, unwatch=False)

    def publish(self, etcd: Any, namespace: str, ttl: float) -> str:
        """Keep this agent's metadata in etcd under a lease of ``ttl`` s; returns the key. Published there already
        (same etcd, namespace and ttl): the blob is put again under the same lease, never deleted meanwhile (a
        new lease would first revoke the old one, and every peer watching the key would drop this agent)."""
        from .etcd import EtcdPublisher

        how = (etcd if isinstance(etcd, str) else tuple(etcd), namespace, ttl)
        with self._publishing:  # two at once, or one beside close, would leave a publisher nobody stops
            if self._closed:
                raise TransferStateError(f"agent {self._name!r} is closed: it publishes nothing")
            if self.publisher is not None and self._published_as == how:
                self.publisher.update()
                return self.publisher.key
            self._unpublish(CLOSE_TIMEOUT_S)  # a new one that fails to start leaves none
            publisher = EtcdPublisher(etcd, namespace, self._name, self.metadata, ttl=ttl)
            with self._lock:
                self.publisher, self._published_as = publisher, how
            # a registration while the first blob was made and put found no publisher to hand its blob to
            publisher.update()
            return publisher.key

    def unpublish(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Revoke the etcd lease now, if there is one, waiting for etcd at most ``timeout`` s. Call it without the
        agent's lock: only taking the publisher away holds it."""
        with self._publishing:
            self._unpublish(timeout)

    def _unpublish(self, timeout: float) -> None:
        with self._lock:  # registrations from here on hand their blob to no publisher
            publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close(timeout=timeout)

    def close(self) -> None:
        """Stop the watches, the side channel and the etcd lease. Call it without the agent's lock: each of them
        waits for a thread or for etcd (a watch's thread may itself wait for that lock to deliver)."""
        with self._lock:
            self._closed = True
            watches = list(self._watches.values())
            self._watches.clear()
            for _, cut in watches:
                cut.set()  # a delivery already on its way loads nothing now
        for w, _ in watches:
            w.close()
        if self.server is not None:
            self.server.close()
        self.unpublish()


def _merge_metadata(old: AgentMetadata, new: AgentMetadata) -> AgentMetadata:
    """``old`` with a partial blob's regions (same id: the new one wins) and connection info added."""
    regions = {r[4]: r for r in old.regions}
    regions.update({r[4]: r for r in new.regions})
    backends = {**old.backends, **new.backends}
    blob = encode_metadata(old.name, backends, list(regions.values()), ident=old.ident, partial=old.partial)
    return decode_metadata(blob)
