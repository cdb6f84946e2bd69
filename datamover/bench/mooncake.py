"""The Mooncake workload: DRAM <-> a Mooncake Store pool through datamover beside MooncakeDistributedStore called
directly, on the same memory, the same store client and the same pool, in one run.

Each case moves ``batch`` values of ``block`` bytes. Ours is one prepared transfer through the ``mooncake``
backend (zero-copy multi-buffer puts and gets with a CRC32C trailer, verified on every read). Raw is what a
Mooncake user writes: ``batch_put_from`` / ``batch_get_into`` on the very registered memory, through the
backend's own store client (so both sides share its connections). The two sides use their own keys (ours
carry trailers, raw values do not); before every timed WRITE both key sets are removed, because Mooncake keeps
the first object written under a key and a repeated put would be a no-op. LOOKUP times the pool lookup the
tier cache makes (which of ``batch`` chunk keys the pool holds: ``PoolClient.exists``) against
``batch_is_exist``; its rows' p50/p99 are judged against ``budget_ms`` (the seed's 1 ms by default).

Without ``master_server_addr`` (workload option, or ``$DATAMOVER_BENCH_MOONCAKE_MASTER`` with
``$DATAMOVER_BENCH_MOONCAKE_METADATA``) the workload starts ``mooncake_master`` on loopback and one pool
member in another process lending the memory the values live in, so every byte crosses processes over TCP as
in a pool of instances, and stops both at the end. ``DATAMOVER_BENCH_MOONCAKE_PARAMS`` (JSON) overrides backend
parameters.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, ClassVar

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, aligned_empty
from ..units import size_text
from .workload import Case, Workload, fill_random, timed_transfer

KiB, MiB = 1 << 10, 1 << 20


class MooncakeWorkload(Workload):
    """DRAM <-> pool values: ours (one transfer) against MooncakeDistributedStore's batch calls."""

    backend = "mooncake"
    ops: ClassVar[tuple[str, ...]] = ("WRITE", "READ", "LOOKUP")
    raw_name = "MooncakeDistributedStore batch_put_from / batch_get_into / batch_is_exist"
    default_points: ClassVar[list[tuple[int, int]]] = [
        (4 * KiB, 1), (4 * KiB, 64), (64 * KiB, 1), (64 * KiB, 16), (64 * KiB, 64),
        (256 * KiB, 16), (1 * MiB, 1), (1 * MiB, 16), (4 * MiB, 4), (16 * MiB, 1),
    ]  # fmt: skip

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(max_bytes, options)
        opts = self.options
        self.master = self.member = None
        self.agent: Agent | None = None
        params = dict(opts.get("mooncake", {}))
        params.update(json.loads(os.environ.get("DATAMOVER_BENCH_MOONCAKE_PARAMS") or "{}"))
        # the lookup budget: workload option, or --param mooncake.budget_ms=...; the seed's 1 ms by default
        self.budget_ms = float(params.pop("budget_ms", opts.get("budget_ms", 1.0)))
        addr = opts.get("master_server_addr") or os.environ.get("DATAMOVER_BENCH_MOONCAKE_MASTER")
        try:
            if addr:
                params.setdefault("master_server_addr", addr)
                meta = opts.get("metadata_server") or os.environ.get("DATAMOVER_BENCH_MOONCAKE_METADATA")
                if meta:
                    params.setdefault("metadata_server", meta)
            else:
                from ..testing.mooncake import MooncakeMaster, PoolMember

                self.master = MooncakeMaster()  # before its start, so that close() removes its directory
                self.master.start()
                # ours and raw each keep one set of values in the pool, plus room for the allocator
                self.member = PoolMember(self.master, segment_bytes=2 * max_bytes + 64 * MiB)
                params = self.master.config(**params)
            params.setdefault("global_segment_size", 0)  # this process only reads and writes: the pool is elsewhere
            params.setdefault("write_mode", "keep")  # Mooncake's put, as raw: the keys are removed before each WRITE
            params.setdefault("local_buffer_size", 64 * MiB)
            self.agent = Agent("bench-mooncake", {"backends": {"mooncake": params}, "timeout_s": 300})
            self.client = self.agent.backend("mooncake").client
            self.store = self.client.store
            self.mem = aligned_empty(max_bytes)
            fill_random(self.mem)
            self.agent.register_memory(self.mem)  # registers it with the store (register_buffer) for both sides
            self.objects = self.agent.register_objects("bench", prefix="")
        except BaseException:
            self.close()
            raise

    def header(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "pool": "mooncake_master + 1 member process (local, loopback)" if self.master else "configured master",
        }
        head.update(self.agent.backend("mooncake").describe())  # type: ignore[union-attr]
        head["lookup_budget_ms"] = self.budget_ms
        return head

    def case(self, op: str, block: int, batch: int) -> Case:
        n = block * batch
        ours_keys = [f"ours/{block}/{i}" for i in range(batch)]
        pool_ours = [f"bench/{k}" for k in ours_keys]
        raw_keys = [f"bench-raw/{block}/{i}" for i in range(batch)]
        base = int(self.mem.ctypes.data)
        ptrs = [base + i * block for i in range(batch)]
        sizes = [block] * batch
        store, cfg, client = self.store, self.client.replicate_config, self.client
        lp = self.agent.prepare(DescList.blocks(self.mem[:n], block))
        rp = self.agent.prepare(DescList.objects(self.objects, np.full(batch, block), 0, keys=ours_keys))
        want = self.mem[:n].copy()
        before_each = lambda: None  # noqa: E731
        if op == "WRITE":

            def before_each() -> None:
                store.batch_remove(pool_ours + raw_keys, True)

        else:  # the values must be there, with their trailers for ours
            store.batch_remove(pool_ours + raw_keys, True)
            self.agent.make_transfer("WRITE", lp, None, rp, None).post().wait()
            got = store.batch_put_from(raw_keys, ptrs, sizes, cfg)
            if any(r != 0 for r in got):
                raise RuntimeError(f"raw batch_put_from failed: {sorted(set(got))}")
        xfer = None if op == "LOOKUP" else self.agent.make_transfer(op, lp, None, rp, None)

        if op == "LOOKUP":

            def ours() -> tuple[float, float]:
                t0 = time.perf_counter()
                found = client.exists(pool_ours)
                dt = time.perf_counter() - t0
                if any(f != 1 for f in found):
                    raise RuntimeError("a key the pool holds was not found")
                return 0.0, dt

            def raw() -> float:
                t0 = time.perf_counter()
                found = store.batch_is_exist(raw_keys)
                dt = time.perf_counter() - t0
                if any(f != 1 for f in found):
                    raise RuntimeError("a key the pool holds was not found (raw)")
                return dt

        else:
            ours = timed_transfer(xfer)
            call = store.batch_put_from if op == "WRITE" else store.batch_get_into

            def raw() -> float:
                t0 = time.perf_counter()
                got = call(raw_keys, ptrs, sizes, cfg) if op == "WRITE" else call(raw_keys, ptrs, sizes)
                dt = time.perf_counter() - t0
                ok = (r == 0 for r in got) if op == "WRITE" else (r == block for r in got)
                if not all(ok):
                    raise RuntimeError(f"raw {call.__name__} failed: {sorted(set(got))}")
                return dt

        def verify() -> bool:
            if op == "LOOKUP":
                return all(f == 1 for f in client.exists(pool_ours))
            if op == "WRITE":
                xfer.post().wait()  # type: ignore[union-attr]
            self.mem[:n] = 0
            rd = self.agent.make_transfer("READ", lp, None, rp, None)
            with rd:
                rd.post().wait()
            good = np.array_equal(self.mem[:n], want)
            self.mem[:n] = want
            return good

        def close() -> None:
            if xfer is not None:
                xfer.release()
            store.batch_remove(pool_ours + raw_keys, True)

        name = {"WRITE": "batch_put_from", "READ": "batch_get_into", "LOOKUP": "batch_is_exist"}[op]
        return Case(op, block, batch, ours, raw, verify, before_each, raw_name=name, close=close)

    @staticmethod
    def summary(results: list, header: dict[str, Any]) -> list[str]:
        """Verdicts: ours/raw at >= 64 KiB against 0.95 (an interval reaching it is parity), and the lookups'
        p50/p99 against the budget."""
        lines = ["mooncake: ours / MooncakeDistributedStore (95% CI); goal >= 0.95 at >= 64 KiB values:"]
        for r in results:
            if r.op == "LOOKUP" or r.ratio is None:
                continue
            ci = f"[{r.ratio_lo:.2f}, {r.ratio_hi:.2f}]" if r.ratio_lo is not None else "[n/a]"
            goal = ""
            if r.block >= 64 * KiB:
                hi = r.ratio_hi if r.ratio_hi is not None else r.ratio
                goal = "  meets" if hi >= 0.95 else "  BELOW"
            lines.append(f"  {r.op:<5} {size_text(r.block):>8} x {r.batch:<4} {r.ratio:5.2f} {ci}{goal}")
        budget = header.get("lookup_budget_ms")
        for r in results:
            if r.op == "LOOKUP":
                p50, p99 = r.xfer_p50_us or 0.0, r.xfer_p99_us
                verdict = ""
                if budget:
                    verdict = f", {'within' if p99 <= budget * 1e3 else 'OVER'} the {budget:g} ms budget"
                lines.append(
                    f"  lookup of {r.batch} key(s): p50 {p50:.0f} us, p99 {p99:.0f} us "
                    f"(ours/raw {r.ratio:.2f}){verdict}"
                )
        return lines

    def close(self) -> None:
        """Close the agent, then stop the pool member and the master, each even when what came before failed."""
        try:
            if self.agent is not None:
                agent, self.agent = self.agent, None
                agent.close()
        finally:
            try:
                if self.member is not None:
                    member, self.member = self.member, None
                    member.kill()
            finally:
                if self.master is not None:
                    master, self.master = self.master, None
                    master.close()
