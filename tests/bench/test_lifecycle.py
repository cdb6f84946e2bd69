"""`datamover bench` stopped or failing mid-run: what it started is stopped and removed, and it says so in one line.

Each fault is injected at a known point: the bench runs in a child process whose ``_measure`` prints a marker and
waits once the backend's services are up; the test signals it after reading the marker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _held_bench(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The bench started and held in its first case; (process, service pid or 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
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
def test_a_signal_mid_run_stops_the_s3_server_and_says_so_in_one_line(sig, tmp_path):
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


def test_sigterm_mid_run_removes_the_posix_file(tmp_path):
    """Before: the bench's file (up to --max-bytes, 256 MiB by default) stayed behind in the temp dir."""
    proc, _ = _held_bench(["--backend", "posix", "--op", "WRITE", "--dir", str(tmp_path)], tmp_path)
    assert any(p.name.startswith("datamover-bench-") for p in tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(tmp_path.iterdir()) == []
