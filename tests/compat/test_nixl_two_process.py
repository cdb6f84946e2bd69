"""Two processes through the NIXL facade over UCX, written the way NIXL's Python examples are.

As in NIXL's blocking_send_recv_example.py: a target holds buffers of known
values and serves its metadata on a listen port; the initiator fetches it,
receives the target's descriptors as a serialized notification, READs them
with a completion notification, verifies the data and tears down. The
second round does the same with prepared lists and int32 index arrays
(nixl_api_2proc.py's prep mode), reading the blocks swapped. Buffers are
numpy arrays described by (addr, len, devId[, meta]) tuples as in
nixl_api_2proc.py (torch would add seconds of import time to each process).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest

from datamover.backends import backend_status

HOST = "127.0.0.1"
DEADLINE_S = 60.0
BUF_ITEMS = 64 << 10  # float32: 256 KiB per buffer


def _until(pred, what: str, timeout: float = DEADLINE_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.001)
    raise TimeoutError(f"timed out waiting for {what}")


def target_process(ports, errors) -> None:
    try:
        import numpy as np

        from datamover.compat.nixl import nixl_agent, nixl_agent_config

        # any free port, told to the initiator: a port picked free beforehand can be taken by then
        config = nixl_agent_config(True, True, 0)
        agent = nixl_agent("target", config)
        ports.put(agent.listen_port)
        bufs = [np.full(BUF_ITEMS, i + 1, dtype=np.float32) for i in range(2)]
        strings = [(b.ctypes.data, b.nbytes, 0, name) for b, name in zip(bufs, ("a", "b"))]
        reg_descs = agent.register_memory(agent.get_reg_descs(strings, "DRAM"))
        target_descs = reg_descs.trim()
        target_desc_str = agent.get_serialized_descs(target_descs)

        # the initiator pushes its metadata to this listener with send_local_metadata(ip, port)
        _until(lambda: agent.check_remote_metadata("initiator"), "the initiator's metadata")
        agent.send_notif("initiator", target_desc_str)

        _until(lambda: agent.check_remote_xfer_done("initiator", b"UUID1"), "UUID1")
        _until(lambda: agent.check_remote_xfer_done("initiator", b"UUID2"), "UUID2")
        # the initiator reads only: the target's buffers are untouched
        for i, b in enumerate(bufs):
            assert (b == i + 1).all(), f"target buffer {i} changed"
        _until(lambda: agent.check_remote_xfer_done("initiator", b"BYE"), "the initiator's goodbye")
        _until(lambda: not agent.check_remote_metadata("initiator"), "the initiator's invalidation")
        agent.deregister_memory(reg_descs)
        agent.close()
    except BaseException:
        errors.put(("target", traceback.format_exc()))
        raise


def initiator_process(ports, errors) -> None:
    try:
        import numpy as np

        from datamover.compat.nixl import nixl_agent, nixl_agent_config

        config = nixl_agent_config(True, True, 0)
        agent = nixl_agent("initiator", config)
        target_port = ports.get(timeout=DEADLINE_S)
        bufs = [np.zeros(BUF_ITEMS, dtype=np.float32) for _ in range(2)]
        reg_descs = agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")

        agent.fetch_remote_metadata("target", HOST, target_port)
        agent.send_local_metadata(HOST, target_port)
        notifs = _until(lambda: agent.get_new_notifs(), "the target's descriptors")
        target_descs = agent.deserialize_descs(notifs["target"][0])
        initiator_descs = reg_descs.trim()
        _until(lambda: agent.check_remote_metadata("target"), "the target's metadata")

        # round 1: initialize_xfer + transfer + check_xfer_state, completion notification UUID1
        xfer_handle = agent.initialize_xfer("READ", initiator_descs, target_descs, "target", "UUID1")
        state = agent.transfer(xfer_handle)
        assert state != "ERR", "posting transfer failed"
        while True:
            state = agent.check_xfer_state(xfer_handle)
            assert state != "ERR", f"transfer got to error state: {xfer_handle.error!r}"
            if state == "DONE":
                break
        for i, b in enumerate(bufs):
            assert (b == i + 1).all(), f"round 1: buffer {i} differs"

        # round 2: prepared lists and index arrays, the target's blocks read swapped, notification UUID2
        for b in bufs:
            b[:] = 0
        local_prep = agent.prep_xfer_dlist("NIXL_INIT_AGENT", initiator_descs)
        remote_prep = agent.prep_xfer_dlist("target", target_descs)
        local_idx, remote_idx = np.array([0, 1], dtype=np.int32), np.array([1, 0], dtype=np.int32)
        xfer_handle_2 = agent.make_prepped_xfer("READ", local_prep, local_idx, remote_prep, remote_idx, b"UUID2")
        assert agent.transfer(xfer_handle_2) in ("DONE", "PROC")  # a failure raises
        while (state := agent.check_xfer_state(xfer_handle_2)) == "PROC":
            pass
        assert state == "DONE", f"prepped transfer ended {state}: {xfer_handle_2.error!r}"
        assert (bufs[0] == 2).all() and (bufs[1] == 1).all(), "round 2: blocks not swapped"

        backend = agent.query_xfer_backend(xfer_handle_2)
        assert backend == "UCX", backend

        agent.send_notif("target", b"BYE")
        agent.invalidate_local_metadata(HOST, target_port)
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(xfer_handle)
        agent.release_xfer_handle(xfer_handle_2)
        agent.release_dlist_handle(local_prep)
        agent.release_dlist_handle(remote_prep)
        agent.deregister_memory(reg_descs)
        agent.close()
    except BaseException:
        errors.put(("initiator", traceback.format_exc()))
        raise


def test_read_with_notifications_across_processes():
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    ctx = mp.get_context("spawn")
    errors, ports = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=target_process, args=(ports, errors), name="target"),
        ctx.Process(target=initiator_process, args=(ports, errors), name="initiator"),
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S + 30
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    reports = []
    while not errors.empty():
        who, tb = errors.get()
        reports.append(f"{who}:\n{tb}")
    assert not stuck, f"processes did not finish: {stuck}; {reports}"
    assert not reports, "\n".join(reports)
    assert [p.exitcode for p in procs] == [0, 0]
