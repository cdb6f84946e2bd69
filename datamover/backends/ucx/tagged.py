"""Owner-served tag send/recv: the initiator's tagged rows, and the owner checking and serving requests."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...descriptors import DescList, MemType
from ...descriptors.desclist import check_rows
from ...errors import (
    DatamoverError,
    InvalidMetadata,
    RemoteDisconnected,
    TransferTimeout,
)
from .config import _CACHE_ROWS, _DRAIN_MAX, _DRAINS_PER_PEER, ucx_error
from .messages import Done, Fail, Refuse, Req
from .state import Drain, Inbound, OutOp, Peer, Requests, row_views


class Tagged:
    """Owner-served tag send/recv: the initiator's tagged rows, and the owner checking and serving requests."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    def _post_local(self, peer: Peer, op: OutOp) -> bool:
        views = op.req.plan.views
        tag, ep, T = op.tag0, peer.ep, self.b._ucx.UCXXTag
        try:
            if op.req.op == "WRITE":
                reqs = [ep.tag_send(v, T(tag + i)) for i, v in enumerate(views)]
            else:
                reqs = [ep.tag_recv(v, T(tag + i)) for i, v in enumerate(views)]
        except Exception as exc:
            self._end(op, RemoteDisconnected(f"posting to agent {peer.name!r} failed: {exc}", backend=self.b.name))
            return False
        op.reqs = Requests(reqs, self.b._retired)
        self.b._active_out[op.id] = op
        return True

    def _maybe_done(self, op: OutOp) -> None:
        # a request that failed ends with its error once its rows ended, whatever the target says meanwhile
        if op.done_msg and op.drain is None and op.reqs is not None and op.reqs.k >= len(op.reqs.reqs):
            self._end(op, None)

    def _end(self, op: OutOp, error: BaseException | None) -> None:
        """Finish the caller's completion; UCX requests still pending stay tracked until they end."""
        op.finish(error)
        if op.reqs is None or op.reqs.k >= len(op.reqs.reqs):
            self.b._active_out.pop(op.id, None)
            op.peer.ops.pop(op.id, None)

    def _check_requests(self) -> bool:
        progressed = False
        if self.b._revokes:
            self.b.one_sided._check_revokes()
        for op in list(self.b._active_out.values()):
            k = op.reqs.k  # type: ignore[union-attr]
            res = op.reqs.poll()  # type: ignore[union-attr]
            progressed |= op.reqs.k != k  # type: ignore[union-attr]
            if res is False:
                continue
            if op.abandoned:
                self.b._active_out.pop(op.id, None)
                op.peer.ops.pop(op.id, None)
            elif op.drain is not None:
                continue  # failed: its drain ends it
            elif res is True:
                self.b._active_out.pop(op.id, None)
                self._maybe_done(op)
            else:
                idx = op.req.caller_index(op.reqs.k)  # type: ignore[union-attr]
                self.b._fail_served(op, ucx_error(res, op.peer.name, idx, self.b.name))
        for key, inbound in list(self.b._active_in.items()):
            entry = inbound.ops.get(key[1])
            if entry is None:
                self.b._active_in.pop(key, None)
                continue
            reqs, op_name, notify, _, _ = entry
            k = reqs.k
            res = reqs.poll()
            progressed |= reqs.k != k
            if res is False:
                continue
            self.b._active_in.pop(key, None)
            inbound.ops.pop(key[1], None)
            if res is True:
                if notify:
                    self.b.host.deliver_notification(inbound.name, notify)
                if op_name == "WRITE":
                    inbound.conn.send(Done(key[1]))
            else:
                inbound.conn.send(Fail(key[1], f"{type(res).__name__}: {res}"))
        return progressed

    def _late(self, op: OutOp) -> TransferTimeout:
        return TransferTimeout(
            f"{op.req.op} to agent {op.peer.name!r} did not start within {op.req.timeout:g} s", backend=self.b.name
        )

    def _self_complete(self, tag0: int, rows: list[int]) -> None:
        """Complete pending receives of ours that no peer will ever match, with empty self-sends."""
        if not rows:
            return
        if self.b._self_ep is None:
            self.b._self_ep = self.b._worker.create_endpoint_from_worker_address(self.b._worker.address, False)
        empty = self.b._Array(memoryview(bytearray(1))[:0])
        for i in rows:
            self.b._self_ep.tag_send(empty, self.b._ucx.UCXXTag(tag0 + i))

    def _serve(self, inbound: Inbound, msg: Req) -> None:
        self.b.counts["served for peers"] += 1
        op_id, op, tag0 = msg.id, msg.op, msg.tag
        # a prepared transfer posted again sends the same descriptors: reuse their check while the
        # registrations are unchanged (the table object is rebuilt on every change)
        cap, serving = int(self.b.params["max_served_rows"]), self.b.served_rows()
        if serving + msg.rows > cap:  # each posted row holds UCX request state (about 700 bytes) until it ends
            reason = f"this agent serves at most {cap} rows for its peers at once ({serving} now); retry later"
            inbound.conn.send(Refuse(op_id, reason, None))
            if op == "WRITE":
                self._drain(inbound, msg, tag0)
            return
        key = (msg.mem, msg.addr, msg.length, msg.dev)
        cached = self.b._checked.get(key)
        if cached is not None and cached[0] is self.b.host.region_table:
            views, regions = cached[1], cached[2]
        else:
            try:
                descs, rids = self._validate(msg)
            except DatamoverError as exc:
                inbound.conn.send(Refuse(op_id, exc.reason, exc.index))
                if op == "WRITE":
                    self._drain(inbound, msg, tag0)
                return
            views = row_views(self.b.host.regions, rids, descs.addr, descs.length, self.b._Array)
            regions = frozenset(rids.tolist())
            if len(views) <= _CACHE_ROWS:  # 256 entries of at most this many views each: bounded memory
                if len(self.b._checked) >= 256:
                    self.b._checked.pop(next(iter(self.b._checked)))
                self.b._checked[key] = (self.b.host.region_table, views, regions)
        ep, T = inbound.ep, self.b._ucx.UCXXTag
        try:
            if op == "WRITE":
                reqs = [ep.tag_recv(v, T(tag0 + i)) for i, v in enumerate(views)]
            else:
                reqs = [ep.tag_send(v, T(tag0 + i)) for i, v in enumerate(views)]
        except Exception as exc:
            inbound.conn.send(Fail(op_id, f"posting failed: {exc}"))
            return
        inbound.ops[op_id] = (Requests(reqs, self.b._retired), op, msg.notify or b"", tag0, regions)
        self.b._active_in[(inbound.conn_id, op_id)] = inbound

    def _cancel_served(self, inbound: Inbound, op_id: int) -> None:
        """The initiator gave up on a request this side serves: it gets no done and no notification.

        Its posted sends and receives touch only memory registered here for
        the initiator to write or read: they run out on their own, or are cancelled later (``Retired``); dropped
        here, one ending in the progress thread meanwhile would deadlock both threads.
        """
        if inbound.ops.pop(op_id, None) is not None:
            self.b._active_in.pop((inbound.conn_id, op_id), None)

    def _validate(self, msg: Req) -> tuple[DescList, np.ndarray]:
        """The request's descriptors checked against this agent's registrations; raises naming the row.

        ``messages.Req`` already checked the op and that the columns are equal-length int64 arrays.
        """
        from ...errors import InvalidDescriptor

        mem = MemType.parse(msg.mem)
        if mem not in (MemType.DRAM, MemType.VRAM):
            raise InvalidDescriptor(f"ucx serves DRAM and VRAM, not {mem}")
        cols = [msg.addr, msg.length, msg.dev]
        rows = np.empty((msg.rows, 3), dtype=np.int64, order="F")
        for k, c in enumerate(cols):
            rows[:, k] = np.frombuffer(c, dtype="<i8")
        check_rows(rows)  # negative fields, address overflow; the same checks DescList makes, without its overhead
        descs = DescList.wrap(rows, mem, None, ())
        rids = self.b.host.region_table.lookup(descs, owner=f"agent {self.b.host.name!r}", backend=self.b.name)
        return descs, rids

    def _drain(self, inbound: Inbound, msg: Req, tag0: int) -> None:
        """Consume the refused request's data into scratch memory, so none of it touches registered memory."""
        n = msg.rows
        longest = int(np.frombuffer(msg.length, dtype="<i8").max()) if n else 0
        mine = [d for d in self.b._draining if d.inbound is inbound]
        if len(mine) >= _DRAINS_PER_PEER:
            raise InvalidMetadata(f"more than {_DRAINS_PER_PEER} refused WRITEs in flight")
        drain = Drain(inbound, tag0, n, max(1, min(longest, _DRAIN_MAX)), self.b._Array, self.b._ucx.UCXXTag)
        if drain.step(time.monotonic()):
            self.b._draining.append(drain)
