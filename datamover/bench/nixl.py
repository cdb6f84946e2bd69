"""The NIXL side of `datamover bench --vs nixl`: each case again through NIXL's Python API, same memory, same files.

A NixlSide is built on a running datamover Workload and reuses its buffers,
its file descriptors and its block permutation, so both libraries move the
same bytes between the same addresses and file offsets. NIXL settings that
change its numbers several-fold are pinned explicitly (``NixlSettings``):
UCX_TLS, the UCX error-handling mode, the POSIX I/O queue, and no progress
thread (NIXL's progress thread spins a whole core, which on a 2-core machine
would be taken from whichever library runs next).
"""

from __future__ import annotations

import importlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, NixlError, TransferTimeout
from .nixl_api import NixlSettings, make_agent, nixl_status, posix_params, ucx_params
from .workload import Case, Workload, permutation


def block_rows(base: int, offsets: np.ndarray, block: int, dev: int) -> np.ndarray:
    """An (N, 3) uint64 array of (base + offset, block, dev) rows, NIXL's descriptor form."""
    rows = np.empty((offsets.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = base + offsets.astype(np.uint64)
    rows[:, 1] = block
    rows[:, 2] = dev
    return rows


@dataclass
class NixlCase:
    """One prepared NIXL transfer: ``run`` times it, ``verify`` checks its bytes, ``close`` releases it.

    ``zero_target`` zeroes the destination so that a later check proves the
    next writer (ours) rather than bytes NIXL left there.
    """

    run: Callable[[], tuple[float, float]]
    verify: Callable[[], bool]
    close: Callable[[], None]
    zero_target: Callable[[], None] = lambda: None
    #: called before and after each timed ``run`` (outside its time and CPU): a peer process that polls rests
    #: in between, so that it takes no CPU from the other library's transfers; ``run`` alone still works
    enter: Callable[[], None] = lambda: None
    leave: Callable[[], None] = lambda: None


class NixlSide(ABC):
    """NIXL's version of one datamover workload, on that workload's memory."""

    def __init__(self, workload: Workload, settings: NixlSettings) -> None:
        self.workload = workload
        self.settings = settings

    def header(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def case(self, case: Case) -> NixlCase: ...

    def close(self) -> None:
        """Deregister and drop the NIXL agent."""

    # -- shared by the pairs -------------------------------------------------
    def _prepped(self, agent, op: str, local_rows: np.ndarray, local_mem: str, remote_rows, remote_mem, peer: str):
        """Prepare both sides and make one transfer handle; returns (handle, releaser)."""
        n = local_rows.shape[0]
        try:
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, local_mem)
            rh = agent.prep_xfer_dlist(peer, remote_rows, remote_mem)
            idx = np.arange(n, dtype=np.int32)
            xh = agent.make_prepped_xfer(op, lh, idx, rh, idx)
        except Exception as exc:
            raise NixlError(f"NIXL could not prepare {op} of {n} descriptors: {exc}", backend="nixl") from exc

        def release() -> None:
            agent.release_xfer_handle(xh)
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)

        return xh, release

    def _timed(self, agent, handle) -> Callable[[], tuple[float, float]]:
        timeout = self.settings.timeout

        def run() -> tuple[float, float]:
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            t1 = time.perf_counter()
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                if time.perf_counter() - t0 > timeout:
                    raise TransferTimeout(f"NIXL transfer still in progress after {timeout} s", backend="nixl")
            if state != "DONE":
                raise NixlError(f"NIXL reported {state} for the transfer", backend="nixl")
            return t1 - t0, time.perf_counter() - t0

        return run


class NixlLocalDram(NixlSide):
    """DRAM -> DRAM in one process: NIXL's UCX backend in loopback, against our memcpy backend."""

    def __init__(self, workload: Workload, settings: NixlSettings) -> None:
        super().__init__(workload, settings)
        self.src, self.dst = workload.src, workload.dst
        self.agent = make_agent("bench-nixl-local", settings, {"UCX": ucx_params(settings)})
        self.reg = self.agent.register_memory(
            [(int(a.ctypes.data), int(a.nbytes), 0, "") for a in (self.src, self.dst)], "DRAM"
        )

    def header(self) -> dict[str, Any]:
        return {"nixl backend": "UCX (loopback)", "ucx": self.agent.get_backend_params("UCX")}

    def case(self, case: Case) -> NixlCase:
        block, batch, n = case.block, case.batch, case.nbytes
        perm = permutation(batch)
        src_rows = block_rows(int(self.src.ctypes.data), np.arange(batch, dtype=np.int64) * block, block, 0)
        dst_rows = block_rows(int(self.dst.ctypes.data), perm.astype(np.int64) * block, block, 0)
        xh, release = self._prepped(self.agent, "WRITE", src_rows, "DRAM", dst_rows, "DRAM", self.agent.name)
        run = self._timed(self.agent, xh)

        def zero_target() -> None:
            self.dst[:n] = 0

        def verify() -> bool:
            zero_target()
            run()
            return bool(np.array_equal(self.dst[:n].reshape(batch, block)[perm], self.src[:n].reshape(batch, block)))

        return NixlCase(run, verify, release, zero_target)

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


class NixlPosix(NixlSide):
    """DRAM <-> FILE: NIXL's POSIX backend on the very fd (same O_DIRECT flag) and buffer our posix workload uses."""

    def __init__(self, workload: Workload, settings: NixlSettings) -> None:
        super().__init__(workload, settings)
        self.mem = workload.mem
        self.path = workload.path
        self.fd = workload.handle.fd
        self.direct = bool(workload.handle.direct)
        size = os.fstat(self.fd).st_size
        self.agent = make_agent("bench-nixl-posix", settings, {"POSIX": posix_params(settings)})
        self.mem_reg = self.agent.register_memory([(int(self.mem.ctypes.data), int(self.mem.nbytes), 0, "")], "DRAM")
        self.file_reg = self.agent.register_memory([(0, size, self.fd, self.path)], "FILE")

    def header(self) -> dict[str, Any]:
        flags = os.O_DIRECT if self.direct else 0
        return {
            "nixl backend": "POSIX",
            "posix": self.agent.get_backend_params("POSIX"),
            "file": self.path,
            "fd shared with ours": True,
            "O_DIRECT": bool(flags),
        }

    def case(self, case: Case) -> NixlCase:
        block, batch, n, op = case.block, case.batch, case.nbytes, case.op
        perm = permutation(batch)
        mem_rows = block_rows(int(self.mem.ctypes.data), np.arange(batch, dtype=np.int64) * block, block, 0)
        file_rows = block_rows(0, perm.astype(np.int64) * block, block, self.fd)
        xh, release = self._prepped(self.agent, op, mem_rows, "DRAM", file_rows, "FILE", self.agent.name)
        run = self._timed(self.agent, xh)

        def disk() -> np.ndarray:
            with open(self.path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                return np.frombuffer(f.read(n), dtype=np.uint8).reshape(batch, block)

        def zero_target() -> None:
            if op == "WRITE":
                with open(self.path, "r+b") as f:
                    f.write(bytes(n))
                    f.flush()
                    os.fsync(f.fileno())
            else:
                self.mem[:n] = 0

        def verify() -> bool:
            zero_target()
            run()
            return bool(np.array_equal(disk()[perm], self.mem[:n].reshape(batch, block)))

        return NixlCase(run, verify, release, zero_target)

    def close(self) -> None:
        self.agent.deregister_memory(self.file_reg)
        self.agent.deregister_memory(self.mem_reg)


class NixlObj(NixlSide):
    """DRAM <-> OBJ: NIXL's OBJ backend (aws-sdk-cpp) on the same bucket, keys and buffer as our s3 workload."""

    def __init__(self, workload: Workload, settings: NixlSettings) -> None:
        super().__init__(workload, settings)
        from urllib.parse import urlparse

        self.mem, self.client = workload.mem, workload.client
        ours = workload.agent.backend("s3")
        endpoint = ours.params.get("endpoint_url") or ours.client.meta.endpoint_url
        self.params = {
            "bucket": workload.bucket,
            "endpoint_override": endpoint,
            "scheme": urlparse(endpoint).scheme or "https",
            "region": ours.params.get("region") or ours.client.meta.region_name or "us-east-1",
            "use_virtual_addressing": "true" if ours.params.get("addressing_style") == "virtual" else "false",
            "req_checksum": "supported",
        }
        if ours.params.get("access_key_id"):
            self.params["access_key"] = ours.params["access_key_id"]
            self.params["secret_key"] = ours.params.get("secret_access_key") or ""
        self.agent = make_agent("bench-nixl-obj", settings, {"OBJ": self.params})
        self.mem_reg = self.agent.register_memory([(int(self.mem.ctypes.data), int(self.mem.nbytes), 0, "")], "DRAM")
        self._next_dev = 1

    def header(self) -> dict[str, Any]:
        shown = {k: v for k, v in self.params.items() if k not in ("access_key", "secret_key")}
        return {"nixl backend": "OBJ", "obj": shown, "crtMinLimit": "unset (standard S3 client)"}

    def case(self, case: Case) -> NixlCase:
        block, batch, n, op = case.block, case.batch, case.nbytes, case.op
        keys = self.workload.keys(block, batch)
        devs = np.arange(self._next_dev, self._next_dev + batch, dtype=np.int64)
        self._next_dev += batch
        obj_reg = self.agent.register_memory([(0, block, int(d), k) for d, k in zip(devs, keys)], "OBJ")
        mem_rows = block_rows(int(self.mem.ctypes.data), np.arange(batch, dtype=np.int64) * block, block, 0)
        obj_rows = np.zeros((batch, 3), dtype=np.uint64)
        obj_rows[:, 1] = block
        obj_rows[:, 2] = devs
        xh, release_xfer = self._prepped(self.agent, op, mem_rows, "DRAM", obj_rows, "OBJ", self.agent.name)
        run = self._timed(self.agent, xh)
        bucket = self.workload.bucket

        def stored(k: str) -> bytes:
            return self.client.get_object(Bucket=bucket, Key=k)["Body"].read()

        def zero_target() -> None:
            if op == "WRITE":
                for k in keys:
                    self.client.put_object(Bucket=bucket, Key=k, Body=bytes(block))
            else:
                self.mem[:n] = 0

        def verify() -> bool:
            zero_target()
            run()
            mem = self.mem[:n].reshape(batch, block)
            return all(stored(k) == mem[i].tobytes() for i, k in enumerate(keys))

        def release() -> None:
            release_xfer()
            self.agent.deregister_memory(obj_reg)

        return NixlCase(run, verify, release, zero_target)

    def close(self) -> None:
        self.agent.deregister_memory(self.mem_reg)


class NixlRemoteDram(NixlSide):
    """DRAM -> remote DRAM: NIXL's UCX backend to a NIXL agent in another process (``nixl_peer``).

    The local side is the workload's own source buffer; block i goes to the
    peer's slot ``perm[i]``, the permutation the workload uses. The peer
    holds a buffer as large as the workload's.
    """

    def __init__(self, workload: Workload, settings: NixlSettings) -> None:
        super().__init__(workload, settings)
        from .nixl_peer import NixlPeer

        self.mem = local_buffer(workload)
        self.agent = make_agent("bench-nixl-initiator", settings, {"UCX": ucx_params(settings)})
        self.reg = self.agent.register_memory([(int(self.mem.ctypes.data), int(self.mem.nbytes), 0, "")], "DRAM")
        hosts = getattr(workload, "hosts", None)
        self.peer = NixlPeer(int(self.mem.nbytes), settings, host=hosts[1] if hosts else None)
        try:
            self.peer_name = self.agent.add_remote_agent(self.peer.metadata)
            if isinstance(self.peer_name, bytes):
                self.peer_name = self.peer_name.decode()
            self.agent.make_connection(self.peer_name)
        except Exception as exc:
            self.peer.close()
            raise NixlError(f"NIXL could not connect to its peer process: {exc}", backend="nixl") from exc
        self.peer.rest()  # it polls only while NIXL's own transfers run (NixlCase.enter / leave)

    def header(self) -> dict[str, Any]:
        return {
            "nixl backend": "UCX (two processes)",
            "ucx": self.agent.get_backend_params("UCX"),
            "peer pid": self.peer.proc.pid,
            "peer host": str(self.peer.host) if self.peer.host else "this one",
            "peer progress": (
                f"polled every {self.peer.poll_s * 1e6:.0f} us while NIXL's transfers are timed, resting otherwise"
                if self.peer.polls
                else "none (one-sided)"
            ),
        }

    def case(self, case: Case) -> NixlCase:
        block, batch, n, op = case.block, case.batch, case.nbytes, case.op
        perm = remote_permutation(self.workload, batch)
        local_rows = block_rows(int(self.mem.ctypes.data), np.arange(batch, dtype=np.int64) * block, block, 0)
        remote_rows = block_rows(self.peer.addr, perm.astype(np.int64) * block, block, 0)
        xh, release = self._prepped(self.agent, op, local_rows, "DRAM", remote_rows, "DRAM", self.peer_name)
        timed = self._timed(self.agent, xh)
        if op == "READ":
            self.peer.fill(n, seed=block ^ batch)

        def run() -> tuple[float, float]:
            if not self.peer.resting:
                return timed()
            self.peer.wake()
            try:
                return timed()
            finally:
                self.peer.rest()

        def in_remote_order() -> np.ndarray:
            out = np.empty((batch, block), dtype=np.uint8)
            out[perm] = self.mem[:n].reshape(batch, block)
            return out

        def zero_target() -> None:
            if op == "WRITE":
                self.peer.zero(n)
            else:
                self.mem[:n] = 0

        def verify() -> bool:
            from .nixl_peer import digest

            zero_target()
            run()
            return digest(in_remote_order()) == self.peer.digest(n)

        return NixlCase(run, verify, release, zero_target, enter=self.peer.wake, leave=self.peer.rest)

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.peer_name)
        finally:
            self.peer.close()
            self.agent.deregister_memory(self.reg)


def local_buffer(workload: Workload) -> np.ndarray:
    """The workload's registered source buffer (``mem`` or ``src``)."""
    for name in ("mem", "src", "local"):
        buf = getattr(workload, name, None)
        if isinstance(buf, np.ndarray):
            return buf
    raise NixlError(f"{type(workload).__name__} exposes no local buffer (mem or src) to share with NIXL")


def remote_permutation(workload: Workload, batch: int) -> np.ndarray:
    """The slots block i lands in on the remote side: the workload's own, else the local workloads' permutation."""
    fn = getattr(workload, "permutation", None)
    return np.asarray(fn(batch)) if callable(fn) else permutation(batch)


#: datamover backend -> "module:Class" of the NIXL side compared with it
NIXL_PAIRS: dict[str, str] = {
    "memcpy": "datamover.bench.nixl:NixlLocalDram",
    "posix": "datamover.bench.nixl:NixlPosix",
    "s3": "datamover.bench.nixl:NixlObj",
    "ucx": "datamover.bench.nixl:NixlRemoteDram",
}


def nixl_side(backend: str, workload: Workload, settings: NixlSettings) -> NixlSide:
    """The NIXL side for ``backend``'s workload; BackendUnavailable if there is none or NIXL is missing."""
    target = NIXL_PAIRS.get(backend)
    if target is None:
        raise BackendUnavailable(f"no NIXL counterpart for the {backend} workload", backend="nixl")
    ok, reason = nixl_status()
    if not ok:
        raise BackendUnavailable(reason, backend="nixl")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)(workload, settings)
