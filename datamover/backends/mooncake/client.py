"""PoolClient: one Mooncake Store client (``MooncakeDistributedStore``) set up from datamover parameters.

It registers memory, puts and gets datamover's objects (payload and CRC32C trailer, ``objects.py``) in
batches with one status per key (``codes.py``), never an exception for a key that is absent, retries gets
that failed in transfer, bounds every size the store reports before allocating for it, and answers what
the pool holds (``exists``, ``replicas``), removes, and copies objects between members (copy tasks). The
backend (``backend.py``) and the shared L4 pool of the tier cache both use it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...descriptors import host_view
from ..base import clock
from . import codes
from .objects import MAGIC, SLOT, TRAILER, Arena, answers, get_objects, put_objects

__all__ = ["DEFAULTS", "MAGIC", "TRAILER", "PoolClient", "resolve", "store_import_error"]

log = logging.getLogger("datamover.mooncake")

#: the key ``close`` asks about to tell a stalled master before Mooncake's close blocks on it
_PROBE_KEY = "datamover/close-probe"

#: how long ``exists`` waits for the store's answer by default
EXISTS_S = 1.0

#: the most keys in one batched call of the store
BATCH_KEYS = 4096

#: what a PoolClient takes, with defaults: Mooncake's own setup() arguments first
DEFAULTS: dict[str, Any] = {
    "master_server_addr": None,  # host:port of mooncake_master; None: $MOONCAKE_MASTER, else 127.0.0.1:50051
    "metadata_server": None,  # "P2PHANDSHAKE", an http://.../metadata URL, or etcd://...; None: $MOONCAKE_...
    "local_hostname": "127.0.0.1",
    "protocol": "tcp",
    "rdma_devices": "",
    "global_segment_size": 256 << 20,  # the memory this client lends to the pool (0: lends none)
    "local_buffer_size": 16 << 20,
    # the address the transfer engine listens on (MC_TCP_BIND_ADDRESS): None keeps the process's setting,
    # else the local_hostname; Mooncake would otherwise pick the first non-loopback interface
    "bind_address": None,
    # placement
    "replica_count": 1,
    "preferred_segment": "",  # a segment (host:port) new replicas go to first; "local": this client's own
    "hard_pin": False,  # objects this client writes are never evicted
    # bounds and retries
    "max_object_bytes": 1 << 30,
    # how objects move: "staged" (one buffer per object through a registered arena, verified before the
    # caller sees it), "zero_copy" (payload and trailer as two buffers of one object, from/to the caller), or
    # "auto": staged below zero_copy_bytes (where a second buffer's round trip costs more than a copy),
    # zero-copy from there on (where a copy costs more than the round trip); in a call moving more than
    # cached_copy_bytes, whose copies no longer run from the CPU's caches (several times slower), zero-copy
    # from zero_copy_bytes_large on
    "transfer_mode": "auto",
    "zero_copy_bytes": 4 << 20,
    "zero_copy_bytes_large": 1 << 20,
    "cached_copy_bytes": 4 << 20,
    "staging_bytes": 64 << 20,  # the most arena bytes one call uses (and the most kept between calls)
    "read_retries": 2,  # a get that failed in transfer (a dead holder) is asked again this many times
    "connect_timeout": 3.0,  # seconds to wait for the master to accept before setup (which would wait on)
    # the transfer engine's slice (MC_SLICE_SIZE, unless the process set it): Mooncake's 64 KiB plus 4 KiB, so
    # an object's 16-byte trailer never costs one more RDMA slice and a value of up to 16 x 64 KiB takes as
    # many slices as without it (TCP sends one request per buffer); None leaves Mooncake's default
    "slice_bytes": 65536 + 4096,
    "quiet": True,  # Mooncake logs errors only (MC_LOG_LEVEL=ERROR unless the process set it)
}


def store_import_error() -> str | None:
    """Why ``mooncake.store`` cannot be used here (None when it can), found without importing it."""
    import ctypes.util

    if importlib.util.find_spec("mooncake") is None:
        return "needs mooncake-transfer-engine-non-cuda (pip install 'datamover[mooncake]')"
    if ctypes.util.find_library("ibverbs") is None:
        return "mooncake.store needs libibverbs.so.1 to import (Debian: apt-get install libibverbs1)"
    return None


def resolve(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` over the defaults, with the environment's master and metadata server where not given."""
    p = {**DEFAULTS, **(params or {})}
    unknown = set(p) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"mooncake: unknown parameter(s) {sorted(unknown)}; known: {', '.join(sorted(DEFAULTS))}")
    p["master_server_addr"] = p["master_server_addr"] or os.environ.get("MOONCAKE_MASTER") or "127.0.0.1:50051"
    p["metadata_server"] = p["metadata_server"] or os.environ.get("MOONCAKE_TE_META_DATA_SERVER") or "P2PHANDSHAKE"
    if int(p["replica_count"]) < 1:
        raise ValueError(f"mooncake: replica_count must be >= 1, got {p['replica_count']}")
    if int(p["max_object_bytes"]) < 1:
        raise ValueError("mooncake: max_object_bytes must be >= 1")
    if p["transfer_mode"] not in ("auto", "staged", "zero_copy"):
        mode = p["transfer_mode"]
        raise ValueError(f"mooncake: transfer_mode must be 'auto', 'staged' or 'zero_copy', got {mode!r}")
    return p


class PoolClient:
    """A set-up store client: register memory, put and get objects with trailers, check, remove, replicate."""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        p = self.params = resolve(params)
        if p["quiet"]:
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        if p["slice_bytes"]:
            os.environ.setdefault("MC_SLICE_SIZE", str(int(p["slice_bytes"])))
        bind = p["bind_address"] or p["local_hostname"]
        if bind and "MC_TCP_BIND_ADDRESS" not in os.environ:
            os.environ["MC_TCP_BIND_ADDRESS"] = str(bind)
        why = store_import_error()
        if why:
            raise RuntimeError(why)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise RuntimeError(f"mooncake.store does not import: {exc}") from exc

        _probe_master(str(p["master_server_addr"]), float(p["connect_timeout"]))
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            str(p["local_hostname"]), str(p["metadata_server"]), int(p["global_segment_size"]),
            int(p["local_buffer_size"]), str(p["protocol"]), str(p["rdma_devices"]), str(p["master_server_addr"]),
        )  # fmt: skip
        if rc != 0:
            raise ConnectionError(
                f"mooncake: setup against master {p['master_server_addr']} (metadata {p['metadata_server']}) "
                f"failed with {rc} ({codes.name(rc)})"
            )
        self.hostname: str = self._store.get_hostname()
        cfg = ReplicateConfig()
        cfg.replica_num = int(p["replica_count"])
        seg = p["preferred_segment"]
        if seg:
            cfg.preferred_segment = self.hostname if seg == "local" else str(seg)
        cfg.with_hard_pin = bool(p["hard_pin"])
        self._config = cfg
        mode = p["transfer_mode"]
        self._copy_below = {"staged": 1 << 62, "zero_copy": 0}.get(mode, int(p["zero_copy_bytes"]))
        self._copy_below_large = min(self._copy_below, int(p["zero_copy_bytes_large"])) if mode == "auto" else None
        self._cached_copy = int(p["cached_copy_bytes"])
        self._arena = Arena(self.register, self.unregister, int(p["staging_bytes"]))
        self._upsert = hasattr(self._store, "batch_upsert_from")  # Mooncake 0.3.13 on
        self._asker = Asker("dm-mooncake-exists")
        self._closed = False

    # -- memory --------------------------------------------------------------
    def register(self, addr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(int(addr), int(nbytes))
        if rc != 0:
            raise OSError(f"mooncake: register_buffer({addr:#x}, {nbytes}) failed with {rc} ({codes.name(rc)})")

    def unregister(self, addr: int) -> None:
        self._store.unregister_buffer(int(addr))

    def staged(self, size: int) -> bool:
        """Whether an object of ``size`` bytes, alone in a call, moves through the arena (else zero-copy)."""
        return size < self._below([size])

    def _below(self, sizes: Sequence[int]) -> int:
        """Values below this many bytes are staged in a call of ``sizes``."""
        if self._copy_below_large is not None and sum(sizes) > self._cached_copy:
            return self._copy_below_large
        return self._copy_below

    def groups(self, sizes: Sequence[int]) -> list[tuple[int, int, bool]]:
        """Rows cut so that one call moves at most BATCH_KEYS keys and about ``staging_bytes`` bytes, in one mode
        (staged or zero-copy): (first row, end, staged). A caller moving the same sizes again (a prepared
        transfer) keeps them and passes them to ``put`` and ``get``."""
        limit, below = int(self.params["staging_bytes"]), self._below(sizes)
        n = len(sizes)
        if 0 < n <= BATCH_KEYS:  # the common case, one call: no walk over the rows
            staged = min(sizes) < below
            if (max(sizes) < below) == staged and sum(sizes) * staged + (SLOT if staged else TRAILER) * n <= limit:
                return [(0, n, staged)]
        out, a, used = [], 0, 0
        mode = sizes[0] < below if n else True
        for i, s in enumerate(sizes):
            m = s < below
            if i > a and (i - a >= BATCH_KEYS or used + s + SLOT > limit or m != mode):
                out.append((a, i, mode))
                a, used = i, 0
            mode = m
            used += s + SLOT if m else TRAILER
        if a < n:
            out.append((a, n, mode))
        return out

    # -- puts and gets -------------------------------------------------------
    def put(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        replace: bool = False,
        groups: Sequence[tuple[int, int, bool]] | None = None,
        deadline: float | None = None,
        fence: Any = None,
    ) -> list[int]:
        """Write each ``sizes[i]`` bytes at ``addrs[i]`` as object ``keys[i]`` with its trailer; one status per key.

        Mooncake keeps the first object written under a key: a put of an existing key succeeds and leaves it
        as it was. With ``replace`` what is written is what the keys hold after: staged objects are upserted
        (``batch_upsert_from``: one call, where a remove and a put are two), zero-copy ones removed first; a key
        whose remove the store refused (OBJECT_HAS_LEASE, RPC_FAIL, ...) is not put and answers that status.
        ``groups`` is ``groups(sizes)``, computed here when not given. Past ``deadline`` (on ``backends.base.clock``)
        no further call starts: the keys left answer DEADLINE. With a ``fence`` (``backends.fence.ReadFence``) each
        group's calls (its remove, its reads of ``addrs``, its put) run inside it: once it was cancelled nothing
        of ``addrs`` is read and nothing is removed or put (those keys: CANCELLED).
        """
        keys = keys if type(keys) is list else list(keys)
        groups = groups or self.groups(sizes)
        if len(groups) == 1:
            return self._put_group(keys, addrs, sizes, groups[0][2], replace, fence)
        out: list[int] = []
        for a, z, staged in groups:
            if deadline is not None and clock() > deadline:
                out += [codes.DEADLINE] * (z - a)
                continue
            out += self._put_group(keys[a:z], addrs[a:z], sizes[a:z], staged, replace, fence)
        return out

    def _put_group(
        self, keys: list[str], addrs: Sequence[int], sizes: Sequence[int], staged: bool, replace: bool, fence: Any
    ) -> list[int]:
        if fence is None:
            return self._put_calls(keys, addrs, sizes, staged, replace)
        if not fence.enter():
            return [codes.CANCELLED] * len(keys)
        try:
            return self._put_calls(keys, addrs, sizes, staged, replace)
        finally:
            fence.leave()

    def _put_calls(
        self, keys: list[str], addrs: Sequence[int], sizes: Sequence[int], staged: bool, replace: bool
    ) -> list[int]:
        upsert = replace and staged and self._upsert
        if not replace or upsert:
            return put_objects(self._store, self._config, self._arena, keys, addrs, sizes, staged, upsert)
        # a key the store refused to remove (a lease on it, the master gone) would keep its old object under a put
        # that "succeeds": it fails with the remove's status and is not put
        removed = answers(self._store.batch_remove(keys, True), len(keys))
        ok = [i for i, r in enumerate(removed) if r == 0 or r == codes.OBJECT_NOT_FOUND]
        if len(ok) == len(keys):
            return put_objects(self._store, self._config, self._arena, keys, addrs, sizes, staged, upsert)
        if ok:
            got = put_objects(
                self._store, self._config, self._arena, [keys[i] for i in ok], [addrs[i] for i in ok],
                [sizes[i] for i in ok], staged, upsert,
            )  # fmt: skip
            for i, st in zip(ok, got):
                removed[i] = st
        return removed

    def get(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        groups: Sequence[tuple[int, int, bool]] | None = None,
        fence: Any = None,
        deadline: float | None = None,
    ) -> list[int]:
        """Read whole objects ``keys[i]`` of payload ``sizes[i]`` into ``addrs[i]``; one status per key (0: read
        and verified). A get that failed in transfer is asked again ``read_retries`` times (Mooncake picks a
        replica per get, so another try may reach a live holder). ``groups`` as in ``put``; with a ``fence``
        (``backends.fence.ReadFence``) nothing reaches ``addrs`` once it was cancelled (those keys: CANCELLED). Past
        ``deadline`` (on ``backends.base.clock``) no call starts, no retry either: a key not asked answers DEADLINE,
        one that failed keeps its status."""
        keys = keys if type(keys) is list else list(keys)
        status = self._get_round(keys, addrs, sizes, groups or self.groups(sizes), fence, deadline)
        if not any(status):
            return status
        n = len(keys)
        for _ in range(max(0, int(self.params["read_retries"]))):
            if deadline is not None and clock() > deadline:
                return status
            todo = [i for i in range(n) if status[i] in codes.RETRYABLE]
            if not todo:
                break
            sub = [sizes[i] for i in todo]
            got = self._get_round(
                [keys[i] for i in todo], [addrs[i] for i in todo], sub, self.groups(sub), fence, deadline
            )
            for i, st in zip(todo, got):
                if st != codes.DEADLINE:
                    status[i] = st
        if deadline is not None and clock() > deadline:
            return status
        for i in [i for i in range(n) if status[i] in (codes.INVALID_PARAMS, codes.TRANSFER_FAIL)]:
            size = self._size(keys[i])  # too small a buffer (-600) or a shorter object (-800): say which
            if size >= 0 and size != sizes[i]:
                status[i] = codes.SIZE_MISMATCH
            elif size in (codes.TOO_LARGE, codes.NOT_DATAMOVER):
                status[i] = size
        return status

    def _get_round(
        self,
        keys: list[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        groups: Sequence[tuple[int, int, bool]],
        fence: Any = None,
        deadline: float | None = None,
    ) -> list[int]:
        """One try at every row: a status per key (DEADLINE for the calls not started past ``deadline``)."""
        if len(groups) == 1:
            return get_objects(self._store, self._arena, keys, addrs, sizes, groups[0][2], fence)
        out: list[int] = []
        for a, z, staged in groups:
            if deadline is not None and clock() > deadline:
                out += [codes.DEADLINE] * (z - a)
                continue
            out += get_objects(self._store, self._arena, keys[a:z], addrs[a:z], sizes[a:z], staged, fence)
        return out

    def size(self, key: str) -> int | None:
        """The payload size of ``key`` as the store reports it; None when absent, not ours, or too large."""
        size = self._size(key)
        return size if size >= 0 else None

    def _size(self, key: str) -> int:
        """The payload size of ``key``, or a negative status (absent, too small to be ours, too large)."""
        total = int(self._store.get_size(key))
        if total < 0:
            return total
        if total < TRAILER:
            return codes.NOT_DATAMOVER
        if total - TRAILER > int(self.params["max_object_bytes"]):
            return codes.TOO_LARGE
        return total - TRAILER

    def get_range(
        self, key: str, offset: int, addr: int, nbytes: int, fence: Any = None, deadline: float | None = None
    ) -> tuple[int, int | None]:
        """Read ``nbytes`` at ``offset`` of object ``key`` into ``addr``: the whole object is read into a
        bounce buffer and verified first. Returns (status, the object's payload size or None). ``fence`` as
        in ``get``."""
        size = self._size(key)
        if size < 0:
            return size, None
        if offset + nbytes > size:
            return codes.SIZE_MISMATCH, size
        bounce = np.empty(max(size, 1), dtype=np.uint8)
        self.register(bounce.ctypes.data, bounce.nbytes)
        try:
            st = self.get([key], [bounce.ctypes.data], [size], deadline=deadline)[0]
        finally:
            self.unregister(bounce.ctypes.data)
        if st == 0 and nbytes:
            if fence is not None and not fence.enter():
                return codes.CANCELLED, size
            try:
                host_view(addr, nbytes)[:] = bounce[offset : offset + nbytes]
            finally:
                if fence is not None:
                    fence.leave()
        return st, size

    # -- the pool's view -----------------------------------------------------
    def exists(self, keys: Sequence[str], timeout: float | None = EXISTS_S) -> list[int]:
        """1 where the pool holds ``keys[i]``, 0 where not, -1 where it could not tell.

        With ``timeout`` (None: as long as the store takes) the store call runs on the client's own asking thread
        and this waits at most ``timeout`` seconds for it (a stalled master holds a call ~30 s): -1 for every key
        when it does not answer in time, and at once while an earlier call that did not is still stuck (no second
        call piles up behind it)."""
        keys = keys if isinstance(keys, list) else list(keys)
        if not keys or self._closed:
            return [-1] * len(keys)
        if timeout is None:
            res = self._store.batch_is_exist(keys)
        else:
            answered, res = self._asker.ask(lambda: self._store.batch_is_exist(keys), timeout)
            if not answered:
                return [-1] * len(keys)
        if res is None or len(res) != len(keys):
            return [-1] * len(keys)
        return res

    def remove(self, keys: Sequence[str], force: bool = True) -> np.ndarray:
        if not keys:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(answers(self._store.batch_remove(list(keys), bool(force)), len(keys)), dtype=np.int64)

    def remove_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with ``prefix`` (every instance's); how many went (< 0: failed)."""
        import re

        return int(self._store.remove_by_regex("^" + re.escape(prefix), True))

    def replicas(self, keys: Sequence[str]) -> dict[str, list[str]]:
        """The segments (host:port) holding a complete memory replica of each key."""
        out: dict[str, list[str]] = {}
        for key, descs in self._store.batch_get_replica_desc(list(keys)).items():
            holders = []
            for d in descs:
                if d.is_memory_replica() and str(d.status).endswith("COMPLETE"):
                    holders.append(str(d.get_memory_descriptor().buffer_descriptor.transport_endpoint))
            out[str(key)] = holders
        return out

    def copy_to(self, key: str, targets: Sequence[str]) -> tuple[Any, int]:
        """Ask the master to copy ``key`` to ``targets`` (segments); (task id, status)."""
        task, rc = self._store.create_copy_task(key, list(targets))
        return task, int(rc)

    def task_state(self, task: Any) -> str:
        """PENDING, PROCESSING, SUCCESS, FAILED, or UNKNOWN for a copy/move task."""
        resp, rc = self._store.query_task(task)
        if rc != 0 or resp is None:
            return "UNKNOWN"
        return str(resp.status).rpartition(".")[2]

    def healthy(self) -> bool:
        return self._store.health_check() == 0

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (for the benchmark's raw baseline)."""
        return self._store

    @property
    def replicate_config(self) -> Any:
        return self._config

    def close(self, timeout: float | None = None) -> bool:
        """Close the store client. Mooncake's close makes RPCs to the master holding the GIL (no Python thread runs
        meanwhile, so no thread can bound it): with ``timeout``, the master is first asked something (on the asking
        thread, bounded by ``timeout``); when it does not answer (stalled), or an existence check is still stuck,
        the client is left open (leaked) with a warning rather than blocking the process for as long as the RPCs
        take. True when closed."""
        if self._closed:
            return True
        if timeout is not None:
            try:
                answered, _ = self._asker.ask(lambda: self._store.batch_is_exist([_PROBE_KEY]), timeout)
            except Exception:  # any failure to answer is "not answered"
                answered = False
            if not answered:
                self._closed = True
                self._asker.stop(0)
                log.warning("mooncake: the master did not answer within %g s: the store client is left open", timeout)
                return False
        self._closed = True
        if not self._asker.stop(timeout):
            log.warning("mooncake: an existence check is stuck in the store; the store client is left open")
            return False
        self._arena.close()
        self._store.close()
        return True


class Asker:
    """One daemon thread that runs store calls for callers who wait for them a bounded time.

    A caller that gave up marks the thread stuck: until that call returns, ``ask`` answers at once without
    starting another (calls would only pile up behind it)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stuck = False
        self._running = 0  # calls queued or running

    def ask(self, fn: Any, timeout: float) -> tuple[bool, Any]:
        """(True, fn()) when it returned within ``timeout`` seconds, else (False, None); fn's exception is raised."""
        with self._lock:
            if self._stuck:
                return False, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._running += 1
        # a bare lock that the serving thread releases: an Event would wake the caller through its Condition's locks,
        # more hand-offs between the two threads on every call
        done = threading.Lock()
        done.acquire()
        job: list[Any] = [fn, done, None, None]  # fn, done, result, exception
        self._jobs.put(job)
        if not done.acquire(True, max(timeout, 0.0)):
            with self._lock:
                if not done.acquire(False):
                    self._stuck = True
                    return False, None
        if job[3] is not None:
            raise job[3]
        return True, job[2]

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job[2] = job[0]()
            except BaseException as exc:  # handed to the caller
                job[3] = exc
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._stuck = False
                    self._idle.notify_all()
                job[1].release()

    def stop(self, timeout: float | None) -> bool:
        """Wait (at most ``timeout``) for the calls asked to return, then let the thread end; False if one is stuck."""
        with self._lock:
            idle = self._idle.wait_for(lambda: not self._running, timeout)
            self._stuck = True  # nothing more is asked
        self._jobs.put(None)
        return idle


def _probe_master(addr: str, timeout: float) -> None:
    """Fail at once, naming the address, when no master accepts there: Mooncake's setup would wait for it."""
    import socket

    if "://" in addr:  # etcd://... (HA leader discovery): Mooncake resolves it
        return
    host, _, port = addr.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"mooncake: master_server_addr must be host:port, got {addr!r}")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(
            f"mooncake: no mooncake_master answers at {addr} ({exc.strerror or exc}); start one, or set "
            "master_server_addr (or $MOONCAKE_MASTER)"
        ) from exc
