"""The NIXL facade's etcd route (NIXL_ETCD_ENDPOINTS), following NIXL's nixl_etcd_example.py."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from datamover.backends import backend_status
from datamover.compat import nixl as nx
from datamover.compat.nixl import _metadata as md
from datamover.compat.nixl import nixl_agent, nixl_agent_config
from datamover.testing.services import EtcdServer, etcd_binary

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def etcd_url():
    if etcd_binary() is None:
        pytest.skip("no etcd binary (Debian package etcd-server)")
    pytest.importorskip("etcd3gw", reason="etcd3gw is not installed")
    with EtcdServer() as server:  # retries on fresh ports when one was taken before etcd bound it
        yield server.endpoint


@pytest.fixture
def etcd_env(etcd_url, monkeypatch, request):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd_url)
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", f"/nixl/test/{request.node.name}")
    return etcd_url


def until(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_etcd_example_flow(etcd_env):
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    agent1 = nixl_agent("EtcdAgent1", nixl_agent_config(backends=["UCX"]))
    agent2 = nixl_agent("EtcdAgent2", nixl_agent_config(backends=["UCX"]))
    try:
        buf1 = np.frombuffer(b"a" * 1024, dtype=np.uint8).copy()
        buf2 = np.frombuffer(b"b" * 1024, dtype=np.uint8).copy()
        reg1 = agent1.register_memory(agent1.get_reg_descs([(buf1.ctypes.data, 1024, 0, "a" * 1024)], "DRAM"))
        reg2 = agent2.register_memory(agent2.get_reg_descs([(buf2.ctypes.data, 1024, 0, "b" * 1024)], "DRAM"))

        agent1.send_local_metadata()
        agent2.send_local_metadata()
        agent1.fetch_remote_metadata("EtcdAgent2")
        agent2.fetch_remote_metadata("EtcdAgent1")
        # as in NIXL, fetches run on the agent's background thread: poll until the metadata is there
        until(lambda: agent1.check_remote_metadata("EtcdAgent2") and agent2.check_remote_metadata("EtcdAgent1"))

        src = agent1.get_xfer_descs([(buf1.ctypes.data + 16, 8, 0)], "DRAM")
        dst = agent2.get_xfer_descs([(buf2.ctypes.data + 8, 8, 0)], "DRAM")
        handle = agent1.initialize_xfer("WRITE", src, dst, "EtcdAgent2", b"notification")
        state = agent1.transfer(handle)
        notifs: dict = {}
        deadline = time.monotonic() + 30
        while (state != "DONE" or not notifs) and time.monotonic() < deadline:
            if state != "DONE":
                state = agent1.check_xfer_state(handle)
                assert state != "ERR", handle.error
            if not notifs:
                notifs = agent2.get_new_notifs()
        assert state == "DONE" and notifs == {"EtcdAgent1": [b"notification"]}
        assert bytes(buf2[:8]) == b"b" * 8 and bytes(buf2[8:16]) == b"a" * 8 and bytes(buf2[16:]) == b"b" * 1008
        agent1.release_xfer_handle(handle)

        # agent2 withdraws its metadata: agent1, watching it, drops it
        agent2.invalidate_local_metadata()
        deadline = time.monotonic() + 15
        while agent1.check_remote_metadata("EtcdAgent2") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not agent1.check_remote_metadata("EtcdAgent2")

        agent1.deregister_memory(reg1, backends=["UCX"])
        agent2.deregister_memory(reg2, backends=["UCX"])
    finally:
        agent1.close()
        agent2.close()


def test_etcd_fetch_of_an_absent_agent_is_logged_and_counted(etcd_env, monkeypatch):
    monkeypatch.setattr(md, "FETCH_RETRY_S", 0.5)
    agent = nixl_agent("lonely", nixl_agent_config(backends=[]))
    try:
        agent.fetch_remote_metadata("nobody")  # returns at once, as NIXL's
        assert agent.agent.wait_metadata(10)
        assert agent.agent.metadata_failures == 1
        assert isinstance(agent.agent._worker.last_error, nx.nixlRemoteDisconnectError)
        assert not agent.check_remote_metadata("nobody")
    finally:
        agent.close()


def test_push_and_invalidate_at_a_listener_and_the_etcd_route_needs_endpoints(monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    agent = nixl_agent("pusher", nixl_agent_config(backends=[]))
    listener = nixl_agent("listener", nixl_agent_config(True, True, 0, backends=[]))
    try:
        port = listener.listen_port
        agent.send_local_metadata(HOST, port)
        until(lambda: listener.check_remote_metadata("pusher"))
        agent.invalidate_local_metadata(HOST, port)
        until(lambda: not listener.check_remote_metadata("pusher"))
        listener.close()
        # the peer is gone: NIXL's examples call this in teardown and rely on it not raising
        agent.send_local_metadata(HOST, port)
        agent.invalidate_local_metadata(HOST, port)
        # that listener was reached before: its refusal fails at once (as NIXL's sends), not after 10 s of retries
        assert agent.agent.wait_metadata(md.FETCH_RETRY_S / 2)
        assert agent.agent.metadata_failures == 2
        with pytest.raises(nx.nixlInvalidParamError):
            agent.send_local_metadata()
        with pytest.raises(nx.nixlInvalidParamError):
            agent.fetch_remote_metadata("target")
    finally:
        agent.close()


def test_a_push_to_a_listener_not_up_yet_is_retried_until_it_is():
    agent = nixl_agent("early", nixl_agent_config(backends=[]))
    held = socket.socket()  # the port, bound and not listening: a connect is refused until the listener takes it
    held.bind((HOST, 0))
    port = held.getsockname()[1]
    listener = None
    try:
        agent.send_local_metadata(HOST, port)
        assert not agent.agent.wait_metadata(0.3)  # refused and retrying, not failed
        held.close()
        listener = nixl_agent("late", nixl_agent_config(True, True, port, backends=[]))
        until(lambda: listener.check_remote_metadata("early"))
        assert agent.agent.wait_metadata(5) and agent.agent.metadata_failures == 0
    finally:
        held.close()
        agent.close()
        if listener is not None:
            listener.close()


def _partial_flow(target, init, exchange) -> None:
    """partial_md_example.py's flow: label 1's descriptors work, label 2's are not found until sent."""
    bufs = [np.full(256, i, dtype=np.uint8) for i in range(4)]
    mine = np.zeros(512, dtype=np.uint8)
    regs1 = target.get_reg_descs([(b.ctypes.data, 256, 0, "t") for b in bufs[:2]], "DRAM")
    regs2 = target.get_reg_descs([(b.ctypes.data, 256, 0, "t") for b in bufs[2:]], "DRAM")
    target.register_memory(regs1)
    target.register_memory(regs2)
    init.register_memory([(mine.ctypes.data, 512, 0, "")], "DRAM")
    local = init.get_xfer_descs([(mine.ctypes.data, 256, 0), (mine.ctypes.data + 256, 256, 0)], "DRAM")

    exchange(regs1, "label_1")
    until(lambda: init.check_remote_metadata("target", regs1.trim()))
    assert not init.check_remote_metadata("target", regs2.trim())
    h1 = init.initialize_xfer("READ", local, regs1.trim(), "target", b"UUID1")
    init.transfer(h1)
    until(lambda: init.check_xfer_state(h1) == "DONE")
    assert (mine[:256] == 0).all() and (mine[256:] == 1).all()
    with pytest.raises(nx.nixlNotFoundError):
        init.initialize_xfer("READ", local, regs2.trim(), "target", b"UUID2")

    exchange(regs2, "label_2")
    until(lambda: init.check_remote_metadata("target", regs2.trim()))
    assert init.check_remote_metadata("target", regs1.trim())  # merged, not replaced
    h2 = init.initialize_xfer("READ", local, regs2.trim(), "target", b"UUID2")
    init.transfer(h2)
    until(lambda: init.check_xfer_state(h2) == "DONE")
    assert (mine[:256] == 2).all() and (mine[256:] == 3).all()
    until(lambda: target.check_remote_xfer_done("initiator", b"UUID2"))


def test_partial_metadata_by_label_in_etcd(etcd_env):
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    with (
        nixl_agent("target", nixl_agent_config(backends=["UCX"])) as target,
        nixl_agent("initiator", nixl_agent_config(backends=["UCX"])) as init,
    ):

        def exchange(regs, label):
            target.send_partial_agent_metadata(regs, True, ["UCX"], label=label)
            init.fetch_remote_metadata("target", label=label)

        _partial_flow(target, init, exchange)
        target.invalidate_local_metadata()  # withdraws the labelled keys too
        assert target.agent.wait_metadata(10) and target.agent.metadata_failures == 0
        client = target.agent._labels["client"]
        assert not client.get_prefix(f"/{md.etcd_settings()[1]}/agents/target/")


def test_partial_metadata_pushed_to_a_listener():
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    with (
        nixl_agent("target", nixl_agent_config(True, True, 0)) as target,
        nixl_agent("initiator", nixl_agent_config(True, True, 0)) as init,
    ):

        def exchange(regs, label):  # with an address the label is ignored, as in NIXL
            target.send_partial_agent_metadata(regs, True, ["UCX"], HOST, init.listen_port, label)

        _partial_flow(target, init, exchange)
        blob = target.get_partial_agent_metadata(nx.nixlRegDList(nx.DRAM_SEG), False)  # NIXL: get_reg_descs([]) raises
        assert isinstance(blob, bytes)
