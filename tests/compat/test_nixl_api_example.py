"""NIXL's nixl_api_example.py through the facade: two agents in one process over UCX.

The calls and their order are the example's; NIXL's ``malloc_passthru``
buffers are numpy arrays here, and the example's asserts check the bytes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from datamover.backends import backend_status
from datamover.compat.nixl import nixl_agent, nixl_agent_config

BUF_SIZE = 256


def wait_for_transfer_completion(initiator, target, handle, uid: bytes, timeout: float = 30.0) -> None:
    """NIXL's util.wait_for_transfer_completion: initiator DONE and the target's notification."""
    init_done = target_done = False
    deadline = time.monotonic() + timeout
    while not (init_done and target_done):
        assert time.monotonic() < deadline, "transfer did not complete"
        if not init_done:
            state = initiator.check_xfer_state(handle)
            assert state != "ERR", handle.error
            init_done = state == "DONE"
        if not target_done:
            target_done = target.check_remote_xfer_done("initiator", uid)


def test_nixl_api_example():
    ok, reason = backend_status("ucx")
    if not ok:
        pytest.skip(f"ucx backend unavailable: {reason}")
    agent_config = nixl_agent_config(backends=["UCX"])
    nixl_agent1 = nixl_agent("target", agent_config)
    nixl_agent2 = nixl_agent("initiator", None)
    try:
        assert "UCX" in nixl_agent1.get_plugin_list()
        assert nixl_agent1.get_plugin_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
        assert nixl_agent1.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]

        mem1 = np.arange(BUF_SIZE * 2, dtype=np.uint32).astype(np.uint8)
        addr1 = mem1.ctypes.data
        addr2 = addr1 + BUF_SIZE
        agent1_addrs = [(addr1, BUF_SIZE, 0), (addr2, BUF_SIZE, 0)]
        agent1_strings = [(addr1, BUF_SIZE, 0, "a"), (addr2, BUF_SIZE, 0, "b")]
        agent1_reg_descs = nixl_agent1.get_reg_descs(agent1_strings, "DRAM")
        agent1_xfer_descs = nixl_agent1.get_xfer_descs(agent1_addrs, "DRAM")
        agent1_addrs_np = np.array(agent1_addrs)
        assert agent1_xfer_descs == nixl_agent1.get_xfer_descs(agent1_addrs_np, "DRAM")
        assert agent1_reg_descs.trim() == nixl_agent1.get_reg_descs(agent1_addrs_np, "DRAM").trim()
        assert nixl_agent1.register_memory(agent1_reg_descs) is not None

        mem2 = np.zeros(BUF_SIZE * 2, dtype=np.uint8)
        addr3 = mem2.ctypes.data
        addr4 = addr3 + BUF_SIZE
        agent2_addrs = [(addr3, BUF_SIZE, 0), (addr4, BUF_SIZE, 0)]
        agent2_strings = [(addr3, BUF_SIZE, 0, "a"), (addr4, BUF_SIZE, 0, "b")]
        agent2_reg_descs = nixl_agent2.get_reg_descs(agent2_strings, "DRAM")
        agent2_xfer_descs = nixl_agent2.get_xfer_descs(agent2_addrs, "DRAM")
        assert nixl_agent2.register_memory(agent2_reg_descs) is not None

        meta = nixl_agent1.get_agent_metadata()
        remote_name = nixl_agent2.add_remote_agent(meta)
        assert remote_name == b"target"

        serdes = nixl_agent1.get_serialized_descs(agent1_reg_descs)
        assert nixl_agent2.deserialize_descs(serdes) == agent1_reg_descs

        # initialize transfer mode, posted twice
        xfer_handle_1 = nixl_agent2.initialize_xfer("READ", agent2_xfer_descs, agent1_xfer_descs, remote_name, b"UUID1")
        for _ in range(2):
            mem2[:] = 0
            assert nixl_agent2.transfer(xfer_handle_1) != "ERR"
            wait_for_transfer_completion(nixl_agent2, nixl_agent1, xfer_handle_1, b"UUID1")
            assert np.array_equal(mem2, mem1)

        # prep transfer mode
        local_prep_handle = nixl_agent2.prep_xfer_dlist("NIXL_INIT_AGENT", agent2_addrs, "DRAM")
        remote_prep_handle = nixl_agent2.prep_xfer_dlist(remote_name, agent1_xfer_descs, "DRAM")
        assert local_prep_handle != 0 and remote_prep_handle != 0

        test_notif = b"DESCS: " + serdes
        nixl_agent2.send_notif(remote_name, test_notif)
        deadline = time.monotonic() + 30
        notif_recv = False
        while not notif_recv:
            assert time.monotonic() < deadline, "notification did not arrive"
            notif_map = nixl_agent1.get_new_notifs()
            notif_recv = test_notif in notif_map.get("initiator", [])

        # WRITE the initiator's two blocks into the target's, swapped
        mem2[:BUF_SIZE], mem2[BUF_SIZE:] = 7, 9
        xfer_handle_2 = nixl_agent2.make_prepped_xfer(
            "WRITE", local_prep_handle, [0, 1], remote_prep_handle, [1, 0], b"UUID2"
        )
        assert nixl_agent2.transfer(xfer_handle_2) != "ERR"
        wait_for_transfer_completion(nixl_agent2, nixl_agent1, xfer_handle_2, b"UUID2")
        assert (mem1[:BUF_SIZE] == 9).all() and (mem1[BUF_SIZE:] == 7).all()

        nixl_agent2.release_xfer_handle(xfer_handle_1)
        nixl_agent2.release_xfer_handle(xfer_handle_2)
        nixl_agent2.release_dlist_handle(local_prep_handle)
        nixl_agent2.release_dlist_handle(remote_prep_handle)
        nixl_agent2.remove_remote_agent("target")
        nixl_agent1.deregister_memory(agent1_reg_descs)
        nixl_agent2.deregister_memory(agent2_reg_descs)
    finally:
        nixl_agent1.close()
        nixl_agent2.close()
