"""The ucx benchmark workload: two processes, ours and raw ucxx on the same bytes, byte-checked."""

import pytest

from datamover.backends import backend_status
from datamover.bench.runner import run_sweep

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


def test_sweep_checks_bytes_and_reports_transports():
    headers = {}
    results = run_sweep(
        ["ucx"], None, [4096, 1 << 20], [1, 16], max_bytes=16 << 20, min_time=0.01, max_iters=3, check=True,
        progress=False, headers=headers,
    )  # fmt: skip
    assert {(r.op, r.block, r.batch) for r in results} == {
        (op, b, n) for op in ("WRITE", "READ") for b in (4096, 1 << 20) for n in (1, 16)
    }
    for r in results:
        assert r.checked is True, r
        assert r.gbps > 0 and r.raw_gbps and r.raw_gbps > 0
    assert "over" in headers["ucx"]["transports in use"], headers
    # the congestion control paces TCP (bbr) or not: it changes the tcp rows' tails, so the header names it
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        assert headers["ucx"]["tcp congestion control"] == f.read().strip()


def test_a_target_on_another_host_exits_by_itself_at_close(test_hosts, monkeypatch):
    """Closing the workload lets its target process end on its own: the target's raw ucxx endpoint closes as the
    process exits, and across hosts that close waits for this side's raw worker to be progressed (left alone, the
    target spun until it was killed ten seconds later, at every ucx workload's end)."""
    from datamover.bench.ucx import UcxWorkload

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", test_hosts[0].ifname)
    w = UcxWorkload(1 << 20, {"ucx": {"direct_cma": False}, "test_hosts": test_hosts})
    try:
        case = w.case("WRITE", 4096, 16)
        case.ours()
        assert case.raw() > 0  # the raw endpoint carries traffic both ways
        assert case.verify()
        case.close()
    finally:
        w.close()
    assert w.process.exitcode == 0, f"the target ended with {w.process.exitcode} (negative: killed by that signal)"


def test_a_target_that_cannot_start_is_its_own_error_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A bad --param fails in the target process: before, the bench died with an EOFError traceback (the reason only
    in the target's log) and left that log behind; now it is the one line any other backend's bad --param gives."""
    import tempfile

    from datamover.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["bench", "--backend", "ucx", "--param", "ucx.nonsense=1", "--block-sizes", "4K", "--batch-sizes", "1"]
    assert main([*argv, "--quiet", "--min-time", "0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("datamover bench: backend 'ucx': unknown parameter(s) ['nonsense']")
    assert list(tmp_path.iterdir()) == []


def hung_target(conn, go, nbytes, log_path, params) -> None:
    """A target process that never answers (spawned: imported by name from this module)."""
    import threading

    threading.Event().wait()


def test_a_target_that_never_answers_is_a_bounded_wait_and_is_killed(tmp_path, monkeypatch):
    """Before: the initiator waited on the target's pipe with no bound, so a target stuck starting hung the bench."""
    import tempfile

    from datamover.bench import ucx
    from datamover.testing.services import ServiceError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ucx, "_target_main", hung_target)
    monkeypatch.setattr(ucx.UcxWorkload, "answer_timeout_s", 2.0, raising=False)
    started = []
    real_start = ucx.mp.context.SpawnProcess.start
    monkeypatch.setattr(ucx.mp.context.SpawnProcess, "start", lambda self: (started.append(self), real_start(self))[1])
    with pytest.raises(ServiceError, match=r"^the ucx bench target \(pid \d+\) did not answer start within 2 s"):
        ucx.UcxWorkload(1 << 20)
    (target,) = started
    assert not target.is_alive() and target.exitcode is not None
    assert list(tmp_path.iterdir()) == []
