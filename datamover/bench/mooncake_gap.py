"""Where the mooncake workload's gap to raw Mooncake comes from: Mooncake's own price for datamover's object
format, and datamover's work around the store call.

Per case (op, value size, batch), in alternated rounds (the order flips every round) on one store client, one
registered buffer and one pool (its own ``mooncake_master`` and a member process lending the memory, as the
``mooncake`` bench workload starts them):

- raw: the bench's baseline, ``batch_put_from`` / ``batch_get_into`` of ``block``-byte objects on the caller's
  memory;
- ours: ``objects.put_objects`` / ``get_objects`` in the call groups the client picks (the backend's path, less
  the transfer lifecycle), with the store call inside it timed on its own;
- halves (batches of 2 or more): raw as two calls of half the batch each, one after the other. A pipeline of
  ours in two parts (stage or verify one part while the other's store call runs) costs at least this, since it
  hides at most ours' own work behind the second call: it can only win where ``halves_us`` is below ``ours_us``.

Per case: medians; ``ratio`` = ours/raw in GB/s (the bench's number); ``format`` = raw over the store call inside
ours (what Mooncake charges for payload + trailer objects, staged or as two buffers: the best ours could reach if
its own work cost nothing); ``work_us`` = ours' time outside the store call (copies, CRC32C, trailers, Python).
Each ratio comes with a 95% paired-bootstrap interval. Run: ``python -m datamover.bench.mooncake_gap --cases
64K:16,256K:16``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..units import parse_size, size_text
from .runner import paired_ratio_ci
from .workload import fill_random

#: the store calls ours makes (staged, upserted, two-buffer objects)
STORE_CALLS = frozenset(
    {"batch_put_from", "batch_upsert_from", "batch_put_from_multi_buffers", "batch_get_into",
     "batch_get_into_multi_buffers"}
)  # fmt: skip


@dataclass
class GapRow:
    """One case: medians in microseconds and ratios (raw time over the other's) with 95% intervals."""

    op: str
    block: int
    batch: int
    rounds: int
    raw_us: float
    ours_us: float
    store_us: float  # the store call(s) inside ours
    work_us: float  # ours outside its store call(s), median of the per-round differences
    ratio: float
    ratio_lo: float | None
    ratio_hi: float | None
    format: float
    format_lo: float | None
    format_hi: float | None
    staged: bool
    # raw as two calls of half the batch each, one after the other: the least a two-part pipeline of ours can
    # cost (it hides at most our work behind the second call); None for a batch of 1
    halves_us: float | None = None

    def line(self) -> str:
        def ci(lo: float | None, hi: float | None) -> str:
            return f"[{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "[n/a]"

        return (
            f"{self.op:<5} {size_text(self.block):>8} x {self.batch:<4} raw {self.raw_us:8.0f} us  ours "
            f"{self.ours_us:8.0f} us  store in ours {self.store_us:8.0f} us  our work {self.work_us:7.0f} us  "
            f"ours/raw {self.ratio:.2f} {ci(self.ratio_lo, self.ratio_hi)}  format {self.format:.2f} "
            f"{ci(self.format_lo, self.format_hi)}  {'staged' if self.staged else 'two buffers'}"
            + (f"  raw in halves {self.halves_us:.0f} us" if self.halves_us is not None else "")
        )


class _TimedStore:
    """The store with its batched data calls timed (``spent``: seconds in them since the last ``reset``)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.spent = 0.0

    def reset(self) -> None:
        self.spent = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in STORE_CALLS:
            return attr

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args)
            finally:
                self.spent += time.perf_counter() - t0

        return timed


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"64K:16,1M:1"`` -> [(65536, 16), (1048576, 1)]: value size and batch per case."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        size, sep, batch = item.partition(":")
        if not sep or not batch.strip().isdigit() or int(batch) < 1:
            raise ValueError(f"case {item!r}: want SIZE:BATCH with BATCH >= 1, e.g. 64K:16")
        block = parse_size(size, "value size")
        if block < 1:
            raise ValueError(f"case {item!r}: the value size must be >= 1 byte")
        out.append((block, int(batch)))
    if not out:
        raise ValueError("no cases given (e.g. 64K:16,256K:16)")
    return out


def measure(
    cases: Sequence[tuple[int, int]],
    ops: Sequence[str] = ("WRITE", "READ"),
    rounds: int = 100,
    params: dict[str, Any] | None = None,
) -> list[GapRow]:
    """Run every case of ``ops`` for ``rounds`` alternated rounds against a pool of its own; one row per case.
    Every status is checked and, for READ, the bytes ours delivered."""
    from ..backends.mooncake.client import PoolClient
    from ..backends.mooncake.objects import Arena
    from ..descriptors import aligned_empty
    from ..testing.mooncake import MooncakeMaster, PoolMember

    bad = [op for op in ops if op not in ("WRITE", "READ")]
    if bad:
        raise ValueError(f"ops must be WRITE or READ, got {bad}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    most = max(b * n for b, n in cases)
    with MooncakeMaster() as master, PoolMember(master, segment_bytes=4 * most + (64 << 20)):
        cfg = master.config(**{"global_segment_size": 0, "local_buffer_size": 64 << 20, **(params or {})})
        client = PoolClient(cfg)
        try:
            mem = aligned_empty(most)
            fill_random(mem)
            client.register(int(mem.ctypes.data), mem.nbytes)
            arena = Arena(client.register, client.unregister, int(client.params["staging_bytes"]))
            try:
                timed = _TimedStore(client.store)
                return [_case(client, timed, arena, mem, op, b, n, rounds) for op in ops for b, n in cases]
            finally:
                arena.close()
                client.unregister(int(mem.ctypes.data))
        finally:
            client.close()


def _case(
    client: Any, timed: _TimedStore, arena: Any, mem: np.ndarray, op: str, block: int, batch: int, rounds: int
) -> GapRow:
    """One case's alternated rounds."""
    from ..backends.mooncake.objects import get_objects, put_objects

    store, cfg = client.store, client.replicate_config
    base = int(mem.ctypes.data)
    addrs = [base + i * block for i in range(batch)]
    sizes = [block] * batch
    ours_keys = [f"gap/ours/{block}/{i}" for i in range(batch)]
    raw_keys = [f"gap/raw/{block}/{i}" for i in range(batch)]
    half_keys = [f"gap/halves/{block}/{i}" for i in range(batch)]
    every_key = ours_keys + raw_keys + half_keys
    groups = client.groups(sizes)
    want = mem[: block * batch].copy()

    def ours() -> list[int]:
        out: list[int] = []
        for a, z, staged in groups:
            k, ad, sz = ours_keys[a:z], addrs[a:z], sizes[a:z]
            if op == "WRITE":
                out += put_objects(timed, cfg, arena, k, ad, sz, staged)
            else:
                out += get_objects(timed, arena, k, ad, sz, staged)
        return out

    def call(keys: list[str], a: int, z: int) -> list[int]:
        if op == "WRITE":
            return store.batch_put_from(keys[a:z], addrs[a:z], sizes[a:z], cfg)
        return [0 if r == block else r for r in store.batch_get_into(keys[a:z], addrs[a:z], sizes[a:z])]

    def raw() -> list[int]:
        return call(raw_keys, 0, batch)

    def halves() -> list[int]:
        return call(half_keys, 0, batch // 2) + call(half_keys, batch // 2, batch)

    def delivered(read: Any) -> None:
        """Raw reads land in the same memory: ours is checked on its own, before and after the rounds."""
        mem[: block * batch] = 0
        _check("ours", read())
        if not np.array_equal(mem[: block * batch], want):
            raise RuntimeError(f"READ {block} x {batch}: the bytes ours delivered differ from what was written")

    store.batch_remove(every_key, True)
    if op == "READ":  # the values, ours with their trailers
        for a, z, staged in groups:
            _check("put", put_objects(store, cfg, arena, ours_keys[a:z], addrs[a:z], sizes[a:z], staged))
        _check("put", store.batch_put_from(raw_keys + half_keys, addrs * 2, sizes * 2, cfg))
        delivered(ours)
    t_ours, t_raw, t_store, t_halves = [], [], [], []
    sides = (ours, raw, halves) if batch > 1 else (ours, raw)
    for r in range(-1, rounds):  # round -1 warms each side up, untimed
        if op == "WRITE":  # Mooncake keeps the first object written under a key: a repeated put would be a no-op
            store.batch_remove(every_key, True)
        for side in sides[::-1] if r % 2 else sides:
            timed.reset()
            t0 = time.perf_counter()
            st = side()
            dt = time.perf_counter() - t0
            _check(side.__name__, st)
            if r < 0:
                continue
            if side is ours:
                t_ours.append(dt)
                t_store.append(timed.spent)
            elif side is raw:
                t_raw.append(dt)
            else:
                t_halves.append(dt)
    if op == "READ":
        delivered(ours)
    store.batch_remove(every_key, True)
    o, w, s = np.asarray(t_ours), np.asarray(t_raw), np.asarray(t_store)
    lo, hi = paired_ratio_ci(t_ours, t_raw)
    flo, fhi = paired_ratio_ci(t_store, t_raw)
    return GapRow(
        op, block, batch, rounds, float(np.median(w) * 1e6), float(np.median(o) * 1e6), float(np.median(s) * 1e6),
        float(np.median(o - s) * 1e6), float(w.sum() / o.sum()), lo, hi, float(w.sum() / s.sum()), flo, fhi,
        all(g[2] for g in groups), float(np.median(t_halves) * 1e6) if t_halves else None,
    )  # fmt: skip


def _check(side: str, statuses: Sequence[int]) -> None:
    bad = sorted({int(v) for v in statuses if v != 0})
    if bad:
        raise RuntimeError(f"{side}: store statuses {bad}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datamover.bench.mooncake_gap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="64K:1,64K:16,64K:64,256K:16,1M:16,4M:4", help="SIZE:BATCH,... per case")
    ap.add_argument("--op", default="WRITE,READ", help="WRITE, READ or both")
    ap.add_argument("--rounds", type=int, default=100, help="alternated rounds per case")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=JSON", help="a PoolClient parameter")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
        params = {}
        for item in args.param:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--param {item!r}: want KEY=VALUE")
            try:
                params[key] = json.loads(value)
            except ValueError:
                params[key] = value
        rows = measure(cases, [op.strip().upper() for op in args.op.split(",")], args.rounds, params)
    except ValueError as exc:
        ap.error(str(exc))
    for row in rows:
        print(row.line())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
