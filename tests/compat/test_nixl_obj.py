"""The NIXL facade's OBJ route: NIXL's OBJ plugin parameters and (offset, len, devId, key) rows over the s3 backend."""

from __future__ import annotations

import numpy as np
import pytest

from datamover.backends import backend_status
from datamover.compat import nixl as nx
from datamover.compat.nixl import nixl_agent, nixl_agent_config
from datamover.testing.s3server import S3Server

BUF = 64 << 10


@pytest.fixture(scope="module")
def server():
    ok, reason = S3Server.available()
    if not ok:
        pytest.skip(reason)
    ok, reason = backend_status("s3")
    if not ok:
        pytest.skip(reason)
    with S3Server(bucket="nixl-facade") as srv:
        yield srv


def wait_done(agent: nixl_agent, handle: nx.nixl_xfer_handle) -> str:
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    return state


def test_obj_write_and_read_by_devid(server):
    agent = nixl_agent("obj-client", nixl_agent_config(backends=[]))
    try:
        assert "OBJ" in agent.get_plugin_list()
        defaults = agent.get_plugin_params("OBJ")
        agent.create_backend(
            "OBJ",
            defaults
            | {
                "bucket": server.bucket,
                "endpoint_override": server.endpoint_url,
                "access_key": server.access_key,
                "secret_key": server.secret_key,
                "region": server.region,
                "use_virtual_addressing": "false",
                "num_threads": "4",
            },
        )
        params = agent.get_backend_params("OBJ")
        assert params["endpoint_url"] == server.endpoint_url and params["addressing_style"] == "path"
        assert params["concurrency"] == "4"  # NIXL's num_threads
        mapped = {"endpoint_url", "addressing_style", "access_key_id", "secret_access_key", "region", "concurrency"}
        assert {k: v for k, v in params.items() if k not in mapped} == {
            k: v for k, v in defaults.items() if k not in mapped
        }  # get_plugin_params() round-trips through create_backend()
        assert agent.get_backend_mem_types("OBJ") == ["DRAM_SEG", "OBJ_SEG"]

        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, 2 * BUF, dtype=np.uint8)
        dst = np.zeros(2 * BUF, dtype=np.uint8)
        s, d = src.ctypes.data, dst.ctypes.data
        agent.register_memory([(s, src.nbytes, 0, "src"), (d, dst.nbytes, 0, "dst")], "DRAM")
        # metaInfo names the object; without it the devId is the key, as in NIXL's OBJ plugin
        objs = agent.register_memory([(0, BUF, 7, "kv/block-7"), (0, BUF, 9, "")], "OBJ")

        local = agent.get_xfer_descs([(s, BUF, 0), (s + BUF, BUF, 0)], "DRAM")
        remote = agent.get_xfer_descs([(0, BUF, 7), (0, BUF, 9)], "OBJ")
        h = agent.initialize_xfer("WRITE", local, remote, agent.name)
        agent.transfer(h)
        assert wait_done(agent, h) == "DONE", h.error
        assert agent.query_xfer_backend(h) == "OBJ"
        client = server.client()
        assert client.get_object(Bucket=server.bucket, Key="kv/block-7")["Body"].read() == src[:BUF].tobytes()
        assert client.get_object(Bucket=server.bucket, Key="9")["Body"].read() == src[BUF:].tobytes()

        # read them back swapped, through prepared lists
        ol = agent.prep_xfer_dlist(agent.name, [(0, BUF, 7), (0, BUF, 9)], "OBJ")
        ml = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(d, BUF, 0), (d + BUF, BUF, 0)], "DRAM")
        h2 = agent.make_prepped_xfer("READ", ml, [0, 1], ol, [1, 0])
        agent.transfer(h2)
        assert wait_done(agent, h2) == "DONE", h2.error
        assert np.array_equal(dst[:BUF], src[BUF:]) and np.array_equal(dst[BUF:], src[:BUF])

        with pytest.raises(nx.nixlNotFoundError):  # a devId never registered
            agent.initialize_xfer("READ", local, agent.get_xfer_descs([(0, BUF, 8), (0, BUF, 9)], "OBJ"), agent.name)
        with pytest.raises(nx.nixlInvalidParamError):  # one devId, two keys
            agent.register_memory([(0, BUF, 7, "other-key")], "OBJ")
        for x in (h, h2):
            agent.release_xfer_handle(x)
        agent.deregister_memory(objs)
        with pytest.raises(nx.nixlNotFoundError):
            agent.initialize_xfer("WRITE", local, remote, agent.name)
    finally:
        agent.close()
