"""Workloads for the GPU backends: cuda against torch copies from pinned memory, gds against kvikio itself.

cuda: WRITE moves local GPU blocks to permuted slots of registered host
memory (D2H), READ the reverse (H2D); the raw side is
``torch.Tensor.copy_(non_blocking=True)`` per block between the same GPU
tensor and a torch pinned host tensor, then one stream synchronize.
gds: WRITE moves GPU blocks to permuted offsets of a registered file, READ
the reverse; the raw side calls ``kvikio.CuFile.pwrite``/``pread`` per block
on the same file and waits on the futures. ``python -m datamover.bench.gpu
results.json`` checks a ``datamover bench --json`` run against the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, aligned_empty
from .local import drop_cache
from .workload import Case, Workload, bench_file, fill_random, permutation, timed_transfer

DIRECTION = {
    ("cuda", "WRITE"): "D2H",
    ("cuda", "READ"): "H2D",
    ("gds", "WRITE"): "GPU->file",
    ("gds", "READ"): "file->GPU",
}


def _random_device_tensor(torch, nbytes: int, device: int):
    host = aligned_empty(nbytes)
    fill_random(host, seed=3)
    return torch.from_numpy(host).to(f"cuda:{device}")


class CudaWorkload(Workload):
    """VRAM <-> registered host memory (page-locked by the backend), beside torch copies from pinned memory."""

    backend = "cuda"
    raw_name = "torch copy_(non_blocking) per block from pinned memory + sync"

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(max_bytes, options)
        import torch

        self.torch = torch
        self.device = int(self.options.get("device", 0))
        self.agent = Agent("bench-cuda", {"backends": {"cuda": dict(self.options.get("cuda", {}))}})
        self.gpu = _random_device_tensor(torch, max_bytes, self.device)
        self.host = aligned_empty(max_bytes)
        fill_random(self.host, seed=4)
        self.pinned = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)
        self.agent.register_memory(self.gpu)
        self.agent.register_memory(self.host)
        self.backend_impl = self.agent.backend("cuda")  # page-locks the host buffer now, outside the timing
        self.stream = torch.cuda.current_stream(self.device)

    def header(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "device": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "WRITE": "D2H",
            "READ": "H2D",
            **self.backend_impl.describe(),
        }

    def case(self, op: str, block: int, batch: int) -> Case:
        torch = self.torch
        n = block * batch
        perm = permutation(batch)
        lp = self.agent.prepare(DescList.blocks(self.gpu[:n], block))
        rp = self.agent.prepare(DescList.blocks(self.host[:n], block))
        xfer = self.agent.make_transfer(op, lp, np.arange(batch), rp, perm)
        gpu_blocks = [self.gpu[i * block : (i + 1) * block] for i in range(batch)]
        host_blocks = [self.pinned[int(p) * block : (int(p) + 1) * block] for p in perm]
        pairs = list(zip(host_blocks, gpu_blocks)) if op == "WRITE" else list(zip(gpu_blocks, host_blocks))
        stream = self.stream

        def raw() -> float:
            t0 = time.perf_counter()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            return time.perf_counter() - t0

        def verify() -> bool:
            host2 = self.host[:n].reshape(batch, block)
            if op == "WRITE":
                host2[:] = 0
            else:
                self.gpu[:n].zero_()
                torch.cuda.synchronize(self.device)
            xfer.post()
            xfer.wait()
            gpu2 = self.gpu[:n].cpu().numpy().reshape(batch, block)
            return bool(np.array_equal(host2[perm], gpu2))

        return Case(
            op,
            block,
            batch,
            timed_transfer(xfer),
            raw,
            verify,
            raw_name=self.raw_name,
            notes={"direction": DIRECTION[("cuda", op)]},
            close=xfer.release,
        )

    def close(self) -> None:
        self.agent.close()


class GdsWorkload(Workload):
    """VRAM <-> a registered file through the gds backend, beside kvikio CuFile calls on the same file."""

    backend = "gds"
    raw_name = "kvikio CuFile.pread/pwrite per block, futures waited"

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(max_bytes, options)
        import kvikio
        import torch

        self.torch = torch
        self.kvikio = kvikio
        self.device = int(self.options.get("device", 0))
        self.path = bench_file(self.options.get("dir") or tempfile.gettempdir(), "gds")
        self.agent = Agent("bench-gds", {"backends": {"gds": dict(self.options.get("gds", {}))}})
        self.gpu = _random_device_tensor(torch, max_bytes, self.device)
        self.agent.register_memory(self.gpu)
        self.file = self.agent.register_file(self.path, size=max_bytes)
        self.backend_impl = self.agent.backend("gds")  # opens the file and configures kvikio
        self.raw_file = kvikio.CuFile(self.path, "r+")
        self.raw_file.pwrite(self.gpu, max_bytes, 0).get()
        self.fd = os.open(self.path, os.O_RDONLY)
        self.task_size = self.backend_impl.params["task_size"]

    def header(self) -> dict[str, Any]:
        return {
            "device": self.torch.cuda.get_device_name(self.device),
            "file": self.path,
            "WRITE": "GPU->file",
            "READ": "file->GPU",
            **self.backend_impl.describe(),
        }

    def case(self, op: str, block: int, batch: int) -> Case:
        torch = self.torch
        n = block * batch
        perm = permutation(batch)
        offsets = perm.astype(np.int64) * block
        lp = self.agent.prepare(DescList.blocks(self.gpu[:n], block))
        rp = self.agent.prepare(DescList.file(self.file, offsets, block))
        xfer = self.agent.make_transfer(op, lp, None, rp, None)
        gpu_blocks = [self.gpu[i * block : (i + 1) * block] for i in range(batch)]
        offs = offsets.tolist()
        f = self.raw_file
        call = f.pwrite if op == "WRITE" else f.pread
        task_size = self.task_size

        def raw() -> float:
            t0 = time.perf_counter()
            futures = [call(b, block, o, task_size) for b, o in zip(gpu_blocks, offs)]
            for fut in futures:
                fut.get()
            return time.perf_counter() - t0

        def verify() -> bool:
            if op == "READ":
                self.gpu[:n].zero_()
                torch.cuda.synchronize(self.device)
            xfer.post()
            xfer.wait()
            with open(self.path, "rb") as fh:
                disk = np.frombuffer(fh.read(n), dtype=np.uint8).reshape(batch, block)
            gpu2 = self.gpu[:n].cpu().numpy().reshape(batch, block)
            return bool(np.array_equal(disk[perm], gpu2))

        def cold() -> None:
            if op == "READ":
                drop_cache(self.fd)

        return Case(
            op,
            block,
            batch,
            timed_transfer(xfer),
            raw,
            verify,
            before_each=cold,
            raw_name=self.raw_name,
            notes={"direction": DIRECTION[("gds", op)]},
            close=xfer.release,
        )

    def close(self) -> None:
        self.agent.close()
        self.raw_file.close()
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def check_targets(
    results: Sequence[dict[str, Any]], *, target: float = 0.9, min_block: int = 1 << 20
) -> tuple[list[str], bool]:
    """Lines judging each result of blocks >= ``min_block`` against ``target`` x raw; and whether all met it.

    ``results`` are the rows of a ``datamover bench --json`` file. Smaller
    blocks are listed for information only.
    """
    lines, ok = [], True
    for r in results:
        ratio = r.get("ratio")
        direction = DIRECTION.get((r["backend"], r["op"]), r["op"])
        judged = r["block"] >= min_block and ratio is not None
        verdict = "-" if not judged else ("ok" if ratio >= target else "BELOW")
        if judged and ratio < target:
            ok = False
        if r.get("checked") is False:
            verdict, ok = "BYTES WRONG", False
        ratio_text = f"{ratio:5.2f}" if ratio is not None else "    -"
        raw_text = f"{r['raw_gbps']:8.2f}" if r.get("raw_gbps") is not None else "       -"
        lines.append(
            f"{r['backend']:<5} {direction:<10} block {r['block']:>9} x {r['batch']:<5} "
            f"ours {r['gbps']:8.2f} GB/s  raw {raw_text} GB/s  ratio {ratio_text}  {verdict}"
        )
    return lines, ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="judge a `datamover bench --json` GPU run against its targets")
    parser.add_argument("results", help="JSON written by `datamover bench --json`")
    parser.add_argument("--target", type=float, default=0.9, help="minimum ours/raw ratio (default 0.9)")
    parser.add_argument("--min-block", type=int, default=1 << 20, help="judge blocks of at least this many bytes")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    lines, ok = check_targets(data["results"], target=args.target, min_block=args.min_block)
    print("\n".join(lines))
    print(f"targets (>= {args.target:g} x raw at blocks >= {args.min_block} bytes): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
