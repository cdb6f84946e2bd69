"""``datamover.testing.stopped``: ``freeze`` returns only once every thread of the process has stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from datamover.testing.stopped import all_stopped, freeze
from datamover.testing.waiting import until

# a main thread and three more, each spinning on the CPU: none of them is stopped unless the process is
_SPINNERS = "import threading\nfor _ in range(3): threading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"
_SPINNERS += "print('up', flush=True)\nwhile True: pass\n"


@pytest.fixture
def spinning():
    proc = subprocess.Popen([sys.executable, "-c", _SPINNERS], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        until(lambda: len(os.listdir(f"/proc/{proc.pid}/task")) == 4, what="the spinner's four threads")
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _states(pid: int) -> list[str]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        out.append(stat.rsplit(")", 1)[1].split()[0])
    return out


def test_a_running_process_is_not_stopped(spinning) -> None:
    assert not all_stopped(spinning.pid)


def test_freeze_returns_with_every_thread_stopped_and_thaw_runs_them_again(spinning) -> None:
    freeze(spinning.pid)
    states = _states(spinning.pid)
    assert len(states) == 4 and set(states) <= {"T", "t"}, states
    os.kill(spinning.pid, signal.SIGCONT)
    until(lambda: not all_stopped(spinning.pid), what="the thawed process running")
