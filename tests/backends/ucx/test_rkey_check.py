"""Packed rkeys from a peer, parsed before UCX unpacks them; the unpacking process is another one, so a crash fails.

UCX's posix and sysv components map whatever segment a key names (a ``/proc/<pid>/fd/<fd>`` of any process, any
sysv id): before the check, a key naming a file or a sysv segment of this test process was mapped into the
unpacker, and a 7-byte key (UCX reads a key without knowing its length) left it hanging.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamover.agents.metadata import encode_metadata
from datamover.backends import backend_status
from datamover.backends.ucx.address import parse
from datamover.backends.ucx.rkeys import RkeyCheck
from datamover.backends.ucx.segments import POSIX, SYSV
from datamover.errors import DatamoverError, InvalidMetadata
from datamover.testing.remote import RemotePeer

from .control import FakeTarget

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

_PROCFS = 1 << 63


class Unpacker:
    """The rkey_target.py process: ``ask(key)`` is its answer; ``mapped()`` what of ours it has mapped."""

    def __init__(self, sentinel: Path, shmid: int) -> None:
        script = Path(__file__).with_name("rkey_target.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(sentinel), str(shmid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        info = json.loads(self._line(120))
        self.address, self.key, self.addr = bytes.fromhex(info["address"]), bytes.fromhex(info["key"]), info["addr"]
        self.sentinel, self.shmid = sentinel, shmid

    def _line(self, timeout: float) -> str:
        """The next answer line (``= ...``), UCX's log lines skipped."""
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
            if not line:
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                raise AssertionError(f"the unpacker answered nothing (exit status {self.proc.returncode})")
            if line.startswith("= "):
                return line[2:].strip()

    def ask(self, key: bytes, timeout: float = 60) -> str:
        self.proc.stdin.write(key.hex() + "\n")  # type: ignore[union-attr]
        return self._line(timeout)

    def mapped(self) -> list[str]:
        """Lines of the unpacker's memory map naming the sentinel file or the sentinel sysv segment."""
        with open(f"/proc/{self.proc.pid}/maps") as maps:
            return [
                ln
                for ln in maps
                if str(self.sentinel) in ln
                or (len(ln.split()) > 5 and "SYSV" in ln and ln.split()[4] == str(self.shmid))
            ]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # hung on a key (what the check prevents): end it
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    """A file this process holds open (``(path, fd)``): a key naming ``/proc/<our pid>/fd/<fd>`` must not map it."""
    path = tmp_path_factory.mktemp("rkeys") / "sentinel.bin"
    path.write_bytes(b"not yours " * 410)
    fd = os.open(path, os.O_RDWR)
    yield path, fd
    os.close(fd)


@pytest.fixture(scope="module")
def shmid():
    """A sysv segment of this process (IPC_PRIVATE, 4 KiB), removed after the module."""
    libc = ctypes.CDLL(None, use_errno=True)
    sid = libc.shmget(0, 4096, 0o1600)
    assert sid >= 0, os.strerror(ctypes.get_errno())
    yield sid
    libc.shmctl(sid, 0, None)  # IPC_RMID


@pytest.fixture(scope="module")
def unpacker(sentinel, shmid):
    u = Unpacker(sentinel[0], shmid)
    yield u
    u.close()


def _md(address: bytes, csum: int) -> int:
    return next(t.md for t in parse(address).transports if t.csum == csum)


def _key(md_map: int, payloads: list[bytes], tail: bytes = b"\xff", mem_type: int = 0) -> bytes:
    return struct.pack("<QB", md_map, mem_type) + b"".join(bytes([len(p)]) + p for p in payloads) + tail


def _posix_key(address: bytes, fd: int, length: int = 4096) -> bytes:
    """A key whose posix part names ``/proc/<this pid>/fd/<fd>``, mapped for ``length`` bytes."""
    seg = _PROCFS | os.getpid() | fd << 30
    return _key(1 << _md(address, POSIX), [struct.pack("<QQQ", seg, 0x10000000, length)])


def _sysv_key(address: bytes, sid: int, owner: int = 0x10000000) -> bytes:
    """A key whose sysv part names segment ``sid`` as if it sat at ``owner`` in the peer."""
    return _key(1 << _md(address, SYSV), [struct.pack("<IQ", sid, owner)])


def _alive(u: Unpacker) -> None:
    assert u.proc.poll() is None, f"the unpacker died (exit status {u.proc.returncode})"
    assert u.ask(u.key) == "got 7", "the unpacker no longer gets through a real key"


def test_a_real_key_is_accepted_and_used(unpacker):
    assert unpacker.ask(unpacker.key) == "got 7"


def test_a_key_naming_a_posix_segment_is_refused_before_ucx_maps_it(unpacker, sentinel):
    """Before: UCX mapped our sentinel file into the unpacker (``got 7 mapped``)."""
    said = unpacker.ask(_posix_key(unpacker.address, sentinel[1]))
    assert said.startswith("refused") and "posix shared memory" in said, said
    _alive(unpacker)


def test_a_key_naming_a_sysv_segment_is_refused_before_ucx_attaches_it(unpacker, shmid):
    """Before: UCX attached our sysv segment in the unpacker (``got 7 mapped``)."""
    said = unpacker.ask(_sysv_key(unpacker.address, shmid))
    assert said.startswith("refused") and "sysv shared memory" in said, said
    _alive(unpacker)


def test_a_key_shorter_than_its_header_is_refused(sentinel, shmid):
    """Before: UCX read the 7-byte key's map and type past its end and the unpacker never answered (60 s)."""
    u = Unpacker(sentinel[0], shmid)
    try:
        said = u.ask(bytes.fromhex("8bad526313187f"), timeout=60)
        assert said.startswith("refused") and "shorter than its memory domain map" in said, said
        _alive(u)
    finally:
        u.close()


def _mutations(real: bytes, hostile: list[bytes]) -> st.SearchStrategy[bytes]:
    flips = st.tuples(st.integers(0, len(real) - 1), st.integers(0, 255)).map(
        lambda f: real[: f[0]] + bytes([f[1]]) + real[f[0] + 1 :]
    )
    mds = st.integers(0, 63).map(lambda i: 1 << i)
    built = st.builds(
        _key,
        st.one_of(mds, st.integers(0, (1 << 64) - 1)),
        st.lists(st.one_of(st.binary(max_size=40), st.sampled_from([h[10:-1] for h in hostile])), max_size=4),
        st.one_of(st.just(b"\xff"), st.binary(max_size=8)),
        st.sampled_from([0, 0, 1, 9, 200]),
    )
    cut = st.integers(0, len(real) - 1).map(lambda n: real[:n])
    return st.one_of(flips, built, cut, st.sampled_from(hostile), st.binary(max_size=64))


@settings(max_examples=150)
@given(data=st.data())
def test_fuzzed_keys_never_kill_or_map_into_the_unpacker(unpacker, sentinel, shmid, data):
    hostile = [_posix_key(unpacker.address, sentinel[1]), _sysv_key(unpacker.address, shmid)]
    key = data.draw(_mutations(unpacker.key, hostile))
    if not key:
        return  # parse_rkeys refuses empty keys before any of this
    said = unpacker.ask(key)
    assert said in ("got 7", "unusable") or said.startswith("refused"), said


@pytest.mark.parametrize(
    "key, reason",
    [
        (b"\x01" + b"\0" * 7, "shorter than its memory domain map"),
        (_key(1, [b""], b"\xff\x00"), "bytes after its last field"),
        (_key(1, [b""], b""), "ends before its system device"),
        (_key(3, [b""], b""), "ends before memory domain 1's size"),
        (_key(1, [b"\1\2"]), "carries 2 bytes where its keys are empty"),
        (_key(1, [b""], b"\xff", mem_type=1), "memory type 1 in a key for DRAM"),
        (_key(1, [b""], b"\x00"), "system device 0x0 in a key for DRAM"),
        (_key(0, [], b"\x00"), "1 bytes after an empty memory domain map"),
        (struct.pack("<QB", 1, 0) + b"\x20abc", "run past its end"),
    ],
)
def test_malformed_keys_are_refused_with_the_reason(unpacker, key, reason):
    with pytest.raises(InvalidMetadata, match="agent 'p' sent an unusable rkey for region 5: .*" + reason):
        RkeyCheck(parse(unpacker.address)).check("agent 'p'", 5, "DRAM", key)


def test_device_keys_need_their_distances_terminated(unpacker):
    check = RkeyCheck(parse(unpacker.address))
    check.check("p", 1, "VRAM", _key(1, [b""], b"\x03" + b"\x01\x02\x03" + b"\xff", mem_type=1))
    with pytest.raises(InvalidMetadata, match="do not end with the terminator"):
        check.check("p", 1, "VRAM", _key(1, [b""], b"\x03" + b"\x01\x02\x03", mem_type=1))


@pytest.fixture(scope="module")
def initiator():
    with RemotePeer("rkey-initiator", {"backends": {"ucx": {}}}) as peer:
        yield peer


def test_a_welcome_with_a_key_naming_a_posix_segment_is_refused_naming_the_peer(initiator, unpacker, sentinel):
    """The initiator's own path: the welcome's rkeys are checked with the address it carries, before any get."""
    fake = FakeTarget()
    try:
        fake.address = unpacker.address  # a live worker on this host, so the segments its address names check out
        row = [3, "DRAM", 0, unpacker.addr, 4096, _posix_key(unpacker.address, sentinel[1])]
        fake.rkeys = msgpack.packb([row], use_bin_type=True)
        blob = encode_metadata(
            "fake", {"ucx": {"address": unpacker.address, "host": "127.0.0.1", "port": fake.port}}, []
        )
        initiator.call("add_remote", blob)
        with pytest.raises(
            DatamoverError, match=r"agent 'fake' sent an unusable rkey for region 3: .*posix shared memory"
        ):
            initiator.call("send_notification", "fake", b"x", timeout=20)
        initiator.call("remove_remote", "fake")
        assert initiator.call("ping", timeout=10) == initiator.pid
    finally:
        fake.close()
