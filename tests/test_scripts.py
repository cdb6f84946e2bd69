"""The README's two commands, ``scripts/bench.sh`` and ``scripts/test.sh``, stopped by a signal to the script.

Each runs a copy of the script beside stand-ins for what it calls (setup.sh, the venv's ``datamover``, ``python``
and ``ruff``): the stand-in for the long-running last command prints ``MARK <pid>`` and waits, and the test
signals the script's own pid once the marker is read.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from datamover.testing.waiting import until

ROOT = Path(__file__).resolve().parents[1]

# stand-in for the long-running command: says its pid, then waits to be signalled
_LONG = 'echo "MARK $$"; exec sleep 300\n'
STANDINS = {
    "datamover": '#!/bin/sh\n[ "$1" = bench ] || exit 0\n' + _LONG,
    "python": '#!/bin/sh\n[ "$2" = pytest ] || exit 0\n' + _LONG,
    "ruff": "#!/bin/sh\nexit 0\n",
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of scripts/ with setup.sh a no-op and a .venv whose commands are the stand-ins."""
    (tmp_path / "scripts").mkdir()
    for name in ("bench.sh", "test.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("script", ["bench.sh", "test.sh"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_script_reaches_its_long_running_command(script, sig, checkout, sigint_handled):
    """Before: the script ran the benchmark or pytest as a child, so SIGTERM (or a SIGINT sent to the script alone)
    ended bash and left the benchmark or the whole test suite running on, orphaned."""
    env = {**os.environ, "DATAMOVER_SKIP_EXTRAS": "1", "DATAMOVER_TEST_WORKERS": "1"}
    proc = subprocess.Popen(
        ["bash", str(checkout / "scripts" / script)], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    worker = 0
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        while line and not line.startswith("MARK"):
            line = proc.stdout.readline()  # type: ignore[union-attr]
        worker = int(line.split()[1])
        proc.send_signal(sig)
        proc.wait(30)
        until(lambda: not _alive(worker), 10, what=f"the command {script} ran ending with the script")
    finally:
        proc.kill()
        proc.wait()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
