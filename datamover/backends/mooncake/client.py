"""PoolClient: one Mooncake Store client (``MooncakeDistributedStore``) with datamover's object format.

Every object datamover writes is the payload followed by a 16-byte trailer: magic ``DMv1``, the payload's
CRC32C and its length (little-endian u32, u32, u64). Puts send payload and trailer as one object from two
registered buffers (``batch_put_from_multi_buffers``), gets land the payload in the caller's buffer and the
trailer in a registered scratch row (``batch_get_into_multi_buffers``): zero-copy both ways. A get is
accepted only when the store answered exactly payload + trailer bytes, the trailer's magic and length are the
ones expected and the CRC32C of what landed matches; anything else is a miss, and the destination row is
zeroed, so a miss never leaves bytes behind. Sizes that come from the store are bounded before anything is
allocated for them.

The backend (``backend.py``) and the shared L4 pool of the tier cache both use this class; answers are one
status per key (``codes.py``), never an exception for a key that is absent.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...descriptors import host_view
from . import codes

MAGIC = 0x31764D44  # b"DMv1" little-endian
TRAILER = 16
TRAILER_DTYPE = np.dtype([("magic", "<u4"), ("crc", "<u4"), ("length", "<u8")])
_SCRATCH_ROWS = 4096

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
    "read_retries": 2,  # a get that failed in transfer (a dead holder) is asked again this many times
    "connect_timeout": 3.0,  # seconds to wait for the master to accept before setup (which would wait on)
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
    return p


class PoolClient:
    """A set-up store client: register memory, put and get objects with trailers, check, remove, replicate."""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        p = self.params = resolve(params)
        if p["quiet"]:
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
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
        self._lock = threading.Lock()
        self._free_scratch: list[np.ndarray] = []
        self._all_scratch: list[np.ndarray] = []
        self._closed = False

    # -- memory --------------------------------------------------------------
    def register(self, addr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(int(addr), int(nbytes))
        if rc != 0:
            raise OSError(f"mooncake: register_buffer({addr:#x}, {nbytes}) failed with {rc} ({codes.name(rc)})")

    def unregister(self, addr: int) -> None:
        self._store.unregister_buffer(int(addr))

    def _scratch(self) -> np.ndarray:
        """A registered array of trailer rows (``_SCRATCH_ROWS`` x 16 bytes) for one call."""
        with self._lock:
            if self._free_scratch:
                return self._free_scratch.pop()
        block = np.zeros(_SCRATCH_ROWS, dtype=TRAILER_DTYPE)
        self.register(block.ctypes.data, block.nbytes)
        with self._lock:
            self._all_scratch.append(block)
        return block

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._free_scratch.append(block)

    # -- puts ----------------------------------------------------------------
    def put(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int], replace: bool = False) -> np.ndarray:
        """Write each ``sizes[i]`` bytes at ``addrs[i]`` as object ``keys[i]`` with its trailer; one status per key.

        Mooncake keeps the first object written under a key: a put of an existing key succeeds and leaves it
        as it was. ``replace`` removes the keys first, so what is written is what the keys hold after.
        """
        n = len(keys)
        out = np.zeros(n, dtype=np.int64)
        if replace and n:
            self._store.batch_remove(list(keys), True)
        for a in range(0, n, _SCRATCH_ROWS):
            z = min(n, a + _SCRATCH_ROWS)
            out[a:z] = self._put_rows(keys[a:z], addrs[a:z], sizes[a:z])
        return out

    def _put_rows(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        import crc32c

        n = len(keys)
        block = self._scratch()
        try:
            tr = block[:n]
            tr["magic"] = MAGIC
            tr["length"] = sizes
            tr["crc"] = [crc32c.crc32c(host_view(a, s)) if s else 0 for a, s in zip(addrs, sizes)]
            t0 = block.ctypes.data
            ptrs = [[a, t0 + TRAILER * i] if s else [t0 + TRAILER * i] for i, (a, s) in enumerate(zip(addrs, sizes))]
            lens = [[s, TRAILER] if s else [TRAILER] for s in sizes]
            res = self._store.batch_put_from_multi_buffers(list(keys), ptrs, lens, self._config)
        finally:
            self._give_back(block)
        return _answers(res, n)

    # -- gets ----------------------------------------------------------------
    def get(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Read whole objects ``keys[i]`` of payload ``sizes[i]`` into ``addrs[i]``; one status per key (0: read
        and verified). A row that is not 0 holds zeros after."""
        n = len(keys)
        out = np.zeros(n, dtype=np.int64)
        for a in range(0, n, _SCRATCH_ROWS):
            z = min(n, a + _SCRATCH_ROWS)
            out[a:z] = self._get_rows(keys[a:z], addrs[a:z], sizes[a:z])
        return out

    def _get_rows(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        n = len(keys)
        status = np.full(n, codes.NO_ANSWER, dtype=np.int64)
        todo = np.arange(n)
        block = self._scratch()
        try:
            for attempt in range(1 + max(0, int(self.params["read_retries"]))):
                sub = todo.tolist()
                status[todo] = self._get_once(block, sub, keys, addrs, sizes)
                retry = np.isin(status[todo], list(codes.RETRYABLE))
                todo = todo[retry]
                if not todo.size or attempt == int(self.params["read_retries"]):
                    break
        finally:
            self._give_back(block)
        bad = np.flatnonzero(status != 0)
        for i in bad.tolist():
            if sizes[i]:
                host_view(addrs[i], sizes[i])[:] = 0
        if bad.size:
            self._explain_sizes(status, bad, keys, sizes)
        return status

    def _get_once(self, block: np.ndarray, rows: list[int], keys, addrs, sizes) -> np.ndarray:
        import crc32c

        t0 = block.ctypes.data
        block[: len(rows)] = 0
        ks = [keys[i] for i in rows]
        ptrs = [[addrs[i], t0 + TRAILER * j] if sizes[i] else [t0 + TRAILER * j] for j, i in enumerate(rows)]
        lens = [[sizes[i], TRAILER] if sizes[i] else [TRAILER] for i in rows]
        got = _answers(self._store.batch_get_into_multi_buffers(ks, ptrs, lens), len(rows))
        want = np.array([sizes[i] for i in rows], dtype=np.int64)
        st = np.where(got < 0, got, 0)
        landed = np.flatnonzero(got >= 0)
        tr = block[: len(rows)]
        short = landed[got[landed] != want[landed] + TRAILER]
        st[short] = codes.SIZE_MISMATCH
        landed = landed[got[landed] == want[landed] + TRAILER]
        foreign = landed[(tr["magic"][landed] != MAGIC) | (tr["length"][landed] != want[landed])]
        st[foreign] = codes.NOT_DATAMOVER
        ok = np.setdiff1d(landed, foreign, assume_unique=True)
        crcs = tr["crc"][ok].tolist()
        for j, crc in zip(ok.tolist(), crcs):
            i = rows[j]
            if sizes[i] and crc32c.crc32c(host_view(addrs[i], sizes[i])) != crc:
                st[j] = codes.CHECKSUM_MISMATCH
            elif not sizes[i] and crc != 0:
                st[j] = codes.CHECKSUM_MISMATCH
        return st

    def _explain_sizes(self, status: np.ndarray, bad: np.ndarray, keys, sizes) -> None:
        """A row the store refused for its size (-600 too small a buffer, -800 a shorter object) is told so."""
        for i in bad[np.isin(status[bad], (codes.INVALID_PARAMS, codes.TRANSFER_FAIL))].tolist():
            size = self._size(keys[i])
            if size >= 0 and size != sizes[i]:
                status[i] = codes.SIZE_MISMATCH
            elif size in (codes.TOO_LARGE, codes.NOT_DATAMOVER):
                status[i] = size

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

    def get_range(self, key: str, offset: int, addr: int, nbytes: int) -> tuple[int, int | None]:
        """Read ``nbytes`` at ``offset`` of object ``key`` into ``addr``: the whole object is read into a
        bounce buffer and verified first. Returns (status, the object's payload size or None)."""
        size = self._size(key)
        if size < 0:
            return size, None
        if offset + nbytes > size:
            return codes.SIZE_MISMATCH, size
        bounce = np.empty(max(size, 1), dtype=np.uint8)
        self.register(bounce.ctypes.data, bounce.nbytes)
        try:
            st = int(self.get([key], [bounce.ctypes.data], [size])[0])
        finally:
            self.unregister(bounce.ctypes.data)
        if st == 0 and nbytes:
            host_view(addr, nbytes)[:] = bounce[offset : offset + nbytes]
        return st, size

    # -- the pool's view -----------------------------------------------------
    def exists(self, keys: Sequence[str]) -> np.ndarray:
        """1 where the pool holds ``keys[i]``, 0 where not, -1 where it could not tell."""
        if not keys:
            return np.zeros(0, dtype=np.int64)
        res = self._store.batch_is_exist(list(keys))
        if len(res) != len(keys):
            return np.full(len(keys), -1, dtype=np.int64)
        return np.clip(np.asarray(res, dtype=np.int64), -1, 1)

    def remove(self, keys: Sequence[str], force: bool = True) -> np.ndarray:
        if not keys:
            return np.zeros(0, dtype=np.int64)
        return _answers(self._store.batch_remove(list(keys), bool(force)), len(keys))

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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            blocks, self._all_scratch, self._free_scratch = self._all_scratch, [], []
        for b in blocks:
            self.unregister(b.ctypes.data)
        self._store.close()


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


def _answers(res: Sequence[int], n: int) -> np.ndarray:
    """The store's per-key answers as an array; a short or missing answer is NO_ANSWER for every key."""
    if res is None or len(res) != n:
        return np.full(n, codes.NO_ANSWER, dtype=np.int64)
    return np.asarray(res, dtype=np.int64)
