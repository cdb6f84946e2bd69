"""posix READs that time out or are released while a preadv or native AIO is in flight: what the destination
holds when ERR is seen (or ``release`` returned) is what it holds after; no byte of the READ lands later.

The fault is the synchronous path's preadv, or the AIO reaper's io_submit or io_getevents, held at a known point
(before the kernel sees it) until the test lets it go; a watcher thread polls the transfer's state until its
deadline has turned it ERR. Nothing waits for a fixed time.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix.aio import aio_available
from datamover.errors import TransferTimeout
from datamover.testing.waiting import HeldOnce, cut_short, until

B = 4096
N = 8


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_a_read_cut_short_mid_preadv_lands_nothing_after_err(tmp_path, monkeypatch, end):
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}  # the pool's synchronous path
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(3).integers(0, 256, N * B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=N * B, direct=False)
        mem[:] = 0xAA
        held = HeldOnce("the preadv")
        monkeypatch.setattr(os, "preadv", held.wrap(os.preadv))
        xfer = agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * B, B), timeout=0.5)
        assert held.reached.wait(60), "the READ never reached preadv"
        changed = cut_short(xfer, xfer._completion, end, mem.tobytes, held)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * B, B)).wait() == (
            XferState.DONE
        )
        assert np.array_equal(mem, data)


class _HeldAio:
    """libc for ``aio``: counts the I/Os in flight (submitted, not yet reaped) and holds the ``nth`` call of
    syscall ``nr`` (io_submit or io_getevents) before the kernel sees it, until the test lets it go."""

    def __init__(self, real, nr: int, nth: int) -> None:
        self.real, self.nr, self.nth = real, nr, nth
        self.calls = 0
        self.lock = threading.Lock()
        self.in_flight = 0
        self.submits_after_err = 0
        self.err_seen = False
        self.reached, self.go, self.returned = threading.Event(), threading.Event(), threading.Event()

    def syscall(self, nr, *args):
        from datamover.backends.posix import aio

        hold = False
        if nr == self.nr:
            with self.lock:
                self.calls += 1
                hold = self.calls == self.nth
        if hold:
            self.reached.set()
            assert self.go.wait(60), "the test never let the held syscall go"
        ret = self.real.syscall(nr, *args)
        with self.lock:
            if nr == aio._NR_SUBMIT and ret > 0:
                self.in_flight += ret
                self.submits_after_err += self.err_seen
            elif nr == aio._NR_GETEVENTS and ret > 0:
                self.in_flight -= ret
        if hold:
            self.returned.set()
        return ret


@pytest.mark.skipif(not aio_available()[0], reason="native AIO unavailable here")
@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("held", ["io_submit", "io_getevents"])
def test_an_aio_read_cut_short_is_reaped_before_err(tmp_path, monkeypatch, end, held):
    """Two of the READ's eight I/Os go out in post(); the reaper's next io_submit (a top-up, past its check for
    a cancel) or its first io_getevents (both I/Os in flight) is held while the deadline passes or ``release``
    runs. ERR is seen only once every I/O submitted was reaped, none is submitted after, and the destination
    at ERR is what it holds once everything settled."""
    from datamover.backends.posix import aio

    params = {"aio_depth": 2, "inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(4).integers(0, 256, 2 * N * B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=2 * N * B)
        slots = DescList.file(reg, np.arange(N) * 2 * B, B)  # gaps between rows: eight I/Os, not one
        mem[:] = 0xAA
        nr = aio._NR_SUBMIT if held == "io_submit" else aio._NR_GETEVENTS
        libc = _HeldAio(aio._libc, nr, 2 if held == "io_submit" else 1)  # io_submit 1 runs in post()
        monkeypatch.setattr(aio, "_libc", libc)
        xfer = agent.transfer("READ", DescList.blocks(mem, B), slots, timeout=0.5)
        assert xfer.request.plan.aio is not None and not xfer.request.plan.inline
        assert libc.reached.wait(60), f"the READ's reaper never reached {held}"
        seen: dict = {}

        def at_err() -> None:
            with libc.lock:
                libc.err_seen = True
                seen["in flight"] = libc.in_flight

        changed = cut_short(xfer, xfer._completion, end, mem.tobytes, libc, at_err)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"
        assert seen["in flight"] == 0, f"ERR was reported with {seen['in flight']} I/O(s) of the READ in flight"
        assert libc.submits_after_err == 0, "an I/O of the READ was submitted after ERR"
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", DescList.blocks(mem, B), slots).wait() == XferState.DONE
        assert np.array_equal(mem.reshape(N, B), data.reshape(N, 2, B)[:, 0])


def test_a_second_thread_polling_sees_err_only_once_the_fence_held(tmp_path, monkeypatch):
    """Thread A's poll turns the READ ERR and waits on the fence for the held preadv; thread B polls meanwhile.
    B must not see ERR before A's fence is done: the destination B sees at ERR is what it holds after."""
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        path.write_bytes(np.random.default_rng(5).integers(0, 256, N * B, dtype=np.uint8).tobytes())
        reg = agent.register_file(path, size=N * B, direct=False)
        mem[:] = 0xAA
        held = HeldOnce("the preadv")
        reached, go = held.reached, held.go
        monkeypatch.setattr(os, "preadv", held.wrap(os.preadv))
        xfer = agent.transfer("READ", DescList.blocks(mem, B), DescList.file(reg, np.arange(N) * B, B), timeout=0.5)
        assert reached.wait(60), "the READ never reached preadv"
        fence = xfer._completion
        waits = [0]
        real_wait_for = fence._idle.wait_for

        def counted(pred, timeout=None):
            waits[0] += 1  # called with the condition's lock held
            return real_wait_for(pred, timeout)

        fence._idle.wait_for = counted  # a known point: a thread waiting on the fence
        seen: dict[str, bytes] = {}

        def poll(who: str) -> None:
            until(lambda: xfer.state == XferState.ERR, what="the READ timing out")
            seen[who] = mem.tobytes()

        a = threading.Thread(target=poll, args=("A",))
        a.start()
        until(lambda: waits[0] >= 1, what="A waiting on the fence")
        b = threading.Thread(target=poll, args=("B",))
        b.start()
        until(lambda: waits[0] >= 2 or not b.is_alive(), what="B waiting on the fence, or B seeing ERR")
        go.set()
        a.join(60)
        b.join(60)
        assert fence.wait(60)
        after = mem.tobytes()
        for who in "AB":
            changed = int(np.count_nonzero(np.frombuffer(after, np.uint8) != np.frombuffer(seen[who], np.uint8)))
            assert changed == 0, f"{changed} bytes of the READ landed after thread {who} saw ERR"


@pytest.mark.skipif(not aio_available()[0], reason="native AIO unavailable here")
def test_an_aio_read_whose_reaper_gets_no_pool_thread_is_reaped_by_its_cancel(tmp_path, monkeypatch, caplog):
    """The pool's one thread is held inside another READ's preadv, so the AIO READ's reaper is still queued behind
    it when the deadline passes: the cancel reaps the two I/Os post() submitted itself. Before, it waited on the
    fence for 10 s, warned that bytes may still land, and ERR came with both I/Os never reaped."""
    from datamover.backends.posix import aio

    params = {"threads": 1, "aio_depth": 2, "inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(2 * N * B)
        agent.register_memory(mem)
        data = np.random.default_rng(6).integers(0, 256, 2 * N * B, dtype=np.uint8)
        (tmp_path / "buffered.bin").write_bytes(data[: N * B].tobytes())
        (tmp_path / "direct.bin").write_bytes(data.tobytes())
        buffered = agent.register_file(tmp_path / "buffered.bin", size=N * B, direct=False)
        direct = agent.register_file(tmp_path / "direct.bin", size=2 * N * B)
        hog_dst, dst = DescList.blocks(mem[: N * B], B), DescList.blocks(mem[N * B :], B)
        held = HeldOnce("the preadv")
        reached, go = held.reached, held.go
        monkeypatch.setattr(os, "preadv", held.wrap(os.preadv))
        hog = agent.transfer("READ", hog_dst, DescList.file(buffered, np.arange(N) * B, B), timeout=60)
        assert reached.wait(60), "the first READ never reached preadv on the pool's thread"
        libc = _HeldAio(aio._libc, -1, 0)  # holds nothing: counts the I/Os in flight
        monkeypatch.setattr(aio, "_libc", libc)
        try:
            xfer = agent.transfer("READ", dst, DescList.file(direct, np.arange(N) * 2 * B, B), timeout=0.5)
            assert xfer.request.plan.aio is not None and not xfer.request.plan.inline
            assert libc.in_flight == 2, "post() did not submit the READ's first two I/Os"
            # ``error`` polls without running the reaper itself (``state`` would, before the deadline)
            until(lambda: xfer.error is not None, what="the READ timing out")
            with libc.lock:
                libc.err_seen = True
                in_flight = libc.in_flight
            assert isinstance(xfer.error, TransferTimeout)
            assert in_flight == 0, f"ERR was reported with {in_flight} I/O(s) of the READ in flight"
            assert not [r for r in caplog.records if r.name == "datamover.fence"], "the fence gave up waiting"
        finally:
            go.set()
        assert hog.wait() == XferState.DONE
        assert libc.submits_after_err == 0, "an I/O of the READ was submitted after ERR"
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", dst, DescList.file(direct, np.arange(N) * 2 * B, B)).wait() == XferState.DONE
        assert np.array_equal(mem[N * B :].reshape(N, B), data.reshape(N, 2, B)[:, 0])


@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("held", ["pwritev", "io_submit"])
def test_a_write_cut_short_writes_nothing_after_err(tmp_path, monkeypatch, end, held):
    """A WRITE's pwritev (the pool's synchronous path), or its AIO reaper's next io_submit (a top-up past its
    check for a cancel), is held while the deadline passes or ``release`` runs; at ERR the caller refills the
    source buffer with other bytes. The file must hold at ERR what it holds once everything settled: before,
    ERR came at once and the held call then wrote the refilled bytes into the file under the cut-off WRITE."""
    from datamover.backends.posix import aio

    if held == "io_submit" and not aio_available()[0]:
        pytest.skip("native AIO unavailable here")
    params = {"aio": held == "io_submit", "aio_depth": 2, "inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        src = aligned_empty(N * B)
        agent.register_memory(src)
        data = np.random.default_rng(7).integers(0, 256, N * B, dtype=np.uint8)
        src[:] = data
        path = tmp_path / "f.bin"
        path.write_bytes(bytes(2 * N * B))
        reg = agent.register_file(path, size=2 * N * B, direct=held == "io_submit")
        slots = DescList.file(reg, np.arange(N) * 2 * B, B)  # gaps between rows: eight I/Os, not one
        if held == "pwritev":
            hold = HeldOnce("the pwritev")
            monkeypatch.setattr(os, "pwritev", hold.wrap(os.pwritev))
        else:
            hold = _HeldAio(aio._libc, aio._NR_SUBMIT, 2)  # io_submit 1 runs in post()
            monkeypatch.setattr(aio, "_libc", hold)
        xfer = agent.transfer("WRITE", DescList.blocks(src, B), slots, timeout=0.5)
        assert (xfer.request.plan.aio is not None) == (held == "io_submit") and not xfer.request.plan.inline
        assert hold.reached.wait(60), f"the WRITE never reached {held}"
        seen: dict = {}

        def reuse() -> None:
            src[:] = 0xBB  # the caller's next use of its buffer, once the WRITE reported ERR
            if held == "io_submit":
                with hold.lock:
                    hold.err_seen = True
                    seen["in flight"] = hold.in_flight

        changed = cut_short(xfer, xfer._completion, end, path.read_bytes, hold, reuse)
        if end == "timeout":
            assert isinstance(xfer.error, TransferTimeout)
        assert changed == 0, f"{changed} bytes reached the file from the caller's buffer after the WRITE reported ERR"
        if held == "io_submit":
            assert seen["in flight"] == 0, f"ERR was reported with {seen['in flight']} I/O(s) of the WRITE in flight"
            assert hold.submits_after_err == 0, "an I/O of the WRITE was submitted after ERR"
        monkeypatch.undo()
        src[:] = data
        assert agent.transfer("WRITE", DescList.blocks(src, B), slots).wait() == XferState.DONE
        assert np.frombuffer(path.read_bytes(), np.uint8).reshape(N, 2, B)[:, 0].tobytes() == data.tobytes()


@pytest.mark.parametrize("end", ["timeout", "release"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_bounce_row_cut_short_starts_no_piece_after_the_cancel(tmp_path, monkeypatch, end, op):
    """An unaligned row of three bounce-buffer pieces (one syscall each) is cut short while its second piece's
    syscall is held: the fence waits for that syscall, and the third piece's never starts (it used to: the
    row ran to its end, past ERR or ``release``, however long that took)."""
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0, "bounce_bytes": 3 * B}  # a block a piece
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(3 * B + 1)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(6).integers(0, 256, 3 * B, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=3 * B)
        agent.backend("posix")
        assert reg.handles["posix"].direct
        mem[:] = 0xAA
        name = "preadv" if op == "READ" else "pwritev"
        real, calls, held = getattr(os, name), [], HeldOnce(f"the second piece's {name}")

        def counted(fd, views, offset):
            calls.append(offset)
            return (held.wrap(real) if offset == B else real)(fd, views, offset)

        monkeypatch.setattr(os, name, counted)
        local = DescList.from_columns(mem.ctypes.data + 1, 3 * B)  # one byte off: never aligned
        xfer = agent.transfer(op, local, DescList.file(reg, [0], [3 * B]), timeout=0.5)
        assert held.reached.wait(60), f"the row never reached its second {name}"
        changed = cut_short(xfer, xfer._completion, end, mem.tobytes, held)
        assert changed == 0, f"{changed} bytes reached the caller after ERR"
        assert calls == [0, B], f"{name} calls at {calls}: a piece started after the cancel"
        monkeypatch.undo()
        mem[:] = 0
        assert agent.transfer("READ", local, DescList.file(reg, [0], [3 * B])).wait() == XferState.DONE
        if op == "READ":
            assert np.array_equal(mem[1:], data)
        else:  # the first two pieces were written, the third not
            assert not np.any(mem[1 : 2 * B + 1] != 0xAA) and np.array_equal(mem[2 * B + 1 :], data[2 * B :])
