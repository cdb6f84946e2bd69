"""posix backend details: O_DIRECT read-modify-write, short I/O, EOF, fallback, fsync."""

import errno
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.errors import InvalidParameter, TransferIOError
from datamover.testing.waiting import HeldOnce

SIZE = 5 * 4096 + 123  # not a multiple of the O_DIRECT block


@pytest.fixture
def setup(tmp_path):
    # aio off: these tests patch os.preadv/os.pwritev, the path native AIO bypasses (tests/test_posix_aio.py covers it)
    agent = Agent("p", {"backends": {"posix": {"threads": 2, "aio": False}}})
    mem = aligned_empty(SIZE + 64)
    agent.register_memory(mem)
    path = tmp_path / "f.bin"
    reg = agent.register_file(path, size=SIZE)
    yield agent, mem, reg, path
    agent.close()


@settings(max_examples=40)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, SIZE - 1), st.integers(1, 3 * 4096), st.integers(0, 63)),
        min_size=1,
        max_size=8,
    )
)
def test_random_unaligned_io_matches_model(tmp_path_factory, ops):
    """Any mix of unaligned O_DIRECT writes and reads behaves like a plain byte array."""
    path = tmp_path_factory.mktemp("rmw") / "f.bin"
    with Agent("p", {"backends": {"posix": {}}}) as agent:
        mem = aligned_empty(SIZE + 64)
        agent.register_memory(mem)
        reg = agent.register_file(path, size=SIZE)
        agent.backend("posix")  # backends start lazily; this opens the file
        assert reg.handles["posix"].direct
        model = bytearray(SIZE)
        rng = np.random.default_rng(len(ops))
        for write, off, n, shift in ops:
            n = min(n, SIZE - off)
            local = DescList.from_columns(mem.ctypes.data + shift, n)
            remote = DescList.file(reg, [off], [n])
            if write:
                data = rng.bytes(n)
                mem[shift : shift + n] = np.frombuffer(data, np.uint8)
                agent.transfer("WRITE", local, remote).wait()
                model[off : off + n] = data
            else:
                mem[:] = 0
                agent.transfer("READ", local, remote).wait()
                assert mem[shift : shift + n].tobytes() == bytes(model[off : off + n])
        assert os.path.getsize(path) == SIZE, "read-modify-write changed the file size"
        assert path.read_bytes() == bytes(model)


def test_short_io_is_resumed(setup, monkeypatch):
    agent, mem, reg, path = setup
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = []

    def short(real):
        def call(fd, bufs, offset):
            bufs = list(bufs)
            calls.append(len(bufs))
            first = memoryview(bufs[0])
            # move at most 4096 bytes per call (aligned, so O_DIRECT still accepts it)
            return real(fd, [first[: min(4096, first.nbytes)]], offset)

        return call

    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    monkeypatch.setattr(os, "preadv", short(real_preadv))
    n = 4 * 4096
    mem[:n] = np.frombuffer(np.random.default_rng(3).bytes(n), np.uint8)
    blocks = DescList.blocks(mem[:n], 8192)
    slots = DescList.file(reg, [0, 8192], 8192)
    agent.transfer("WRITE", blocks, slots).wait()
    want = mem[:n].copy()
    mem[:n] = 0
    agent.transfer("READ", blocks, slots).wait()
    assert np.array_equal(mem[:n], want)
    assert len(calls) >= 8, "each short call should have been followed by another"
    monkeypatch.undo()
    assert path.read_bytes()[:n] == want.tobytes()


def test_read_past_end_is_an_error_not_zeros(setup):
    agent, mem, reg, path = setup
    os.truncate(path, 4096)  # behind the agent's back
    with pytest.raises(TransferIOError, match="past the end") as info:
        agent.transfer("READ", DescList.blocks(mem[: 3 * 4096], 4096), DescList.file(reg, [0, 4096, 8192], 4096)).wait()
    assert info.value.index in (0, 1, 2) and info.value.backend == "posix"
    with pytest.raises(TransferIOError, match="past the end"):
        agent.transfer(
            "READ", DescList.from_columns(mem.ctypes.data + 1, 100), DescList.file(reg, [5000], [100])
        ).wait()


def test_fallback_when_filesystem_refuses_direct(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with Agent("p", {"backends": {"posix": {}}}) as agent:
        mem = aligned_empty(8192)
        mem[:] = 7
        agent.register_memory(mem)
        reg = agent.register_file(tmp_path / "x.bin", size=8192)
        agent.backend("posix")  # starting the backend opens the file
        handle = reg.handles["posix"]
        assert not handle.direct and "refuses O_DIRECT" in handle.note
        agent.transfer("WRITE", DescList.from_buffers(mem), DescList.file(reg, [0], [8192])).wait()
        assert "refuses O_DIRECT" in agent.backend("posix").describe()["files"][str(tmp_path / "x.bin")]
    assert (tmp_path / "x.bin").read_bytes() == bytes([7]) * 8192


def test_fsync_option_syncs_written_files(tmp_path, monkeypatch):
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    for fsync in (False, True):
        with Agent("p", {"backends": {"posix": {"fsync": fsync}}}) as agent:
            mem = aligned_empty(4096)
            agent.register_memory(mem)
            reg = agent.register_file(tmp_path / f"s{fsync}.bin", size=4096)
            agent.transfer("WRITE", DescList.from_buffers(mem), DescList.file(reg, [0], [4096])).wait()
            assert bool(synced) == fsync
            if fsync:
                assert synced == [reg.handles["posix"].fd]


@pytest.mark.parametrize(
    "params, key",
    [
        ({"bounce_bytes": 8192}, "bounce_bytes"),  # no room for a block between the two partial ones: post() spun
        ({"bounce_bytes": 0}, "bounce_bytes"),
        ({"alignment": 0}, "alignment"),  # ZeroDivisionError at make time
        ({"alignment": 1000}, "alignment"),
        ({"mem_alignment": 0}, "mem_alignment"),
        ({"aio_depth": 0}, "aio_depth"),  # io_setup's EINVAL escaped post() untyped
    ],
)
def test_parameters_out_of_range_are_refused_when_the_backend_starts(params, key):
    with Agent("p", {"backends": {"posix": params}}) as agent:
        with pytest.raises(InvalidParameter, match=key) as info:
            agent.backend("posix")
        assert info.value.backend == "posix"


def test_an_unaligned_write_past_the_end_keeps_a_concurrent_write_that_grew_the_file(tmp_path, monkeypatch):
    """A file that writes grow (``extend=False``, as NIXL registers it): an unaligned WRITE at its start is held
    at its write while a second WRITE grows the file to 516 KiB and is DONE; the first then completes. Both are
    DONE, so both must be in the file (the bounce path used to write a whole block past the end and cut the file
    back to the end of its own bytes, the second WRITE's with it)."""
    path = tmp_path / "grown.bin"
    params = {"aio": False, "inline_bytes": 0, "inline_batch_bytes": 0}
    with Agent("p", {"backends": {"posix": params}}) as agent:
        mem = aligned_empty(2 * 4096)
        mem[:4096], mem[4096:] = 0x11, 0x22
        agent.register_memory(mem)
        reg = agent.register_file(path, size=1 << 20, extend=False)
        agent.backend("posix")
        assert reg.handles["posix"].direct and os.path.getsize(path) == 0
        held = HeldOnce("the unaligned WRITE's write")
        real = os.pwritev
        monkeypatch.setattr(
            os, "pwritev", lambda fd, views, off: (held.wrap(real) if off < 4096 else real)(fd, views, off)
        )
        first = agent.transfer(
            "WRITE", DescList.from_columns(mem.ctypes.data + 1, 100), DescList.file(reg, [10], [100])
        )
        assert held.reached.wait(60), "the unaligned WRITE never reached its write"
        second = agent.transfer(
            "WRITE", DescList.from_columns(mem.ctypes.data + 4096, 4096), DescList.file(reg, [512 << 10], [4096])
        )
        assert second.wait() == XferState.DONE
        held.go.set()
        assert first.wait() == XferState.DONE
    data = path.read_bytes()
    assert len(data) == (512 << 10) + 4096, "the file lost the second WRITE's end"
    assert data[10:110] == b"\x11" * 100 and data[512 << 10 :] == b"\x22" * 4096
    assert not any(data[:10]) and not any(data[110 : 512 << 10])


@pytest.mark.parametrize("direct", [True, False])
def test_a_registered_file_gone_when_the_backend_starts_is_a_typed_error(tmp_path, direct):
    """The backend opens registered files when it starts (lazily): one removed since is a TransferIOError naming
    it, buffered as well as O_DIRECT (the buffered open let a bare FileNotFoundError out)."""
    with Agent("p", {"backends": {"posix": {}}}) as agent:
        path = tmp_path / "gone.bin"
        agent.register_file(path, size=4096, direct=direct)
        path.unlink()
        with pytest.raises(TransferIOError, match=r"gone\.bin") as info:
            agent.backend("posix")
        assert info.value.errno == errno.ENOENT and info.value.backend == "posix"


def test_an_unaligned_write_past_the_end_of_a_file_renamed_since_it_was_registered(tmp_path):
    """The buffered write of a piece past the end goes to the registered file, renamed or not."""
    path = tmp_path / "grown.bin"
    with Agent("p", {"backends": {"posix": {}}}) as agent:
        mem = aligned_empty(4096)
        mem[:] = 0x33
        agent.register_memory(mem)
        reg = agent.register_file(path, size=1 << 20, extend=False)
        agent.backend("posix")
        path.rename(tmp_path / "moved.bin")
        local = DescList.from_columns(mem.ctypes.data + 1, 100)
        assert agent.transfer("WRITE", local, DescList.file(reg, [10], [100])).wait() == XferState.DONE
    assert (tmp_path / "moved.bin").read_bytes() == bytes(10) + b"\x33" * 100
