"""Real services on loopback for tests and benchmarks: etcd, started in a temp dir on free ports."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence

from ..processes import pid_alive

# the launcher ``tied_to_parent`` puts in front of a service: PR_SET_PDEATHSIG (1) with SIGKILL (9), which execve keeps;
# a parent that died before the prctl is noticed by its pid having changed
_LIFELINE = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, 9) != 0:
    sys.exit("cannot tie the service to its parent: prctl: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit("the service's parent is gone before it started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


class ServiceError(RuntimeError):
    """A service (moto_server, etcd, mooncake_master, a pool member, a benchmark's peer process) did not start or
    stopped answering; the message names it and says why in one line. ``exited``: it ended by itself (another port
    may do, where a port taken by another process is the likely cause)."""

    def __init__(self, message: str, *, exited: bool = False) -> None:
        super().__init__(message)
        self.exited = exited


def last_line(text: str) -> str:
    """The last non-blank line of a service's output: where it says why it stopped."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def temp_path(kind: str, suffix: str = "", *, directory: bool = True) -> str:
    """A new temp directory (or empty file) named ``datamover-<kind>-<this pid>-...<suffix>``, for a service's data
    and log. First removes those of processes that are gone (SIGKILLed before their cleanup: a directory each, for
    good), saying so on stderr; those of live processes are theirs and stay."""
    tmp = tempfile.gettempdir()
    stale = re.compile(rf"datamover-{re.escape(kind)}-(\d+)-\w+{re.escape(suffix)}")
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    for name in names:
        m = stale.fullmatch(name)
        if m is None or pid_alive(int(m[1])):
            continue
        path = os.path.join(tmp, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        print(f"{kind}: removed {path}, left by process {m[1]} that ended before its cleanup", file=sys.stderr)
    prefix = f"datamover-{kind}-{os.getpid()}-"
    if directory:
        return tempfile.mkdtemp(prefix=prefix, suffix=suffix)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path


def tied_to_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` behind a launcher that makes the service die with the thread starting it (Linux PR_SET_PDEATHSIG),
    so that a test run or benchmark SIGKILLed before its cleanup leaves no moto_server, etcd or mooncake_master
    running for good; elsewhere ``argv`` itself."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _LIFELINE, str(os.getpid()), *argv]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range where there is room.

    The kernel hands ports of that range to every outgoing connection, so one picked there can be taken before
    the server binds it, or while a server that keeps its port across a restart (``EtcdServer.stop``/``start``)
    is down; below it only an explicit bind takes a port. The caller still retries a server that could not bind.
    """
    low = _ephemeral_low()
    for _ in range(64 if low > _LOWEST + 1024 else 0):
        port = random.randrange(_LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOWEST = 10000  # below: ports that well-known services are configured on


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), or 32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def etcd_binary() -> str | None:
    """Path of the etcd server binary (``$ETCD_BIN``, PATH, or Debian's /usr/bin/etcd), or None."""
    for cand in (os.environ.get("ETCD_BIN"), shutil.which("etcd"), "/usr/bin/etcd"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class EtcdServer:
    """A single-member etcd on 127.0.0.1 with a temp data dir; ``endpoint`` is its client URL."""

    def __init__(self, binary: str | None = None, timeout: float = 20.0) -> None:
        binary = binary or etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        self._binary, self._timeout = binary, timeout
        self.process: subprocess.Popen | None = None
        for attempt in range(3):  # a port picked free can still be taken before etcd binds it: new ports, again
            self.dir = temp_path("etcd")
            self.port, peer = free_port(), free_port()
            self.endpoint = f"http://127.0.0.1:{self.port}"
            self._peer_url = f"http://127.0.0.1:{peer}"
            self._log = open(os.path.join(self.dir, "etcd.log"), "ab")
            try:
                self.start()
                return
            except ServiceError as exc:
                if attempt == 2 or not exc.exited:
                    raise

    def start(self) -> None:
        """Start etcd (again, after ``stop``: same ports, same data) and wait until it is healthy."""
        env = {**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")}
        peer_url = self._peer_url
        self.process = subprocess.Popen(
            tied_to_parent([
                self._binary, "--name", "dm", "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"dm={peer_url}", "--log-level", "error",
            ]),
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            self._wait_healthy()
        except BaseException:
            self.close()  # an interrupted start leaves no etcd behind either
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._timeout
        while True:
            if self.process.poll() is not None:  # type: ignore[union-attr]
                code = self.process.returncode  # type: ignore[union-attr]
                raise ServiceError(f"etcd exited with {code} at start: {last_line(self._tail())}", exited=True)
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as resp:
                    if b"true" in resp.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"etcd did not become healthy on {self.endpoint} within {self._timeout:g} s: "
                    f"{last_line(self._tail())}"
                )
            time.sleep(0.1)

    def _tail(self, nbytes: int = 4000) -> str:
        """The end of etcd's log (the log goes with its directory on ``close``)."""
        try:
            with open(os.path.join(self.dir, "etcd.log"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop etcd, keeping its data directory, so that ``start`` brings the same cluster back."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
