"""The ucx control port under hostile input, the target in another process: an abort there fails the test.

Hellos with malformed UCX worker addresses (mutations of a real one), welcomes
with them (the initiator in another process), random control messages after a
valid hello, oversized frames before the handshake, and refused requests that
claim a million rows: the peer must answer with a refusal or a hang-up, keep
serving, and keep its memory.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover import Agent, XferState
from datamover.agents.metadata import decode_metadata, encode_metadata
from datamover.backends import backend_status
from datamover.backends.ucx.address import AddressCheck, parse
from datamover.backends.ucx.segments import POSIX, SYSV
from datamover.errors import DatamoverError, InvalidMetadata
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

from .control import TCP_RX, FakeTarget, control_of, recv, send

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

UCX = {"backends": {"ucx": {}}}


@pytest.fixture(scope="module")
def target():
    with RemotePeer("fuzz-target", UCX) as peer:
        yield peer


@pytest.fixture(scope="module")
def agent(target):
    with Agent("fuzz-init", UCX) as agent:
        agent.add_remote(target.metadata())
        yield agent


@pytest.fixture(scope="module")
def real_address(agent) -> bytes:
    return agent.backend("ucx").connection_info()["address"]


def _control(target) -> tuple[str, int]:
    return control_of(target.metadata())


def _hello(target, address: bytes, name: str = "fuzzer") -> dict | None:
    """Say hello with ``address``; the target's answer (welcome or error), or None when it hung up."""
    with socket.create_connection(_control(target), timeout=10) as sock:
        challenge = recv(sock)
        assert challenge is not None and challenge["t"] == "challenge"
        send(
            sock,
            {"t": "hello", "name": name, "address": address, "nonce": os.urandom(16), "mac": b"", "tcp_rx": TCP_RX},
        )
        return recv(sock)


def _welcomed(target, address: bytes, name: str, timeout: float = 30) -> socket.socket:
    """A control connection to ``target`` that said hello with ``address`` and was welcomed."""
    sock = socket.create_connection(_control(target), timeout=timeout)
    try:
        assert recv(sock)["t"] == "challenge"
        send(sock, {"t": "hello", "name": name, "address": address, "nonce": os.urandom(16), "tcp_rx": TCP_RX})
        assert recv(sock)["t"] == "welcome"
    except BaseException:
        sock.close()
        raise
    return sock


def _mutations(base: bytes):
    n = len(base)
    flips = st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 255)), min_size=1, max_size=6)
    return st.one_of(
        flips.map(lambda fl: bytes(_apply(base, fl))),
        st.integers(1, n - 1).map(lambda k: base[:k]),
        st.binary(min_size=1, max_size=64).map(lambda tail: base + tail),
        st.integers(0, 255).map(lambda v: bytes([v]) + base[1:]),
        st.binary(min_size=1, max_size=512),
    )


def _apply(base: bytes, flips) -> bytearray:
    out = bytearray(base)
    for pos, val in flips:
        out[pos] = val
    return out


def _serves(agent, target) -> None:
    """The target still moves bytes for a legitimate peer."""
    buf = RemoteBuffer(target, 1 << 16)
    local = HostBuffer(agent, 1 << 16)
    try:
        agent.add_remote(target.metadata())
        data = random_bytes(1 << 16, 77)
        local.write(0, data)
        xfer = agent.transfer("WRITE", local.descs([0], [1 << 16]), buf.descs([0], [1 << 16]), "fuzz-target")
        assert xfer.wait() == XferState.DONE
        assert buf.read(0, 1 << 16) == data
    finally:
        agent.deregister_memory(local.registration)
        buf.free()


@pytest.mark.parametrize("first", [6, 9, 0x0F, 0xF2])
def test_hello_with_an_unknown_address_version_is_refused(agent, target, real_address, first):
    """The fault matrix's frame: UCX asserted on the version nibble and aborted the whole agent (SIGABRT)."""
    answer = _hello(target, bytes([first]) + real_address[1:])
    assert answer is not None and answer["t"] == "error" and "version" in answer["reason"], answer
    assert target.call("ping", timeout=10) == target.pid
    _serves(agent, target)


@settings(max_examples=150)
@given(data=st.data())
def test_fuzzed_hello_addresses_never_kill_the_target(target, real_address, data):
    address = data.draw(_mutations(real_address))
    answer = _hello(target, address)
    assert answer is None or answer["t"] in ("welcome", "error"), answer
    assert target.call("ping", timeout=10) == target.pid, "the target died on a hello"


def test_fuzzed_hellos_leave_the_target_serving(agent, target):
    _serves(agent, target)


_FIELDS = ["id", "op", "mem", "addr", "len", "dev", "tag", "notify", "msg", "add", "row", "reason", "nonce", "conn_id"]
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.binary(max_size=64), st.text(max_size=16),
    st.lists(st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.binary(max_size=8)), max_size=4),
    st.sampled_from(["WRITE", "READ", "DRAM", "VRAM"]),
)  # fmt: skip
_TYPES = ["req", "notif", "rkeys", "revoke", "revoked", "cancel", "hello", "welcome", "done", "refuse", "x"]


@settings(max_examples=100)
@given(msgs=st.lists(st.fixed_dictionaries({"t": st.sampled_from(_TYPES)}, optional=dict.fromkeys(_FIELDS, _VALUES)),
                     min_size=1, max_size=5))  # fmt: skip
def test_random_messages_after_a_valid_hello_never_kill_the_target(target, real_address, msgs):
    with _welcomed(target, real_address, "fuzzer", timeout=10) as sock:
        for m in msgs:
            try:
                send(sock, m)
            except OSError:
                break  # the target hung up on an earlier one
    assert target.call("ping", timeout=10) == target.pid


def test_random_messages_leave_the_target_serving(agent, target):
    _serves(agent, target)


def test_a_large_frame_before_the_handshake_is_refused_at_its_header(target):
    """An unauthenticated connection cannot make the target buffer a big frame: it hangs up on the length."""
    with socket.create_connection(_control(target), timeout=10) as sock:
        assert recv(sock)["t"] == "challenge"
        sock.sendall(struct.pack("!I", 1 << 20) + b"\x00" * 1024)
        sock.settimeout(4.0)  # under the target's 5 s handshake deadline: the hang-up must come from the header
        assert sock.recv(4096) == b"", "the target kept reading a 1 MiB frame from a connection that never said hello"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_refused_million_row_writes_keep_the_targets_memory(target, real_address):
    """Three refused 1M-row WRITEs took the target's RSS to 3.1 GB (one posted receive per claimed row)."""
    n = 1 << 20
    cols = np.full(n, 1 << 40, dtype="<i8").tobytes()  # an address no one registered
    before = _rss(target.pid)
    socks = []
    try:
        for k in range(3):
            sock = _welcomed(target, real_address, f"big{k}")
            socks.append(sock)
            req = {"t": "req", "id": 1, "op": "WRITE", "mem": "DRAM", "addr": cols, "len": cols, "dev": cols,
                   "tag": 1 << 40, "notify": b""}  # fmt: skip
            send(sock, req)
            answer = recv(sock)
            assert answer is not None and answer["t"] == "refuse", answer
        assert target.call("ping", timeout=10) == target.pid
        grown = _rss(target.pid) - before
        assert grown < 256 << 20, f"the target's RSS grew by {grown >> 20} MiB"
    finally:
        for sock in socks:
            sock.close()


def test_incomplete_frames_of_many_peers_are_bounded_in_all():
    """Every connection may hold one frame of up to 64 MiB; eight unauthenticated ones each sending 20 MiB of a
    64 MiB frame and stopping took the target's RSS up by 160 MiB (1024 connections: 64 GiB). Now the frames
    not yet complete share ``max_buffered_bytes`` (here 48 MiB): the first two are held, each later one is
    dropped when it would go over, the target keeps serving, and a dropped one's share is free again."""
    cfg = {"backends": {"ucx": {"max_buffered_bytes": 48 << 20}}}
    with RemotePeer("frames-target", cfg) as target, Agent("frames-init", UCX) as agent:
        address = agent.backend("ucx").connection_info()["address"]
        before = _rss(target.pid)
        socks, part = [], 20 << 20
        try:
            for k in range(8):
                sock = _welcomed(target, address, f"part{k}")
                socks.append(sock)
                try:
                    sock.sendall(struct.pack("!I", (64 << 20) - 1) + bytes(part))
                except (ConnectionResetError, BrokenPipeError):
                    assert k >= 2, f"connection {k} was dropped within the budget"
                    continue  # the target hung up while the frame was still being sent
                if k >= 2:  # the known point: the target hung up on this one
                    try:
                        assert sock.recv(4096) == b"", f"connection {k} was kept beyond the budget"
                    except ConnectionResetError:
                        pass
                else:  # the known point: the target has read it all
                    want = (k + 1) * (part + 4)
                    _until(lambda want=want: target.call("describe", "ucx")["control bytes buffered"]["held"] == want)
            grown = _rss(target.pid) - before
            assert grown < 100 << 20, f"the target's RSS grew by {grown >> 20} MiB"
            socks.pop(0).close()
            _until(lambda: target.call("describe", "ucx")["control bytes buffered"]["held"] == part + 4)
            remote, local = RemoteBuffer(target, 1 << 20), HostBuffer(agent, 1 << 20)
            agent.add_remote(target.metadata())
            data = random_bytes(1 << 20, 3)
            local.write(0, data)
            xfer = agent.transfer("WRITE", local.descs([0], [1 << 20]), remote.descs([0], [1 << 20]), target.name)
            assert xfer.wait() == XferState.DONE and remote.read(0, 1 << 20) == data
        finally:
            for sock in socks:
                sock.close()


def test_rows_served_for_peers_at_once_are_bounded():
    """Three unauthenticated WRITEs of 1M one-byte rows into a region the target registered, whose data never
    comes, took its RSS from 51 to 2277 MiB (each posted row holds UCX request state) and its service thread for
    30 s; nothing bounded how many. Now ``max_served_rows`` (here 1000): 800 rows are posted, a second 800-row
    request is refused with the reason (its data drained), a real 100-row WRITE still fits and lands, a 300-row one
    does not, and fits once the first request's peer hung up (its rows given back)."""
    cfg = {"backends": {"ucx": {"max_served_rows": 1000}}}
    served = {"backends": {"ucx": {"one_sided": False}}}
    with RemotePeer("rows-target", cfg) as target, Agent("rows-init", served) as agent:
        remote = RemoteBuffer(target, 1 << 20)
        blob = target.metadata()
        base = int(decode_metadata(blob).rows[0, 1])
        address = agent.backend("ucx").connection_info()["address"]

        def req(sock, rows: int, k: int) -> None:
            cols = [base + np.arange(rows, dtype="<i8"), np.ones(rows, dtype="<i8"), np.zeros(rows, dtype="<i8")]
            send(sock, {"t": "req", "id": 1, "op": "WRITE", "mem": "DRAM", "addr": cols[0].tobytes(),
                        "len": cols[1].tobytes(), "dev": cols[2].tobytes(), "tag": k << 40, "notify": b""})  # fmt: skip

        socks = []
        try:
            for k in (1, 2):
                sock = _welcomed(target, address, f"rows{k}")
                socks.append(sock)
                req(sock, 800, k)
                if k == 1:  # the known point: the target posted its rows
                    _until(lambda: target.call("describe", "ucx")["rows served for peers"]["now"] == 800)
            answer = recv(socks[1])
            assert answer is not None and answer["t"] == "refuse" and "at most 1000 rows" in answer["reason"], answer
            agent.add_remote(blob)
            local = HostBuffer(agent, 1 << 20)
            data = random_bytes(1 << 20, 4)
            local.write(0, data)

            def write(rows: int) -> XferState:  # rows of 1 KiB, 2 KiB apart: none merged
                offs = np.arange(rows) * 2048
                return agent.transfer("WRITE", local.descs(offs, 1024), remote.descs(offs, 1024), target.name).wait()

            assert write(100) == XferState.DONE  # served by the target (one_sided off): 900 of 1000
            assert remote.read(0, 1024) == data[:1024]
            with pytest.raises(DatamoverError, match="at most 1000 rows"):
                write(300)
            socks.pop(0).close()  # its 800 rows go with it: the known point is the target's count
            _until(lambda: target.call("describe", "ucx")["rows served for peers"]["now"] == 0)
            assert write(300) == XferState.DONE
            assert target.call("ping", timeout=10) == target.pid
        finally:
            for sock in socks:
                sock.close()


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _array(n: int) -> bytes:
    return b"\xdd" + struct.pack(">I", n)


def _map(n: int) -> bytes:
    i = np.arange(n)
    entries = np.empty((n, 6), dtype=np.uint8)
    entries[:, 0], entries[:, 5] = 0xA4, 0x80  # a str of 4 bytes -> {}
    for d in range(4):  # n distinct ASCII keys: base-64 digits from 0x40 on
        entries[:, 1 + d] = 0x40 + (i >> (6 * d)) % 64
    return b"\xdf" + struct.pack(">I", n) + entries.tobytes()


@pytest.mark.parametrize(
    "shape",
    [
        _array(16 << 20) + b"\x90" * (16 << 20),  # 16M empty lists
        _array(1 << 16) + (b"\xdc\x00\xff" + b"\x90" * 255) * (1 << 16),  # 64K lists of 255 empty lists
        _map(5 << 19),  # a map of 2.5M keys, each holding an empty map
    ],
    ids=["lists", "lists-of-lists", "maps"],
)
def test_a_frame_of_millions_of_containers_is_refused_before_they_are_built(shape):
    """After a valid hello, one 16 MiB frame of empty lists (or of maps): as Python objects about 1 GB; before,
    the target built them all (peak RSS 50 -> 1242 MiB, 12 s of its service thread). Control messages are flat
    maps whose only lists are rkey rows: the decoder refuses the first container beyond that."""
    with RemotePeer("bomb-target", UCX) as target, Agent("bomb-init", UCX) as agent:
        address = agent.backend("ucx").connection_info()["address"]
        before = _peak(target.pid)
        with _welcomed(target, address, "bomb", timeout=120) as sock:
            sock.sendall(struct.pack("!I", len(shape)) + shape)
            assert recv(sock) is None, "the target answered a frame that is no control message"
        assert target.call("ping", timeout=60) == target.pid
        grown = _peak(target.pid) - before
        assert grown < 200 << 20, f"the target's peak RSS grew by {grown >> 20} MiB decoding one 16 MiB frame"


def _until(cond, timeout: float = 30.0) -> None:
    """Wait (bounded) for the target to have done what was sent to it: a hang guard, not a race."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the target did not get there"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def initiator():
    with RemotePeer("fuzz-initiator", UCX) as peer:
        yield peer


@settings(max_examples=60)
@given(data=st.data())
def test_fuzzed_welcome_addresses_never_kill_the_initiator(initiator, real_address, data):
    """The second abort the fault matrix found: a target whose welcome carries a malformed address."""
    fake = FakeTarget()
    try:
        fake.address = data.draw(_mutations(real_address))
        blob = encode_metadata("fake", {"ucx": {"address": real_address, "host": "127.0.0.1", "port": fake.port}}, [])
        initiator.call("add_remote", blob)
        try:
            initiator.call("send_notification", "fake", b"x", timeout=20)
        except DatamoverError:
            pass  # refused: what a malformed welcome should give
        initiator.call("remove_remote", "fake")
        assert initiator.call("ping", timeout=10) == initiator.pid, "the initiator died on a welcome"
    finally:
        fake.close()


def _welcome_from_fake(initiator, real_address: bytes, address: bytes) -> str:
    """A fake target's welcome carries ``address``; what the initiator's notification to it raised ('' if sent)."""
    fake = FakeTarget()
    try:
        fake.address = address
        blob = encode_metadata("fake", {"ucx": {"address": real_address, "host": "127.0.0.1", "port": fake.port}}, [])
        initiator.call("add_remote", blob)
        try:
            initiator.call("send_notification", "fake", b"x", timeout=20)
            said = ""
        except InvalidMetadata as exc:
            said = str(exc)
        initiator.call("remove_remote", "fake")
        assert initiator.call("ping", timeout=10) == initiator.pid, "the initiator died on a welcome"
        return said
    finally:
        fake.close()


def _with_segment(address: bytes, csum: int, seg_id: int) -> bytes:
    """``address`` with the first ``csum`` transport's segment id replaced (everything else stays valid)."""
    t = next(t for t in parse(address).transports if t.csum == csum)
    return address[: t.at] + struct.pack("<Q", seg_id) + address[t.at + 8 :]


def _posix_fd(address: bytes, fd: int) -> bytes:
    """``address`` whose posix FIFO is ``/proc/<this pid>/fd/<fd>`` (flags kept: procfs mode)."""
    t = next(t for t in parse(address).transports if t.csum == POSIX)
    (seg,) = struct.unpack_from("<Q", t.iface)
    flags = seg & ~((1 << 60) - 1)
    return _with_segment(address, POSIX, flags | os.getpid() | fd << 30)


def _has(address: bytes, csum: int) -> bool:
    return any(t.csum == csum for t in parse(address).transports)


@pytest.fixture
def posix_file():
    """An open, unlinked file named like a UCX posix segment: ``(fd, size)``; the test sets its size."""
    path = f"/dev/shm/ucx_shm_posix_dmtest{os.getpid():x}{threading.get_ident() & 0xFFFF:x}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    try:
        yield fd
    finally:
        os.close(fd)


def test_a_welcome_naming_an_empty_segment_file_is_refused(initiator, real_address, posix_file):
    """The initiator's death the fuzz found: UCX maps the named file as its peer's FIFO and reads its header.

    An empty file (named like a UCX segment, of a live process) made that first read fault: SIGBUS, the
    initiator process died. Now the segment is looked at first and the welcome refused, naming the peer.
    """
    if not _has(real_address, POSIX):
        pytest.skip("this UCX has no posix transport")
    said = _welcome_from_fake(initiator, real_address, _posix_fd(real_address, posix_file))
    assert "agent 'fake'" in said and "posix segment" in said and "holds 0 bytes, less than a FIFO" in said, said


def test_a_hello_naming_an_empty_segment_file_is_refused(target, real_address, posix_file):
    """The same fault from the other side: a hostile initiator's hello must not make the target map the file."""
    if not _has(real_address, POSIX):
        pytest.skip("this UCX has no posix transport")
    answer = _hello(target, _posix_fd(real_address, posix_file))
    assert answer is not None and answer["t"] == "error" and "holds 0 bytes" in answer["reason"], answer
    assert target.call("ping", timeout=10) == target.pid


def test_a_welcome_naming_a_segment_without_its_owner_is_refused(initiator, real_address, posix_file):
    """A segment as long as a FIFO whose header names no live process (pid 0) is not attached."""
    if not _has(real_address, POSIX):
        pytest.skip("this UCX has no posix transport")
    own = next(t for t in parse(real_address).transports if t.csum == POSIX)
    (seg,) = struct.unpack_from("<Q", own.iface)
    os.ftruncate(posix_file, os.stat(f"/proc/self/fd/{(seg & ((1 << 60) - 1)) >> 30}").st_size)
    said = _welcome_from_fake(initiator, real_address, _posix_fd(real_address, posix_file))
    assert "agent 'fake'" in said and "not of process" in said, said


def test_a_welcome_naming_another_file_is_refused(initiator, real_address, tmp_path):
    if not _has(real_address, POSIX):
        pytest.skip("this UCX has no posix transport")
    with open(tmp_path / "victim", "wb+") as victim:
        victim.write(b"v" * (1 << 20))
        victim.flush()
        said = _welcome_from_fake(initiator, real_address, _posix_fd(real_address, victim.fileno()))
        victim.seek(0)
        assert victim.read() == b"v" * (1 << 20)
    assert "agent 'fake'" in said and "is not a UCX segment" in said, said


def test_a_welcome_naming_a_short_sysv_segment_is_refused(initiator, real_address):
    if not _has(real_address, SYSV):
        pytest.skip("this UCX has no sysv transport")
    libc = ctypes.CDLL(None, use_errno=True)
    shmid = libc.shmget(0, 4096, 0o600)  # IPC_PRIVATE, one page: shorter than a FIFO
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        said = _welcome_from_fake(initiator, real_address, _with_segment(real_address, SYSV, shmid))
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    assert "agent 'fake'" in said and f"sysv segment {shmid} holds 4096 bytes" in said, said


_GONE = """
import sys
from datamover import Agent
agent = Agent("gone", {"backends": {"ucx": {}}})
sys.stdout.write(agent.backend("ucx").connection_info()["address"].hex())
"""


def test_a_welcome_naming_a_gone_worker_is_refused(initiator, real_address):
    """The address of a worker whose process has exited (known point: it was waited for): its segments are gone.

    UCX finds the posix one unreachable (it cannot open it) and attaches nothing; the sysv one it would attach,
    so that is what the refusal names.
    """
    out = subprocess.run([sys.executable, "-c", _GONE], capture_output=True, text=True, check=True, timeout=120)
    gone = bytes.fromhex(out.stdout.strip())
    said = _welcome_from_fake(initiator, real_address, gone)
    if _has(gone, SYSV):
        assert "agent 'fake'" in said and "sysv segment" in said and "does not exist on this host" in said, said
    else:
        assert said == "" or "agent 'fake'" in said, said


def test_a_welcome_whose_posix_segment_is_gone_still_works_over_the_others(initiator, real_address):
    """A posix id naming no open file: UCX does not attach it (unreachable), and the other transports serve."""
    if not (_has(real_address, POSIX) and _has(real_address, SYSV)):
        pytest.skip("this UCX lacks posix or sysv")
    assert _welcome_from_fake(initiator, real_address, _posix_fd(real_address, (1 << 29) + 7)) == ""


def test_own_addresses_parse_and_check_under_every_tls():
    """The parser walks what this UCX packs (v1 by default, v2 on request) to its last byte."""
    from datamover.backends.ucx import import_ucxx, ucx_config

    u, _ = import_ucxx()
    features = (u.Feature.TAG, u.Feature.WAKEUP, u.Feature.RMA)
    for cfg in ({}, {"TLS": "tcp,self"}, {"ADDRESS_VERSION": "v2"}, {"TLS": "tcp", "ADDRESS_VERSION": "v2"}):
        worker = u.UCXWorker(u.UCXContext(ucx_config(cfg, False), feature_flags=features))
        own = worker.address.tobytes()
        assert parse(own).transports, cfg
        AddressCheck(own).check(own, "self")
        with pytest.raises(InvalidMetadata):
            AddressCheck(own).check(own[:-1], "self")


def test_a_hello_that_does_not_say_its_tcp_segment_is_refused_with_the_reason(agent, target, real_address):
    """A peer from before ``tcp_rx`` (or one on UCX's 8 KiB default) would be sent 64 KiB messages UCX aborts on."""
    for rx in (None, 8192):
        with socket.create_connection(_control(target), timeout=10) as sock:
            assert recv(sock)["t"] == "challenge"
            hello = {"t": "hello", "name": "old", "address": real_address, "nonce": os.urandom(16), "mac": b""}
            send(sock, hello if rx is None else {**hello, "tcp_rx": rx})
            answer = recv(sock)
            assert answer is not None and answer["t"] == "error" and "UCX_TCP_TX_SEG_SIZE" in answer["reason"], answer
    _serves(agent, target)
