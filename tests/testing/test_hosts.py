"""Test hosts: network namespaces joined by veth pairs, each process in its own pid namespace."""

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.descriptors import DescList
from datamover.testing import hosts as hosts_mod
from datamover.testing.hosts import TestHosts, TestHostsUnavailable, make_test_hosts, unavailable
from datamover.testing.remote import RemoteBuffer, RemotePeer


@pytest.fixture(scope="module")
def three():
    # here=True only for the session's test_hosts: an address that comes and goes in this namespace mid-run is
    # one that UCX processes started meanwhile advertise and cache routes to
    hosts = make_test_hosts(3, here=False)
    yield hosts
    hosts.close()


def _names(prefix: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [w for w in (netns + links).replace(":", " ").replace("@", " ").split() if w.startswith(prefix)]


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def _report(conn, address: str, port: int) -> None:
    """Runs on a test host: connect back to ``address`` and say who this is."""
    with socket.create_connection((address, port), timeout=10) as s:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        s.sendall(f"{os.getpid()} {socket.gethostname()} {boot}".encode())
    conn.send(os.readlink("/proc/self/ns/net"))


def test_a_process_on_another_host_reaches_this_one_over_the_veth(test_hosts):
    here, there = test_hosts[0], test_hosts[1]
    assert here.netns is None and there.netns and here.address != there.address
    with socket.socket() as srv:
        srv.bind((here.address, 0))
        srv.listen()
        mine, theirs = mp.get_context("spawn").Pipe()
        proc = there.process(_report, (theirs, here.address, srv.getsockname()[1]), daemon=True)
        proc.start()
        conn, (peer_addr, _) = srv.accept()
        with conn:
            pid, hostname, boot = conn.recv(200).decode().split()
        assert mine.poll(30)
        netns = mine.recv()
        proc.join(10)
    assert proc.exitcode == 0
    assert peer_addr == there.address  # it came over its own link, not loopback
    assert pid == "1"  # its own pid namespace
    assert hostname == there.name and boot != open("/proc/sys/kernel/random/boot_id").read().strip()
    assert netns != os.readlink("/proc/self/ns/net")


def test_hosts_reach_each_other_and_a_process_here_is_in_its_own_pid_namespace(three):
    cmd = "echo $$ $UCX_NET_DEVICES; ip -o -4 addr show"
    out = three[2].run(["sh", "-c", cmd], capture_output=True, text=True, check=True)
    first, addrs = out.stdout.split("\n", 1)
    assert first.split() == ["1", three[2].ifname]
    assert three[2].address in addrs and three[1].address not in addrs
    script = (
        "import socket; s = socket.socket(); s.bind(({a!r}, 0)); s.listen(); print(s.getsockname()[1], flush=True);"
        " s.accept()"
    )
    server = three[0].popen(["python3", "-c", script.format(a=three[0].address)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        client = f"import socket; socket.create_connection(({three[0].address!r}, {port}), timeout=5).close()"
        three[2].run(["python3", "-c", client], check=True, timeout=30)
        assert server.wait(30) == 0
    finally:
        server.kill()


def test_sysctl_reads_each_hosts_own_network_namespace(test_hosts):
    here, there = test_hosts[0], test_hosts[1]
    key = "net.ipv4.tcp_congestion_control"
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        mine = f.read().strip()
    other = "reno" if mine != "reno" else "cubic"
    subprocess.run(["ip", "netns", "exec", there.netns, "sysctl", "-qw", f"{key}={other}"], check=True)
    try:
        assert there.sysctl(key) == other  # the host's own value, not this namespace's
        assert here.sysctl(key) == mine
    finally:
        subprocess.run(["ip", "netns", "exec", there.netns, "sysctl", "-qw", f"{key}={mine}"], check=True)
    assert there.sysctl("net.ipv4.no_such_setting") == ""


def test_link_down_cuts_the_host_off_and_link_up_brings_it_back(test_hosts):
    three = test_hosts
    target = three[1]
    script = (
        "import socket,sys\n"
        "try:\n"
        f"    socket.create_connection(({three[0].address!r}, {{port}}), timeout=1).close()\n"
        "except OSError as e:\n"
        "    sys.exit(3)\n"
    )
    with socket.socket() as srv:
        srv.bind((three[0].address, 0))
        srv.listen()
        code = script.format(port=srv.getsockname()[1])
        target.link_down()
        try:
            assert target.run(["python3", "-c", code], timeout=30).returncode == 3
        finally:
            target.link_up()
        assert target.run(["python3", "-c", code], timeout=30).returncode == 0


def test_close_removes_every_namespace_and_link():
    hosts = make_test_hosts(2, here=False)
    prefix = hosts.prefix
    assert len(_names(prefix)) >= 3  # switch and two hosts
    assert all(h.netns for h in hosts)
    hosts.close()
    assert _names(prefix) == []
    hosts.close()  # idempotent


def test_a_run_killed_before_cleanup_is_swept_by_the_next():
    hosts = make_test_hosts(2, here=False)
    prefix = hosts.prefix
    dead = subprocess.Popen(["true"])
    dead.wait()
    with open(os.path.join(hosts_mod._REGISTRY, prefix), "w") as f:
        f.write(f"{dead.pid}\n{hosts._dir}\n")  # as if its owner had been SIGKILLed
    hosts._finalizer.detach()
    with TestHosts(2, here=False) as fresh:
        assert fresh.prefix != prefix
        assert _names(prefix) == []
        assert not os.path.exists(hosts._dir)
    assert not os.path.exists(os.path.join(hosts_mod._REGISTRY, prefix))


_OWNER = """
import threading
from datamover.testing.hosts import TestHosts
hosts = TestHosts(2, here=False)
print(hosts.prefix, hosts._dir, flush=True)
threading.Event().wait()
"""


def test_a_run_sigkilled_leaves_nothing_after_the_next_and_the_next_says_so(capfd):
    """Before: the next run removed the killed run's namespaces and links, but its temp directory stayed for good,
    and nothing said what had been removed."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        prefix, directory = owner.stdout.readline().split()  # type: ignore[union-attr]
    finally:
        owner.kill()
        owner.wait()
    assert _names(prefix) and os.path.isdir(directory)
    with TestHosts(2, here=False) as fresh:
        assert fresh.prefix != prefix
        assert _names(prefix) == []
        assert not os.path.exists(directory)
    said = capfd.readouterr().err
    assert f"test hosts: removed {prefix}* (namespaces, links, {directory}) left by an earlier run" in said
    assert not os.path.exists(os.path.join(hosts_mod._REGISTRY, prefix))


def test_without_root_they_are_unavailable_and_the_fixture_skips(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in unavailable()
    with pytest.raises(TestHostsUnavailable, match="root"):
        TestHosts(2)
    with pytest.raises(pytest.skip.Exception, match="root"):
        make_test_hosts(2)


def test_names_carry_the_given_prefix():
    with make_test_hosts(2, prefix="Native-", here=False) as hosts:
        assert hosts.prefix.startswith("native") and len(hosts.prefix) == 10
        assert all(n.startswith(hosts.prefix) for n in _names(hosts.prefix))
        assert {h.ifname for h in hosts} == {f"{hosts.prefix}h0", f"{hosts.prefix}h1"}
        assert not [n for n in _names(hosts.prefix) if n in _root_links()]  # nothing in this namespace


ok, why = backend_status("ucx")


@pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")
def test_ucx_between_hosts_moves_bytes_and_direct_cma_says_why_it_is_off(test_hosts):
    here, there = test_hosts[0], test_hosts[1]
    cfg = {"backends": {"ucx": {"host": there.address}}}
    with RemotePeer("far", cfg, env={"UCX_TLS": "tcp,self"}, host=there) as peer:
        assert peer.pid != 1 and peer.process.is_alive()
        remote = RemoteBuffer(peer, 1 << 16)
        near = {"host": here.address, "ucx_config": {"TLS": "tcp,self", **here.ucx_config()}}
        with Agent("near", {"backends": {"ucx": near}}) as agent:
            agent.add_remote(peer.metadata())
            mem = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
            agent.register_memory(mem)
            offsets = np.arange(16)[::-1] * 4096
            xfer = agent.transfer("WRITE", DescList.blocks(mem, 4096), remote.descs(offsets, 4096), "far")
            assert xfer.wait() == XferState.DONE
            got = np.frombuffer(remote.read(0, 1 << 16), dtype=np.uint8).reshape(16, 4096)
            assert np.array_equal(got[::-1], mem.reshape(16, 4096))
            why_not = agent.backend("ucx").describe()["direct cma"]["far"]
            assert "another pid namespace" in why_not


_AFFINITY = "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two hosts needs two CPUs")
def test_split_cpus_pin_each_hosts_processes_to_its_own_share_and_close_unpins_this_one():
    mine = os.sched_getaffinity(0)
    with make_test_hosts(2, prefix="natpin", cpus="split") as hosts:
        h0, h1 = hosts[0].cpus, hosts[1].cpus
        assert h0 and h1 and not set(h0) & set(h1) and set(h0) | set(h1) <= mine
        for host in hosts:
            out = host.run([sys.executable, "-c", _AFFINITY], capture_output=True, text=True, check=True).stdout
            assert out.strip() == ",".join(map(str, host.cpus))
        assert os.sched_getaffinity(0) == mine  # nothing pinned here until asked
        hosts[0].pin_here()
        assert os.sched_getaffinity(0) == set(h0)
        # a thread started after inherits it
        seen = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert seen == [set(h0)]
    assert os.sched_getaffinity(0) == mine


def test_without_split_cpus_processes_run_anywhere_and_pin_here_does_nothing():
    mine = os.sched_getaffinity(0)
    with make_test_hosts(2, prefix="natpin", here=False) as hosts:
        assert hosts[0].cpus == hosts[1].cpus == ()
        out = hosts[1].run([sys.executable, "-c", _AFFINITY], capture_output=True, text=True, check=True).stdout
        assert out.strip() == ",".join(map(str, sorted(mine)))
        hosts[0].pin_here()
        assert os.sched_getaffinity(0) == mine


def test_split_cpus_need_a_cpu_per_host_and_a_known_mode():
    mine = os.sched_getaffinity(0)
    if unavailable():
        pytest.skip(f"test hosts unavailable: {unavailable()}")
    os.sched_setaffinity(0, {min(mine)})
    try:
        with pytest.raises(TestHostsUnavailable, match="needs 2 CPUs"):
            TestHosts(2, prefix="natpin", cpus="split")
    finally:
        os.sched_setaffinity(0, mine)
    with pytest.raises(ValueError, match="cpus"):
        TestHosts(2, prefix="natpin", cpus="all")


def test_the_session_hosts_are_made_before_an_xdist_worker_reports_its_collection_done(request):
    # a worker's tests start once every worker has reported: hosts made after that report appear mid-run
    hook = request.config.pluginmanager.hook.pytest_collection_finish
    called = list(reversed(hook.get_hookimpls()))  # pluggy calls the last first
    ours = [i for i, impl in enumerate(called) if impl.function.__module__ == hosts_mod.__name__]
    workers = [i for i, impl in enumerate(called) if type(impl.plugin).__name__ == "WorkerInteractor"]
    assert len(ours) == 1 and called[ours[0]].tryfirst
    assert all(ours[0] < i for i in workers)
