"""Workloads for the local backends: memcpy against numpy, posix against plain preadv/pwritev."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, aligned_empty
from .workload import Case, Workload, bench_file, fill_random, permutation, timed_transfer


class MemcpyWorkload(Workload):
    """DRAM -> DRAM: contiguous source blocks scattered to permuted destination slots."""

    backend = "memcpy"
    ops = ("WRITE",)
    raw_name = "numpy row copy (dst[perm] = src)"

    def __init__(self, max_bytes, options=None) -> None:
        super().__init__(max_bytes, options)
        # --param memcpy.KEY=VALUE: the backend refuses a key it does not know, or a value of the wrong type
        self.agent = Agent("bench-memcpy", {"backends": {"memcpy": dict(self.options.get("memcpy", {}))}})
        try:
            self.agent.backend("memcpy")
            self.src = aligned_empty(max_bytes)
            self.dst = aligned_empty(max_bytes)
            fill_random(self.src)
            self.dst[:] = 1
            self.agent.register_memory(self.src)
            self.agent.register_memory(self.dst)
        except BaseException:
            self.agent.close()
            raise

    def header(self):
        return {"threads": self.agent.backend("memcpy").params["threads"]}

    def case(self, op, block, batch):
        n = block * batch
        perm = permutation(batch)
        lp = self.agent.prepare(DescList.blocks(self.src[:n], block))
        rp = self.agent.prepare(DescList.blocks(self.dst[:n], block))
        xfer = self.agent.make_transfer("WRITE", lp, np.arange(batch), rp, perm)
        s2, d2 = self.src[:n].reshape(batch, block), self.dst[:n].reshape(batch, block)

        def raw() -> float:
            t0 = time.perf_counter()
            d2[perm] = s2
            return time.perf_counter() - t0

        def verify() -> bool:
            self.dst[:n] = 0
            xfer.post()
            xfer.wait()
            return bool(np.array_equal(d2[perm], s2))

        return Case(op, block, batch, timed_transfer(xfer), raw, verify, raw_name=self.raw_name, close=xfer.release)

    def close(self):
        self.agent.close()


def drop_cache(fd: int) -> None:
    """Empty the page cache for a file so reads come from the disk."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class PosixWorkload(Workload):
    """DRAM <-> FILE: blocks at permuted file offsets, O_DIRECT against O_DIRECT, cold cache."""

    backend = "posix"
    raw_name = "os.pwritev/os.preadv loop, same O_DIRECT fd"

    def __init__(self, max_bytes, options=None) -> None:
        super().__init__(max_bytes, options)
        self.path = bench_file(self.options.get("dir") or tempfile.gettempdir())
        self.agent = Agent("bench-posix", {"backends": {"posix": dict(self.options.get("posix", {}))}})
        try:
            self.mem = aligned_empty(max_bytes)
            fill_random(self.mem)
            self.agent.register_memory(self.mem)
            self.file = self.agent.register_file(self.path, size=max_bytes)
            self.agent.backend("posix")  # starting the backend opens every registered file (a bad --param fails)
            self.handle = self.file.handles["posix"]
            self.agent.transfer("WRITE", DescList.blocks(self.mem, 64 << 20), self.file.blocks(64 << 20)).wait()
        except BaseException:
            self.close()  # the caller gets no workload to close: the file goes here
            raise

    def header(self):
        return {"file": self.path, "io": self.handle.note, "threads": self.agent.backend("posix").params["threads"]}

    def case(self, op, block, batch):
        n = block * batch
        perm = permutation(batch)
        offsets = perm.astype(np.int64) * block
        lp = self.agent.prepare(DescList.blocks(self.mem[:n], block))
        rp = self.agent.prepare(DescList.file(self.file, offsets, block))
        xfer = self.agent.make_transfer(op, lp, None, rp, None)
        fd = self.handle.fd
        views = [memoryview(self.mem[i * block : (i + 1) * block]) for i in range(batch)]
        offs = offsets.tolist()

        def raw() -> float:
            t0 = time.perf_counter()
            if op == "WRITE":
                for v, o in zip(views, offs):
                    os.pwritev(fd, [v], o)
            else:
                for v, o in zip(views, offs):
                    os.preadv(fd, [v], o)
            return time.perf_counter() - t0

        def verify() -> bool:
            with open(self.path, "rb") as f:
                disk = np.frombuffer(f.read(), dtype=np.uint8)[: batch * block].reshape(batch, block)
            mem = self.mem[:n].reshape(batch, block)
            if op == "READ":
                mem[:] = 0
                xfer.post()
                xfer.wait()
            return bool(np.array_equal(disk[perm], mem))

        def cold() -> None:
            if op == "READ":
                drop_cache(fd)

        return Case(
            op,
            block,
            batch,
            timed_transfer(xfer),
            raw,
            verify,
            before_each=cold,
            raw_name=self.raw_name,
            close=xfer.release,
        )

    def close(self):
        try:
            self.agent.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
