"""Benchmark workloads: one per backend, each timing datamover against the raw library below it.

A Workload sets up agents, buffers and services once; ``case(op, block,
batch)`` returns a Case whose ``ours`` posts a prepared transfer and whose
``raw`` moves the same bytes with the library underneath, so both are timed
in the same run on the same memory.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..processes import pid_alive
from ..units import size_text


@dataclass
class Case:
    """One (op, block size, batch) point: ours, raw, and a byte check."""

    op: str
    block: int
    batch: int
    ours: Callable[[], tuple[float, float]]  # runs one transfer; returns (post_s, total_s)
    raw: Callable[[], float] | None  # runs the raw equivalent; returns seconds
    verify: Callable[[], bool]
    before_each: Callable[[], None] = lambda: None  # e.g. drop the page cache for cold reads
    raw_name: str = ""
    notes: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None

    @property
    def nbytes(self) -> int:
        return self.block * self.batch


class Workload(ABC):
    """Setup shared by every case of one backend."""

    backend: ClassVar[str]
    ops: ClassVar[tuple[str, ...]] = ("WRITE", "READ")
    raw_name: ClassVar[str] = ""

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        self.max_bytes = max_bytes
        self.options = options or {}

    def header(self) -> dict[str, Any]:
        """Settings worth printing above the results (transports, I/O mode, server)."""
        return {}

    @abstractmethod
    def case(self, op: str, block: int, batch: int) -> Case: ...

    def close(self) -> None:
        """Stop services and free buffers."""


def timed_transfer(xfer) -> Callable[[], tuple[float, float]]:
    """A callable that posts ``xfer``, waits, and returns (post seconds, post-to-done seconds)."""
    import time

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        xfer.post()
        t1 = time.perf_counter()
        xfer.wait()
        return t1 - t0, time.perf_counter() - t0

    return run


#: a benchmark file's name: a file workload's kind and the pid of the run that made it
BENCH_FILE = re.compile(r"datamover-bench-(?:[a-z]+-)?(\d+)\.bin")


def bench_file(directory: str, kind: str = "") -> str:
    """This run's benchmark file in ``directory`` (``kind``: e.g. "gds"), after removing the files earlier runs
    left there when they were killed before their cleanup (SIGKILL; each is up to --max-bytes, 256 MiB by default),
    saying so on stderr."""
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        m = BENCH_FILE.fullmatch(name)
        if m is None or pid_alive(int(m[1])):
            continue
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
        except OSError:
            continue
        print(
            f"datamover bench: removed {path} ({size_text(size)}), left by run {m[1]} that ended before its cleanup",
            file=sys.stderr,
        )
    return os.path.join(directory, f"datamover-bench-{kind + '-' if kind else ''}{os.getpid()}.bin")


def permutation(batch: int, seed: int = 1) -> np.ndarray:
    """The destination slot of each source block: the same for ours, the raw library and NIXL."""
    return np.random.default_rng(seed).permutation(batch)


def fill_random(arr: np.ndarray, seed: int = 0) -> None:
    """Fill a uint8 array with random bytes (and touch every page)."""
    arr[:] = np.frombuffer(np.random.default_rng(seed).bytes(arr.shape[0]), dtype=np.uint8)


#: backend name -> "module:Class"; a backend's module adds itself here
WORKLOADS: dict[str, str] = {
    "memcpy": "datamover.bench.local:MemcpyWorkload",
    "posix": "datamover.bench.local:PosixWorkload",
    "cuda": "datamover.bench.gpu:CudaWorkload",
    "gds": "datamover.bench.gpu:GdsWorkload",
    "ucx": "datamover.bench.ucx:UcxWorkload",
    "s3": "datamover.bench.s3:S3Workload",
    "mooncake": "datamover.bench.mooncake:MooncakeWorkload",
}


def workload_class(backend: str) -> type[Workload]:
    target = WORKLOADS.get(backend)
    if target is None:
        raise KeyError(f"no benchmark workload for backend {backend!r}; known: {', '.join(WORKLOADS)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
