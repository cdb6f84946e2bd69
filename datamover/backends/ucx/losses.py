"""Lost control connections: a peer or inbound connection that closed, failed its authentication or sent
garbage is dropped, and when it went while sending to this agent either its hang-up is confined (its receives
ended, the receive queue probed by a second worker, see ``Hangup``) or the UCX worker is reset.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ...errors import RemoteDisconnected
from .config import _PROBE_TAG, log
from .state import Hangup, Inbound, Peer


class Losses:
    """Connections lost by the backend ``b``, and the hang-ups mid-WRITE waiting for their probe."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.pending: list[Hangup] = []  # peers that hung up mid-WRITE, waiting for their probe (see lost)
        self.prober: tuple[Any, Any] | None = None  # (worker, endpoint to this worker) that sends the probes
        self.probe_ids = itertools.count()
        self.counts = {"confined": 0, "reset": 0}  # hang-ups mid-WRITE, by how they ended

    def lost(self, owner: Peer | Inbound, why: BaseException | None) -> None:
        """Drop a control connection that closed (``why`` None) or failed; reset the worker if it was sending."""
        b = self.b
        if isinstance(owner, Peer):
            # what it had in flight, its READs' receives included, is cut off by replacing and keeping the worker
            # before their ERR (_disconnect_peer): a fresh worker also gets past a receive queue the dead peer
            # left blocked
            if why is None:
                why = RemoteDisconnected(
                    f"agent {owner.name!r} disconnected (control connection closed)", backend=b.name
                )
            b._disconnect_peer(owner, why)
            return
        receiving = any(entry[1] == "WRITE" for entry in owner.ops.values())
        if receiving and float(b.params["hangup_probe_s"]) > 0:
            self._confine(owner, why)
            return
        if why is not None:
            log.warning("dropping connection from %r: %s", owner.name or "?", str(why))
        # its requests go before its endpoint closes: UCX objects a request still holds outlive the reset
        b._drop_inbound(owner)
        if receiving:
            # a peer that died while sending to us can leave our shared-memory receive queue blocked for
            # every sender; only a fresh worker gets past it
            b._reset_worker(f"agent {owner.name!r} died while sending to this agent")

    def _confine(self, owner: Inbound, why: BaseException | None) -> None:
        """A peer hung up with receives posted for its WRITE: end them, probe the receive queue (see ``Hangup``).

        Receives it never matched end at once with empty self-sends (no byte lands); ``check`` resets
        the worker only if one it matched stays posted, or the probe does not come through, in time. One
        probing worker serves every hang-up (made at the first, freed by a reset or close()).
        """
        b = self.b
        name = owner.name
        writes = [entry[0] for entry in owner.ops.values() if entry[1] == "WRITE"]
        for entry in owner.ops.values():
            if entry[1] == "WRITE":
                b.tagged._self_complete(entry[3], entry[0].pending())
        log.warning("dropping connection from %r: %s", name or "?", why or "it hung up mid-WRITE")
        hangup = Hangup(name, writes, time.monotonic() + float(b.params["hangup_probe_s"]))
        hangup.ep, owner.ep = owner.ep, None  # closed only once its requests went (see release)
        b._drop_inbound(owner)
        try:
            if self.prober is None:
                worker = b._ucx.UCXWorker(b._ctx)
                self.prober = (worker, worker.create_endpoint_from_worker_address(b._worker.address, False))
            tag = b._ucx.UCXXTag(_PROBE_TAG | next(self.probe_ids))
            hangup.recv = b._worker.tag_recv(b._Array(memoryview(hangup.probe)), tag)
            hangup.send = self.send_probe(self.prober[1], tag)
        except Exception as exc:  # no probe, no proof: reset
            log.warning("cannot probe the UCX receive queue after %r hung up: %s", name, exc)
            self._end(hangup, "the receive queue could not be probed")
            return
        self.pending.append(hangup)

    def send_probe(self, ep: Any, tag: Any) -> Any:
        """Send the probe from the probing worker's endpoint ``ep`` to this worker, under ``tag``."""
        return ep.tag_send(self.b._Array(memoryview(bytearray(b"dm-probe"))), tag)

    def check(self, now: float) -> None:
        """End the hang-ups whose receives and probe ended (confined), or whose deadline passed (reset)."""
        if self.prober is not None:
            while self.prober[0].progress_once():  # the probe's own side: its wireup and send
                pass
        for hangup in list(self.pending):
            if hangup.ended():
                self.pending.remove(hangup)
                self._end(hangup, None)
            elif now > hangup.deadline:
                self.pending.remove(hangup)
                self._end(
                    hangup,
                    "a receive it had matched is still posted"
                    if hangup.recv.completed
                    else f"the receive queue did not answer a probe within {self.b.params['hangup_probe_s']:g} s",
                )
                return  # the reset ended every other probe too

    def _end(self, hangup: Hangup, failed: str | None) -> None:
        self.release(hangup)
        if failed is None:
            self.counts["confined"] += 1
            log.info("agent %r hung up mid-WRITE: its receives ended and the receive queue answered", hangup.name)
            return
        self.counts["reset"] += 1
        self.b._reset_worker(f"agent {hangup.name!r} died while sending to this agent ({failed})")

    def release(self, hangup: Hangup) -> None:
        """Its requests go, then its endpoint closes: UCX objects that a request still holds when its endpoint
        closes outlive the worker (a reset would leak it)."""
        b = self.b
        b._retired.add([hangup.recv])
        hangup.send = hangup.recv = None
        hangup.reqs = []
        b._retired.cancel_now(b._quiesced)  # in flight: cancelled safely, before the endpoint closes
        b._retire_ep(hangup.ep)
        hangup.ep = None

    def on_reset(self) -> None:
        """The worker is being replaced: the pending hang-ups' receives and probes were on it, the prober speaks
        to it."""
        pending, self.pending = self.pending, []
        for hangup in pending:
            self.release(hangup)
        prober, self.prober = self.prober, None
        if prober is not None:
            try:
                prober[1].close()
            except Exception as exc:
                log.debug("closing the probe endpoint: %s", exc)
            self.b._graveyard.append((time.monotonic(), prober))  # freed with the closed endpoints

    def free(self) -> None:
        """The service thread's end: let go of the hang-ups (a request's UCX objects before its endpoint's)."""
        for hangup in self.pending:
            hangup.reqs = []
        self.pending.clear()
        self.prober = None
