"""Publishing this agent's metadata blob in etcd under a kept-alive lease (``EtcdPublisher``).

The blob lives at ``/<namespace>/agents/<name>``, attached to a lease with a short TTL that a thread of the
publisher keeps alive. When the agent dies the keepalives stop, the lease expires, etcd deletes the key, and peers
watching it drop the agent.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import InvalidMetadata
from .answers import as_revision, checked_field, key_b64
from .gateway import agent_key, connect, gateway_call

log = logging.getLogger("datamover.etcd")

#: how long ``EtcdPublisher.close`` (and so unpublish, and closing the agent) waits for etcd to confirm the revoke
CLOSE_TIMEOUT_S = 5.0


class EtcdPublisher:
    """Keeps ``provider()`` at the agent's key under a lease of ``ttl`` seconds, refreshed every ttl/3.

    The constructor grants the lease and puts the first blob itself (its
    errors are the caller's). After that two threads of its own do every
    etcd call: one keeps the lease alive, the other puts the latest blob that
    ``update`` handed it, so a put etcd holds never delays a keepalive (the
    key does not lapse while etcd answers keepalives). ``update`` (after memory was registered, say) only
    makes the new blob and returns: it never waits for etcd, so a slow or
    unreachable etcd never stalls a registration, nor the agent's lock it is
    made under. Blobs handed over while a put is on its way are coalesced:
    the next put carries the latest, whatever came between (latest wins).

    It survives etcd going away and coming back: a put that failed is logged
    and tried again at the lease's rhythm (every ttl/3) until it lands, and a
    lease etcd no longer knows is replaced, the blob put again under the new
    one. ``generation`` counts the blobs made, ``published_generation`` is the
    one in etcd under the current lease (-1: none known to be), ``pending``
    says the latest is not in etcd yet, ``last_error`` is why the last put
    failed (None once one landed), and ``wait_published`` waits for the blob
    current at its call. Every answer of the gateway (grant, put, keepalive,
    revoke) is read within a bound and checked: one not understood is
    InvalidMetadata naming the key, an HTTP error RemoteRefused, etcd out of
    reach RemoteDisconnected.
    """

    def __init__(
        self, endpoints: str | Sequence[str], namespace: str, name: str, provider: Callable[[], bytes], ttl: float = 5.0
    ) -> None:
        self.client = connect(endpoints)
        self.key = agent_key(namespace, name)
        self.ttl = max(2, round(ttl))
        self._name = name
        self._provider = provider
        # guards what follows; never held across an etcd call (update() takes it under the agent's lock)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False  # once set, nothing is put or granted again (see close)
        self._blob = b""  # the latest blob made by update(): what the put thread puts
        self._generation = 0  # blobs made so far; the latest is this one
        self._put_generation = -1  # the generation of the blob in etcd under the current lease; -1: none known
        self._retry_at = 0.0  # no put before this (monotonic): a failed one waits for the lease's rhythm
        self.last_error: BaseException | None = None  # why the last put failed; None once one landed
        self.lease, granted = self._grant()
        self._interval = min(self.ttl, granted) / 3
        try:
            self._blob, self._generation = provider(), 1
            self._put(self.lease, self._blob)
        except BaseException:
            self._revoke(self.lease)  # nothing was published under it
            raise
        self._put_generation = 1
        self._threads = (
            threading.Thread(target=self._keep_alive, name=f"dm-etcd-lease-{name}", daemon=True),
            threading.Thread(target=self._put_pending, name=f"dm-etcd-put-{name}", daemon=True),
        )
        for t in self._threads:
            t.start()

    # -- what the agent sees -----------------------------------------------------------
    def update(self) -> None:
        """Hand the put thread the current blob (after registering memory, say) and return at once.

        Never waits for etcd: the put thread puts it (or a later one) when etcd answers. The blob is made here
        (``provider()``, which takes the agent's lock: the agent calls this under it, which also keeps the blobs
        in the order of their generations); the threads never call ``provider``, so they never wait for the
        agent's lock. Nothing once closed.
        """
        with self._cond:
            if self._closed:
                return
        blob = self._provider()
        with self._cond:
            if self._closed or blob == self._blob:  # the latest blob already: nothing new to put
                return
            self._blob = blob
            self._generation += 1
            self._cond.notify_all()

    @property
    def generation(self) -> int:
        """How many blobs were made (the first by the constructor): the latest is of this generation."""
        return self._generation

    @property
    def published_generation(self) -> int:
        """The generation of the blob in etcd under the current lease; -1 when none is known to be there (a put
        failed since etcd went away, or the lease was replaced and the blob not put again yet)."""
        return self._put_generation

    @property
    def pending(self) -> bool:
        """Whether the latest blob is not (yet) known to be in etcd."""
        with self._cond:
            return self._put_generation < self._generation

    def wait_published(self, timeout: float | None) -> bool:
        """Wait (up to ``timeout`` s; None: no bound) until the blob current at this call, or a later one, is in
        etcd; True if it is, False if not within the timeout or once closed. ``timeout=0`` only looks."""
        with self._cond:
            target = self._generation
            self._cond.wait_for(lambda: self._closed or self._put_generation >= target, timeout)
            return not self._closed and self._put_generation >= target

    # -- the publisher's threads ---------------------------------------------------------
    def _keep_alive(self) -> None:
        """The lease thread: refresh the lease every interval, whatever the put thread waits on."""
        while True:
            with self._cond:
                next_refresh = time.monotonic() + self._interval
                while not self._closed and (left := next_refresh - time.monotonic()) > 0:
                    self._cond.wait(left)
                if self._closed:
                    return
            try:
                self._refresh()
            except Exception as exc:  # etcd briefly away: keep trying; what did not land is put again later
                log.warning("etcd lease refresh for %s failed: %s", self.key, exc)

    def _put_pending(self) -> None:
        """The put thread: put the latest blob whenever one is not in etcd (after a failed put, not before the
        lease's rhythm says)."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    if self._put_generation < self._generation:
                        left = self._retry_at - time.monotonic()
                        if left <= 0:
                            put = self.lease, self._blob, self._generation
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
            self._put_latest(*put)

    def _put_latest(self, lease: Any, blob: bytes, generation: int) -> None:
        """Put ``blob`` (of ``generation``) under ``lease``; a failure is logged and tried again at the lease's
        rhythm, with the latest blob by then."""
        try:
            self._put(lease, blob)
        except Exception as exc:
            with self._cond:
                self.last_error = exc
                if lease is self.lease:  # else replaced since: put again at once, under the new one
                    self._retry_at = time.monotonic() + self._interval
                closed = self._closed
            if closed:  # refused under the revoked lease, as it should be
                log.debug("etcd put of %s after close failed: %s", self.key, exc)
                return
            log.warning("etcd put of %s failed (%s); putting the latest blob again in %.1f s", self.key, exc,
                        self._interval)  # fmt: skip
            return
        with self._cond:
            again = self.last_error is not None
            if lease is self.lease:
                self._put_generation = max(self._put_generation, generation)
            self.last_error = None
            self._cond.notify_all()
        if again:
            log.info("republished %s to etcd", self.key)

    def _refresh(self) -> None:
        """Keep the lease alive; one etcd no longer knows is replaced (the blob put again under the new one)."""
        with self._cond:
            lease = self.lease
        try:
            alive = self._keepalive_once(lease) > 0
        except InvalidMetadata:
            raise  # an answer not understood says nothing of the lease: keep it, try again at the next refresh
        except Exception:
            with self._cond:  # put again once etcd answers (at the next refresh's rhythm, not at once)
                self._put_generation = -1
                self._retry_at = time.monotonic() + self._interval
                self._cond.notify_all()
            self._call("/maintenance/status", {}, "etcd status")  # raises while etcd is away; answers when only
            alive = False  # the lease is gone
        if alive:
            return
        with self._cond:
            if self._closed:
                return
        log.info("etcd lost the lease of %s; publishing under a new one", self.key)
        new, granted = self._grant()
        with self._cond:
            closed = self._closed
            if not closed:
                self.lease, self._interval = new, min(self.ttl, granted) / 3
                self._put_generation, self._retry_at = -1, 0.0  # the blob is put again under it, now
                self._cond.notify_all()
        if closed:  # closed while the grant was on its way: close revoked the lease it saw, not this one
            self._revoke(new)

    def _call(self, path: str, body: dict, what: str) -> dict:
        return gateway_call(self.client, path, body, what)

    def _grant(self) -> tuple[Any, int]:
        """A new lease of ``ttl`` s and the TTL etcd granted; InvalidMetadata for an answer that is not a lease."""
        from etcd3gw.lease import Lease

        what = f"etcd lease grant for {self.key}"
        doc = self._call("/lease/grant", {"TTL": self.ttl, "ID": 0}, what)
        lease_id = as_revision(doc.get("ID"), f"{what}: ID")
        granted = as_revision(doc.get("TTL"), f"{what}: TTL")
        if lease_id == 0 or granted == 0:  # lease 0 is no lease: a key put under it would never expire
            raise InvalidMetadata(f"{what}: lease {lease_id} of {granted} s is not a lease")
        return Lease(lease_id, client=self.client), granted

    def _put(self, lease: Any, blob: bytes) -> None:
        body = {"key": key_b64(self.key), "value": base64.b64encode(blob).decode(), "lease": lease.id}
        self._call("/kv/put", body, f"etcd put of {self.key}")

    def _keepalive_once(self, lease: Any) -> int:
        """The TTL etcd gives ``lease`` now that it was kept alive; 0 when etcd no longer knows it."""
        what = f"etcd lease keepalive for {self.key}"
        result = checked_field(self._call("/lease/keepalive", {"ID": lease.id}, what), "result", dict, what, None)
        return as_revision(result.get("TTL", 0), f"{what}: TTL")

    def _revoke(self, lease: Any) -> None:
        try:
            self._call("/kv/lease/revoke", {"ID": lease.id}, f"etcd lease revoke for {self.key}")
        except Exception as exc:  # the key then goes when the lease expires, a TTL after the last keepalive
            log.warning("etcd lease revoke for %s failed (%s); the key goes when the lease expires", self.key, exc)

    def close(self, revoke: bool = True, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the threads and revoke the lease, so the key disappears now rather than after the TTL.

        Never waits for a put or refresh in flight: once the lease is revoked, etcd refuses a put still on its way
        (or deletes the key with the lease, had it landed), and the threads put or grant nothing once closed. The
        revoke is waited for at most ``timeout`` s: unconfirmed by then, the key goes when the lease expires (a TTL
        after the last keepalive etcd took). ``revoke=False`` leaves the key to expire with its lease, as when the
        agent dies. Once called, ``wait_published`` says False.
        """
        with self._cond:
            self._closed = True  # before reading the lease to revoke: a refresh granting one now sees it, revokes it
            self._cond.notify_all()
            lease = self.lease
        if not revoke:
            return
        revoking = threading.Thread(
            target=self._revoke, args=(lease,), name=f"dm-etcd-revoke-{self._name}", daemon=True
        )
        revoking.start()
        revoking.join(timeout)
        if revoking.is_alive():
            log.warning("etcd did not confirm the revoke of %s's lease within %g s; the key goes when it expires",
                        self.key, timeout)  # fmt: skip

    def wait_stopped(self, timeout: float | None) -> bool:
        """After ``close``: wait up to ``timeout`` s for the threads to end the etcd calls they were in; True once
        they have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
