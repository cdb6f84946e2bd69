"""posix errors on contiguous descriptors the agent merged into one row name the caller's failing descriptor.

Issue 14, item 8: the file is truncated, or the disk fills, at a known byte; nothing is timed.
"""

import errno
import os

import numpy as np
import pytest

from datamover import Agent, DescList, aligned_empty
from datamover.errors import TransferIOError

B = 4096


@pytest.fixture(params=[False, True], ids=["sync", "aio"])
def setup(tmp_path, request):
    agent = Agent("p", {"backends": {"posix": {"aio": request.param}}})
    mem = aligned_empty(8 * B)
    agent.register_memory(mem)
    path = tmp_path / "f.bin"
    reg = agent.register_file(path, size=8 * B)
    yield agent, mem, reg, path
    agent.close()


def test_read_past_the_end_names_the_descriptor_that_runs_past_it(setup):
    agent, mem, reg, path = setup
    os.truncate(path, 2 * B + 100)  # descriptors 0 and 1 are whole, 2 runs past the end
    blocks, slots = DescList.blocks(mem[: 4 * B], B), DescList.file(reg, np.arange(4) * B, B)
    with pytest.raises(TransferIOError, match="past the end") as info:
        agent.transfer("READ", blocks, slots).wait()
    assert info.value.index == 2, str(info.value)


def test_unaligned_rows_read_past_the_end_name_the_descriptor_that_runs_past_it(setup):
    """Rows of 1000 bytes go through the O_DIRECT bounce buffer (or plain reads): the same naming."""
    agent, mem, reg, path = setup
    n = 1000
    os.truncate(path, 2 * n + 100)
    blocks, slots = DescList.blocks(mem[: 4 * n], n), DescList.file(reg, np.arange(4) * n, n)
    with pytest.raises(TransferIOError, match="past the end") as info:
        agent.transfer("READ", blocks, slots).wait()
    assert info.value.index == 2, str(info.value)


def test_a_full_disk_names_the_descriptor_being_written(tmp_path, monkeypatch):
    with Agent("p", {"backends": {"posix": {"aio": False}}}) as agent:
        mem = aligned_empty(4 * B)
        agent.register_memory(mem)
        reg = agent.register_file(tmp_path / "g.bin", size=4 * B, direct=False)  # a short write stays unaligned
        real = os.pwritev

        def fill_up(fd, views, offset):
            if offset == 0:  # one descriptor and a bit of the next fit, then the disk is full
                return real(fd, [memoryview(b"\0" * (B + 10))], offset)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwritev", fill_up)
        with pytest.raises(TransferIOError, match="space") as info:
            agent.transfer("WRITE", DescList.blocks(mem, B), DescList.file(reg, np.arange(4) * B, B)).wait()
        assert info.value.index == 1 and info.value.errno == errno.ENOSPC, str(info.value)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_a_bounce_row_failing_part_way_names_the_descriptor_of_the_failing_byte(tmp_path, monkeypatch, op):
    """Unaligned memory sends the merged row through the O_DIRECT bounce buffer: the disk takes (or gives) its
    first three blocks, then fails (ENOSPC on WRITE, EIO on READ); descriptor 3 holds the failing byte."""
    with Agent("p", {"backends": {"posix": {"aio": False}}}) as agent:
        mem = aligned_empty(8 * B + 1)
        agent.register_memory(mem)
        reg = agent.register_file(tmp_path / "g.bin", size=8 * B)
        agent.backend("posix")
        assert reg.handles["posix"].direct
        name, code = ("pwritev", errno.ENOSPC) if op == "WRITE" else ("preadv", errno.EIO)
        real = getattr(os, name)

        def fail_after_three_blocks(fd, views, offset):
            if offset == 0:
                return real(fd, [memoryview(views[0])[: 3 * B]], offset)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, name, fail_after_three_blocks)
        local = DescList.from_columns(mem.ctypes.data + 1 + np.arange(8) * B, B)  # 1 byte off: never aligned
        xfer = agent.transfer(op, local, DescList.file(reg, np.arange(8) * B, B))
        assert len(xfer.request.local) == 1, "the agent merged the descriptors into one row"
        with pytest.raises(TransferIOError) as info:
            xfer.wait()
        assert info.value.index == 3 and info.value.errno == code, str(info.value)
