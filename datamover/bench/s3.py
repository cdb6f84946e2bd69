"""The S3 workload: DRAM <-> OBJ through datamover beside plain boto3 on the same objects, in one run.

Each case moves ``batch`` objects of ``block`` bytes. Ours is one prepared
transfer (objects and parts concurrently on the backend's bounded pool,
CRC32C on every write and whole-object read). Raw is what a user writes with
boto3 alone: a loop of ``put_object`` / ``get_object``, and for writes of objects
of ``large`` bytes (8 MiB) or more boto3's managed ``upload_fileobj``
(its multipart transfer manager, 10 threads; ``DATAMOVER_BENCH_S3_RAW_LARGE=put_object``
times ``put_object`` instead). Both sides use the same keys, so raw reads the
very objects ours wrote.

With no endpoint configured (workload option ``endpoint_url`` or the
environment variable ``DATAMOVER_BENCH_S3_ENDPOINT``) the workload starts the
local moto_server itself on loopback and stops it at the end; with one, the
bucket (option ``bucket`` or ``DATAMOVER_BENCH_S3_BUCKET``) must exist and the
credentials come from the usual AWS environment and config files.
``DATAMOVER_BENCH_S3_PARAMS`` (JSON) overrides S3 backend parameters.

Against the local moto_server the workload raises ``multipart_threshold`` and
``read_part_size`` to 256 MiB (``LOCAL_TUNING``): moto serves every ranged GET
by reading the whole object and copies every part again to complete a
multipart upload, so on it a single PUT or GET is the fast path. On AWS S3
parallel 8-16 MiB parts are (AWS's own guidance), hence the backend's defaults.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Any, ClassVar

import numpy as np

from ..agents import Agent
from ..descriptors import DescList, aligned_empty
from ..units import MiB
from .workload import Case, Workload, fill_random, timed_transfer

#: backend parameters for the local moto_server (see the module docstring)
LOCAL_TUNING = {"multipart_threshold": 256 * MiB, "read_part_size": 256 * MiB}


class S3Workload(Workload):
    """DRAM <-> objects of one bucket: ours (one transfer) against plain boto3 (one call per object)."""

    backend = "s3"
    raw_name = "boto3 put_object/get_object loop; upload_fileobj for large writes"
    #: the (block, batch) points this workload suggests for a default sweep: against a local Python server
    #: a 4096-object batch takes about a minute per side and iteration, so batches stop at 256 objects
    default_points: ClassVar[list[tuple[int, int]]] = [
        (4 << 10, 1), (4 << 10, 64), (256 << 10, 1), (256 << 10, 64), (256 << 10, 256),
        (1 * MiB, 64), (8 * MiB, 1), (16 * MiB, 1), (64 * MiB, 1),
    ]  # fmt: skip

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(max_bytes, options)
        opts = self.options
        self.server = None
        endpoint = opts.get("endpoint_url") or os.environ.get("DATAMOVER_BENCH_S3_ENDPOINT")
        params = dict(opts.get("s3", {}))
        params.update(json.loads(os.environ.get("DATAMOVER_BENCH_S3_PARAMS") or "{}"))
        self.large = int(opts.get("large", 8 * MiB))
        self.raw_large = opts.get("raw_large") or os.environ.get("DATAMOVER_BENCH_S3_RAW_LARGE") or "upload_fileobj"
        if self.raw_large not in ("upload_fileobj", "put_object"):
            raise ValueError(f"raw_large must be upload_fileobj or put_object, got {self.raw_large!r}")
        if endpoint:
            self.bucket = opts.get("bucket") or os.environ.get("DATAMOVER_BENCH_S3_BUCKET") or "datamover-bench"
            params.setdefault("endpoint_url", endpoint)
        else:
            from ..testing.s3server import S3Server

            self.server = S3Server(bucket="datamover-bench").start()
            self.bucket = self.server.bucket
            params = self.server.config(**{**LOCAL_TUNING, **params})
        try:
            # thousands of objects through a local Python server take longer than the default 30 s
            self.agent = Agent("bench-s3", {"backends": {"s3": params}, "timeout_s": 900})
            self.client = self._raw_client(params)
            self.mem = aligned_empty(max_bytes)
            fill_random(self.mem)
            self.agent.register_memory(self.mem)
            self.objects = self.agent.register_objects(self.bucket, prefix="datamover-bench/")
        except BaseException:
            self.close()
            raise

    def _raw_client(self, params: dict[str, Any]) -> Any:
        """A plain boto3 client with boto3's defaults, for the same endpoint and credentials."""
        import boto3
        from botocore.config import Config

        b = self.agent.backend("s3")
        kw: dict[str, Any] = {"endpoint_url": params.get("endpoint_url"), "region_name": b.client.meta.region_name}
        if params.get("access_key_id"):
            kw["aws_access_key_id"] = params["access_key_id"]
            kw["aws_secret_access_key"] = params.get("secret_access_key")
        style = params.get("addressing_style", "auto")
        return boto3.client("s3", config=Config(s3={"addressing_style": style}), **kw)

    def header(self) -> dict[str, Any]:
        head = {"server": "moto_server (local, loopback)" if self.server else "configured endpoint"}
        head.update(self.agent.backend("s3").describe())
        head["bucket"] = self.bucket
        return head

    def keys(self, block: int, batch: int) -> list[str]:
        return [f"datamover-bench/{block}/{i}" for i in range(batch)]

    def case(self, op: str, block: int, batch: int) -> Case:
        n = block * batch
        keys = self.keys(block, batch)
        lp = self.agent.prepare(DescList.blocks(self.mem[:n], block))
        rp = self.agent.prepare(DescList.objects(self.objects, np.full(batch, block), 0, keys=keys))
        if op == "READ":  # the objects must exist, with their CRC32C
            self.agent.make_transfer("WRITE", lp, None, rp, None).post().wait()
        xfer = self.agent.make_transfer(op, lp, None, rp, None)
        views = [memoryview(self.mem[i * block : (i + 1) * block]) for i in range(batch)]
        client, bucket = self.client, self.bucket
        fileobj = block >= self.large and self.raw_large == "upload_fileobj"

        def raw() -> float:
            t0 = time.perf_counter()
            if op == "WRITE" and fileobj:
                for v, k in zip(views, keys):
                    client.upload_fileobj(io.BytesIO(v), bucket, k)
            elif op == "WRITE":
                for v, k in zip(views, keys):
                    client.put_object(Bucket=bucket, Key=k, Body=v.tobytes())
            else:
                for v, k in zip(views, keys):
                    v[:] = client.get_object(Bucket=bucket, Key=k)["Body"].read()
            return time.perf_counter() - t0

        def verify() -> bool:
            want = self.mem[:n].copy()
            if op == "READ":
                self.mem[:n] = 0
                xfer.post()
                xfer.wait()
                if not np.array_equal(self.mem[:n], want):
                    return False
            # what the store holds must be the memory's bytes, object by object
            return all(
                client.get_object(Bucket=bucket, Key=k)["Body"].read() == want[i * block : (i + 1) * block].tobytes()
                for i, k in enumerate(keys)
            )

        name = "boto3 get_object" if op == "READ" else "boto3 upload_fileobj" if fileobj else "boto3 put_object"
        return Case(op, block, batch, timed_transfer(xfer), raw, verify, raw_name=name, close=xfer.release)

    def close(self) -> None:
        """Close the agent, then stop the server even when that close failed."""
        agent = getattr(self, "agent", None)
        try:
            if agent is not None:
                agent.close()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None
