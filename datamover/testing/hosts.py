"""Several "hosts" on this machine: network namespaces joined by veth pairs, each process in its own pid namespace.

``TestHosts(n)`` makes ``n`` hosts, each with its own address on one /24,
joined through a bridge in a switch namespace, so traffic between them
crosses a real network stack (veth, bridge, TCP), not loopback. With
``here=True`` (the default) host 0 is the calling process's own network
namespace (its end of the veth gets the address), so a test's in-process
Agent is on host 0 and peers run on the others. Every process started on a
host (``Host.process``, ``Host.popen``) also gets its own pid and mount
namespace (``unshare --pid --fork --mount-proc``): nothing can attach to it
with process_vm_readv/writev, so direct cma must fall back. UCX there uses
the host's veth as its only network device (``UCX_NET_DEVICES``); an Agent in
the calling process passes ``hosts[0].ucx_config()`` for the same. Hosts other than
the caller's also get their own hostname, /dev/shm and boot id, which is what
UCX tells machines apart by (its shared-memory transports then see them as
different machines, as they would be).

UCX reads the routing table once per process, at its first connection: make
the hosts before that in a process that runs an Agent on host 0 (the
``test_hosts`` fixture of this module's pytest plugin does, before any test).

Everything is named ``<prefix>...`` with a prefix unique to this run, and
removed on ``close()``; what a run killed before its cleanup left behind is
removed by the next run that finds its owner gone. Needs root (CAP_NET_ADMIN,
CAP_SYS_ADMIN), iproute2 and util-linux's unshare; ``unavailable()`` says
why not, and the ``test_hosts`` pytest fixture skips with that reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import multiprocessing as mp
import os
import random
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing import popen_spawn_posix, spawn
from typing import Any

from ..processes import pid_alive

_REGISTRY = "/run/datamover-testhosts"
_LOCK = "/run/lock/datamover-testhosts.lock"
_NAME = re.compile(r"^[a-z][a-z0-9]{1,9}$")
_MAX_HOSTS = 16
_DIR_PREFIX = "datamover-testhosts-"


class TestHostsUnavailable(RuntimeError):
    """Test hosts cannot be made here; the message says why (not root, no iproute2, a namespace refused...)."""

    __test__ = False


def unavailable() -> str | None:
    """Why test hosts cannot be made on this machine, or None when they likely can (creation may still fail)."""
    if not sys.platform.startswith("linux"):
        return f"test hosts need Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "test hosts need root (network and pid namespaces); run the tests as root"
    for tool in ("ip", "unshare", "sh"):
        if shutil.which(tool) is None:
            return f"test hosts need {tool!r} (iproute2, util-linux) on PATH"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TestHostsUnavailable(f"{shlex.join(argv)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _remove_prefix(prefix: str) -> None:
    """Delete every netns and root-namespace link named ``prefix...`` (their processes first)."""
    netns = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for line in netns:
        name = line.split(" ", 1)[0]
        if name.startswith(prefix):
            for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _run(["ip", "netns", "delete", name], check=False)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.split("\n")
    for line in links:
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(prefix):
            _run(["ip", "link", "delete", parts[1].split("@")[0]], check=False)


def _sweep_stale() -> None:
    """Remove what earlier runs left behind when their owner process is gone (killed before cleanup): their
    namespaces, links and temp directory, saying so on stderr."""
    try:
        entries = os.listdir(_REGISTRY)
    except FileNotFoundError:
        return
    for prefix in entries:
        path = os.path.join(_REGISTRY, prefix)
        try:
            with open(path) as f:
                words = f.read().split("\n")
            owner = int(words[0])
        except (OSError, ValueError, IndexError):
            owner, words = 0, []
        if owner and pid_alive(owner):
            continue
        directory = words[1] if len(words) > 1 else ""
        if _NAME.match(prefix):
            _remove_prefix(prefix)
        if os.path.basename(directory).startswith(_DIR_PREFIX):  # only ever a directory TestHosts made
            shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(path)
        print(
            f"test hosts: removed {prefix}* (namespaces, links, {directory or 'no directory'}) left by an earlier run "
            f"whose process {owner or '?'} ended before its cleanup",
            file=sys.stderr,
        )


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route or address of this network namespace overlaps."""
    used = []
    for line in _run(["ip", "-4", "-o", "route", "show", "table", "all"], check=False).stdout.split("\n"):
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "anycast", "multicast") and len(words) > 1:
            words = words[1:]
        with contextlib.suppress(ValueError, IndexError):
            used.append(ipaddress.ip_network(words[0], strict=False))
    rng = random.Random(secrets.randbits(64))
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(200, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise TestHostsUnavailable("no free 10.x.y.0/24 subnet for test hosts")


_spawn_lock = threading.Lock()


class _HostProcess(mp.context.SpawnProcess):
    """A spawned process whose interpreter starts through a host's wrapper (netns, pid ns), pickling as usual."""

    _wrapper = ""

    @staticmethod
    def _Popen(process_obj: _HostProcess) -> Any:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # started here, not on the host
        with _spawn_lock:
            before = spawn.get_executable()
            spawn.set_executable(process_obj._wrapper)
            try:
                return popen_spawn_posix.Popen(process_obj)
            finally:
                spawn.set_executable(before)


def sysctl(name: str, netns: str | None = None) -> str:
    """A sysctl's value (``net.ipv4.tcp_congestion_control``) in network namespace ``netns`` (None: this
    process's own), '' if unknown."""
    path = "/proc/sys/" + name.replace(".", "/")
    try:
        if not netns:
            with open(path) as f:
                return f.read().strip()
        return _run(["ip", "netns", "exec", netns, "cat", path]).stdout.strip()
    except (OSError, TestHostsUnavailable):
        return ""


class Host:
    """One test host: its address and interface, and the means to start processes on it and cut its link."""

    def __init__(
        self, hosts: TestHosts, index: int, netns: str | None, ifname: str, address: str, cpus: tuple[int, ...] = ()
    ) -> None:
        self.index = index
        self.cpus = cpus  # CPUs this host's processes run on (``TestHosts(cpus="split")``); () = any
        self.name = f"{hosts.prefix}-h{index}"
        self.netns = netns  # None: the calling process's own network namespace
        self.ifname = ifname
        self.address = address
        self.hostname = self.name if netns else None
        self._hosts = hosts
        self._dir = hosts._dir
        self._wrapper = self._write_wrapper()

    def __repr__(self) -> str:
        return f"Host({self.name!r}, address={self.address!r}, netns={self.netns!r})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host: in its network namespace, in a pid and mount namespace of its own."""
        inner = [
            "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "--",
            "sh", "-c", self._setup_script() + 'exec "$@"', "sh", *argv,
        ]  # fmt: skip
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        return (["ip", "netns", "exec", self.netns] if self.netns else []) + pin + inner

    def pin_here(self) -> None:
        """Run every thread of the calling process on this host's CPUs (host 0 of ``here=True`` hosts), until
        the hosts close; threads started later inherit it. Without ``cpus`` it does nothing."""
        if self.cpus:
            self._hosts._pin_here(set(self.cpus))

    def _setup_script(self) -> str:
        # UCX's network device on a host is its veth: left to itself UCX would also open lanes on devices
        # another host cannot reach (eth0 through the default route, lo)
        devices = f"export UCX_NET_DEVICES={shlex.quote(self.ifname)} && "
        if not self.netns:
            return devices
        boot_id = os.path.join(self._dir, f"{self.name}.boot_id")
        if not os.path.exists(boot_id):
            with open(boot_id, "w") as f:
                f.write(str(uuid.uuid4()) + "\n")
        return (
            f"hostname {shlex.quote(self.name)} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
            f"mount --bind {shlex.quote(boot_id)} /proc/sys/kernel/random/boot_id && " + devices
        )

    def _write_wrapper(self) -> str:
        path = os.path.join(self._dir, f"{self.name}.python")
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexec " + shlex.join(self.argv([sys.executable])) + ' "$@"\n')
        os.chmod(path, 0o755)
        return path

    def ucx_config(self) -> dict[str, str]:
        """UCX settings for an Agent on this host in the calling process (host 0): its veth as the network device.

        Processes started on a host get ``UCX_NET_DEVICES`` set to it already.
        """
        return {"NET_DEVICES": self.ifname}

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on this host. Its pid here is the unshare parent's; SIGKILL to it kills the whole tree."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), **kwargs)

    def process(self, target: Any, args: tuple = (), kwargs: dict | None = None, **options: Any) -> mp.Process:
        """A multiprocessing (spawn) Process that runs ``target`` on this host; call ``start()`` as usual.

        Pipes and other picklable arguments pass as with any spawned process.
        ``pid`` is the unshare parent's pid here (SIGKILL to it takes the
        whole process tree down); ``os.getpid()`` inside reads 1.
        """
        proc = _HostProcess(target=target, args=args, kwargs=kwargs or {}, **options)
        proc._wrapper = self._wrapper
        return proc

    @staticmethod
    def pid_here(pid: int) -> int:
        """The pid, in this process's pid namespace, of what runs inside the unshare parent ``pid`` (its child)."""
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            raise ProcessLookupError(f"no process runs under unshare pid {pid}") from None

    def sysctl(self, name: str) -> str:
        """A sysctl's value in this host's network namespace (``net.ipv4.tcp_congestion_control``), '' if unknown."""
        return sysctl(name, self.netns)

    def ip(self, *args: str) -> str:
        """Run ``ip args...`` in this host's network namespace; returns its output."""
        return _run(["ip", *(["-n", self.netns] if self.netns else []), *args]).stdout

    def link_down(self) -> None:
        """Take this host's network link down (``ip link set down``): its peers' packets stop arriving."""
        self.ip("link", "set", self.ifname, "down")

    def link_up(self) -> None:
        self.ip("link", "set", self.ifname, "up")


class TestHosts:
    """``n`` hosts joined by veth pairs to one bridge; ``hosts[i].address`` reaches host ``i`` from any of them."""

    __test__ = False

    def __init__(self, n: int = 2, *, here: bool = True, prefix: str | None = None, cpus: str | None = None) -> None:
        """``cpus="split"``: the CPUs this process may use are split evenly between the hosts, each host's processes
        pinned to its share (``taskset``; host 0 of ``here=True``: ``hosts[0].pin_here()``), as machines of their
        own would be instead of sharing every core; TestHostsUnavailable with fewer CPUs than hosts."""
        if not 2 <= n <= _MAX_HOSTS:
            raise ValueError(f"test hosts: n must be 2..{_MAX_HOSTS}, not {n}")
        if cpus not in (None, "split"):
            raise ValueError(f'test hosts: cpus must be None or "split", not {cpus!r}')
        why = unavailable()
        if why:
            raise TestHostsUnavailable(why)
        mine = sorted(os.sched_getaffinity(0))
        if cpus and len(mine) < n:
            raise TestHostsUnavailable(f"pinning {n} hosts to CPUs of their own needs {n} CPUs, not {mine}")
        share = len(mine) // n
        self._cpus = [tuple(mine[i * share : (i + 1) * share]) if cpus else () for i in range(n)]
        self._unpin: dict[int, set[int]] = {}
        base = re.sub(r"[^a-z0-9]", "", (prefix or os.environ.get("DATAMOVER_TESTHOSTS_PREFIX") or "dm").lower())
        base = (base if base[:1].isalpha() else "dm" + base)[:6]
        self.hosts: list[Host] = []
        self._dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)
        self._closed = False
        os.makedirs(_REGISTRY, exist_ok=True)
        os.makedirs(os.path.dirname(_LOCK), exist_ok=True)
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _sweep_stale()
            existing = _run(["ip", "netns", "list"], check=False).stdout
            while True:
                self.prefix = base + secrets.token_hex(2)
                if self.prefix not in existing:
                    break
            with open(os.path.join(_REGISTRY, self.prefix), "w") as f:
                f.write(f"{os.getpid()}\n{self._dir}\n")  # what the next run removes if this one is killed
            self._finalizer = weakref.finalize(self, _teardown, self.prefix, self._dir)
            try:
                self.subnet = _free_subnet()
                self._build(n, here)
            except BaseException:
                self.close()
                raise

    def _build(self, n: int, here: bool) -> None:
        p = self.prefix
        switch, bridge = f"{p}-sw", f"{p}br"
        _run(["ip", "netns", "add", switch])
        _run(["ip", "-n", switch, "link", "add", bridge, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", bridge, "up"])
        addrs = list(self.subnet.hosts())
        for i in range(n):
            netns = None if (here and i == 0) else f"{p}-h{i}"
            ifname, port = f"{p}h{i}", f"{p}s{i}"
            if netns:
                _run(["ip", "netns", "add", netns])
                _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            _run(["ip", *(["-n", netns] if netns else []), "link", "add", ifname, "type", "veth",
                  "peer", "name", port, "netns", switch])  # fmt: skip
            _run(["ip", "-n", switch, "link", "set", port, "master", bridge, "up"])
            address = str(addrs[i])
            ns = ["-n", netns] if netns else []
            # IPv4 only: an IPv6 link-local address that comes up a second or two later changes what UCX packs into
            # a worker address for this device (and so what a peer's address check sees) mid-run
            _run([*(["ip", "netns", "exec", netns] if netns else []), "sh", "-c",
                  f"echo 1 > /proc/sys/net/ipv6/conf/{ifname}/disable_ipv6 || true"])  # fmt: skip
            _run(["ip", *ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", ifname])
            _run(["ip", *ns, "link", "set", ifname, "up"])
            self.hosts.append(Host(self, i, netns, ifname, address, self._cpus[i]))

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def _pin_here(self, cpus: set[int]) -> None:
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                self._unpin.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, cpus)

    def close(self) -> None:
        """Kill what runs in the hosts, delete their namespaces and links, unpin this process (idempotent)."""
        unpin, self._unpin = self._unpin, {}
        for tid, cpus in unpin.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
        self._finalizer()

    def __enter__(self) -> TestHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _teardown(prefix: str, directory: str) -> None:
    _remove_prefix(prefix)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(_REGISTRY, prefix))
    shutil.rmtree(directory, ignore_errors=True)


def make_test_hosts(n: int = 2, **kwargs: Any) -> TestHosts:
    """``TestHosts(n)``, or ``pytest.skip`` with the reason they cannot be made here."""
    import pytest

    try:
        return TestHosts(n, **kwargs)
    except TestHostsUnavailable as exc:
        pytest.skip(f"test hosts unavailable: {exc}")


# -- pytest plugin (``pytest_plugins = ["datamover.testing.hosts"]``) ---------------------------------------
# UCX reads the routing table once per process, at its first reachability check: an interface made after that
# is unreachable to UCX in this process. So the session's hosts are made once collection is done, before any
# test runs, when a collected test asks for them.

_session: dict[str, Any] = {}


def pytest_collection_finish(session: Any) -> None:
    if any("test_hosts" in getattr(item, "fixturenames", ()) for item in session.items):
        _session_hosts()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    hosts = _session.pop("hosts", None)
    if hosts is not None:
        hosts.close()


def _session_hosts() -> TestHosts | None:
    if "hosts" not in _session and "error" not in _session:
        try:
            _session["hosts"] = TestHosts(2)
        except TestHostsUnavailable as exc:
            _session["error"] = str(exc)
    return _session.get("hosts")


try:
    import pytest as _pytest
except ImportError:  # pragma: no cover - pytest is only needed for the fixture
    _pytest = None

if _pytest is not None:
    # first among this hook's implementations: under pytest-xdist a worker reports its collection done from its own
    # implementation, and the run's tests start once every worker has; so each worker's hosts exist before any starts
    pytest_collection_finish = _pytest.hookimpl(tryfirst=True)(pytest_collection_finish)

    @_pytest.fixture(scope="session")
    def test_hosts() -> TestHosts:
        """Two test hosts for the session, made before any test ran (host 0: the test process's network namespace).

        An Agent in the test process is on host 0 (give it ``test_hosts[0].address`` and
        ``test_hosts[0].ucx_config()``); ``RemotePeer(..., host=test_hosts[1])`` runs a peer on host 1.
        """
        hosts = _session_hosts()
        if hosts is None:
            _pytest.skip(f"test hosts unavailable: {_session['error']}")
        return hosts
