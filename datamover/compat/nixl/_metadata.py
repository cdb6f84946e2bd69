"""The binding agent's metadata (full and partial, by socket or etcd, labels included) and notifications.

Sends, fetches and invalidations run on the agent's background thread
(``_worker``), as NIXL queues them to its listener thread: they return at once,
programs poll ``checkRemoteMD``, and a failure (a peer that has already exited,
say) is logged and counted in ``metadata_failures`` instead of raised.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from ...agents.metadata import MAX_BLOB_BYTES, decode_metadata, open_metadata
from ...errors import DatamoverError, InvalidMetadata, NotRegistered, RemoteDisconnected
from ._dlists import nixlRegDList, nixlXferDList
from ._errors import NixlError, nixl_errors, nixlInvalidParamError, nixlMismatchError, nixlNotFoundError
from ._types import DEFAULT_COMM_PORT, as_bytes, as_name, nixl_status_t
from ._worker import FETCH_RETRY_S, MetadataWorker, retry

log = logging.getLogger("datamover.compat.nixl")

#: NIXL's etcd namespace when NIXL_ETCD_NAMESPACE is not set.
ETCD_NAMESPACE_DEFAULT = "/nixl/agents"


def etcd_settings() -> tuple[list[str], str]:
    """Endpoints and namespace from NIXL_ETCD_ENDPOINTS / NIXL_ETCD_NAMESPACE, as NIXL reads them."""
    endpoints = [e.strip() for e in re.split(r"[,;]", os.environ.get("NIXL_ETCD_ENDPOINTS", "")) if e.strip()]
    if not endpoints:
        raise nixlInvalidParamError("no peer address given and NIXL_ETCD_ENDPOINTS is not set")
    namespace = os.environ.get("NIXL_ETCD_NAMESPACE", ETCD_NAMESPACE_DEFAULT).strip("/") or "nixl"
    return endpoints, namespace


class MetadataMixin:
    """getLocalMD, loadRemoteMD, send/fetch/invalidate, checkRemoteMD, makeConnection, notifications."""

    agent: Any
    name: str
    _worker: MetadataWorker
    _labels: dict[str, Any]
    _reached: set[tuple[str, int]]

    # -- blobs -------------------------------------------------------------
    def getLocalMD(self) -> bytes:
        """This agent's full metadata blob."""
        with nixl_errors():
            return self.agent.metadata()

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Any = ()) -> bytes:
        """Metadata of the registrations behind ``descs`` only (with connection info if asked)."""
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"partial metadata takes a nixlRegDList, got {type(descs).__name__}")
        regs = self._registrations_of(descs) if len(descs) else []  # type: ignore[attr-defined]
        with nixl_errors():
            return self.agent.metadata(regs, connection=bool(inc_conn_info))

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        """Load a peer's (full or partial) metadata; returns its name as bytes, as NIXL's binding does.

        As NIXL: a blob that does not decode is nixlMismatchError; partial metadata without connection info
        from a peer not loaded yet is nixlNotFoundError (there is nothing to connect with)."""
        blob = as_bytes(metadata)
        with nixl_errors():
            try:
                meta = decode_metadata(open_metadata(blob, self.agent.secret))
            except InvalidMetadata as exc:
                raise nixlMismatchError(f"cannot load the metadata: {exc.reason}") from exc
            if meta.partial and not meta.backends and meta.name not in self.agent.remotes:
                raise nixlNotFoundError(
                    f"partial metadata of {meta.name!r} has no connection info, and {meta.name!r} is not loaded"
                )
            return self.agent.add_remote(blob).encode()

    def invalidateRemoteMD(self, agent: Any) -> nixl_status_t:
        """Forget a peer and disconnect from it; an unknown one is NIXL_ERR_NOT_FOUND, not raised (as NIXL)."""
        try:
            with nixl_errors():
                self.agent.remove_remote(as_name(agent))
        except KeyError:
            log.info("invalidateRemoteMD: no remote agent %r is loaded", as_name(agent))
            return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, agent: Any, descs: nixlXferDList | None = None) -> nixl_status_t:
        """NIXL_SUCCESS when the peer is loaded (and its metadata covers ``descs``), else NIXL_ERR_NOT_FOUND.
        This agent's own name is always loaded (NIXL's loopback section), checked against its own registrations."""
        name = as_name(agent)
        own = name == self.name
        if not own and name not in self.agent.remotes:
            return nixl_status_t.NIXL_ERR_NOT_FOUND
        if descs is not None and len(descs.descs):
            try:
                if own:
                    self.agent.prepare(self._own_side(descs.descs))  # type: ignore[attr-defined]
                else:
                    self.agent.prepare(descs.descs, name)
            except (DatamoverError, NixlError):
                return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def makeConnection(self, remote_agent: Any, backends: Any = ()) -> nixl_status_t:
        """Check that the peer is loaded (nixlNotFoundError if not); datamover backends connect on first use."""
        self._backend_names(backends)  # type: ignore[attr-defined]
        name = as_name(remote_agent)
        if name not in self.agent.remotes:
            raise nixlNotFoundError(f"unknown remote agent {name!r}; load its metadata first")
        return nixl_status_t.NIXL_SUCCESS

    # -- exchange, on the background thread -----------------------------------
    @property
    def metadata_failures(self) -> int:
        """Metadata jobs (sends, fetches, invalidations) that failed on the background thread."""
        return self._worker.failures

    def wait_metadata(self, timeout: float = FETCH_RETRY_S) -> bool:
        """Wait for queued metadata jobs to run (datamover's addition; NIXL programs poll instead)."""
        return self._worker.wait_idle(timeout)

    def sendLocalMD(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Queue a push of this agent's metadata to a peer's listener, or its publication to etcd."""
        self._send(None, ip_addr, port, "", True)

    def sendLocalPartialMD(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: Any = (),
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """Queue a push of partial metadata to a peer's listener, or to etcd under ``label``."""
        blob = self.getLocalPartialMD(descs, inc_conn_info, backends)
        if not ip_addr and not label:
            raise nixlInvalidParamError("partial metadata for etcd needs a label")
        self._send(blob, ip_addr, port, label, False)

    def _send(self, blob: bytes | None, ip_addr: str, port: int, label: str, full: bool) -> None:
        if ip_addr:
            what = f"send to {ip_addr}:{port}"

            def push() -> None:  # a listener not up yet is retried, as a fetch is
                self._reaching(ip_addr, int(port), lambda: self._push(ip_addr, int(port), blob))

            self._worker.submit(what, push)
            return
        endpoints, namespace = etcd_settings()
        if full:
            self._worker.submit("publish to etcd", lambda: self.agent.publish(endpoints, namespace))
            return
        what = f"publish label {label!r} to etcd"
        self._worker.submit(what, lambda: self._put_label(endpoints, namespace, label, blob))

    def _reaching(self, ip_addr: str, port: int, job: Callable[[], Any]) -> Any:
        """``job()`` against the listener at (``ip_addr``, ``port``): retried while it refuses only until it was
        reached once (a listener not up yet); after that a refusal means its agent is gone, and fails at once, as
        every NIXL send does."""
        where = (ip_addr, port)
        got = retry(job, timeout=0.0 if where in self._reached else FETCH_RETRY_S, retry_on=(RemoteDisconnected,))
        self._reached.add(where)
        return got

    def _push(self, ip_addr: str, port: int, blob: bytes | None) -> None:
        with nixl_errors():
            self.agent.send_metadata(ip_addr, port, blob=blob)

    def _put_label(self, endpoints: list[str], namespace: str, label: str, blob: bytes | None) -> None:
        from ...agents import etcd as etcd_mod

        client = self._labels.get("client") or etcd_mod.connect(endpoints)
        self._labels["client"] = client
        client.put(f"{etcd_mod.agent_key(namespace, self.name)}/{label}", blob)
        self._labels.setdefault("keys", set()).add((namespace, label))

    def fetchRemoteMD(
        self, remote_agent: Any, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Queue a fetch of a peer's metadata from its listener or etcd (``label``: that partial blob).

        A listener not up yet (or a key not in etcd yet) is retried for up to
        10 s, one reached before is not; a listener serving another agent's
        metadata is refused (logged).
        """
        name = as_name(remote_agent)
        if ip_addr:

            def fetch() -> None:
                got = self._reaching(ip_addr, int(port), lambda: self._fetch_tcp(ip_addr, int(port)))
                if got != name:
                    self.agent.remove_remote(got)
                    raise nixlMismatchError(f"{ip_addr}:{port} serves the metadata of {got!r}, not {name!r}")

            self._worker.submit(f"fetch of {name!r} from {ip_addr}:{port}", fetch)
            return
        endpoints, namespace = etcd_settings()
        if label:
            self._worker.submit(f"fetch of {name!r} label {label!r} from etcd",
                                lambda: self._fetch_label(endpoints, namespace, name, label))  # fmt: skip
            return
        self._worker.submit(f"fetch of {name!r} from etcd", lambda: self._fetch_etcd(endpoints, namespace, name))

    def _fetch_tcp(self, ip_addr: str, port: int) -> str:
        with nixl_errors():
            return self.agent.fetch_remote(ip_addr, port)

    def _fetch_etcd(self, endpoints: list[str], namespace: str, name: str) -> None:
        with nixl_errors():
            self.agent.fetch_remote(name, etcd=endpoints, namespace=namespace, timeout=FETCH_RETRY_S)

    def _fetch_label(self, endpoints: list[str], namespace: str, name: str, label: str) -> None:
        from ...agents import etcd as etcd_mod

        client = self._labels.get("client") or etcd_mod.connect(endpoints)
        self._labels["client"] = client
        key = f"{etcd_mod.agent_key(namespace, name)}/{label}"
        deadline = time.monotonic() + FETCH_RETRY_S
        while True:
            got = client.get(key)
            if got:
                value = got[0].encode("latin-1") if isinstance(got[0], str) else got[0]
                if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_BLOB_BYTES:
                    raise nixlInvalidParamError(f"etcd value at {key} is not a metadata blob")
                with nixl_errors():
                    self.agent.add_remote(bytes(value))
                return
            if time.monotonic() > deadline:
                raise NotRegistered(f"no metadata of {name!r} labelled {label!r} in etcd at {key}")
            time.sleep(0.05)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Queue telling the peer at (``ip_addr``, ``port``) to drop this agent, or withdrawing it from etcd."""
        if ip_addr:

            def drop() -> None:
                with nixl_errors():
                    self.agent.invalidate_at(ip_addr, int(port))

            self._worker.submit(f"invalidation at {ip_addr}:{port}", drop)
            return
        etcd_settings()
        self._worker.submit("withdrawal from etcd", self._withdraw)

    def _withdraw(self) -> None:
        self.agent.unpublish()
        client = self._labels.get("client")
        if client is not None:
            from ...agents import etcd as etcd_mod

            for namespace, label in self._labels.pop("keys", set()):
                client.delete(f"{etcd_mod.agent_key(namespace, self.name)}/{label}")

    # -- notifications ---------------------------------------------------------
    def getNotifs(self, notifs: dict[str, list[bytes]] | None = None, backends: Any = ()) -> dict[str, list[bytes]]:
        """``notifs`` with every notification received since the last call appended, by sender."""
        out = {} if notifs is None else notifs
        for sender, msgs in self.agent.get_notifications().items():
            out.setdefault(sender, []).extend(msgs)
        return out

    def genNotif(self, remote_agent: Any, msg: Any, backend: Any = None) -> nixl_status_t:
        """Send a notification without data to a peer (or to this agent)."""
        if backend is not None:
            self._backend_name(backend)  # type: ignore[attr-defined]
        with nixl_errors():
            self.agent.send_notification(as_name(remote_agent), as_bytes(msg))
        return nixl_status_t.NIXL_SUCCESS
