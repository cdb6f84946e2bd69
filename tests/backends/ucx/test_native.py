"""The native data path (datamover.backends.ucx._ucp): rows posted and UCX progressed in C, and its ctypes fallback."""

import hashlib
import importlib
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.backends.ucx import rma as ucx_rma
from datamover.testing import HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer

from .native_hold import event_arrives, held_and_idle

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

TCP = {"ucx_config": {"TLS": "tcp,self"}, "direct_cma": False}  # put/get over tcp: the target must progress


needs_native = pytest.mark.skipif(ucx_rma.native() is None, reason=ucx_rma.data_path())


@pytest.fixture(scope="module")
def target():
    with RemotePeer("native-target", {"backends": {"ucx": TCP}}, env={"UCX_TLS": "tcp,self"}) as peer:
        yield peer


@pytest.fixture(params=["native", "ctypes"])
def path(request, monkeypatch):
    if request.param == "native":
        if ucx_rma.native() is None:
            pytest.skip(ucx_rma.data_path())
    else:
        monkeypatch.setattr(ucx_rma, "native", lambda: None)
    return request.param


def test_info_says_which_path_is_active_and_why():
    out = subprocess.run(
        [sys.executable, "-c", "from datamover.backends.ucx import rma; print(rma.data_path())"],
        capture_output=True, text=True, env={"DATAMOVER_UCX_NATIVE": "0", "PATH": "/usr/bin:/bin"}, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "ctypes: DATAMOVER_UCX_NATIVE=0"
    if ucx_rma.native() is not None:
        assert ucx_rma.data_path().startswith("native: ") and "libucp" in ucx_rma.data_path()
    from datamover.backends.ucx import UcxBackend

    assert UcxBackend.environment()["native path"] == ucx_rma.data_path()


def test_an_extension_built_from_another_source_is_not_used_and_says_rebuild(monkeypatch):
    monkeypatch.delenv("DATAMOVER_UCX_NATIVE", raising=False)
    stale = types.ModuleType("datamover.backends.ucx._ucp")
    stale.SOURCE_SHA256 = "0" * 64  # as if _ucp.c changed (a git pull) after the build
    monkeypatch.setitem(sys.modules, "datamover.backends.ucx._ucp", stale)
    lib, reason = ucx_rma._native_state.__wrapped__()
    assert lib is None
    assert reason.startswith("ctypes: the native extension") and "built 000000000000" in reason
    assert "rebuild it" in reason


def test_the_built_extension_was_built_from_the_source_beside_it():
    """A stale build would quietly turn every native test into a skip: fail here instead, saying rebuild."""
    try:
        _ucp = importlib.import_module("datamover.backends.ucx._ucp")
    except ImportError as exc:
        pytest.skip(f"the native extension was not built ({exc})")
    source = Path(ucx_rma.__file__).with_name("_ucp.c")
    assert _ucp.SOURCE_SHA256 == hashlib.sha256(source.read_bytes()).hexdigest(), ucx_rma.data_path()


def test_without_the_extension_the_ctypes_path_is_chosen_and_says_why(monkeypatch):
    monkeypatch.delenv("DATAMOVER_UCX_NATIVE", raising=False)
    monkeypatch.setitem(sys.modules, "datamover.backends.ucx._ucp", None)  # as if it had not been built
    lib, reason = ucx_rma._native_state.__wrapped__()
    assert lib is None and reason.startswith("ctypes: the native extension datamover.backends.ucx._ucp was not built")


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("pause_us", [0, 5])
def test_both_paths_move_permuted_rows_one_sided(target, path, op, pause_us):
    """Every row lands where it should, whichever path posts it (and however long the waiter pauses between
    progress calls that found nothing)."""
    n, bs = 512, 4096
    with Agent(f"native-{path}", {"backends": {"ucx": {**TCP, "drive_pause_us": pause_us}}}) as agent:
        backend = agent.backend("ucx")
        assert (backend._progress is not None) == (path == "native")
        mine, theirs = HostBuffer(agent, n * bs), RemoteBuffer(target, n * bs)
        agent.add_remote(target.metadata())
        data = np.random.default_rng(3).integers(0, 256, n * bs, dtype=np.uint8)
        perm = np.random.default_rng(4).permutation(n)
        if op == "WRITE":
            mine.write(0, data.tobytes())
        else:
            theirs.write(0, data.tobytes())
        local, remote = mine.descs(np.arange(n) * bs, bs), theirs.descs(perm * bs, bs)
        posted = []
        spy = pytest.MonkeyPatch()
        for name in ("post_native", "post_rows"):
            real = getattr(ucx_rma, name)
            spy.setattr(ucx_rma, name, lambda *args, real=real, name=name: posted.append(name) or real(*args))
        try:
            for _ in range(2):
                assert agent.transfer(op, local, remote, target.name).wait() == XferState.DONE
        finally:
            spy.undo()
        assert posted == ["post_native" if path == "native" else "post_rows"] * 2
        if op == "WRITE":
            got = np.frombuffer(theirs.read(0, n * bs), dtype=np.uint8).reshape(n, bs)
            assert np.array_equal(got[perm], data.reshape(n, bs))
        else:
            got = np.frombuffer(mine.read(0, n * bs), dtype=np.uint8).reshape(n, bs)
            assert np.array_equal(got, data.reshape(n, bs)[perm])
        assert backend.counts["one-sided"] >= 2 and backend.counts["served by the owner"] == 0
        theirs.free()


@needs_native
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_waiter_looks_at_its_flush_and_the_clock_only_every_few_empty_progress_calls(target, op, monkeypatch):
    """The drive loop asks UCX again at once after a progress that found nothing; only every DRIVE_LOOK_EVERY (8)
    of those in a row does it take the flush's lock and read the clock, and the flush is seen to end after the
    progress that ended it (never late, at one of those looks).

    The waiter is made the only thread that progresses the worker: the service thread hands a request nobody
    drives yet to the native progress thread after a 2 ms grace, which a loaded machine can take between post()
    and wait() (that thread then ends the flush and the waiter sees it late: once, two suites side by side); here
    the grace is lifted once connected, and the native thread is held outside UCX (``quiesce``) meanwhile, since
    a burst it began before the waiter's hold can end the flush too (seen at load 13-18)."""
    from datamover.backends.ucx import _ucp, one_sided

    n, bs = 256, 4096
    with Agent("native-looks", {"backends": {"ucx": TCP}}) as agent:
        mine, theirs = HostBuffer(agent, n * bs), RemoteBuffer(target, n * bs)
        agent.add_remote(target.metadata())
        data = np.random.default_rng(5).integers(0, 256, n * bs, dtype=np.uint8)
        (mine if op == "WRITE" else theirs).write(0, data.tobytes())
        local, remote = mine.descs(np.arange(n) * bs, bs), theirs.descs(np.arange(n)[::-1] * bs, bs)
        # connected first: a request posted before its peer is ready goes through the service thread, which needs
        # the grace; from here each is posted by the caller and driven by its waiter alone
        assert agent.transfer(op, local, remote, target.name).wait() == XferState.DONE
        monkeypatch.setattr(one_sided, "_DIRECT_GRACE_S", 1e9)
        progress = agent.backend("ucx")._progress
        progress.quiesce()
        try:
            before = _ucp.drive_stats()
            for _ in range(5):
                assert agent.transfer(op, local, remote, target.name).wait() == XferState.DONE
            after = _ucp.drive_stats()
        finally:
            progress.resume()
        d = {k: after[k] - before[k] for k in after}
        assert d["drives"] >= 1 and d["progress"] > d["empty"] >= d["drives"]  # some progress did work
        assert d["looks"] <= d["empty"] // 8 + d["drives"] and d["late"] == 0 and d["pauses"] == 0
        got = (theirs if op == "WRITE" else mine).read(0, n * bs)
        assert got == data.reshape(n, bs)[::-1].tobytes()  # either way block i is the far side's n-1-i
        theirs.free()


@needs_native
def test_a_target_is_served_by_the_native_thread_not_by_python(monkeypatch):
    """Puts over tcp need the target to progress: its native thread does, its service thread never touches UCX."""
    with Agent("native-owner", {"backends": {"ucx": TCP}}) as owner:
        backend = owner.backend("ucx")
        assert backend._progress is not None and not backend._ucx_watched
        assert backend.describe()["UCX progress"] == "a native thread on UCX's event fd"
        calls = []
        worker = backend._worker
        monkeypatch.setattr(backend, "_worker", _Spy(worker, calls))
        mem = HostBuffer(owner, 1 << 20)
        with RemotePeer("native-writer", {"backends": {"ucx": TCP}}, env={"UCX_TLS": "tcp,self"}) as writer:
            writer.call("add_remote", owner.metadata())
            handle, _ = writer.call("alloc", 1 << 20)
            writer.call("write", handle, 0, bytes(range(256)) * 4096)
            before = backend._progress.stats["bursts"]
            for _ in range(3):
                addrs = mem.descs(np.arange(256) * 4096, 4096).addr
                xid = writer.call("start_transfer", "WRITE", handle, "native-owner", addrs, [4096] * 256)
                assert writer.call("wait_transfer", xid) == "DONE"
            assert mem.read(0, 1 << 20) == bytes(range(256)) * 4096
            assert backend._progress.stats["bursts"] > before
        assert calls == [], f"the service thread progressed UCX itself: {calls[:3]}"


class _Spy:
    """A ucxx worker whose progress calls are recorded (any other attribute is the worker's)."""

    def __init__(self, worker, calls):
        self._worker, self._calls = worker, calls

    def progress_once(self):
        self._calls.append("progress_once")
        return self._worker.progress_once()

    def progress(self):
        self._calls.append("progress")
        return self._worker.progress()

    def __getattr__(self, name):
        return getattr(self._worker, name)


@needs_native
def test_a_target_whose_native_thread_is_held_serves_nothing_until_released():
    """The native thread is what serves a tcp target: held off its worker, a peer's WRITE stays in flight."""
    with Agent("native-held", {"backends": {"ucx": TCP}}) as owner:
        backend = owner.backend("ucx")
        progress = backend._progress
        mem = HostBuffer(owner, 16 * 4096)
        with RemotePeer("native-held-writer", {"backends": {"ucx": TCP}}, env={"UCX_TLS": "tcp,self"}) as writer:
            writer.call("add_remote", owner.metadata())
            handle, _ = writer.call("alloc", 16 * 4096)
            writer.call("write", handle, 0, b"".join(bytes([i + 1]) * 4096 for i in range(16)))
            addrs = mem.descs(np.arange(16)[::-1] * 4096, 4096).addr  # block i to slot 15 - i
            xid = writer.call("start_transfer", "WRITE", handle, "native-held", addrs, [4096] * 16)
            assert writer.call("wait_transfer", xid) == "DONE"  # connected, rkeys known: one-sided from here on
            mem.write(0, bytes(16 * 4096))
            progress.hold()
            try:
                held_and_idle(progress, backend._worker)
                before = progress.stats
                xid = writer.call("start_transfer", "WRITE", handle, "native-held", addrs, [4096] * 16)
                event_arrives(backend._worker)  # known point: the puts reached the target's socket
                # they wait there for its progress: not a byte has landed
                assert mem.read(0, 16 * 4096) == bytes(16 * 4096)
                assert progress.stats["progressed"] == before["progressed"]
            finally:
                progress.release()
            assert writer.call("wait_transfer", xid) == "DONE"
            after = progress.stats
            assert after["held"] == 0 and after["holds"] == before["holds"]
            assert mem.read(0, 16 * 4096) == b"".join(bytes([16 - j]) * 4096 for j in range(16))
        assert backend.describe()["native progress"]["progressed"] >= after["progressed"]


@needs_native
def test_a_waiter_drives_its_own_request_and_wakes_no_other_thread(target):
    """A posted one-sided request holds the native thread off the worker until its flush ends: its waiter drives
    it, and neither the progress thread nor the service thread wakes for it; nobody waiting, the service
    thread hands it to the native thread (unhold) and it completes anyway."""
    n, bs = 16, 4096
    with Agent("native-waiter", {"backends": {"ucx": TCP}}) as agent:
        backend = agent.backend("ucx")
        mine, theirs = HostBuffer(agent, n * bs), RemoteBuffer(target, n * bs)
        agent.add_remote(target.metadata())
        local, remote = mine.descs(np.arange(n) * bs, bs), theirs.descs(np.arange(n) * bs, bs)
        xfer = agent.make_transfer("WRITE", agent.prepare(local), None, agent.prepare(remote, target.name), None)
        xfer.post().wait()  # connected, rkeys unpacked
        progress = backend._progress
        before = progress.stats
        for _ in range(50):
            assert xfer.post().wait() == XferState.DONE
        after = progress.stats
        assert after["holds"] - before["holds"] == 50 and after["held"] == 0  # each request held the thread off
        # the waiter alone drives it: with the thread held off the worker by the test as well (asleep on the
        # hold, UCX's fd out of its set) and the service thread not progressing UCX, 50 transfers complete, and
        # the thread neither progressed nor was woken by UCX for them. (Between transfers, unheld, an event
        # such as a late ack or a keepalive may wake it: not counted, it depends on the machine's load.)
        progress.hold()
        try:
            held_and_idle(progress, backend._worker)
            before = progress.stats
            for _ in range(50):
                assert xfer.post().wait() == XferState.DONE
            after = progress.stats
        finally:
            progress.release()
        assert after["progressed"] == before["progressed"] and after["wakeups"] == before["wakeups"]
        assert after["holds"] - before["holds"] == 50 and after["held"] == 1
        assert not backend._directs
        # nobody waits: the service thread gives the request to the native thread, which finishes it
        xfer.post()
        deadline = time.monotonic() + 60
        while xfer._completion.finished_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert xfer._completion.finished_at is not None and xfer.state == XferState.DONE
        assert backend._progress.stats["held"] == 0
        theirs.free()


@needs_native
def test_native_post_refuses_rows_that_are_not_an_n_by_5_uint64_array():
    from datamover.backends.ucx import _ucp

    assert ucx_rma.native() is _ucp  # bound to ucxx's libucp
    with pytest.raises(ValueError, match=r"\(n, 5\) uint64"):
        _ucp.post(False, 0, np.zeros((2, 4), dtype=np.uint64).ravel()[:7].copy())
    with pytest.raises(ValueError):
        _ucp.post(False, 0, np.zeros((2, 5), dtype=np.float64))
    with pytest.raises(TypeError):
        _ucp.post(False, 0, [1, 2, 3, 4, 5])


@needs_native
@pytest.mark.parametrize("poll_us", [0, 100])
def test_a_native_thread_that_polls_after_work_serves_a_stream_and_still_respects_holds(poll_us):
    """With progress_poll_us, the thread looks again on its own timer after work (polls counted) instead of
    being woken by each arriving segment; off, it never does. Either way a hold keeps it off the worker."""
    params = {**TCP, "progress_poll_us": poll_us}
    with Agent(f"native-poll{poll_us}", {"backends": {"ucx": params}}) as owner:
        backend = owner.backend("ucx")
        progress = backend._progress
        assert ("polling every 100 us" in backend.describe()["UCX progress"]) == (poll_us > 0)
        n, bs = 256, 4096
        mem = HostBuffer(owner, n * bs)
        blocks = b"".join(bytes([i % 251 + 1]) * bs for i in range(n))
        with RemotePeer(f"native-poll{poll_us}-writer", {"backends": {"ucx": TCP}}, env={"UCX_TLS": "tcp,self"}) as w:
            w.call("add_remote", owner.metadata())
            handle, _ = w.call("alloc", n * bs)
            w.call("write", handle, 0, blocks)
            addrs = mem.descs(np.arange(n)[::-1] * bs, bs).addr  # block i to slot n-1-i
            before = progress.stats
            for _ in range(3):
                xid = w.call("start_transfer", "WRITE", handle, owner.name, addrs, [bs] * n)
                assert w.call("wait_transfer", xid) == "DONE"
            want = b"".join(blocks[(n - 1 - j) * bs : (n - j) * bs] for j in range(n))
            assert mem.read(0, n * bs) == want
            after = progress.stats
            assert after["progressed"] > before["progressed"]
            assert (after["polls"] > before["polls"]) == (poll_us > 0)
            mem.write(0, bytes(n * bs))
            progress.hold()
            try:
                held_and_idle(progress, backend._worker)
                before = progress.stats
                xid = w.call("start_transfer", "WRITE", handle, owner.name, addrs, [bs] * n)
                event_arrives(backend._worker)  # known point: the puts reached the target's socket
                assert mem.read(0, n * bs) == bytes(n * bs)
                held = progress.stats
                assert held["progressed"] == before["progressed"] and held["polls"] == before["polls"]
            finally:
                progress.release()
            assert w.call("wait_transfer", xid) == "DONE"
            assert mem.read(0, n * bs) == want
        assert backend.describe()["native progress"]["polls"] >= after["polls"]


@needs_native
def test_the_native_progress_thread_is_named_and_sleeps_on_its_timer_without_slack():
    """The thread shows as dm-ucx-progress (top, perf); its timer polls of tens of microseconds are not stretched by
    the default 50 us timer slack (1 us instead)."""
    import glob
    import os

    with Agent("native-slack", {"backends": {"ucx": TCP}}) as agent:
        assert agent.backend("ucx")._progress is not None
        tids = [t.rsplit("/", 1)[1] for t in glob.glob(f"/proc/{os.getpid()}/task/*")]
        mine = [t for t in tids if open(f"/proc/{os.getpid()}/task/{t}/comm").read().strip() == "dm-ucx-progress"]
        assert mine
        assert {int(open(f"/proc/{t}/timerslack_ns").read()) for t in mine} == {1000}


@needs_native
@pytest.mark.parametrize(
    "key",
    [
        "progress_poll_us", "progress_spin_us", "far_progress_spin_us", "far_progress_poll_us", "drive_pause_us",
        "far_drive_pause_us", "far_read_pause_us", "far_stream_poll_us",
    ],
)  # fmt: skip
@pytest.mark.parametrize("bad", [-1, 1_000_001, "100", True, None])
def test_a_poll_interval_out_of_range_is_refused_naming_the_parameter(key, bad):
    from datamover.errors import InvalidParameter

    with Agent("native-poll-bad", {"backends": {"ucx": {**TCP, key: bad}}}) as agent:
        with pytest.raises(InvalidParameter, match=key):
            agent.backend("ucx")  # started on first use


@needs_native
def test_the_native_thread_refuses_times_out_of_range_at_start_and_tune():
    from datamover.backends.ucx import _ucp

    with Agent("native-poll-ok", {"backends": {"ucx": TCP}}) as agent:
        worker = agent.backend("ucx")._worker.handle
        for poll_s in (-1e-6, 1.5, float("nan")):
            with pytest.raises(ValueError, match="poll_s"):
                _ucp.Progress(worker, 0.0, -1, poll_s)
            with pytest.raises(ValueError, match="stream_poll_s"):
                _ucp.Progress(worker, 0.0, -1, 0.0, poll_s)
        progress = agent.backend("ucx")._progress
        for times in ((-1e-6, 0.0), (0.0, 1.5), (float("nan"), 0.0), (2.0, 0.0), (0.0, 0.0, 1.5), (0.0, 0.0, -1.0)):
            with pytest.raises(ValueError, match="spin_s, poll_s and stream_poll_s must be in"):
                progress.tune(*times)


@pytest.mark.parametrize("bad", [-1, 1 << 41, 1.5, True, "2M", None])
def test_far_stream_poll_bytes_must_be_a_whole_number(bad):
    from datamover.errors import InvalidParameter

    with Agent("stream-bytes-bad", {"backends": {"ucx": {**TCP, "far_stream_poll_bytes": bad}}}) as agent:
        with pytest.raises(InvalidParameter, match="far_stream_poll_bytes"):
            agent.backend("ucx")  # started on first use


@needs_native
def test_a_peer_on_this_machine_keeps_the_near_waiting_settings():
    """The far_ settings are for peers on other machines only: over loopback neither side takes them."""
    far = {**TCP, "far_drive_spin_us": 1234, "far_progress_spin_us": 55}
    env = {"UCX_TLS": "tcp,self"}
    with (
        Agent("native-near", {"backends": {"ucx": far}}) as agent,
        RemotePeer("native-near-target", {"backends": {"ucx": far}}, env=env) as peer,
    ):
        agent.add_remote(peer.metadata())
        mem, remote = HostBuffer(agent, 4096), RemoteBuffer(peer, 4096)
        agent.add_remote(peer.metadata())
        assert agent.transfer("WRITE", mem.descs([0], [4096]), remote.descs([0], [4096]), peer.name).wait()
        assert agent.backend("ucx").describe()["peers on other machines"] == {}
        assert peer.call("describe", "ucx")["UCX progress"] == "a native thread on UCX's event fd"


@needs_native
def test_the_status_values_the_extension_compares_against_are_ucxs():
    """_ucp.c writes UCX's status values out (no headers here); each must be the loaded UCX's, by its own text. A
    wrong UCS_ERR_BUSY (once -4, UCX's "Out of memory") made every busy arm look like a failure: the target's
    thread then slept 1 ms instead of progressing at once."""
    texts = {
        "UCS_OK": "Success",
        "UCS_INPROGRESS": "Operation in progress",
        "UCS_ERR_NO_MESSAGE": "No pending message",
        "UCS_ERR_BUSY": "Device is busy",
        "UCS_ERR_CANCELED": "Request canceled",
    }
    codes = ucx_rma.native().status_codes()
    assert set(codes) == set(texts)
    assert {name: ucx_rma.status_text(value) for name, value in codes.items()} == texts


NO_CMA = {"ucx_config": {"TLS": "^cma"}, "direct_cma": False}  # get emulated over shared memory: the target answers


@needs_native
def test_a_target_woken_over_shared_memory_progresses_again_at_once_instead_of_sleeping():
    """Over shared memory without cma each get is answered by the target's thread. Woken by the reader's signal,
    its next arm says busy (the signal is read there): it must progress again at once (busy), never take the
    1 ms fallback for an arm that failed (unarmed)."""
    with Agent("native-shm-owner", {"backends": {"ucx": NO_CMA}}) as owner:
        backend = owner.backend("ucx")
        progress = backend._progress
        n, bs = 16, 65536
        mem = HostBuffer(owner, n * bs)
        blocks = b"".join(bytes([i + 1]) * bs for i in range(n))
        mem.write(0, blocks)
        with RemotePeer("native-shm-reader", {"backends": {"ucx": NO_CMA}}, env={"UCX_TLS": "^cma"}) as reader:
            reader.call("add_remote", owner.metadata())
            handle, _ = reader.call("alloc", n * bs)
            addrs = mem.descs(np.arange(n)[::-1] * bs, bs).addr  # slot n-1-i to block i
            before = progress.stats
            for _ in range(5):
                xid = reader.call("start_transfer", "READ", handle, owner.name, addrs, [bs] * n)
                assert reader.call("wait_transfer", xid) == "DONE"
            after = progress.stats
            assert reader.call("read", handle, 0, n * bs) == b"".join(bytes([n - j]) * bs for j in range(n))
        assert after["wakeups"] > before["wakeups"]
        assert after["busy"] > before["busy"]
        assert after["unarmed"] == before["unarmed"]
