"""NIXL's two-peer examples' teardown: the initiator invalidates its metadata at a target that has already exited.

As basic_two_peers.py: the target serves its metadata, sends its descriptors as a
notification, waits for "Done_reading" and exits; the initiator READs, checks the
data, then tears down with remove_remote_agent / invalidate_local_metadata /
send_local_metadata towards the dead listener. The fault is injected at a known
point: the parent lets the initiator tear down only after the target process has
exited. NIXL queues these calls to a background thread and returns; so must we,
with the failures logged and counted, and the initiator exiting 0.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

from datamover.backends import backend_status

HOST = "127.0.0.1"
DEADLINE_S = 60.0


def _until(pred, what: str):
    end = time.monotonic() + DEADLINE_S
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.001)


def target(ports, errors) -> None:
    try:
        import numpy as np

        from datamover.compat.nixl import nixl_agent, nixl_agent_config

        # any free port, told to the initiator: a port picked free beforehand can be taken by then (suites
        # side by side: "Address already in use", the initiator talking to whatever took it)
        agent = nixl_agent("target", nixl_agent_config(True, True, 0))
        ports.put(agent.listen_port)
        rows = np.ones((10, 16), dtype=np.float32)
        reg = agent.register_memory(agent.get_reg_descs([(rows.ctypes.data, rows.nbytes, 0, "")], "DRAM"))
        descs = agent.get_xfer_descs([(rows[i].ctypes.data, rows[i].nbytes, 0) for i in range(10)], "DRAM")
        _until(lambda: agent.check_remote_metadata("initiator"), "the initiator's metadata")
        agent.send_notif("initiator", agent.get_serialized_descs(descs))
        _until(lambda: b"Done_reading" in agent.get_new_notifs().get("initiator", []), "Done_reading")
        agent.deregister_memory(reg)
        # exits without waiting: the initiator's teardown reaches a closed listener
    except BaseException:
        errors.put(("target", traceback.format_exc()))
        raise


def initiator(ports, target_gone, results, errors) -> None:
    try:
        import numpy as np

        from datamover.compat.nixl import nixl_agent, nixl_agent_config

        agent = nixl_agent("initiator", nixl_agent_config(True, True, 0))
        port = ports.get(timeout=DEADLINE_S)
        rows = np.zeros((10, 16), dtype=np.float32)
        reg = agent.register_memory(agent.get_reg_descs([(rows.ctypes.data, rows.nbytes, 0, "")], "DRAM"))
        agent.fetch_remote_metadata("target", HOST, port)
        agent.send_local_metadata(HOST, port)
        notifs: dict = {}
        _until(lambda: notifs.update(agent.get_new_notifs()) or "target" in notifs, "the target's descriptors")
        remote = agent.deserialize_descs(notifs["target"][0])
        local = agent.get_xfer_descs([(rows[i].ctypes.data, rows[i].nbytes, 0) for i in range(10)], "DRAM")
        _until(lambda: agent.check_remote_metadata("target"), "the target's metadata")
        h = agent.initialize_xfer("READ", local, remote, "target", "Done_reading")
        assert agent.transfer(h) in ("DONE", "PROC")  # a failure raises
        _until(lambda: agent.check_xfer_state(h) == "DONE", "the READ")
        assert (rows == 1).all(), "data read is wrong"

        assert target_gone.wait(DEADLINE_S), "the target never exited"
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(h)
        agent.invalidate_local_metadata(HOST, port)  # the target is gone: must not raise
        agent.send_local_metadata(HOST, port)
        agent.deregister_memory(reg)
        assert agent.agent.wait_metadata(DEADLINE_S)
        results.put(("failures", agent.agent.metadata_failures))
    except BaseException:
        errors.put(("initiator", traceback.format_exc()))
        raise


@pytest.mark.parametrize("round_", range(3))
def test_teardown_after_the_peer_exited(round_):
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    ctx = mp.get_context("spawn")
    errors, results, gone, ports = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Queue()
    t = ctx.Process(target=target, args=(ports, errors))
    t.start()
    i = ctx.Process(target=initiator, args=(ports, gone, results, errors))
    i.start()
    t.join(DEADLINE_S)
    gone.set()
    i.join(DEADLINE_S)
    for p in (t, i):
        if p.is_alive():
            p.kill()
    failures = [] if errors.empty() else [errors.get() for _ in range(errors.qsize())]
    assert not failures, failures
    assert t.exitcode == 0 and i.exitcode == 0
    # the fetch, the first push, and the READ's notification reached the target; the invalidation and the
    # second push after its exit failed on the background thread, each logged and counted
    assert results.get(timeout=5) == ("failures", 2)
