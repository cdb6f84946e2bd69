"""posix syscalls that come back short after their transfer ended: a preadv or pwritev stuck past the fence's bound
(a hung device; the fence gives up and the transfer is ERR or released) that then returns having moved part of what
it was asked for. Nothing of the transfer may touch the caller's memory, nor take the caller's bytes to the file,
after that: no syscall resumes the rest, and a bounce-buffered row copies nothing in or out of the caller's buffer.

The fault is the file's preadv or pwritev (``os`` as ``rows`` calls it), at a known call: it moves the first half of
what it was asked for (through a buffered fd of its own, as the kernel did before the device hung), then waits until
the test lets it go, and returns that count (or, ``whole``, moves and returns everything). Each case runs on the
pool's synchronous path, where the fence may give up on a part; inline work, which nothing cancels, is
``test_stuck_inline_post``'s.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends import fence
from datamover.backends.posix import rows
from datamover.errors import TransferTimeout
from datamover.testing.waiting import BOUND_S, bounded, until

from .stuck import head

B = 4096
GRACE_S = 0.2  # FENCE_S in these tests: how long a cancel waits for the stuck syscall before it gives up


class _StuckShort:
    """``os.preadv`` or ``os.pwritev`` for the file ``path``: call ``nth`` on it moves the first ``part`` bytes asked
    for (all when ``part`` is None) through a buffered fd of its own, waits for ``go``, and returns that count.
    Every call on the file made once ``ended`` is set is recorded in ``after``."""

    def __init__(self, real, path, write: bool, nth: int = 1, part: int | None = None) -> None:
        self.real, self.write, self.nth, self.part = real, write, nth, part
        self.ino = os.stat(path).st_ino
        self.fd = os.open(path, os.O_RDWR)
        self.calls = 0
        self.after: list[int] = []
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.reached, self.go, self.returned = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, fd: int, views: list, offset: int) -> int:
        if os.fstat(fd).st_ino != self.ino:
            return self.real(fd, views, offset)
        with self.lock:
            self.calls += 1
            held = self.calls == self.nth
            if self.ended.is_set():
                self.after.append(offset)
        if not held:
            return self.real(fd, views, offset)
        first = head(views, self.part)
        moved = self.real(self.fd, first, offset)  # in the kernel, on the file, under an fd of its own
        self.reached.set()
        assert self.go.wait(BOUND_S), "the test never let the stuck syscall go"
        self.returned.set()
        return moved

    def close(self) -> None:
        self.go.set()
        os.close(self.fd)


@dataclass
class Case:
    """One resume point: the op, the row (memory offset, file offset, length), the file's bytes on disk and its
    registered size, which call of the file's ``name`` syscall sticks, and how much of it moves before."""

    op: str
    mem_at: int  # 0: the buffer's aligned start (a direct row); 1: one byte off (a bounce-buffered row)
    file_at: int
    length: int
    on_disk: int
    size: int
    name: str  # the syscall that sticks
    part: int | None  # what it moves before it sticks (None: all of it)
    direct: bool = True


CASES = {
    # vectored: the rows' own preadv / pwritev over the caller's buffer, resumed after a short one
    "rows READ": Case("READ", 0, 0, 8 * B, 8 * B, 8 * B, "preadv", 4 * B, direct=False),
    "rows WRITE": Case("WRITE", 0, 0, 8 * B, 8 * B, 8 * B, "pwritev", 4 * B, direct=False),
    # read_upto: a bounce-buffered READ's preadv into the bounce buffer, resumed, then copied to the caller
    "bounce READ": Case("READ", 1, 0, 3 * B, 3 * B, 3 * B, "preadv", B),
    "bounce READ, whole": Case("READ", 1, 0, 3 * B, 3 * B, 3 * B, "preadv", None),
    # vectored over the bounce buffer: a bounce-buffered WRITE's pwritev of the caller's bytes it holds
    "bounce WRITE": Case("WRITE", 1, 0, 3 * B, 3 * B, 3 * B, "pwritev", B),
    # read_block (read_upto): an unaligned WRITE's read of its partial first block, then the caller's bytes written
    "bounce WRITE's block read": Case("WRITE", 0, 100, B, 2 * B, 2 * B, "preadv", B // 2),
    "bounce WRITE's block read, whole": Case("WRITE", 0, 100, B, 2 * B, 2 * B, "preadv", None),
    # vectored on the buffered tail fd: an unaligned WRITE growing the file, straight from the caller's buffer
    "bounce WRITE past the end": Case("WRITE", 0, 2 * B, 100, 2 * B, 4 * B, "pwritev", 50),
}


#: each case ended by a release; the rows' own ones by a timeout too (it cancels as a release does)
ENDS = [(case, "release") for case in CASES] + [("rows READ", "timeout"), ("rows WRITE", "timeout")]


@pytest.mark.parametrize(("case", "end"), ENDS, ids=[f"{case}-{end}" for case, end in ENDS])
def test_a_syscall_back_short_after_err_is_not_resumed(tmp_path, monkeypatch, caplog, case, end):
    """The stuck call outlasts the fence (it gives up, the transfer is ERR or released), then comes back short: no
    further syscall on the file, and the caller's buffer (READ) or the file (WRITE, whose caller reuses its buffer
    at ERR) holds at ERR what it holds once the part returned. Before, the part resumed the rest after ERR."""
    c = CASES[case]
    monkeypatch.setattr(fence, "FENCE_S", GRACE_S)
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}  # the pool's synchronous path
    with Agent("p", {"backends": {"posix": params}}) as agent:
        agent.backend("posix")
        mem = aligned_empty(8 * B)
        agent.register_memory(mem)
        path = tmp_path / "f.bin"
        data = np.random.default_rng(8).integers(0, 256, c.on_disk, dtype=np.uint8)
        path.write_bytes(data.tobytes())
        reg = agent.register_file(path, size=c.size, direct=c.direct, extend=False)
        if c.direct and not reg.handles["posix"].direct:
            pytest.skip("this filesystem refuses O_DIRECT: no bounce buffer")
        mem[:] = 0xAA
        stuck = _StuckShort(getattr(os, c.name), path, write=c.name == "pwritev", part=c.part)
        monkeypatch.setattr(rows.os, c.name, stuck)
        try:
            local = DescList.from_columns(mem.ctypes.data + c.mem_at, c.length)
            xfer = agent.transfer(c.op, local, DescList.file(reg, [c.file_at], [c.length]), timeout=0.3)
            assert not xfer.request.plan.inline
            assert stuck.reached.wait(BOUND_S), f"the transfer never reached its {c.name}"
            with caplog.at_level(logging.WARNING, logger="datamover.fence"):
                if end == "release":
                    bounded(xfer.release, "Transfer.release")
                else:
                    until(lambda: xfer.state == XferState.ERR, what="the transfer timing out")
                    assert isinstance(xfer.error, TransferTimeout), xfer.error
            assert any("may still land" in r.getMessage() for r in caplog.records), "the fence did not give up"
            stuck.ended.set()
            snapshot = mem.tobytes if c.op == "READ" else path.read_bytes
            at_err = snapshot()
            if c.op == "WRITE":
                mem[:] = 0xBB  # the caller's next use of its buffer, once the WRITE ended
            stuck.go.set()
            assert stuck.returned.wait(BOUND_S), f"the stuck {c.name} never returned"
            assert xfer._completion.wait(BOUND_S), "the transfer's part never finished"
            assert stuck.after == [], f"{c.name}/other calls on the file after ERR, at offsets {stuck.after}"
            assert _changed(at_err, snapshot()) == 0, "bytes of the transfer moved after ERR"
        finally:
            stuck.close()


def _changed(before: bytes, after: bytes) -> int:
    """How many bytes differ between two snapshots, each byte one grew or shrank by counted as one."""
    n = min(len(before), len(after))
    diff = np.frombuffer(before[:n], np.uint8) != np.frombuffer(after[:n], np.uint8)
    return int(np.count_nonzero(diff)) + abs(len(before) - len(after))
