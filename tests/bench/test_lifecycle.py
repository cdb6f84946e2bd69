"""`datamover bench` stopped or failing mid-run: what it started is stopped and removed, and it says so in one line.

Each fault is injected at a known point: the bench runs in a child process whose ``_measure`` prints a marker and
waits once the backend's services are up; the test signals it after reading the marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datamover.bench import output
from datamover.cli import main
from datamover.testing.s3server import S3Server

ROOT = Path(__file__).resolve().parents[2]

# the bench, held in its first case: prints "MARK <pid of the backend's service or 0>" and waits there
HELD = r"""
import sys, threading
from datamover.bench import runner

def held(workload, *args, **kwargs):
    server = getattr(workload, "server", None)
    print("MARK", server._proc.pid if server is not None else 0, flush=True)
    threading.Event().wait()

runner._measure = held
from datamover.cli import main
sys.exit(main(["bench", "--quiet", "--min-time", "0.01", "--block-sizes", "4K", "--batch-sizes", "1", *sys.argv[1:]]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone, only not yet reaped by its parent
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(pid: int) -> None:
    """SIGKILL what a failing test left running."""
    if pid and _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _held_bench(args: list[str], tmp_path: Path, wrapper: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """The bench started (behind ``wrapper``, e.g. nohup, which execs it) and held in its first case; (process,
    service pid or 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [*wrapper, sys.executable, "-c", HELD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    while line and not line.startswith("MARK"):
        line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.kill()
        raise AssertionError(f"the bench ended before its first case: {proc.communicate()[1][-2000:]}")
    return proc, int(line.split()[1])


@pytest.mark.skipif(not S3Server.available()[0], reason="moto[server] not installed")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_mid_run_stops_the_s3_server_and_says_so_in_one_line(sig, tmp_path, sigint_handled):
    """Before: SIGTERM and SIGHUP killed the bench at once and left moto_server running for good; SIGINT stopped it
    but printed a KeyboardInterrupt traceback."""
    proc, server = _held_bench(["--backend", "s3", "--op", "WRITE"], tmp_path)
    try:
        assert server and _alive(server)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err
        assert err.strip().splitlines() == [
            f"datamover bench: stopped by {sig.name}; the services and processes it started are stopped"
        ], err
        assert _gone_within(server, 10), "moto_server outlived the bench"
    finally:
        _kill(server)


def test_a_signal_the_bench_was_started_ignoring_stays_ignored(tmp_path):
    """Under ``nohup`` (SIGHUP ignored) a hangup must not stop the bench; SIGTERM still does."""
    proc, _ = _held_bench(["--backend", "memcpy"], tmp_path, wrapper=("nohup",))
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err


def test_sigterm_mid_run_removes_the_posix_file(tmp_path):
    """Before: the bench's file (up to --max-bytes, 256 MiB by default) stayed behind in the temp dir."""
    proc, _ = _held_bench(["--backend", "posix", "--op", "WRITE", "--dir", str(tmp_path)], tmp_path)
    assert any(p.name.startswith("datamover-bench-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(tmp_path.iterdir()) == []


TINY = ["--block-sizes", "4K,64K", "--batch-sizes", "1", "--min-time", "0.01", "--max-iters", "3", "--quiet"]


@pytest.mark.skipif(not S3Server.available()[0], reason="moto[server] not installed")
def test_a_service_that_cannot_start_is_one_line_and_the_other_backends_still_run(tmp_path, monkeypatch, capsys):
    """moto_server exits at once on every port (as when its port is taken): before, a RuntimeError traceback ended
    the whole run, memcpy's rows and the JSON with it."""
    from datamover.testing import s3server

    refuse = "import sys; sys.exit('OSError: [Errno 98] Address already in use')"
    monkeypatch.setattr(s3server, "tied_to_parent", lambda argv: [sys.executable, "-c", refuse])
    js = tmp_path / "b.json"
    rc = main(["bench", "--backend", "s3,memcpy", *TINY, "--json", str(js)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [
        "datamover bench: s3: did not start: moto_server could not start on 3 ports: moto_server exited with 1 at "
        "start: OSError: [Errno 98] Address already in use; its 4 case(s) were not run"
    ]
    data = json.loads(js.read_text())
    assert [(r["backend"], r["block"]) for r in data["results"]] == [("memcpy", 4096), ("memcpy", 65536)]
    assert [(f["backend"], f["op"], f["not_run"]) for f in data["failed"]] == [("s3", None, 4)]


def test_a_case_that_fails_mid_run_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    """A case raising mid-run (its service gone, a transfer error): before, the exception ended the run and no
    row of it, or of any backend after it, reached the table or the JSON."""
    from datamover.bench import local
    from datamover.errors import TransferIOError

    real = local.MemcpyWorkload.case

    def case(self, op, block, batch):
        if block == 4096:
            raise TransferIOError("the peer went away", backend="memcpy")
        return real(self, op, block, batch)

    monkeypatch.setattr(local.MemcpyWorkload, "case", case)
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    rc = main(
        ["bench", "--backend", "memcpy,posix", "--dir", str(tmp_path), *TINY, "--json", str(js), "--csv", str(cs)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [
        "datamover bench: memcpy WRITE 4 KiB x 1 failed: TransferIOError: backend 'memcpy': the peer went away; "
        "its 1 later case(s) were not run"
    ]
    data = json.loads(js.read_text())
    assert {r["backend"] for r in data["results"]} == {"posix"} and len(data["results"]) == 4
    assert data["failed"] == [
        {
            "backend": "memcpy",
            "op": "WRITE",
            "block": 4096,
            "batch": 1,
            "not_run": 1,
            "error": "TransferIOError: backend 'memcpy': the peer went away",
        }
    ]
    assert output.read_csv(str(cs))[1]["failed"] == data["failed"]


def test_without_a_failures_list_the_sweep_raises_as_before(monkeypatch):
    """Library callers (examples, tests) that pass no ``failures`` list still get the error itself."""
    from datamover.bench import local
    from datamover.bench.runner import run_sweep

    monkeypatch.setattr(local.MemcpyWorkload, "case", lambda self, op, block, batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run_sweep(["memcpy"], None, [4096], [1], min_time=0.01, max_iters=3, progress=False)


def test_a_nixl_peer_that_cannot_start_leaves_ours_measured_and_says_why(monkeypatch):
    """NIXL's peer process not starting (NixlError) made the whole run a traceback; a missing NIXL was already a
    per-row ``vs_error``, and now so is this."""
    from datamover.bench import nixl
    from datamover.bench.runner import run_sweep
    from datamover.errors import NixlError

    def no_peer(backend, workload, settings):
        raise NixlError("the NIXL target process did not start: exit code 1", backend="nixl")

    monkeypatch.setattr(nixl, "nixl_side", no_peer)
    failures: list = []
    rows = run_sweep(["memcpy"], None, [4096], [1], min_time=0.01, max_iters=3, progress=False, vs="nixl",
                     failures=failures)  # fmt: skip
    assert failures == [] and len(rows) == 1 and rows[0].gbps > 0
    assert rows[0].vs_error == "backend 'nixl': the NIXL target process did not start: exit code 1"


def _failing_close() -> None:
    raise RuntimeError("close failed")


@pytest.mark.skipif(not S3Server.available()[0], reason="moto[server] not installed")
def test_the_s3_workload_stops_its_server_even_when_its_agent_fails_to_close(monkeypatch):
    """Before: an agent close that raised skipped ``server.stop()``, and moto_server outlived the bench."""
    from datamover.bench.s3 import S3Workload

    workload = S3Workload(4096)
    pid = workload.server._proc.pid
    real_close = workload.agent.close
    monkeypatch.setattr(workload.agent, "close", _failing_close)
    try:
        with pytest.raises(RuntimeError, match="close failed"):
            workload.close()
        assert _gone_within(pid, 10), "moto_server outlived the workload's close"
    finally:
        real_close()
        _kill(pid)


def test_the_mooncake_workload_whose_master_cannot_start_leaves_no_directory(tmp_path, monkeypatch):
    """Before: ``MooncakeMaster().start()`` failing left the master's directory, made before its start, behind."""
    import tempfile

    from datamover.bench.mooncake import MooncakeWorkload
    from datamover.testing.services import ServiceError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MOONCAKE_MASTER_BIN", "/bin/false")
    with pytest.raises(ServiceError, match="mooncake_master exited with 1 at start"):
        MooncakeWorkload(4096)
    assert list(tmp_path.iterdir()) == []


def test_the_workload_is_closed_even_when_the_nixl_side_fails_to_close(monkeypatch):
    """Before: NIXL's side raising in its close skipped the workload's close, and with it its services."""
    from datamover.bench import local, nixl
    from datamover.bench.runner import run_sweep
    from datamover.errors import NixlError

    class Side:
        def header(self) -> dict:
            return {}

        def case(self, case):
            raise NixlError("no such pair here", backend="nixl")

        close = staticmethod(_failing_close)

    closed = []
    real = local.MemcpyWorkload.close
    monkeypatch.setattr(local.MemcpyWorkload, "close", lambda self: closed.append(real(self)))
    monkeypatch.setattr(nixl, "nixl_side", lambda backend, workload, settings: Side())
    with pytest.raises(RuntimeError, match="close failed"):
        run_sweep(["memcpy"], None, [4096], [1], min_time=0.01, max_iters=3, progress=False, vs="nixl", failures=[])
    assert closed == [None]


def test_the_file_of_a_run_sigkilled_mid_run_is_removed_by_the_next_run(tmp_path, capsys):
    """SIGKILL leaves no time for cleanup: the posix file (up to 256 MiB) stayed in the temp dir for good, one per
    killed run; the next run now removes the files of runs whose process is gone, and says so."""
    proc, _ = _held_bench(["--backend", "posix", "--op", "WRITE", "--dir", str(tmp_path)], tmp_path)
    proc.kill()
    proc.communicate()
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith("datamover-bench-")]
    live = tmp_path / f"datamover-bench-{os.getppid()}.bin"  # a run still going (this test's parent is alive)
    live.write_bytes(b"x")
    assert main(["bench", "--backend", "posix", "--op", "WRITE", "--dir", str(tmp_path), *TINY]) == 0
    err = capsys.readouterr().err
    said = f"datamover bench: removed {left} (4 KiB), left by run {proc.pid} that ended before its cleanup"
    assert said in err
    assert list(tmp_path.iterdir()) == [live]
