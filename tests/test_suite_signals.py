"""A SIGTERM to the test run (a CI runner's timeout) tears the fixtures down, as Ctrl-C does (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

INNER = """
import threading
from pathlib import Path

import pytest

OUT = Path({out!r})


@pytest.fixture
def service():
    yield
    OUT.joinpath("torn-" + __import__("os").environ.get("PYTEST_XDIST_WORKER", "main")).write_text("down")


def test_held(service):
    OUT.joinpath("started").write_text("up")
    threading.Event().wait()
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("workers", [None, "1"], ids=["serial", "xdist"])
def test_sigterm_tears_fixtures_down(tmp_path: Path, workers: str | None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "test_inner.py").write_text(INNER.format(out=str(out)))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
            "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]  # fmt: skip
    argv += ["-n", workers] if workers else ["-p", "no:xdist"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST_"))}  # not this run's worker
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    # started with SIGINT ignored, as a suite a non-interactive shell ran in the background is (CI may): xdist's
    # controller interrupts its workers through SIGINT, so tests/conftest.py must handle it there
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_ignore_sigint)  # fmt: skip
    try:
        end = time.monotonic() + 60
        while not (out / "started").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < end, "the inner test never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    torn = sorted(p.name for p in out.glob("torn-*"))
    assert torn == (["torn-gw0"] if workers else ["torn-main"]), text
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
