"""The Mooncake benchmark workload: its own master and pool member, ours and raw on the same client, every byte
checked, lookups judged against the budget, and everything it started stopped."""

from __future__ import annotations

import socket

import pytest

from datamover.bench.mooncake import MooncakeWorkload
from datamover.bench.runner import run_sweep
from datamover.testing.mooncake import mooncake_available

pytestmark = pytest.mark.skipif(not mooncake_available()[0], reason=mooncake_available()[1])


def test_sweep_checks_bytes_and_reports_lookups():
    results = run_sweep(
        ["mooncake"], None, [4096, 64 << 10], [1, 4], max_bytes=1 << 20, min_time=0.0, max_iters=3, check=True,
        progress=False, options={"mooncake": {"budget_ms": 0.5}},
    )  # fmt: skip
    seen = {(r.op, r.block, r.batch): r for r in results}
    assert set(seen) == {(op, b, n) for op in ("WRITE", "READ", "LOOKUP") for b in (4096, 64 << 10) for n in (1, 4)}
    for r in results:
        assert r.checked is True, f"{r.op} {r.block} x {r.batch}: bytes differ"
        assert r.gbps > 0 and r.raw_gbps and r.raw_gbps > 0
    assert seen[("READ", 4096, 4)].raw == "batch_get_into" and seen[("WRITE", 4096, 1)].raw == "batch_put_from"
    lines = MooncakeWorkload.summary(results, {"lookup_budget_ms": 0.5})
    lookups = [line for line in lines if "lookup of" in line]
    assert len(lookups) == 4 and all("0.5 ms budget" in line for line in lookups)


def test_workload_stops_what_it_started():
    w = MooncakeWorkload(1 << 20)
    port = w.master.rpc_port
    member = w.member
    assert w.header()["pool"].startswith("mooncake_master")
    w.close()
    assert not member.alive
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
