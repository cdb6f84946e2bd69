"""This agent's regions as ucx maps them for one-sided access: mapped with ``ucp_mem_map`` and their packed rkeys
handed to every connected peer, and at deregistration revoked (peers drop the rkey and confirm their operations on
the region ended, or are cut off), waited on until no operation touches them, then unmapped.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...descriptors import MemType
from . import rma
from .config import log
from .messages import Fail, Revoke, Rkeys


class MappedRegions:
    """The regions the backend ``b`` mapped, and their revocations in progress."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.mapped: dict[int, tuple[int, list]] = {}  # region id -> (memh, [id, mem, dev, addr, length, rkey])
        self.revoking: dict[int, set[int]] = {}  # region id -> inbound connections yet to confirm its revocation
        self.request_params: dict[int, rma.RequestParam] = {}  # VRAM region id -> put/get parameters naming its memh

    def register(self, reg: Any) -> int | None:
        """Map the region for one-sided access and hand its rkey to every connected peer."""
        if not self.b._one_sided:
            return None
        box: list[int] = []
        self.b._call(lambda: box.append(self.map(reg)))
        return box[0]

    def map(self, reg: Any) -> int:
        """On the service thread: map ``reg``, pack its rkey and send it to every peer that said hello."""
        ctx = self.b._ctx
        memh = rma.mem_map(ctx.handle, reg.addr, reg.length, cuda=reg.mem_type == MemType.VRAM)
        try:
            entry = [reg.id, reg.mem_type.value, reg.dev, reg.addr, reg.length, rma.rkey_pack(ctx.handle, memh)]
        except BaseException:
            rma.mem_unmap(ctx.handle, memh)
            raise
        self.mapped[reg.id] = (memh, entry)
        if reg.mem_type == MemType.VRAM:
            self.request_params[reg.id] = rma.memh_param(memh)
        for inbound in self.b._inbound.values():
            if inbound.name:
                inbound.conn.send(Rkeys([entry]))
        return memh

    def deregister(self, reg: Any, handle: Any) -> None:
        """Make sure no peer still reads or writes ``reg``, then unmap it.

        Peers holding its rkey are told to drop it and confirm once their
        operations on us have ended; then served operations are waited for.
        """
        b = self.b
        if threading.current_thread() is b._thread or b._stop:
            return
        deadline = time.monotonic() + b.host.timeout_s
        box: list[bool] = []
        if handle is not None:
            b._call(lambda: self.revoke(reg.id))
            b._wait_until(lambda: box.append(bool(self.revoking.get(reg.id))), box, deadline)
            b._call(lambda: self.revoke_done(reg.id, handle))

        def probe() -> None:
            box.append(self.in_use(reg.id))

        if not b._wait_until(probe, box, deadline):
            log.warning("deregistering region %d while UCX operations on it are still pending", reg.id)
            b._call(lambda: self.cut_off(reg.id))

    def revoke(self, rid: int) -> None:
        """On the service thread: forget region ``rid`` and ask every peer that holds its rkey to drop it."""
        self.mapped.pop(rid, None)
        self.request_params.pop(rid, None)
        waiting = set()
        for inbound in self.b._inbound.values():
            if inbound.name:
                inbound.conn.send(Revoke(rid))
                waiting.add(inbound.conn_id)
        if waiting:
            self.revoking[rid] = waiting

    def revoke_done(self, rid: int, memh: int) -> None:
        """On the service thread: cut off the peers that did not confirm the revocation in time, then unmap."""
        b = self.b
        late = self.revoking.pop(rid, set())
        if late:
            # a peer that neither confirmed nor disconnected may still write: cut it off before unmapping
            for inbound in [i for i in b._inbound.values() if i.conn_id in late]:
                log.warning("agent %r did not confirm dropping region %d; disconnecting it", inbound.name, rid)
                inbound.conn.flush()  # its Revoke goes out before the close: its direct cma copies stop on it
                b._drop_inbound(inbound)
            b._reset_worker(f"peers {sorted(late)} kept region {rid} after it was deregistered")
        rma.mem_unmap(b._ctx.handle, memh)

    def cut_off(self, rid: int) -> None:
        """On the service thread, the wait for region ``rid`` run out: the requests served into it are failed and
        their connections dropped, and the worker is replaced (kept, never progressed, if any is still posted)."""
        b = self.b
        late = [i for i in b._inbound.values() if any(rid in entry[4] for entry in i.ops.values())]
        if not late:
            return
        posted = []
        for inbound in late:
            for op_id, entry in list(inbound.ops.items()):
                if rid in entry[4]:
                    if entry[0].poll() is False:
                        posted.append(inbound.name)
                    inbound.conn.send(Fail(op_id, f"region {rid} was deregistered while this request was served"))
            log.warning("agent %r still had requests served into region %d; disconnecting it", inbound.name, rid)
            b._drop_inbound(inbound)
        reason = f"requests of {sorted({i.name for i in late})} were still served into region {rid} at deregistration"
        b._reset_worker(reason, quarantine=bool(posted), culprit=posted[0] if posted else None)

    def in_use(self, rid: int) -> bool:
        """Whether a request of this agent, or one it serves for a peer, still touches region ``rid``."""
        b = self.b
        if any(rid in op.req.plan.regions for op in b._active_out.values()):
            return True
        if any(rid in d.regions for d in list(b._directs) if not d.done):
            return True
        if any(rid in regions for _, regions in list(b._cma_ops.values())):
            return True
        for peer in b._peers.values():  # requests waiting for the handshake will post soon
            if any(rid in op.req.plan.regions for op in peer.ops.values() if op.reqs is None and not op.abandoned):
                return True
        return any(rid in entry[4] for inbound in b._inbound.values() for entry in inbound.ops.values())

    def unmap_all(self) -> None:
        """At shutdown, on the service thread: unmap every region still mapped."""
        for memh, _ in self.mapped.values():
            rma.mem_unmap(self.b._ctx.handle, memh)
        self.mapped.clear()
