"""The NIXL facade in one process: memcpy (DRAM -> DRAM) and posix (DRAM <-> FILE), loopback transfers."""

from __future__ import annotations

import gc
import os
import pickle

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from datamover.compat import nixl as nx
from datamover.compat.nixl import nixl_agent, nixl_agent_config
from datamover.errors import LengthMismatch, NotRegistered, TransferIOError

BUF = 4096


def wait_done(agent: nixl_agent, handle: nx.nixl_xfer_handle, spins: int = 2_000_000) -> str:
    for _ in range(spins):
        state = agent.check_xfer_state(handle)
        if state != "PROC":
            return state
    raise AssertionError("transfer stayed in PROC")


@pytest.fixture
def agent():
    a = nixl_agent("initiator", nixl_agent_config(backends=["POSIX"]))
    yield a
    a.close()


@pytest.fixture
def bufs():
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 4 * BUF, dtype=np.uint8)
    dst = np.zeros(4 * BUF, dtype=np.uint8)
    return src, dst


def addr(a: np.ndarray, off: int = 0) -> int:
    return a.ctypes.data + off


# -- config, plugins, backends ---------------------------------------------------


def test_config_defaults_match_nixl():
    c = nixl_agent_config()
    assert (c.enable_pthread, c.enable_listen, c.port, c.capture_telemetry, c.num_threads, c.backends) == (
        True,
        False,
        nx.DEFAULT_COMM_PORT,
        False,
        0,
        ["UCX"],
    )
    assert nx.DEFAULT_COMM_PORT == 8888
    c = nixl_agent_config(True, True, 5555)  # positional order as in NIXL's examples
    assert (c.enable_listen, c.port) == (True, 5555)
    with pytest.raises(TypeError):
        nixl_agent_config(sync_mode="strict")


def test_name_mapping():
    assert [nx.datamover_backend_name(n) for n in ("UCX", "POSIX", "GDS", "GDS_MT", "OBJ", "memcpy", "cuda")] == [
        "ucx",
        "posix",
        "gds",
        "gds",
        "s3",
        "memcpy",
        "cuda",
    ]
    assert nx.nixl_plugin_names("gds") == ("GDS", "GDS_MT")
    assert nx.datamover_backend_name("thirdparty") == "thirdparty"


def test_plugins_and_backends(agent):
    plugins = agent.get_plugin_list()
    assert "memcpy" in plugins and "POSIX" in plugins
    assert agent.get_plugin_mem_types("POSIX") == ["DRAM_SEG", "FILE_SEG"]
    assert agent.get_plugin_mem_types("memcpy") == ["DRAM_SEG"]
    assert agent.get_plugin_params("POSIX")["direct"] == "true"
    assert list(agent.backends) == ["POSIX"]
    assert agent.get_backend_mem_types("POSIX") == ["DRAM_SEG", "FILE_SEG"]
    assert agent.get_backend_params("POSIX")["threads"] == "4"
    # not available / not created: NIXL warns and returns empty
    assert agent.get_plugin_mem_types("NOPE") == [] and agent.get_plugin_params("NOPE") == {}
    assert agent.get_backend_mem_types("memcpy") == [] and agent.get_backend_params("memcpy") == {}
    with pytest.raises(nx.nixlNotFoundError):
        agent.create_backend("NOPE")
    with pytest.raises(nx.nixlInvalidParamError):
        agent.create_backend("POSIX")


def test_create_backend_takes_nixl_string_params():
    a = nixl_agent("params", nixl_agent_config(backends=[]))
    try:
        assert a.backends == {}
        params = a.get_plugin_params("memcpy")
        params["threads"] = "2"
        params["some_ucx_only_knob"] = "1"  # unknown: ignored with a warning, as NIXL plugins do
        a.create_backend("memcpy", params)
        assert a.get_backend_params("memcpy")["threads"] == "2"
        with pytest.raises(nx.nixlInvalidParamError):
            a.create_backend("POSIX", {"threads": "many"})
    finally:
        a.close()


def test_num_threads_goes_where_nixl_sends_it():
    # NIXL hands num_threads to UCX, OBJ, LIBFABRIC (num_threads), GDS_MT (thread_count), UCCL; not to POSIX
    a = nixl_agent("threads", nixl_agent_config(backends=["POSIX"], num_threads=3))
    try:
        default = a.get_plugin_params("POSIX")["threads"]
        assert a.get_backend_params("POSIX")["threads"] == default != "3"
        assert a.get_backend_mem_types("POSIX") == ["DRAM_SEG", "FILE_SEG"]  # NIXL's names
    finally:
        a.close()


def test_missing_plugin_in_config_is_skipped():
    a = nixl_agent("skip", nixl_agent_config(backends=["NOT_A_PLUGIN", "POSIX"]))
    try:
        assert list(a.backends) == ["POSIX"]
    finally:
        a.close()


def test_instantiate_all():
    a = nixl_agent("all", None, instantiate_all=True)
    try:
        assert set(a.backends) == set(a.get_plugin_list())
    finally:
        a.close()


# -- descriptor lists in every accepted form ---------------------------------------


def test_xfer_descs_from_every_form(agent, bufs):
    src, _ = bufs
    tuples = [(addr(src), BUF, 0), (addr(src, BUF), BUF, 0)]
    from_tuples = agent.get_xfer_descs(tuples, "DRAM")
    from_array = agent.get_xfer_descs(np.array(tuples, dtype=np.uint64), "DRAM")
    from_int64 = agent.get_xfer_descs(np.array(tuples), "cpu")
    assert from_tuples == from_array == from_int64
    assert from_tuples.descCount() == 2 and not from_tuples.isEmpty()
    assert from_tuples.getType() == nx.DRAM_SEG
    assert from_tuples[1] == (addr(src, BUF), BUF, 0)
    assert agent.get_xfer_descs(from_tuples) is from_tuples

    t = torch.arange(256, dtype=torch.float32)
    one = agent.get_xfer_descs(t)
    assert list(one) == [(t.data_ptr(), 1024, 0)]
    ts = [torch.zeros(10), torch.ones(20, dtype=torch.float64)]
    many = agent.get_xfer_descs(ts)
    assert list(many) == [(ts[0].data_ptr(), 40, 0), (ts[1].data_ptr(), 160, 0)]
    assert many.getType() == nx.DRAM_SEG


def test_reg_descs_from_every_form(agent, bufs):
    src, _ = bufs
    four = agent.get_reg_descs([(addr(src), BUF, 0, "a"), (addr(src, BUF), BUF, 0, b"b")], "DRAM")
    assert four[0] == (addr(src), BUF, 0, b"a") and four.meta == (b"a", b"b")
    three = agent.get_reg_descs(np.array([(addr(src), BUF, 0), (addr(src, BUF), BUF, 0)]), "DRAM")
    assert three.meta == (b"", b"")
    assert three.trim() == four.trim()
    assert three != four  # metaInfo differs
    t = torch.zeros(8)
    assert list(agent.get_reg_descs(t)) == [(t.data_ptr(), 32, 0, b"")]
    assert agent.get_reg_descs([t, torch.ones(4)]).descCount() == 2


def test_list_methods(bufs):
    src, _ = bufs
    lst = nx.nixlXferDList(nx.DRAM_SEG, [(addr(src), 8, 0)])
    lst.append((addr(src, 8), 8, 0))
    lst.addDesc((addr(src, 16), 8, 0))
    assert len(lst) == 3 and lst.index((addr(src, 8), 8, 0)) == 1
    lst[0] = (addr(src, 24), 8, 0)
    lst.remDesc(1)
    assert list(lst) == [(addr(src, 24), 8, 0), (addr(src, 16), 8, 0)]
    with pytest.raises(nx.nixlNotFoundError):
        lst.index((1, 2, 3))
    lst.clear()
    assert lst.isEmpty() and bool(lst)  # NIXL's lists are truthy even when empty
    reg = nx.nixlRegDList("DRAM", [(100, 8, 0, "x")])
    reg.append((200, 8, 0, "y"))
    assert reg.index((200, 8, 0, "y")) == 1
    assert list(nx.nixlRegDList(nx.FILE_SEG, 2)) == [(0, 0, 0, b"")] * 2  # NIXL's init_size: zero descriptors
    assert pickle.loads(pickle.dumps(reg)) == reg


@pytest.mark.parametrize(
    ("descs", "mem_type"),
    [
        ([(1, 2, 0)], None),  # a tuple list needs a memory type
        ([(1, 2)], "DRAM"),
        ([(1, 2, 0, "m")], "DRAM"),  # 4-tuples are for registration
        (np.zeros((2, 4), dtype=np.int64), "DRAM"),
        ("not descriptors", "DRAM"),
    ],
)
def test_bad_xfer_descs_give_none_as_nixl(agent, descs, mem_type):
    # NIXL 1.5.1 logs an error and returns None for these (checked against its wheel)
    assert agent.get_xfer_descs(descs, mem_type) is None


@pytest.mark.parametrize(
    ("descs", "mem_type", "err"),
    [
        ([(1, 2, 0), (1, 2)], "DRAM", ValueError),  # NIXL's binding: "Each descriptor tuple must have exactly 3"
        ([(-1, 2, 0)], "DRAM", nx.nixlInvalidParamError),  # NIXL: RuntimeError from pybind's cast
        ([(2**64, 2, 0)], "DRAM", nx.nixlInvalidParamError),
        (np.zeros((2, 3), dtype=np.float64), "DRAM", nx.nixlInvalidParamError),  # NIXL: ValueError
        ([(1, 2, 0)], "BLOCK", nx.nixlNotSupportedError),  # datamover has no BLOCK memory
        ([(1, 2, 0)], "HBM3", KeyError),  # NIXL looks the name up in nixl_mems
    ],
)
def test_bad_xfer_descs_raise(agent, descs, mem_type, err):
    with pytest.raises(err):
        agent.get_xfer_descs(descs, mem_type)


def test_reg_and_xfer_lists_are_not_interchangeable(agent):
    reg = agent.get_reg_descs([(1, 2, 0, "")], "DRAM")
    assert agent.get_xfer_descs(reg) is None
    assert agent.get_reg_descs(reg.trim()) is None


def test_non_contiguous_tensor_gives_none(agent):
    t = torch.zeros(8, 8).t()
    assert agent.get_xfer_descs(t) is None
    assert agent.get_reg_descs([torch.zeros(4), t]) is None


# -- serialization -------------------------------------------------------------------


def test_serialize_round_trip(agent, bufs):
    src, _ = bufs
    reg = agent.get_reg_descs([(addr(src), BUF, 0, "a"), (addr(src, BUF), BUF, 0, "b")], "DRAM")
    blob = agent.get_serialized_descs(reg)
    assert isinstance(blob, bytes)
    back = agent.deserialize_descs(blob)
    assert isinstance(back, nx.nixlRegDList) and back == reg
    x = reg.trim()
    back = agent.deserialize_descs(agent.get_serialized_descs(x))
    assert isinstance(back, nx.nixlXferDList) and back == x
    empty = nx.nixlXferDList("VRAM")
    assert agent.deserialize_descs(agent.get_serialized_descs(empty)) == empty


rows_st = st.lists(
    st.tuples(st.integers(0, 2**62), st.integers(0, 2**30), st.integers(0, 2**20)), min_size=0, max_size=50
)


@given(rows=rows_st, mem=st.sampled_from(["DRAM", "VRAM", "FILE", "OBJ"]), meta=st.binary(max_size=40))
def test_serialize_round_trip_property(rows, mem, meta):
    x = nx.nixlXferDList(mem, rows)
    assert nx.deserialize_dlist(nx.serialize_dlist(x)) == x
    r = nx.nixlRegDList(mem, [(*row, meta) for row in rows])
    back = nx.deserialize_dlist(nx.serialize_dlist(r))
    assert back == r and back.meta == (meta,) * len(rows)


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/datamover-nixl-pwned",))


@pytest.mark.parametrize(
    "blob",
    [
        pickle.dumps(_Boom()),  # what a pickle-based deserializer would execute
        b"",
        b"\x81",  # truncated map
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": 2, "kind": "xfer", "mem": "DRAM", "rows": b""}),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": 1, "kind": "xfer", "mem": "DRAM", "rows": b"\0" * 23}),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": 1, "kind": "xfer", "mem": "HBM", "rows": b""}),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": 1, "kind": "xfer", "mem": "DRAM", "rows": "text"}),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": 1, "kind": "xfer", "mem": "DRAM", "rows": b"", "extra": 1}),
        msgpack.packb(
            {"tag": "datamover.nixl.dlist", "v": 1, "kind": "reg", "mem": "DRAM", "rows": b"\0" * 24, "meta": []}
        ),
        msgpack.packb(
            {
                "tag": "datamover.nixl.dlist",
                "v": 1,
                "kind": "xfer",
                "mem": "DRAM",
                "rows": np.array([[-1, 8, 0]], dtype="<i8").tobytes(),
            }
        ),
        msgpack.packb({"tag": "datamover.nixl.dlist", "v": True, "kind": "xfer", "mem": "DRAM", "rows": b""}),
        msgpack.packb(msgpack.ExtType(1, b"x")),
    ],
)
def test_hostile_serialized_blob_refused(blob):
    marker = "/tmp/datamover-nixl-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    with pytest.raises(nx.nixlInvalidParamError):
        nx.deserialize_dlist(blob)
    assert not os.path.exists(marker)


def test_serialize_refuses_other_objects(agent):
    with pytest.raises(nx.nixlInvalidParamError):
        agent.get_serialized_descs([(1, 2, 0)])


# -- transfers through memcpy ----------------------------------------------------------


def test_initialize_xfer_write_and_read_loopback(agent, bufs):
    src, dst = bufs
    reg = agent.register_memory([(addr(src), src.nbytes, 0, "src"), (addr(dst), dst.nbytes, 0, "dst")], "DRAM")
    assert isinstance(reg, nx.nixlRegDList)
    local = agent.get_xfer_descs([(addr(src), BUF, 0), (addr(src, BUF), BUF, 0)], "DRAM")
    remote = agent.get_xfer_descs([(addr(dst, 2 * BUF), BUF, 0), (addr(dst), BUF, 0)], "DRAM")
    h = agent.initialize_xfer("WRITE", local, remote, "initiator", b"UUID1")
    assert agent.transfer(h) in ("DONE", "PROC")
    assert wait_done(agent, h) == "DONE"
    assert np.array_equal(dst[2 * BUF : 3 * BUF], src[:BUF]) and np.array_equal(dst[:BUF], src[BUF : 2 * BUF])
    with pytest.raises(nx.nixlNotFoundError):  # datamover's memcpy moved it; no created backend moves DRAM -> DRAM
        agent.query_xfer_backend(h)
    assert agent.check_remote_xfer_done("initiator", b"UUID")  # loopback notification, by prefix

    # READ pulls "remote" (here: our own) memory into the local descriptors
    dst[:] = 0
    back = agent.get_xfer_descs([(addr(dst, 3 * BUF), BUF, 0)], "DRAM")
    h2 = agent.initialize_xfer("READ", back, agent.get_xfer_descs([(addr(src, 3 * BUF), BUF, 0)], "DRAM"), "initiator")
    agent.transfer(h2)
    assert wait_done(agent, h2) == "DONE"
    assert np.array_equal(dst[3 * BUF :], src[3 * BUF :]) and not dst[: 3 * BUF].any()

    # reposting a finished handle moves the bytes again; a new notif_msg replaces the old one
    dst[:] = 0
    agent.transfer(h, b"UUID2")
    assert wait_done(agent, h) == "DONE"
    assert np.array_equal(dst[:BUF], src[BUF : 2 * BUF])
    assert agent.get_new_notifs() == {"initiator": [b"UUID2"]}
    agent.release_xfer_handle(h)
    agent.release_xfer_handle(h2)
    agent.deregister_memory(reg)


def test_query_backend_and_cost_answer_as_nixl(bufs):
    # DRAM -> DRAM in one agent runs on datamover's memcpy, but the answer is the created backend that moves
    # those memory types (NIXL's UCX does loopback itself); the cost method is one NIXL's _api can give
    src, dst = bufs
    a = nixl_agent("query", nixl_agent_config(backends=["UCX"]))
    try:
        a.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
        local = a.get_xfer_descs([(addr(src), BUF, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", local, a.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), a.name)
        assert a.query_xfer_backend(h) == "UCX"
        assert a.estimate_xfer_cost(h) == (0, 0, "UNKNOWN")
        for _ in range(3):
            a.transfer(h)
            assert wait_done(a, h) == "DONE"
        duration, margin, method = a.estimate_xfer_cost(h)
        assert method == "ANALYTICAL_BACKEND" and duration > 0 and margin >= 0
    finally:
        a.close()


def test_torch_tensors_through_the_facade(agent):
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(1000, dtype=torch.float32)
    reg = agent.register_memory([src, dst])
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src), agent.get_xfer_descs(dst), agent.name)
    agent.transfer(h)
    assert wait_done(agent, h) == "DONE"
    assert torch.equal(src, dst)
    agent.release_xfer_handle(h)
    agent.deregister_memory(reg)


@pytest.mark.parametrize("index_kind", ["list", "int32", "uint32", "int64"])
def test_prepped_xfer_with_index_lists_and_arrays(agent, bufs, index_kind):
    src, dst = bufs
    agent.register_memory(np.array([(addr(src), src.nbytes, 0), (addr(dst), dst.nbytes, 0)]), "DRAM")
    blocks = [(addr(src, i * BUF), BUF, 0) for i in range(4)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, "DRAM")
    remote = agent.prep_xfer_dlist(agent.name, np.array([(addr(dst, i * BUF), BUF, 0) for i in range(4)]), "DRAM")
    li, ri = [0, 1, 3], [3, 2, 0]
    if index_kind != "list":
        li, ri = np.array(li, dtype=index_kind), np.array(ri, dtype=index_kind)
    h = agent.make_prepped_xfer("WRITE", local, li, remote, ri, b"done")
    assert agent.transfer(h) in ("DONE", "PROC")
    assert wait_done(agent, h) == "DONE"
    assert np.array_equal(dst[3 * BUF :], src[:BUF])
    assert np.array_equal(dst[2 * BUF : 3 * BUF], src[BUF : 2 * BUF])
    assert np.array_equal(dst[:BUF], src[3 * BUF :])
    assert not dst[BUF : 2 * BUF].any()
    assert agent.check_remote_xfer_done(agent.name, b"done", tag_is_prefix=False)
    assert not agent.check_remote_xfer_done(agent.name, b"done")  # found notifications are consumed
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    with pytest.raises(nx.nixlNotAllowedError):
        agent.make_prepped_xfer("WRITE", local, [0], remote, [0])


def test_requests_nixl_refuses_are_refused(agent, bufs):
    src, dst = bufs
    agent.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src), BUF, 0)], "DRAM")
    loop = agent.prep_xfer_dlist(agent.name, [(addr(dst), BUF, 0)], "DRAM")
    with pytest.raises(nx.nixlInvalidParamError):  # sides swapped
        agent.make_prepped_xfer("WRITE", loop, [0], local, [0])
    with pytest.raises(nx.nixlInvalidParamError):
        agent.make_prepped_xfer("WRITE", local, [], loop, [])
    d = agent.get_xfer_descs([(addr(src), BUF, 0)], "DRAM")
    with pytest.raises(nx.nixlNotFoundError):  # NIXL_INIT_AGENT names no agent
        agent.initialize_xfer("WRITE", d, agent.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), "NIXL_INIT_AGENT")
    other = nixl_agent("peer", nixl_agent_config(backends=[]))
    try:
        other.register_memory([(addr(dst), BUF, 0, "")], "DRAM")
        agent.add_remote_agent(other.get_agent_metadata())
        remote = agent.prep_xfer_dlist("peer", [(addr(dst), BUF, 0)], "DRAM")
        agent.release_xfer_handle(agent.make_prepped_xfer("WRITE", local, [0], remote, [0]))
        agent.remove_remote_agent("peer")
        with pytest.raises(nx.nixlNotFoundError):  # prepared for a peer removed since
            agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
    finally:
        other.close()
    h = agent.make_prepped_xfer("WRITE", local, [0], loop, [0])  # the right way round still works
    agent.transfer(h)
    assert wait_done(agent, h) == "DONE" and np.array_equal(dst[:BUF], src[:BUF])


@pytest.mark.parametrize("indices", [[0.9, 2.7], np.array([1.5, 3.99]), ["1", "2"], [[0, 1]]], ids=repr)
def test_prepped_xfer_refuses_indices_that_are_not_integers(agent, bufs, indices):
    """NIXL's bindings take ints only: numpy would truncate floats and parse strings into other blocks."""
    src, dst = bufs
    agent.register_memory(np.array([(addr(src), src.nbytes, 0), (addr(dst), dst.nbytes, 0)]), "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src, i * BUF), BUF, 0) for i in range(4)], "DRAM")
    remote = agent.prep_xfer_dlist(agent.name, [(addr(dst, i * BUF), BUF, 0) for i in range(4)], "DRAM")
    with pytest.raises(nx.nixlInvalidParamError, match="must be a list or 1-D array of integers"):
        agent.make_prepped_xfer("WRITE", local, indices, remote, [0, 1])
    assert not dst.any()


def test_dropped_prepared_list_is_released(agent, bufs):
    src, _ = bufs
    agent.register_memory([(addr(src), src.nbytes, 0, "")], "DRAM")
    before = len(agent.agent._handles)
    for _ in range(50):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(src), BUF, 0)], "DRAM")  # the handle is dropped at once
    gc.collect()
    assert len(agent.agent._handles) == before  # as NIXL's handle, __del__ released each


def test_prepped_xfer_from_strided_array(agent, bufs):
    src, dst = bufs
    agent.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
    # every other 1 KiB block of src, as one (addr, len, dev, stride, count) row
    strided = np.array([[addr(src), 1024, 0, 2048, 8]], dtype=np.uint64)
    local = agent.prep_xfer_dlist("", strided, "DRAM")
    assert len(agent.agent._prepped(local._handle)) == 8  # one run, eight blocks
    remote = agent.prep_xfer_dlist(agent.name, [(addr(dst, i * 1024), 1024, 0) for i in range(8)], "DRAM")
    h = agent.make_prepped_xfer("WRITE", local, np.arange(8), remote, np.arange(8))
    agent.transfer(h)
    assert wait_done(agent, h) == "DONE"
    want = src[: 16 * 1024].reshape(8, 2048)[:, :1024].reshape(-1)
    assert np.array_equal(dst[: 8 * 1024], want)
    with pytest.raises(ValueError):
        agent.prep_xfer_dlist("", strided)  # NIXL needs the memory type for strided rows too


# -- transfers through posix: NIXL-style FILE descriptors (offset, len, fd) --------------


def test_posix_write_then_read_file(agent, bufs, tmp_path):
    src, dst = bufs
    path = tmp_path / "kv.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        agent.register_memory([(addr(src), src.nbytes, 0, "a"), (addr(dst), dst.nbytes, 0, "b")], "DRAM")
        files = agent.register_memory([(0, src.nbytes, fd, "kv")], "FILE")
        xfer_files = files.trim()
        whole_src = agent.get_xfer_descs([(addr(src), src.nbytes, 0)], "DRAM")
        h1 = agent.initialize_xfer("WRITE", whole_src, xfer_files, agent.name)
        agent.transfer(h1)
        assert wait_done(agent, h1) == "DONE"
        assert agent.query_xfer_backend(h1) == "POSIX"
        assert path.read_bytes() == src.tobytes()

        # two file segments, swapped, read back into dst
        segs = agent.get_xfer_descs([(BUF, BUF, fd), (0, BUF, fd)], "FILE")
        h2 = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([(addr(dst), BUF, 0), (addr(dst, BUF), BUF, 0)], "DRAM"), segs, agent.name
        )
        agent.transfer(h2)
        assert wait_done(agent, h2) == "DONE"
        assert np.array_equal(dst[:BUF], src[BUF : 2 * BUF]) and np.array_equal(dst[BUF : 2 * BUF], src[:BUF])

        # prepared FILE lists index the same way
        fl = agent.prep_xfer_dlist(agent.name, [(i * BUF, BUF, fd) for i in range(4)], "FILE")
        ml = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(dst, i * BUF), BUF, 0) for i in range(4)], "DRAM")
        dst[:] = 0
        h3 = agent.make_prepped_xfer("READ", ml, [0, 1, 2, 3], fl, [3, 2, 1, 0])
        agent.transfer(h3)
        assert wait_done(agent, h3) == "DONE"
        assert np.array_equal(dst.reshape(4, BUF)[::-1], src.reshape(4, BUF))

        info = agent.query_memory([(0, 0, 0, str(path)), (0, 0, 0, str(tmp_path / "absent"))], "POSIX", "FILE")
        assert info[0] is not None and info[0]["size"] == str(src.nbytes) and info[1] is None
        assert info[0]["mode"] == str(path.stat().st_mode)  # decimal, as NIXL's POSIX plugin
        with pytest.raises(ValueError):
            agent.query_memory([(0, 0, 0, str(path))], "UCX", "FILE")

        with pytest.raises(nx.nixlNotFoundError):  # an fd never registered
            agent.initialize_xfer("READ", whole_src, nx.nixlXferDList("FILE", [(0, src.nbytes, 999)]), agent.name)
        for h in (h1, h2, h3):
            agent.release_xfer_handle(h)
        agent.deregister_memory(files)
        with pytest.raises(nx.nixlNotFoundError):
            agent.initialize_xfer("WRITE", whole_src, xfer_files, agent.name)
    finally:
        os.close(fd)


def test_file_read_past_eof_raises_backend_error(agent, bufs, tmp_path):
    # as NIXL's binding (throw_nixl_exception): a failed transfer raises, its "ERR" is never returned
    _, dst = bufs
    path = tmp_path / "short.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        agent.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
        agent.register_memory([(0, dst.nbytes, fd, "")], "FILE")
        os.ftruncate(fd, 100)  # the file shrinks behind the agent's back
        whole = agent.get_xfer_descs([(addr(dst), dst.nbytes, 0)], "DRAM")
        h = agent.initialize_xfer("READ", whole, nx.nixlXferDList("FILE", [(0, dst.nbytes, fd)]), "")
        with pytest.raises(nx.nixlBackendError) as info:
            if agent.transfer(h) == "PROC":  # the failure is raised by the post or by a later check
                wait_done(agent, h)
        assert isinstance(info.value, TransferIOError)  # still the datamover error
        with pytest.raises(nx.nixlBackendError):  # and on every later check
            agent.check_xfer_state(h)
        assert h.error is not None
        os.ftruncate(fd, dst.nbytes)  # a repost after the failure runs again
        if agent.transfer(h) == "PROC":
            assert wait_done(agent, h) == "DONE"
        assert agent.check_xfer_state(h) == "DONE"
    finally:
        os.close(fd)


def test_file_registration_leaves_the_file_alone(agent, bufs, tmp_path):
    # NIXL's POSIX plugin never extends a file at registration: a READ past its end fails, a WRITE grows it
    src, dst = bufs
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDWR)
    try:
        agent.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
        agent.register_memory([(0, dst.nbytes, fd, "")], "FILE")
        assert path.stat().st_size == 100
        dst[:] = 0xEE
        whole_dst = agent.get_xfer_descs([(addr(dst), dst.nbytes, 0)], "DRAM")
        h = agent.initialize_xfer("READ", whole_dst, nx.nixlXferDList("FILE", [(0, dst.nbytes, fd)]), "")
        with pytest.raises(nx.nixlBackendError):
            if agent.transfer(h) == "PROC":
                wait_done(agent, h)
        assert path.stat().st_size == 100
        whole_src = agent.get_xfer_descs([(addr(src), src.nbytes, 0)], "DRAM")
        w = agent.initialize_xfer("WRITE", whole_src, nx.nixlXferDList("FILE", [(0, src.nbytes, fd)]), "")
        agent.transfer(w)
        assert wait_done(agent, w) == "DONE"
        assert path.read_bytes() == src.tobytes()
    finally:
        os.close(fd)


# -- notifications ------------------------------------------------------------------------


def test_notifications_to_self(agent):
    agent.send_notif(agent.name, b"hello")
    agent.send_notif(agent.name, "text is sent as bytes")
    assert agent.get_new_notifs() == {agent.name: [b"hello", b"text is sent as bytes"]}
    assert agent.get_new_notifs() == {}
    agent.send_notif(agent.name, b"tag:1")
    assert agent.update_notifs() == {agent.name: [b"tag:1"]}
    assert not agent.check_remote_xfer_done(agent.name, b"1")  # prefix match by default
    assert agent.check_remote_xfer_done(agent.name, b"1", tag_is_prefix=False)
    assert agent.notifs == {agent.name: []}
    with pytest.raises(KeyError):  # as NIXL: self.backends[backend]
        agent.send_notif(agent.name, b"x", backend="UCX")


def test_send_notif_to_unknown_peer(agent):
    with pytest.raises(nx.nixlNotFoundError):
        agent.send_notif("nobody", b"x")


# -- metadata within one process -------------------------------------------------------------


def test_metadata_of_another_agent(agent, bufs):
    src, _ = bufs
    other = nixl_agent("target", nixl_agent_config(backends=[]))
    try:
        other.register_memory([(addr(src), BUF, 0, "")], "DRAM")
        name = agent.add_remote_agent(other.get_agent_metadata())
        assert name == b"target"  # NIXL's binding returns the name as bytes
        assert agent.check_remote_metadata("target")
        assert agent.check_remote_metadata(name)
        assert agent.check_remote_metadata("target", agent.get_xfer_descs([(addr(src), BUF, 0)], "DRAM"))
        assert not agent.check_remote_metadata("target", agent.get_xfer_descs([(addr(src), BUF + 1, 0)], "DRAM"))
        assert not agent.check_remote_metadata("nobody")
        # its own name is always loaded (NIXL's loopback section), checked against its own registrations
        assert agent.check_remote_metadata(agent.name)
        assert not agent.check_remote_metadata(agent.name, agent.get_xfer_descs([(addr(src), BUF, 0)], "DRAM"))
        agent.register_memory([(addr(src), BUF, 0, "")], "DRAM")
        assert agent.check_remote_metadata(agent.name, agent.get_xfer_descs([(addr(src), BUF, 0)], "DRAM"))
        assert not agent.check_remote_metadata(agent.name, agent.get_xfer_descs([(addr(src), BUF + 1, 0)], "DRAM"))
        agent.make_connection("target")
        with pytest.raises(nx.nixlNotFoundError):
            agent.make_connection("nobody")
        agent.remove_remote_agent("target")
        assert not agent.check_remote_metadata("target")
        agent.remove_remote_agent("target")  # NIXL returns a status here, nothing raised
        with pytest.raises(nx.nixlInvalidParamError):
            agent.add_remote_agent(agent.get_agent_metadata())  # its own
        with pytest.raises(nx.nixlMismatchError):  # as NIXL: a blob that does not decode
            agent.add_remote_agent(b"\x93garbage")
        with pytest.raises(nx.nixlMismatchError):
            agent.add_remote_agent(b"garbage")
        # partial metadata without connection info from a peer not loaded: nothing to connect with (as NIXL)
        partial = other.get_partial_agent_metadata(other.get_reg_descs([(addr(src), BUF, 0, "")], "DRAM"), False)
        with pytest.raises(nx.nixlNotFoundError):
            agent.add_remote_agent(partial)
        assert not agent.check_remote_metadata("target")
        agent.add_remote_agent(other.get_agent_metadata())
        assert agent.add_remote_agent(partial) == b"target"  # once it is loaded, partial metadata merges
    finally:
        other.close()


def test_post_to_a_removed_peer_raises_and_leaves_the_handle_alone(bufs):
    # NIXL's postXferReq refuses (nixlNotFoundError) before touching the request: it stays DONE
    src, dst = bufs
    a = nixl_agent("post-a", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent("post-b", nixl_agent_config(backends=["UCX"]))
    try:
        a.register_memory([(addr(src), BUF, 0, "")], "DRAM")
        b.register_memory([(addr(dst), BUF, 0, "")], "DRAM")
        a.add_remote_agent(b.get_agent_metadata())
        local = a.get_xfer_descs([(addr(src), BUF, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", local, a.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), "post-b")
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        a.remove_remote_agent("post-b")
        dst[:] = 0
        with pytest.raises(nx.nixlNotFoundError):
            a.transfer(h)
        assert a.check_xfer_state(h) == "DONE"
        assert not dst.any()  # nothing was posted
    finally:
        a.close()
        b.close()


# -- errors ------------------------------------------------------------------------------------


def test_error_mapping(agent, bufs):
    src, dst = bufs
    agent.register_memory([(addr(src), BUF, 0, "")], "DRAM")
    good = agent.get_xfer_descs([(addr(src), BUF, 0)], "DRAM")
    unregistered = agent.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM")
    with pytest.raises(nx.nixlNotFoundError) as info:
        agent.initialize_xfer("WRITE", good, unregistered, agent.name)
    assert isinstance(info.value, NotRegistered)  # still the datamover error, with its index
    assert info.value.index == 0

    agent.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
    with pytest.raises(nx.nixlInvalidParamError) as info:  # as NIXL's createXferReq (not nixlMismatchError)
        agent.initialize_xfer("WRITE", good, agent.get_xfer_descs([(addr(dst), BUF - 1, 0)], "DRAM"), agent.name)
    assert isinstance(info.value, LengthMismatch)
    two = agent.get_xfer_descs([(addr(dst), BUF // 2, 0), (addr(dst, BUF), BUF // 2, 0)], "DRAM")
    with pytest.raises(nx.nixlInvalidParamError):  # descriptor counts differ
        agent.initialize_xfer("WRITE", good, two, agent.name)
    with pytest.raises(TypeError):  # NIXL's binding: pybind refuses None where a list is expected
        agent.register_memory(None)
    with pytest.raises(TypeError):
        agent.initialize_xfer("WRITE", None, good, agent.name)
    with pytest.raises(KeyError):  # as NIXL: self.nixl_ops[operation]
        agent.initialize_xfer("COPY", good, good, agent.name)
    with pytest.raises(nx.nixlNotFoundError):
        agent.initialize_xfer("READ", good, good, "unknown-peer")
    with pytest.raises(KeyError):  # not created: NIXL's self.backends[name]
        agent.initialize_xfer("READ", good, good, agent.name, backends=["UCX"])

    h = agent.initialize_xfer("WRITE", good, agent.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), agent.name)
    with pytest.raises(nx.nixlNotPostedError):
        agent.check_xfer_state(h)
    with pytest.raises(nx.nixlNoTelemetryError):
        agent.get_xfer_telemetry(h)  # capture_telemetry is off
    agent.transfer(h)
    wait_done(agent, h)
    agent.release_xfer_handle(h)
    with pytest.raises(nx.nixlNotAllowedError):
        agent.check_xfer_state(h)
    with pytest.raises(nx.nixlNotAllowedError):
        agent.transfer(h)

    with pytest.raises(nx.nixlNotFoundError):
        agent.deregister_memory(agent.get_reg_descs([(addr(dst, 8), 8, 0, "")], "DRAM"))
    with pytest.raises(nx.nixlInvalidParamError):
        agent.register_memory([(0, BUF, 12345, "")], "FILE")  # not an open fd
    if not os.environ.get("AWS_DEFAULT_BUCKET"):
        with pytest.raises(nx.nixlInvalidParamError):  # OBJ needs a bucket, from create_backend or the environment
            agent.register_memory([(0, BUF, 0, "key")], "OBJ")


def test_failed_registration_rolls_back(agent, bufs):
    src, dst = bufs
    agent.register_memory([(addr(dst, BUF), BUF, 0, "")], "DRAM")
    core = len(agent.datamover.registrations)
    # the second row straddles the end of the registered one: datamover's registry refuses a partial overlap
    # (NIXL's UCX would take it; a region inside or equal to a registered one is taken, see below)
    with pytest.raises(nx.nixlInvalidParamError):
        agent.register_memory([(addr(src), BUF, 0, ""), (addr(dst, BUF // 2), BUF, 0, "")], "DRAM")
    assert len(agent.datamover.registrations) == core  # the first row was rolled back
    with pytest.raises(nx.nixlNotFoundError):
        agent.deregister_memory(agent.get_reg_descs([(addr(src), BUF, 0, "")], "DRAM"))


def test_registering_again_inside_or_empty_is_counted(agent, bufs):
    # NIXL (UCX) takes the same region twice, a region inside a registered one and a zero-length one; each
    # deregistration undoes one registration, and the memory stays usable while any registration covers it
    src, dst = bufs
    agent.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
    whole = [(addr(src), src.nbytes, 0, "")]
    agent.register_memory(whole, "DRAM")
    agent.register_memory(whole, "DRAM")
    agent.register_memory([(addr(src, BUF), BUF, 0, "")], "DRAM")  # one block of the pool
    agent.register_memory([(addr(src), 0, 0, "")], "DRAM")
    assert len(agent.datamover.registrations) == 2  # src is registered once in datamover

    def copy_block() -> None:
        local = agent.get_xfer_descs([(addr(src, BUF), BUF, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, agent.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), agent.name)
        agent.transfer(h)
        assert wait_done(agent, h) == "DONE"
        agent.release_xfer_handle(h)

    copy_block()
    assert np.array_equal(dst[:BUF], src[BUF : 2 * BUF])
    agent.deregister_memory(agent.get_reg_descs(whole, "DRAM"))
    agent.deregister_memory(agent.get_reg_descs(whole, "DRAM"))
    copy_block()  # the block's own registration still holds the region
    assert len(agent.datamover.registrations) == 2
    with pytest.raises(nx.nixlNotFoundError):  # both registrations of the whole were undone
        agent.deregister_memory(agent.get_reg_descs(whole, "DRAM"))
    agent.deregister_memory(agent.get_reg_descs([(addr(src, BUF), BUF, 0, "")], "DRAM"))
    assert len(agent.datamover.registrations) == 1  # the last registration in it took the region along
    agent.deregister_memory(agent.get_reg_descs([(addr(src), 0, 0, "")], "DRAM"))
    with pytest.raises(nx.nixlNotFoundError):
        agent.initialize_xfer("WRITE", agent.get_xfer_descs([(addr(src, BUF), BUF, 0)], "DRAM"),
                              agent.get_xfer_descs([(addr(dst), BUF, 0)], "DRAM"), agent.name)  # fmt: skip


def test_telemetry_when_enabled(bufs):
    src, dst = bufs
    a = nixl_agent("telemetry", nixl_agent_config(backends=[], capture_telemetry=True))
    try:
        a.register_memory([(addr(src), src.nbytes, 0, ""), (addr(dst), dst.nbytes, 0, "")], "DRAM")
        # initialize_xfer: NIXL's descCount is the caller's descriptors, though datamover merges them
        local = a.get_xfer_descs([(addr(src), BUF, 0), (addr(src, BUF), BUF, 0)], "DRAM")
        remote = a.get_xfer_descs([(addr(dst), BUF, 0), (addr(dst, BUF), BUF, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", local, remote, a.name)
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        t = a.get_xfer_telemetry(h)
        assert t.totalBytes == 2 * BUF and t.descCount == 2
        assert t.startTime > 1_600_000_000 * 10**6 and 0 < t.postDuration <= t.xferDuration
        # make_prepped_xfer: consecutive indices of contiguous blocks merge, and descCount says so (as NIXL's)
        lp = a.prep_xfer_dlist("", [(addr(src, i * BUF), BUF, 0) for i in range(4)], "DRAM")
        rp = a.prep_xfer_dlist(a.name, [(addr(dst, i * BUF), BUF, 0) for i in range(4)], "DRAM")
        h2 = a.make_prepped_xfer("WRITE", lp, [0, 1, 3], rp, [0, 1, 3])
        a.transfer(h2)
        assert wait_done(a, h2) == "DONE"
        t2 = a.get_xfer_telemetry(h2)
        assert t2.totalBytes == 3 * BUF and t2.descCount == 2
    finally:
        a.close()
