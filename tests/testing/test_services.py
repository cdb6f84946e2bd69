"""The loopback services' ports: picked where outgoing connections cannot take them."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from datamover.testing import services
from datamover.testing.waiting import until


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """The kernel gives ports of its ephemeral range to every outgoing connection: one picked there can be gone
    before the server binds it, or while a restarted server is down (as test_etcd_restart's etcd is)."""
    low = services._ephemeral_low()
    ports = {services.free_port() for _ in range(20)}
    assert all(services._LOWEST <= p < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_with_no_room_below_the_range_any_free_port_is_taken(monkeypatch):
    monkeypatch.setattr(services, "_ephemeral_low", lambda: services._LOWEST)
    port = services.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# a process that starts one service, prints its pid, and waits to be killed
_OWNER = r"""
import sys, threading
kind = sys.argv[1]
if kind == "s3":
    from datamover.testing.s3server import S3Server
    service = S3Server().start()
    pid = service._proc.pid
elif kind == "etcd":
    from datamover.testing.services import EtcdServer
    service = EtcdServer()
    pid = service.process.pid
else:
    from datamover.testing.mooncake import MooncakeMaster
    service = MooncakeMaster().start()
    pid = service._proc.pid
print(pid, flush=True)
threading.Event().wait()
"""


def _service_available(kind: str) -> str | None:
    """Why ``kind`` cannot run here, or None."""
    if kind == "s3":
        from datamover.testing.s3server import S3Server

        ok, why = S3Server.available()
        return None if ok else why
    if kind == "etcd":
        return None if services.etcd_binary() else "etcd is not installed"
    from datamover.testing.mooncake import mooncake_available

    ok, why = mooncake_available()
    return None if ok else why


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("kind", ["s3", "etcd", "mooncake"])
def test_a_service_dies_with_its_owner_killed_before_cleanup(kind, tmp_path):
    """Before: a test run or benchmark SIGKILLed (no finally, no atexit) left moto_server, etcd and mooncake_master
    running for good, each holding its ports and memory."""
    why = _service_available(kind)
    if why:
        pytest.skip(why)
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the killed owner leaves its service's data
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, kind], stdout=subprocess.PIPE, text=True, env=env)
    service = 0
    try:
        service = int(owner.stdout.readline())  # type: ignore[union-attr]
        assert _running(service)
        owner.kill()
        owner.wait()
        until(lambda: not _running(service), 10, what=f"the {kind} service ending with its owner")
    finally:
        owner.kill()
        owner.wait()
        if service and _running(service):
            os.kill(service, signal.SIGKILL)


def test_the_launcher_runs_the_service_itself_in_its_own_process():
    """The launcher execs the service: the pid its starter holds is the service's, so terminate, SIGSTOP and SIGKILL
    reach the service itself."""
    out = subprocess.run(
        services.tied_to_parent([sys.executable, "-c", "import os; print(os.getpid(), os.getppid())"]),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout.split()[1]) == os.getpid()


def test_etcd_that_exits_at_once_says_why_in_one_line(tmp_path, monkeypatch):
    """Before: "etcd exited with 1; see <dir>/etcd.log", a log the failed start had just deleted with its directory."""
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'listen tcp 127.0.0.1:2380: bind: address already in use' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(services.ServiceError) as info:
        services.EtcdServer(binary=str(fake))
    assert str(info.value) == "etcd exited with 1 at start: listen tcp 127.0.0.1:2380: bind: address already in use"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_mooncake_master_that_cannot_start_leaves_no_directory(tmp_path, monkeypatch):
    """Before: ``with MooncakeMaster()`` whose start failed left its temp directory behind (``__exit__`` never ran),
    and a missing binary was a FileNotFoundError with no filename, which ``datamover bench`` printed as a traceback."""
    from datamover.testing.mooncake import MooncakeMaster

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("MOONCAKE_MASTER_BIN", shutil.which("false") or "/bin/false")
    with pytest.raises(services.ServiceError, match=r"^mooncake_master exited with 1 at start: \(no output\)$"):
        with MooncakeMaster():
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["s3", "etcd", "mooncake"])
def test_a_start_interrupted_while_waiting_for_the_service_leaves_no_process(kind, monkeypatch):
    """Ctrl-C (or the bench's SIGTERM) while the service is coming up: before, the process was left running, its
    starter never having returned the object that would stop it."""
    why = _service_available(kind)
    if why:
        pytest.skip(why)
    from datamover.testing.mooncake import MooncakeMaster
    from datamover.testing.s3server import S3Server

    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(urllib.request, "urlopen", interrupted)
    monkeypatch.setattr(MooncakeMaster, "_ready", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            if kind == "s3":
                S3Server().start()
            elif kind == "etcd":
                services.EtcdServer()
            else:
                MooncakeMaster().start()
        assert len(started) == 1
        assert started[0].poll() is not None, f"the {kind} service outlived its interrupted start"
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_instances_started_together_are_all_killed_when_one_fails_to_start(monkeypatch):
    """test_pool's fixture started three cache instances and waited on each in turn: one failing to start left the
    others running (until their pipes closed), as a fixture erring in setup must not; ``start_each`` kills them."""
    from types import SimpleNamespace

    from datamover.testing.mooncake import CacheInstance

    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    waited: list[CacheInstance] = []

    def wait_ready(self):
        waited.append(self)
        if len(waited) == 2:
            raise RuntimeError("cache instance exited with 1")
        return self  # the first is taken for ready

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(CacheInstance, "wait_ready", wait_ready)
    master = SimpleNamespace(master_addr="127.0.0.1:9", metadata_url="P2PHANDSHAKE", admin_url="")
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            CacheInstance.start_each(master, [{}, {"segment_bytes": 0}, {}])  # type: ignore[arg-type]
        assert len(started) == 3
        assert [p.poll() is not None for p in started] == [True, True, True]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


def test_a_service_directory_left_by_a_killed_process_is_removed_by_the_next(tmp_path, monkeypatch, capfd):
    """SIGKILL leaves no time for cleanup: mooncake_master's and etcd's directories (and the ucx bench target's log)
    stayed in the temp dir for good, one per killed run. They are named after their process now, and the next one
    removes those whose process is gone; a live process's, or one not named so, is left alone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"datamover-mooncake-{dead.pid}-k3j_x9q1"
    stale.mkdir()
    (stale / "master.log").write_text("I1207 master.cpp] Master service started\n")
    stale_log = tmp_path / f"datamover-ucx-bench-{dead.pid}-a1b2c3d4.log"
    stale_log.write_text("log")
    kept = [tmp_path / f"datamover-mooncake-{os.getppid()}-live0000", tmp_path / "datamover-mooncake-oldnames"]
    for path in kept:
        path.mkdir()
    made = services.temp_path("mooncake")
    made_log = services.temp_path("ucx-bench", ".log", directory=False)
    assert os.path.isdir(made) and os.path.basename(made).startswith(f"datamover-mooncake-{os.getpid()}-")
    assert os.path.isfile(made_log) and os.path.basename(made_log).startswith(f"datamover-ucx-bench-{os.getpid()}-")
    assert sorted(tmp_path.iterdir()) == sorted([*kept, Path(made), Path(made_log)])
    err = capfd.readouterr().err
    assert f"mooncake: removed {stale}, left by process {dead.pid} that ended before its cleanup" in err
    assert f"ucx-bench: removed {stale_log}, left by process {dead.pid} that ended before its cleanup" in err
