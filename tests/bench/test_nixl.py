"""`datamover bench --vs nixl`: a tiny comparison when NIXL is installed; skipped with the reason when not."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from datamover.bench.nixl_api import NixlSettings, nixl_status
from datamover.cli import main

OK, REASON = nixl_status()
needs_nixl = pytest.mark.skipif(not OK, reason=f"NIXL unavailable: {REASON}")
TINY = ["--block-sizes", "4K,64K", "--batch-sizes", "4", "--min-time", "0.01", "--max-iters", "3", "--quiet"]


@needs_nixl
def test_tiny_comparison_checks_both_libraries(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("UCX_TLS", "^cma")
    js = tmp_path / "vs.json"
    argv = ["bench", "--vs", "nixl", "--backend", "memcpy,posix", "--check", "--dir", str(tmp_path), *TINY]
    assert main([*argv, "--ucx-tls", "self,sm,tcp", "--json", str(js)]) == 0
    assert os.environ["UCX_TLS"] == "^cma"  # pinned for the run only: later UCX contexts see the caller's value
    out = capsys.readouterr().out
    assert "ours/nixl" in out and "UCX_TLS=" in out and "ucx_error_handling_mode=none" in out
    rows = json.loads(js.read_text())["results"]
    assert len(rows) == 2 + 4
    for r in rows:
        assert r["vs"] == "nixl" and r["vs_error"] is None
        assert r["checked"] is True and r["vs_checked"] is True
        assert r["vs_gbps"] > 0 and r["vs_ratio"] == pytest.approx(r["gbps"] / r["vs_gbps"])


@needs_nixl
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_nixl_posix_check_fails_when_nixl_moves_nothing(tmp_path, op) -> None:
    from datamover.bench.local import PosixWorkload
    from datamover.bench.nixl import NixlPosix

    w = PosixWorkload(1 << 20, {"dir": str(tmp_path)})
    side = NixlPosix(w, NixlSettings())
    try:
        case = w.case(op, 65536, 16)
        good = side.case(case)
        assert good.verify() is True
        good.close()
        side._timed = lambda agent, handle: lambda: (0.0, 0.0)  # a NIXL run that moves no bytes
        bad = side.case(case)
        assert bad.verify() is False
        bad.close()
        case.close()
    finally:
        side.close()
        w.close()


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="ucx_err_mode"):
        NixlSettings(ucx_err_mode="sometimes")
    with pytest.raises(ValueError, match="posix_queue"):
        NixlSettings(posix_queue="threads")


def test_missing_nixl_is_reported(monkeypatch, capsys) -> None:
    import datamover.bench.nixl_api as nixl_mod

    monkeypatch.setattr(nixl_mod, "nixl_status", lambda: (False, "nixl is not installed (test)"))
    assert main(["bench", "--vs", "nixl", "--backend", "memcpy", *TINY]) == 1
    assert "nixl is not installed (test)" in capsys.readouterr().err


def _s3_ready() -> tuple[bool, str]:
    import importlib.util

    from datamover.backends import backend_status

    if importlib.util.find_spec("datamover.bench.s3") is None:
        return False, "no s3 benchmark workload yet"
    ok, reason = backend_status("s3")
    if not ok:
        return False, reason
    if importlib.util.find_spec("moto") is None:
        return False, "moto (the local S3 server) is not installed"
    return True, ""


@needs_nixl
def test_tiny_object_comparison(tmp_path, capsys) -> None:
    ok, reason = _s3_ready()
    if not ok:
        pytest.skip(reason)
    js = tmp_path / "obj.json"
    argv = ["bench", "--vs", "nixl", "--backend", "s3", "--check", "--block-sizes", "64K", "--batch-sizes", "2"]
    assert main([*argv, "--min-time", "0.01", "--max-iters", "2", "--quiet", "--json", str(js)]) == 0
    assert "nixl backend=OBJ" in capsys.readouterr().out
    rows = json.loads(js.read_text())["results"]
    assert {r["op"] for r in rows} == {"WRITE", "READ"}
    assert all(r["checked"] is True and r["vs_checked"] is True and r["vs_gbps"] > 0 for r in rows)


class _SourceOnly:
    """Just what the NIXL remote pair needs from a workload: a registered source buffer."""

    def __init__(self, nbytes: int) -> None:
        from datamover.descriptors import aligned_empty

        self.mem = aligned_empty(nbytes)
        self.mem[:] = np.frombuffer(np.random.default_rng(5).bytes(nbytes), np.uint8)


@needs_nixl
def test_nixl_remote_pair_moves_and_checks_bytes_across_processes() -> None:
    from datamover.bench.nixl import NixlRemoteDram
    from datamover.bench.workload import Case

    side = NixlRemoteDram(_SourceOnly(1 << 20), NixlSettings(timeout=30))
    timed = side._timed
    try:
        assert side.header()["nixl backend"] == "UCX (two processes)"
        for op in ("WRITE", "READ"):
            side._timed = timed
            case = Case(op, 65536, 16, lambda: (0.0, 0.0), None, lambda: True)
            good = side.case(case)
            post, total = good.run()
            assert 0 <= post <= total
            assert good.verify() is True
            good.close()
            side._timed = lambda agent, handle: lambda: (0.0, 0.0)  # a NIXL run that moves no bytes
            bad = side.case(case)
            assert bad.verify() is False, op
            bad.close()
    finally:
        side.close()
    assert side.peer.proc.poll() == 0


@needs_nixl
def test_a_polling_nixl_peer_rests_while_the_other_library_is_timed() -> None:
    """Over tcp NIXL's peer must poll UCX for NIXL's transfers, but it does so only between a case's enter and
    leave (or inside a bare run): resting, it takes no CPU from our target on the same cores."""
    from datamover.bench.nixl import NixlRemoteDram
    from datamover.bench.workload import Case

    side = NixlRemoteDram(_SourceOnly(1 << 20), NixlSettings(ucx_tls="tcp,self", timeout=30))
    try:
        peer = side.peer
        assert peer.polls and peer.resting and "resting otherwise" in side.header()["peer progress"]
        case = side.case(Case("WRITE", 65536, 16, lambda: (0.0, 0.0), None, lambda: True))
        rested = peer.polled()
        time.sleep(0.2)  # 2000 polls' worth, were it polling
        assert peer.polled() == rested
        case.enter()
        assert not peer.resting
        post, total = case.run()
        assert 0 <= post <= total and peer.polled() > rested
        case.leave()
        assert peer.resting
        assert case.verify() is True and peer.resting  # a bare run wakes it and lets it rest again
        rested = peer.polled()
        time.sleep(0.2)
        assert peer.polled() == rested
        case.close()
    finally:
        side.close()


@needs_nixl
def test_peer_that_cannot_start_is_a_typed_error(monkeypatch) -> None:
    from datamover.bench import nixl_peer
    from datamover.errors import NixlError

    monkeypatch.setattr(nixl_peer.sys, "executable", "/bin/false")
    with pytest.raises(NixlError, match="did not start"):
        nixl_peer.NixlPeer(4096, NixlSettings(timeout=10))


def test_when_the_nixl_peer_must_progress() -> None:
    from datamover.bench.nixl_peer import needs_progress, tls_allows_cma

    assert tls_allows_cma("self,sm,tcp") and tls_allows_cma("") and tls_allows_cma("all") and tls_allows_cma("^tcp")
    assert not tls_allows_cma("^cma") and not tls_allows_cma("tcp,self") and not tls_allows_cma("^cma,tcp")
    assert not needs_progress(NixlSettings(ucx_tls="self,sm,tcp"))
    assert needs_progress(NixlSettings(ucx_tls="self,sm,tcp", ucx_err_mode="peer"))
    assert needs_progress(NixlSettings(ucx_tls="^cma"))


@needs_nixl
def test_a_process_that_made_a_nixl_ucx_agent_exits_cleanly() -> None:
    """NIXL's bundled libnl crashed such a process in its exit handler (SIGSEGV, 139) when RDMA modules loaded."""
    import subprocess
    import sys

    code = (
        "from datamover.bench.nixl_api import NixlSettings, make_agent, ucx_params\n"
        "s = NixlSettings(ucx_tls='tcp,self')\n"
        "make_agent('exit-probe', s, {'UCX': ucx_params(s)})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_rdma_modules_are_left_out_only_without_a_device_and_without_the_callers_choice(monkeypatch) -> None:
    import datamover.bench.nixl_api as nixl_mod

    monkeypatch.delenv("UCX_MODULES", raising=False)
    monkeypatch.setattr(nixl_mod, "rdma_devices", lambda: [])
    with nixl_mod.ucx_modules_for_this_host():
        assert os.environ["UCX_MODULES"] == "^ib,rdmacm"
    assert "UCX_MODULES" not in os.environ
    assert nixl_mod.ucx_modules() == "^ib,rdmacm"
    monkeypatch.setattr(nixl_mod, "rdma_devices", lambda: ["mlx5_0"])
    with nixl_mod.ucx_modules_for_this_host():
        assert "UCX_MODULES" not in os.environ
    assert nixl_mod.ucx_modules() == "all"
    monkeypatch.setenv("UCX_MODULES", "^cuda")
    monkeypatch.setattr(nixl_mod, "rdma_devices", lambda: [])
    with nixl_mod.ucx_modules_for_this_host():
        assert os.environ["UCX_MODULES"] == "^cuda"
    assert nixl_mod.ucx_modules() == "^cuda"


@needs_nixl
def test_ctrl_c_ends_the_nixl_peer_without_a_traceback(capfd, sigint_handled) -> None:
    """A terminal's Ctrl-C reaches every process of the bench's group: the bench prints one line, and the NIXL peer
    printed a KeyboardInterrupt traceback beside it."""
    import signal

    from datamover.bench.nixl_peer import NixlPeer

    peer = NixlPeer(4096, NixlSettings(timeout=60))
    try:
        peer.proc.send_signal(signal.SIGINT)
        assert peer.proc.wait(30) == 128 + signal.SIGINT
    finally:
        peer.close()
    assert "Traceback" not in capfd.readouterr().err
