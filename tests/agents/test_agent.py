"""Agent: registration, validation, backend choice, lifecycle, notifications, metadata and config."""

import contextlib
import re
import subprocess
import sys

import numpy as np
import pytest

from datamover import Agent, AgentConfig, DescList, MemType, XferState, aligned_empty
from datamover.agents import decode_metadata
from datamover.backends import Backend, register_backend
from datamover.backends.base import Completion
from datamover.errors import (
    BackendUnavailable,
    InvalidDescriptor,
    InvalidMetadata,
    InvalidParameter,
    NotificationTimeout,
    NotRegistered,
    TransferIOError,
    TransferStateError,
    UnsupportedTransfer,
)


@pytest.fixture
def agent():
    with Agent("a", {"backends": {"memcpy": {}, "posix": {}}}) as a:
        yield a


def test_import_needs_only_numpy_and_msgpack():
    code = (
        "import sys; before = set(sys.modules); import datamover; new = set(sys.modules) - before; "
        "print(sorted(m for m in new if m.split('.')[0] in ('torch','boto3','ucxx','kvikio','cuda','yaml')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_register_and_lookup(agent):
    a, b = np.zeros(1000, np.uint8), np.zeros(500, np.uint8)
    ra, rb = agent.register_memory(a), agent.register_memory(b)
    p = agent.prepare(DescList.from_buffers([b, a]))
    assert p.regions.tolist() == [rb.id, ra.id]
    with pytest.raises(NotRegistered) as info:
        agent.prepare(DescList([[a.ctypes.data, 10, 0], [a.ctypes.data + 995, 10, 0]], "DRAM"))
    assert info.value.index == 1 and "outside every region" in str(info.value)
    with pytest.raises(InvalidDescriptor, match="overlaps"):
        agent.register_memory(a[10:20])
    agent.deregister_memory(ra)
    with pytest.raises(NotRegistered):
        agent.prepare(DescList.from_buffers(a))
    with pytest.raises(NotRegistered):
        agent.deregister_memory(ra)


def test_register_list_and_desclist(agent):
    bufs = [np.zeros(64, np.uint8) for _ in range(3)]
    regs = agent.register_memory(bufs)
    assert [r.length for r in regs] == [64, 64, 64]
    more = [np.zeros(16, np.uint8) for _ in range(2)]
    regs2 = agent.register_memory(DescList.from_buffers(more))
    assert len(regs2) == 2 and len(agent.registrations) == 5


def test_register_file_sizes(agent, tmp_path):
    path = tmp_path / "f.bin"
    reg = agent.register_file(path, size=10_000)
    assert path.stat().st_size == 10_000 and reg.mem_type == MemType.FILE and reg.length == 10_000
    reg2 = agent.register_file(tmp_path / "g.bin", size=5, direct=False)
    assert reg2.dev != reg.dev
    with pytest.raises(InvalidDescriptor, match="cannot open"):
        agent.register_file(tmp_path / "missing.bin", create=False)
    mem = aligned_empty(4096)
    agent.register_memory(mem)
    with pytest.raises(NotRegistered) as info:
        agent.transfer("WRITE", DescList.from_buffers(mem), DescList.file(reg, [8192], [4096]))
    assert info.value.index == 0


def test_write_read_file_roundtrip_with_local_notification(agent, tmp_path):
    mem = aligned_empty(1 << 20)
    mem[:] = np.frombuffer(np.random.default_rng(1).bytes(1 << 20), np.uint8)
    agent.register_memory(mem)
    f = agent.register_file(tmp_path / "kv.bin", size=1 << 20)
    blocks = DescList.blocks(mem, 64 << 10)
    slots = DescList.file(f, np.arange(16)[::-1] * (64 << 10), 64 << 10)
    with agent.transfer("WRITE", blocks, slots, notify=b"req-1") as x:
        assert x.wait() == XferState.DONE
        assert x.telemetry.descriptors == 16 and x.telemetry.bytes == 1 << 20
        assert x.telemetry.transfer_duration_s >= 0 and x.backend.name == "posix"
    assert agent.wait_notification(b"req-", timeout=5) == ("a", b"req-1")
    disk = np.fromfile(tmp_path / "kv.bin", dtype=np.uint8).reshape(16, -1)
    assert np.array_equal(disk[::-1], mem.reshape(16, -1))
    with pytest.raises(NotificationTimeout):
        agent.wait_notification(b"req-", timeout=0.05)
    agent.send_notification("a", b"hello")
    assert agent.get_notifications() == {"a": [b"hello"]}
    assert agent.get_notifications() == {}


def test_backend_choice_and_unsupported(agent, tmp_path):
    mem = np.zeros(4096, np.uint8)
    other = np.zeros(4096, np.uint8)
    agent.register_memory(mem)
    agent.register_memory(other)
    assert agent.transfer("WRITE", [mem], [other]).backend.name == "memcpy"
    with pytest.raises(UnsupportedTransfer, match="DRAM -> DRAM"):
        agent.transfer("WRITE", [mem], [other], backends="posix")
    only_memcpy = Agent("m", {"backends": {"memcpy": {}}})
    only_memcpy.register_memory(mem)
    f = only_memcpy.register_file(tmp_path / "x.bin", size=4096)
    with pytest.raises(UnsupportedTransfer, match="DRAM -> FILE"):
        only_memcpy.transfer("WRITE", [mem], DescList.file(f, [0], [4096]))
    with pytest.raises(BackendUnavailable, match="not enabled"):
        only_memcpy.backend("posix")
    only_memcpy.close()


def test_bad_ops_and_indices(agent):
    a, b = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
    agent.register_memory(a)
    agent.register_memory(b)
    lp, rp = agent.prepare([a]), agent.prepare([b])
    with pytest.raises(ValueError, match="op must be"):
        agent.make_transfer("COPY", lp, [0], rp, [0])
    with pytest.raises(InvalidDescriptor, match="out of range"):
        agent.make_transfer("WRITE", lp, [1], rp, [0])
    with pytest.raises(TransferStateError, match="never posted"):
        agent.make_transfer("WRITE", lp, [0], rp, [0]).wait()


class FailingBackend(Backend):
    """Fault injection: every post fails with an I/O error on the second descriptor."""

    name = "failing"
    pairs = frozenset({(MemType.DRAM, MemType.DRAM)})

    @classmethod
    def available(cls):
        return True, "ok"

    def post(self, req):
        c = Completion(1)
        c.finish_part(
            TransferIOError("injected", errno=5, index=req.caller_index(min(1, len(req.local) - 1)), backend=self.name)
        )
        return c


def test_backend_errors_surface_typed():
    register_backend("failing", FailingBackend)
    with Agent("f", {"backends": {"failing": {}}}) as agent:
        a, b = np.zeros(100, np.uint8), np.zeros(100, np.uint8)
        agent.register_memory(a)
        agent.register_memory(b)
        x = agent.transfer("WRITE", DescList.blocks(a, 10), DescList.blocks(b, 10)[::-1])
        assert x.state == XferState.ERR
        with pytest.raises(TransferIOError) as info:
            x.wait()
        assert info.value.errno == 5 and info.value.backend == "failing" and info.value.index == 1
        assert x.error is info.value


def test_metadata_roundtrip_between_agents():
    a, b = Agent("a", {"backends": {"memcpy": {}}}), Agent("b", {"backends": {"memcpy": {}}})
    buf = np.zeros(256, np.uint8)
    reg = a.register_memory(buf)
    f_path_meta = decode_metadata(a.metadata())
    assert f_path_meta.name == "a"
    assert f_path_meta.regions == ((MemType.DRAM, 0, reg.addr, 256, reg.id),)
    assert b.add_remote(a.metadata()) == "a" and b.remotes == ["a"]
    p = b.prepare(DescList.from_buffers(buf), agent="a")
    assert p.agent == "a" and p.regions.tolist() == [reg.id]
    with pytest.raises(NotRegistered):
        b.prepare(DescList([[reg.addr + 200, 100, 0]], "DRAM"), agent="a")
    with pytest.raises(InvalidMetadata, match="own"):
        a.add_remote(a.metadata())
    with pytest.raises(NotRegistered, match="unknown remote"):
        b.prepare(DescList.from_buffers(buf), agent="c")
    b.remove_remote("a")
    assert b.remotes == []


def test_config_validation():
    assert AgentConfig.from_any({"backends": ["memcpy"]}).backends == {"memcpy": {}}
    with pytest.raises(ValueError, match="unknown config key"):
        AgentConfig.from_any({"backend": {}})
    with pytest.raises(ValueError, match="timeout_s"):
        AgentConfig(timeout_s=0)
    with pytest.raises(ValueError, match="unknown parameter"):
        Agent("x", {"backends": {"memcpy": {"threadz": 2}}}).backend("memcpy")


@pytest.mark.parametrize(
    ("backend", "key", "value", "wanted"),
    [
        ("posix", "threads", "x", "a whole number"),
        ("posix", "threads", 2.5, "a whole number"),
        ("posix", "threads", True, "a whole number"),
        ("posix", "aio", "false", "true or false"),
        ("memcpy", "inline_bytes", "1M", "a whole number"),
    ],
)
def test_backend_param_of_wrong_type_is_a_typed_error(backend, key, value, wanted):
    # a bad value is refused when the backend starts, naming backend, key, value and the type wanted (it was a
    # bare ValueError from int(), or "false" taken for true)
    with Agent("x", {"backends": {backend: {key: value}}}) as agent, pytest.raises(InvalidParameter) as info:
        agent.backend(backend)
    assert info.value.backend == backend
    assert f"parameter {key!r} must be {wanted}, got {value!r}" in str(info.value)


def test_param_types_float_default_takes_numbers_and_loose_keys_are_left_alone():
    from datamover.backends.base import check_param_types

    defaults = {"timeout_s": 5.0, "threads": 4, "path": None}
    check_param_types("b", defaults, {"timeout_s": 1, "threads": "many"}, frozenset({"threads"}))
    check_param_types("b", defaults, {"timeout_s": 0.5, "path": 3})
    with pytest.raises(InvalidParameter, match="'timeout_s' must be a number, got 'soon'"):
        check_param_types("b", defaults, {"timeout_s": "soon"})


def test_backend_params_of_the_right_type_are_kept():
    with Agent("x", {"backends": {"posix": {"threads": 1, "aio": False}, "memcpy": {"threads": 1}}}) as agent:
        assert agent.backend("posix").params["threads"] == 1
        assert agent.backend("posix").params["aio"] is False
        assert agent.backend("memcpy").params["threads"] == 1


def test_info_cli_reports_every_backend():
    out = subprocess.run([sys.executable, "-m", "datamover.cli", "info"], capture_output=True, text=True, check=True)
    for name in ("memcpy", "posix", "cuda", "gds", "ucx", "s3"):
        assert name in out.stdout
    assert "usable: yes" in out.stdout


def test_cli_subcommands_have_working_help():
    for cmd in ("info", "bench", "replay", "alerts"):
        out = subprocess.run(
            [sys.executable, "-m", "datamover.cli", cmd, "--help"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert "usage:" in out.stdout


def test_completion_assist_runs_once_in_the_waiter():
    ran = []
    c = Completion(1)
    c.set_assist(lambda: (ran.append(1), c.finish_part()))
    assert not c.wait(0.01)  # a plain timed wait never runs the backend's work
    assert ran == []
    assert c.wait(None, assist=True) and ran == [1]
    assert c.wait(None, assist=True) and ran == [1]


def test_a_timed_wait_that_assists_waits_only_what_is_left_of_its_timeout():
    """The waiter runs the backend's work first (a ucx waiter drives UCX up to the deadline): the wait after it is
    what is left of the timeout (before: the whole timeout again, so a transfer to a frozen peer reported ERR at
    twice its timeout)."""
    import time

    c = Completion(1)
    c.set_assist(lambda: time.sleep(1.0))  # the work outlasts the timeout and does not finish the completion
    t0 = time.monotonic()
    assert not c.wait(1.0, assist=True)
    after_assist = time.monotonic() - t0 - 1.0
    assert after_assist < 0.5, f"waited {after_assist:.2f} s more after the assist used up the timeout"


def test_run_parts_parts_run_exactly_once_with_a_waiter_racing_the_pool():
    from concurrent.futures import ThreadPoolExecutor

    from datamover.backends.base import run_parts

    with ThreadPoolExecutor(2) as pool:
        for _ in range(50):
            seen = []
            c = run_parts(pool, [(0, 1), (1, 2), (2, 3)], lambda a, b, comp, seen=seen: seen.append(a), backend="t")
            assert c.wait(5, assist=True)
            assert sorted(seen) == [0, 1, 2]


def test_the_inbox_keeps_each_sender_within_its_limits_dropping_the_oldest_counted():
    limits = {"max_per_sender": 3, "max_sender_bytes": 1000, "max_messages": 5, "max_bytes": 1 << 20}
    with Agent("me", {"backends": {"memcpy": {}}, "extra": {"inbox": limits}}) as agent:
        for k in range(6):  # a flooding sender: its three newest stay
            agent.deliver_notification("flood", b"f%d" % k)
        agent.deliver_notification("big", b"x" * 600)
        agent.deliver_notification("big", b"y" * 600)  # with overhead, two are over the sender's 1000 bytes
        agent.deliver_notification("calm", b"c0")
        assert agent.notifications_dropped == {"flood": 3, "big": 1}
        agent.deliver_notification("calm", b"c1")  # six queued, over the five in all: the oldest of the sender
        assert agent.notifications_dropped == {"flood": 3, "big": 2}  # holding the most bytes goes
        assert agent.get_notifications() == {"flood": [b"f3", b"f4", b"f5"], "calm": [b"c0", b"c1"]}
        for k in range(5):  # drained: the budget is free again, and the sender's own limit still holds
            agent.deliver_notification("calm", b"c%d" % k)
        assert agent.wait_notification(b"c4", timeout=1) == ("calm", b"c4")
        assert agent.get_notifications() == {"calm": [b"c2", b"c3"]}
        assert agent.notifications_dropped == {"flood": 3, "big": 2, "calm": 2}


def test_inbox_limits_must_be_positive_integers():
    with pytest.raises(InvalidParameter, match="max_bytes"):
        Agent("me", {"backends": {"memcpy": {}}, "extra": {"inbox": {"max_bytes": 0}}})


@pytest.mark.parametrize("inbox", [{"max_byte": 1}, [("max_bytes", 1)]], ids=["unknown-key", "not-a-map"])
def test_inbox_limits_take_only_their_own_names(inbox):
    with pytest.raises(InvalidParameter, match="config extra 'inbox' takes max_per_sender"):
        Agent("me", {"backends": {"memcpy": {}}, "extra": {"inbox": inbox}})


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"sidechannel": {}}, "unknown section(s) ['sidechannel']"),
        ({"side_channel": {"deadlin_s": 1}}, "extra 'side_channel' takes max_connections"),
        ({"push_budget": {"max_peer": 1}}, "extra 'push_budget' takes max_regions"),
        ({"push_budget": 5}, "extra 'push_budget' takes"),
    ],
)
def test_config_extra_sections_take_only_their_own_names(extra, said):
    """A misspelt limit was ignored (or, with listen_port, a TypeError from deep inside the side channel)."""
    with pytest.raises(InvalidParameter, match=re.escape(said)):
        Agent("me", {"backends": {"memcpy": {}}, "listen_port": 0, "extra": extra})


def test_a_backend_that_fails_to_start_keeps_no_file_open(tmp_path):
    """A backend started after files were registered, failing on one of them, closes what it opened for the
    others and leaves them no handle (their descriptors stayed open, a stale handle in the region)."""
    import os

    with Agent("x", {"backends": {"posix": {}}}) as agent:
        first = agent.register_file(tmp_path / "first.bin", size=4096)
        agent.register_file(tmp_path / "second.bin", size=4096)
        os.unlink(tmp_path / "second.bin")

        def open_fds() -> list[str]:
            out = []
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, gone already
                    out.append(os.readlink(f"/proc/self/fd/{fd}"))
            return out

        before = [p for p in open_fds() if p.endswith("first.bin")]
        with pytest.raises(TransferIOError):
            agent.backend("posix")
        assert [p for p in open_fds() if p.endswith("first.bin")] == before
        assert "posix" not in first.handles


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"timeout_s": True}, "'timeout_s' must be a number of seconds"),  # was 1 s
        ({"secret": 5}, "'secret' must be bytes or a string, got int"),  # each GET was refused: hmac's TypeError
        ({"listen_port": "abc"}, "'listen_port' must be an integer 0..65535, got 'abc'"),  # int()'s ValueError
        ({"listen_port": 80.7}, "'listen_port' must be an integer"),  # was port 80
        ({"listen_port": True}, "'listen_port' must be an integer"),  # was port 1
        ({"listen_port": [1]}, "'listen_port' must be an integer"),  # a TypeError
        ({"listen_port": float("inf")}, "'listen_port' must be an integer"),  # an OverflowError
        ({"listen_port": 0, "extra": {"listen_host": 5}}, "'listen_host' must be a host name"),  # bind's OSError
        ({"extra": {"side_channel": {"deadline_s": "x"}}}, "'side_channel' limit 'deadline_s' must be a positive"),
        ({"extra": {"side_channel": {"deadline_s": float("nan")}}}, "limit 'deadline_s' must be a positive finite"),
        ({"extra": {"side_channel": {"max_connections": 0}}}, "limit 'max_connections' must be a positive integer"),
        ({"extra": {"side_channel": {"workers": -1}}}, "limit 'workers' must be a positive integer"),
        ({"extra": {"side_channel": {"max_request_bytes": 1.5}}}, "limit 'max_request_bytes' must be a positive"),
        ({"extra": {"push_budget": {"max_regions": "x"}}}, "'push_budget' limit 'max_regions' must be a positive"),
        ({"extra": {"push_budget": {"max_peers": True}}}, "limit 'max_peers' must be a positive integer"),
    ],
)
def test_config_values_of_the_wrong_type_are_named_when_the_config_is_made(config, said):
    """Each was taken and failed later (a side channel refusing or dropping every connection, a TypeError at the
    first GET), or raised a bare ValueError/TypeError/OverflowError without the setting's name."""
    with pytest.raises(InvalidParameter, match=re.escape(said)):
        AgentConfig.from_any({"backends": ["memcpy"], **config})


def test_a_port_given_as_digits_is_taken_as_a_number():
    assert AgentConfig(listen_port=" 8080 ").listen_port == 8080 and AgentConfig(listen_port=0).listen_port == 0


@pytest.mark.parametrize("form", ["list", "desclist"])
def test_registering_several_buffers_is_all_or_none(form):
    """The second buffer overlaps the first: the call is refused and the first is given back (before: it stayed
    registered, and registering it again was refused as overlapping itself)."""
    buf = np.zeros(8192, np.uint8)
    with Agent("a") as agent:
        if form == "list":
            batch = [buf[:4096], buf[2048:6144]]
        else:
            batch = DescList.from_columns(np.array([buf.ctypes.data, buf.ctypes.data + 2048]), 4096)
        with pytest.raises(InvalidDescriptor, match="overlaps"):
            agent.register_memory(batch)
        assert agent.registrations == {}
        assert agent.register_memory(buf[:4096]).length == 4096
