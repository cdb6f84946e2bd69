"""mooncake: DRAM <-> OBJ against a Mooncake Store pool (``mooncake_master`` and the clients lending memory).

An OBJ descriptor (offset, length) naming key k of a registration for "bucket" b addresses the pool's object
``b/k``, so buckets are namespaces inside one pool:

- WRITE (offset 0, length n) stores the whole object as n bytes plus datamover's trailer (its CRC32C and
  length, see ``objects.py``) with ``replica_count`` replicas: below ``zero_copy_bytes`` staged (copied beside
  its trailer into a registered arena, one buffer per object, ``batch_put_from``), from there on zero-copy
  from the registered source (``batch_put_from_multi_buffers``). Mooncake keeps the first object written
  under a key; with ``write_mode="replace"`` (the default) a WRITE's bytes are what the keys hold after, as
  with any object store (staged objects are upserted, zero-copy ones removed first); ``"keep"`` is
  Mooncake's own put, right for keys that name their content, as KV-cache chunk keys do. A non-zero offset
  on WRITE, and two WRITE rows naming one object, are refused when the transfer is made.
- READ (0, n) of an n-byte object lands in the arena (staged) or in the destination (zero-copy) and is
  verified (trailer and CRC32C) before it counts; a READ at another offset or of fewer bytes reads the whole
  object into a bounce buffer, verifies it, and copies the range. A failed or mismatched row fails the
  transfer with a typed error naming the key; its destination is untouched (staged) or holds zeros
  (zero-copy): a mismatch is a miss, never wrong bytes. A get that failed in transfer (the holder of the
  chosen replica died) is asked again ``read_retries`` times; Mooncake picks a replica per get.

Work runs in parts of at most ``batch_keys`` keys and ``part_bytes`` bytes on ``threads`` pool threads (small
requests, up to ``inline_bytes``, inside post: a store call under way when their deadline passes holds the caller
until Mooncake's RPC timeout, ~30 s; ``inline_bytes: 0`` never runs one on the caller's thread), no call or retry
starts past the deadline, spread over the threads from
``split_bytes`` a thread on, so checksums of one part overlap the transfer of another; a release stops between
parts, and a part stopped (timed out, released) touches neither the caller's memory nor the pool any more: each
batched call runs inside the transfer's fence (``backends.fence.ReadFence``), a WRITE's from its remove or first
read of the source until its put returned. VRAM is refused with the reason: the non-CUDA build of Mooncake cannot
address device memory (datamover's tier cache stages VRAM through host memory).
"""

from __future__ import annotations

import errno as errno_mod
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...descriptors import MemType
from ...errors import (
    ChecksumMismatch,
    DatamoverError,
    InvalidParameter,
    ObjectStoreError,
    OverlappingDestination,
    TransferAborted,
    TransferTimeout,
    UnsupportedTransfer,
)
from ..base import (
    Backend,
    Completion,
    Op,
    TransferRequest,
    clock,
    refuse_offset_writes,
    run_inline,
    run_parts,
    split_by_bytes,
)
from ..fence import ReadFence
from . import codes
from .client import DEFAULTS, PoolClient, store_import_error

log = logging.getLogger("datamover.mooncake")

#: the longest ``close`` waits for store calls in flight, and then for the store client's own close
CLOSE_S = 5.0


@dataclass
class MooncakePlan:
    """One request per row: the pool key, the memory address, the length and object offset, whether the row is
    a whole object; the ``parts`` (row ranges) the work is cut into, and for each part its rows' keys,
    addresses and sizes with the client's call groups (what a post hands the client, made once)."""

    keys: list[str]
    addrs: list[int]
    sizes: list[int]
    offsets: list[int]
    whole: list[bool]
    parts: list[tuple[int, int]]
    inline: bool = False
    all_whole: bool = True
    calls: dict[int, tuple[list[str], list[int], list[int], list[tuple[int, int, bool]]]] = field(default_factory=dict)


class MooncakeBackend(Backend):
    """Host memory to and from objects of a Mooncake Store pool, batched and zero-copy, with CRC32C."""

    name = "mooncake"
    pairs = frozenset({(MemType.DRAM, MemType.OBJ), (MemType.VRAM, MemType.OBJ)})
    default_params = {
        **DEFAULTS,
        "write_mode": "replace",  # or "keep": Mooncake's put (an existing key keeps its bytes)
        "threads": 2,
        "batch_keys": 1024,
        # a request is spread over the threads only from this many bytes per thread on: each batched call of
        # Mooncake's client keeps a core busy while it waits, so calls side by side pay only with cores to spare
        "split_bytes": 32 << 20,
        # requests of at most this many bytes (in one part; the default: 16 values of 64 KiB with their trailers)
        # run inside post(), on the caller's thread: no thread hop, which costs small requests several times their
        # time here (BENCHMARKS.md, session 27); but a store call already under way when the deadline passes can
        # hold the caller until Mooncake's RPC timeout (~30 s) ends it (no call or retry starts past the deadline).
        # 0: every request runs on the pool threads and a caller is never held past its deadline
        "inline_bytes": (1 << 20) + (64 << 10),
        "part_bytes": 32 << 20,
    }

    def __init__(self, host, params=None) -> None:
        super().__init__(host, params)
        p = self.params
        if p["write_mode"] not in ("replace", "keep"):
            mode = p["write_mode"]
            raise InvalidParameter(f"write_mode must be 'replace' or 'keep', got {mode!r}", backend=self.name)
        try:
            self.client = PoolClient({k: p[k] for k in DEFAULTS})
        except ValueError as exc:
            raise InvalidParameter(str(exc), backend=self.name) from exc
        self._replace = p["write_mode"] == "replace"
        self._pool = ThreadPoolExecutor(max(1, int(p["threads"])), thread_name_prefix="dm-mooncake")
        # parts inside a store call now, and whether close began (from then on no part calls the store)
        self._active = threading.Condition(threading.Lock())
        self._running = 0
        self._closing = False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        why = store_import_error()
        if why:
            return False, why
        if importlib_find("crc32c") is None:
            return False, "needs crc32c (pip install 'datamover[mooncake]')"
        return True, "ok"

    @classmethod
    def environment(cls) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version

        here: dict[str, Any] = {}
        for pkg in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "crc32c"):
            try:
                here[pkg] = version(pkg)
            except PackageNotFoundError:
                pass
        return here

    def describe(self) -> dict[str, Any]:
        p = self.client.params
        return {
            "master": p["master_server_addr"],
            "metadata": p["metadata_server"],
            "protocol": p["protocol"],
            "segment": self.client.hostname,
            "lends": p["global_segment_size"],
            "replicas": p["replica_count"],
            "write_mode": self.params["write_mode"],
        }

    # -- registration ----------------------------------------------------------
    def register(self, reg) -> Any:
        """The region registered with the store client, for zero-copy moves; None when it is not (not DRAM, or
        the client refused it: with the master gone, register_buffer fails, and that must not fail the agent's
        registration, which other backends and local tiers use; staged moves do not need it)."""
        if reg.mem_type != MemType.DRAM:
            return None
        try:
            self.client.register(reg.addr, reg.length)
        except OSError as exc:
            log.warning("%s; that memory is not registered with the Mooncake client", exc)
            return None
        return reg.addr

    def deregister(self, reg, handle: Any) -> None:
        if handle is not None:
            self.client.unregister(handle)

    # -- planning ------------------------------------------------------------
    def plan(self, req: TransferRequest) -> MooncakePlan:
        if req.local.mem_type != MemType.DRAM:
            raise UnsupportedTransfer(
                f"{req.local.mem_type} <-> OBJ: this Mooncake build cannot address device memory "
                "(stage through DRAM, as the tier cache does)",
                backend=self.name,
            )
        obj, n = req.remote, len(req.remote)
        write = req.op is Op.WRITE
        regs = req.registrations
        buckets = {r: regs[r].extra["bucket"] for r in np.unique(req.remote_regions).tolist()}
        table = obj.keys or ()
        names = np.array([f"{buckets[int(r)]}/{table[int(d)]}" for r, d in zip(req.remote_regions, obj.dev)], object)
        refuse_offset_writes(req, lambda row: names[row], "Mooncake", self.name)
        if write and n > 1:
            _, first, inverse = np.unique(names.astype(str), return_index=True, return_inverse=True)
            seen = first[inverse.reshape(-1)]
            dup = np.flatnonzero(seen != np.arange(n))
            if dup.size:
                row = int(dup[0])
                raise OverlappingDestination(
                    f"writes object {names[row]!r} that descriptor {req.caller_index(int(seen[row]))} writes too",
                    index=req.caller_index(row),
                    backend=self.name,
                )
        lengths = obj.length + 16
        # parts of at least split_bytes each, so that checks and copies of one overlap the transfer of another
        ranges = split_by_bytes(lengths, int(self.params["threads"]), int(self.params["split_bytes"]))
        parts: list[tuple[int, int]] = []
        step_keys, step_bytes = int(self.params["batch_keys"]), int(self.params["part_bytes"])
        for a, z in ranges:
            parts += _cut(lengths[a:z], a, step_keys, step_bytes)
        inline = len(parts) == 1 and int(lengths.sum()) <= int(self.params["inline_bytes"])
        keys, addrs, sizes = names.tolist(), req.local.addr.tolist(), obj.length.tolist()
        calls = {}
        for a, z in parts:
            rows = sizes[a:z]
            calls[a] = (keys[a:z], addrs[a:z], rows, self.client.groups(rows))
        whole = obj.addr == 0
        return MooncakePlan(
            keys, addrs, sizes, obj.addr.tolist(), whole.tolist(), parts, inline, bool(whole.all()), calls
        )

    # -- execution -----------------------------------------------------------
    def post(self, req: TransferRequest) -> Completion:
        p: MooncakePlan = req.plan
        work = self._write if req.op is Op.WRITE else self._read

        def part(a: int, z: int, c: Completion) -> None:
            if c.cancelled:
                return
            late, failed = "not started", None
            if clock() <= req.deadline:
                with self._active:
                    if self._closing:
                        raise TransferAborted(f"{req.op} of {p.keys[a]!r}: the mooncake backend is closing")
                    self._running += 1
                try:
                    work(req, a, z, c)
                except DatamoverError as exc:
                    if clock() <= req.deadline:
                        raise
                    failed = exc  # a store call that failed past the deadline (an RPC timed out): a timeout
                finally:
                    with self._active:
                        self._running -= 1
                        self._active.notify_all()
                late = "not finished"
                if failed is None and clock() <= req.deadline:
                    return
            err = TransferTimeout(
                f"{req.op} of {z - a} key(s) from {p.keys[a]!r} {late} within the {req.timeout:g} s deadline"
                + (f" ({failed})" if failed is not None else ""),
                index=req.caller_index(a),
                backend=self.name,
            )
            raise err from failed

        if p.inline:
            return run_inline(p.parts, part, backend=self.name)
        # parts go to the pool, never to a waiting caller (a store call can block far past the deadline; the caller
        # waits only to it). The completion fences its parts: once it is cancelled (timed out, released) nothing
        # reaches the caller (a READ), and nothing more is read from the caller nor removed or put in the pool (a
        # WRITE), except what Mooncake itself does in a store call already under way
        return run_parts(self._pool, p.parts, part, backend=self.name, completion_type=ReadFence, assist=False)

    def _write(self, req: TransferRequest, a: int, z: int, c: Completion) -> None:
        keys, addrs, sizes, groups = req.plan.calls[a]
        fence = c if type(c) is ReadFence else None
        st = self.client.put(keys, addrs, sizes, self._replace, groups, req.deadline, fence)
        if any(st):
            bad = [i for i, v in enumerate(st) if v]
            what = "put (replace)" if self._replace else "put"
            raise self._error(req, a + bad[0], st[bad[0]], what, failed=len(bad), of=z - a)

    def _read(self, req: TransferRequest, a: int, z: int, c: Completion) -> None:
        p: MooncakePlan = req.plan
        keys, addrs, sizes, offsets = p.keys, p.addrs, p.sizes, p.offsets
        fence = c if type(c) is ReadFence else None
        if p.all_whole:
            k, ad, sz, groups = p.calls[a]
            got = self.client.get(k, ad, sz, groups, fence, req.deadline)
            if not any(got):
                return
            st = np.asarray(got, dtype=np.int64)
        else:
            whole = [i for i in range(a, z) if p.whole[i]]
            st = np.zeros(z - a, dtype=np.int64)
            if whole:
                st[np.array(whole) - a] = self.client.get(
                    [keys[i] for i in whole], [addrs[i] for i in whole], [sizes[i] for i in whole], None, fence,
                    req.deadline,
                )  # fmt: skip
        # ranged reads, and whole-row reads of objects that hold more (their prefix): verified in a bounce buffer
        for i in range(a, z):
            if not p.whole[i] or st[i - a] == codes.SIZE_MISMATCH:
                if clock() > req.deadline:
                    st[i - a] = codes.DEADLINE
                    continue
                st[i - a] = self.client.get_range(keys[i], offsets[i], addrs[i], sizes[i], fence, req.deadline)[0]
        bad = np.flatnonzero(st != 0)
        if bad.size:
            row = a + int(bad[0])
            raise self._error(req, row, int(st[bad[0]]), "get", failed=int(bad.size), of=z - a)

    def _error(self, req: TransferRequest, row: int, code: int, what: str, failed: int, of: int) -> DatamoverError:
        """A typed error naming the key, Mooncake's code and how many keys of the part failed."""
        key = req.plan.keys[row]
        bucket, _, name = key.partition("/")
        more = f" ({failed} of {of} keys in this part failed)" if failed > 1 else ""
        reason = f"{what} {key!r} failed: {codes.name(code)}{more}"
        if code == codes.SIZE_MISMATCH and clock() <= req.deadline:  # one more store call: only within the deadline
            size = self.client.size(key)
            if size is not None:
                off, n = req.plan.offsets[row], req.plan.sizes[row]
                reason = f"{what} {key!r}: the object holds {size} bytes, [{off}, {off + n}) reads past its end"
        if code in (codes.CHECKSUM_MISMATCH, codes.NOT_DATAMOVER):
            err: DatamoverError = ChecksumMismatch(reason, index=req.caller_index(row), backend=self.name)
            err.bucket, err.key = bucket, name  # type: ignore[attr-defined]
            return err
        return ObjectStoreError(
            reason, bucket=bucket, key=name, status=None, code=codes.token(code),
            errno=codes.errno_of(code) if code != codes.NO_ANSWER else errno_mod.EIO,
            index=req.caller_index(row), backend=self.name,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the pool without waiting for parts stuck in a store call (a stalled master holds one ~30 s, and
        retries would hold it longer): parts not started are cancelled; those inside a call get ``CLOSE_S`` to
        return. Past that the store client is left open (closing it under a call in flight can crash the process)
        and a warning says so; else it is closed, also bounded (``PoolClient.close``)."""
        with self._active:
            self._closing = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._active:
            idle = self._active.wait_for(lambda: not self._running, CLOSE_S)
            stuck = self._running
        if not idle:
            log.warning(
                "mooncake: %d store call(s) still in flight %g s into close: the store client is left open",
                stuck,
                CLOSE_S,
            )
            return
        self.client.close(CLOSE_S)


def _cut(lengths: np.ndarray, base: int, keys: int, nbytes: int) -> list[tuple[int, int]]:
    """Cut rows [base, base + len) into runs of at most ``keys`` rows and about ``nbytes`` bytes."""
    out, n = [], int(lengths.shape[0])
    cum = np.cumsum(lengths)
    a = 0
    while a < n:
        z = min(n, a + keys)
        before = int(cum[a - 1]) if a else 0
        z = max(a + 1, min(z, int(np.searchsorted(cum, before + nbytes, side="right"))))
        out.append((base + a, base + z))
        a = z
    return out


def importlib_find(name: str) -> Any:
    import importlib.util

    return importlib.util.find_spec(name)
