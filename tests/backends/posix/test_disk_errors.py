"""posix READs and WRITEs that meet a disk error (EIO) end in ERR with a TransferIOError naming the caller's
descriptor that holds the bad block, on the thread-pool path and on the native AIO path, merged or not.

There is no error device here (no device-mapper in this kernel), so the bad block is injected where our code
reads the kernel's answer: ``os.preadv``/``os.pwritev`` move the bytes before it and then fail with EIO, the way
a disk with one bad block answers; an AIO completion whose I/O covers it reads -EIO. A block bad only for AIO
(transient) is redone on the synchronous path: DONE, every byte right.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix import aio
from datamover.errors import TransferIOError

B = 4096
N = 8
GAP = 2  # blocks between descriptors 3 and 4 in the file: the agent merges 0-3 and 4-7 into two rows
OFFS = np.array([0, 1, 2, 3, 4 + GAP, 5 + GAP, 6 + GAP, 7 + GAP]) * B
BAD_DESC = 6  # the bad block is descriptor 6's second half, inside merged row 1
BAD = int(OFFS[BAD_DESC]) + B // 2


class BadBlock:
    """One bad 512-byte sector at file offset ``BAD`` of the file with inode ``ino``: the synchronous syscalls
    move what lies before it and then fail; with ``aio``, an AIO completion covering it reads -EIO."""

    def __init__(self, monkeypatch, ino: int, sync: bool = True, aio_too: bool = True) -> None:
        self.ino, self.hits = ino, {"sync": 0, "aio": 0}
        self.real_preadv, self.real_pwritev, self.libc = os.preadv, os.pwritev, aio._libc
        if sync:
            monkeypatch.setattr(os, "preadv", lambda fd, views, off: self._sync(self.real_preadv, fd, views, off))
            monkeypatch.setattr(os, "pwritev", lambda fd, views, off: self._sync(self.real_pwritev, fd, views, off))
        if aio_too and aio.aio_available()[0]:
            monkeypatch.setattr(aio, "_libc", self)

    def ours(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == self.ino
        except OSError:
            return False

    def _sync(self, real, fd, views, offset):
        total = sum(memoryview(v).nbytes for v in views)
        if not self.ours(fd) or not offset <= BAD < offset + total:
            return real(fd, views, offset)
        self.hits["sync"] += 1
        if offset == BAD - BAD % 512:
            raise OSError(errno.EIO, "Input/output error")
        keep, cut = BAD - offset, []  # the bytes before the bad sector move, and the call comes back short
        for v in views:
            v = memoryview(v).cast("B")
            if keep <= 0:
                break
            cut.append(v[:keep])
            keep -= v.nbytes
        return real(fd, cut, offset)

    def syscall(self, nr, *args):
        ret = self.libc.syscall(nr, *args)
        if nr == aio._NR_GETEVENTS and ret > 0:
            events = np.ctypeslib.as_array((ctypes.c_int64 * (4 * ret)).from_address(args[3].value)).reshape(ret, 4)
            for ev in events:
                iocb = np.frombuffer((ctypes.c_char * 64).from_address(int(ev[1]) & (2**64 - 1)), aio.IOCB)[0]
                start, vectored = int(iocb["offset"]), iocb["opcode"] in (aio.IOCB_CMD_PREADV, aio.IOCB_CMD_PWRITEV)
                if vectored:
                    iov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * int(iocb["nbytes"]))).from_address(
                        int(iocb["buf"])))  # fmt: skip
                    length = int(iov[1::2].sum())
                else:
                    length = int(iocb["nbytes"])
                if self.ours(int(iocb["fildes"])) and start <= BAD < start + length:
                    self.hits["aio"] += 1
                    ev[2] = -errno.EIO
        return ret


def _setup(tmp_path, params):
    agent = Agent("p", {"backends": {"posix": params}})
    mem = aligned_empty(N * B)
    agent.register_memory(mem)
    path = tmp_path / "f.bin"
    data = np.random.default_rng(8).integers(0, 256, int(OFFS[-1]) + B, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    reg = agent.register_file(path, size=data.shape[0])
    return agent, mem, reg, path, data


PATHS = {
    "sync": {"aio": False},
    "sync-pool": {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0},
    "aio": {},
    "aio-pool": {"inline_bytes": 0, "inline_batch_bytes": 0},
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_bad_block_ends_in_err_naming_the_callers_descriptor(tmp_path, monkeypatch, path, op):
    if path.startswith("aio") and not aio.aio_available()[0]:
        pytest.skip("native AIO unavailable here")
    agent, mem, reg, fpath, data = _setup(tmp_path, PATHS[path])
    with agent:
        mem[:] = 0x55
        bad = BadBlock(monkeypatch, os.stat(fpath).st_ino)
        xfer = agent.transfer(op, DescList.blocks(mem, B), DescList.file(reg, OFFS, B))
        assert len(xfer.request.local) == 2, "the agent merged the descriptors into two rows"
        assert (xfer.request.plan.aio is not None) == path.startswith("aio")
        with pytest.raises(TransferIOError) as info:
            xfer.wait()
        assert xfer.state == XferState.ERR
        err = info.value
        assert err.errno == errno.EIO and err.index == BAD_DESC and err.backend == "posix", str(err)
        assert bad.hits["sync"] >= 1 and (bad.hits["aio"] >= 1) == path.startswith("aio"), bad.hits
        monkeypatch.undo()
        if op == "READ":  # what lies before the bad sector in its row was read, as a disk would
            assert np.array_equal(mem[4 * B : BAD_DESC * B], data[int(OFFS[4]) : int(OFFS[BAD_DESC])])
        assert agent.transfer(op, DescList.blocks(mem, B), DescList.file(reg, OFFS, B)).wait() == XferState.DONE


@pytest.mark.parametrize("path", ["aio", "aio-pool"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_block_bad_only_for_aio_is_redone_and_every_byte_is_right(tmp_path, monkeypatch, path, op):
    if not aio.aio_available()[0]:
        pytest.skip("native AIO unavailable here")
    agent, mem, reg, fpath, data = _setup(tmp_path, PATHS[path])
    with agent:
        mem[:] = np.random.default_rng(9).integers(0, 256, mem.shape[0], dtype=np.uint8)
        want = mem.copy() if op == "WRITE" else data[OFFS[:, None] + np.arange(B)].reshape(-1)
        bad = BadBlock(monkeypatch, os.stat(fpath).st_ino, sync=False)
        assert agent.transfer(op, DescList.blocks(mem, B), DescList.file(reg, OFFS, B)).wait() == XferState.DONE
        assert bad.hits["aio"] >= 1
        monkeypatch.undo()
        if op == "READ":
            assert np.array_equal(mem, want)
        else:
            disk = np.frombuffer(fpath.read_bytes(), np.uint8)
            assert np.array_equal(disk[OFFS[:, None] + np.arange(B)].reshape(-1), want)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_failed_fdatasync_names_the_first_descriptor_in_that_file(tmp_path, monkeypatch, path):
    """fsync=True: fdatasync of the second of two files fails with EIO (the disk lost a write-back)."""
    if path.startswith("aio") and not aio.aio_available()[0]:
        pytest.skip("native AIO unavailable here")
    with Agent("p", {"backends": {"posix": {**PATHS[path], "fsync": True}}}) as agent:
        mem = aligned_empty(N * B)
        agent.register_memory(mem)
        regs = [agent.register_file(tmp_path / f"{k}.bin", size=4 * B) for k in range(2)]
        second = os.stat(tmp_path / "1.bin").st_ino
        real = os.fdatasync

        def lost(fd):
            if os.fstat(fd).st_ino == second:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd)

        monkeypatch.setattr(os, "fdatasync", lost)
        files = DescList.from_columns(np.tile(np.arange(4) * B, 2), B, [r.dev for r in regs for _ in range(4)], "FILE")
        with pytest.raises(TransferIOError, match="fdatasync") as info:
            agent.transfer("WRITE", DescList.blocks(mem, B), files).wait()
        assert info.value.errno == errno.EIO and info.value.index == 4, str(info.value)
