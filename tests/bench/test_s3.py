"""The S3 benchmark workload: starts its own server, times ours and raw boto3, checks every byte, stops the server."""

from __future__ import annotations

import socket

import pytest

from datamover.bench.runner import run_sweep
from datamover.bench.s3 import S3Workload
from datamover.testing.s3server import S3Server

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not S3Server.available()[0], reason=S3Server.available()[1])


def test_sweep_checks_bytes_on_both_paths():
    """Small objects (put_object/get_object) and one 8 MiB object (upload_fileobj) in both directions."""
    results = run_sweep(
        ["s3"], None, [64 << 10, 8 * MiB], [1, 4], max_bytes=8 * MiB, min_time=0.0, max_iters=2, check=True,
        progress=False,
    )  # fmt: skip
    seen = {(r.op, r.block, r.batch): r for r in results}
    points = ((64 << 10, 1), (64 << 10, 4), (8 * MiB, 1))
    assert set(seen) == {(op, b, n) for op in ("WRITE", "READ") for b, n in points}
    for r in results:
        assert r.checked is True, f"{r.op} {r.block} x {r.batch}: bytes differ"
        assert r.gbps > 0 and r.raw_gbps and r.raw_gbps > 0
    assert seen[("WRITE", 8 * MiB, 1)].raw == "boto3 upload_fileobj"
    assert seen[("WRITE", 64 << 10, 4)].raw == "boto3 put_object"
    assert seen[("READ", 8 * MiB, 1)].raw == "boto3 get_object"


def test_workload_owns_its_server(monkeypatch):
    monkeypatch.delenv("DATAMOVER_BENCH_S3_ENDPOINT", raising=False)
    w = S3Workload(1 * MiB)
    port = w.server.port
    head = w.header()
    assert head["server"].startswith("moto_server") and head["endpoint"] == f"http://127.0.0.1:{port}"
    w.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_workload_uses_a_configured_endpoint(monkeypatch):
    """With an endpoint in the environment the workload starts no server and uses that one."""
    with S3Server(bucket="elsewhere") as srv:
        monkeypatch.setenv("DATAMOVER_BENCH_S3_ENDPOINT", srv.endpoint_url)
        monkeypatch.setenv("DATAMOVER_BENCH_S3_BUCKET", "elsewhere")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", srv.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", srv.secret_key)
        monkeypatch.setenv("DATAMOVER_BENCH_S3_PARAMS", '{"addressing_style": "path", "concurrency": 3}')
        w = S3Workload(1 * MiB)
        try:
            assert w.server is None and w.header()["concurrency"] == 3
            case = w.case("WRITE", 4096, 4)
            case.ours()
            assert case.verify()
            listed = srv.client().list_objects_v2(Bucket="elsewhere", Prefix="datamover-bench/")
            assert listed["KeyCount"] == 4
            case.close()
        finally:
            w.close()
