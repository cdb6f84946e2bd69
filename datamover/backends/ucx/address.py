"""UCX worker addresses parsed by us before UCX sees them: a peer's bytes never reach ``ucp_ep_create`` unchecked.

UCX unpacks a worker address without knowing its length and asserts on what
it does not expect (a version other than 1 or 2 aborts the process). So the
address a peer sends in its hello or welcome is walked here first, field by
field, in the layout ``ucp_address_pack`` writes (src/ucp/wireup/address.c,
non-unified mode, address versions 1 and 2): every length must stay inside the
buffer, the walk must end exactly at its last byte, counts stay within UCX's
own limits (128 transports, 64 lanes, 64 memory domains), and every transport
it names that this worker also has must carry the device, interface and
endpoint address lengths this worker's own address gives that transport
(UCX's transports read their addresses with fixed sizes, so a shorter one
would be read past its end), and the shared-memory segments it names must be
live peers' FIFOs on this host (segments.py: UCX maps them unchecked).
``AddressCheck`` holds this worker's reference; ``check`` raises InvalidMetadata
naming what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ...errors import InvalidMetadata
from .segments import POSIX, Segments, posix_iface_length

MAX_ADDRESS = 1 << 16
_V1, _V2 = 0, 1
_HDR_DEBUG_INFO, _HDR_WORKER_UUID, _HDR_CLIENT_ID, _HDR_AM_ONLY = 1, 2, 4, 8
_FLAG_LAST, _FLAG_HAS_EP, _FLAG_NUM_PATHS, _FLAG_SYS_DEVICE = 0x80, 0x40, 0x40, 0x20
_MD_EMPTY_DEV, _MD_MASK = 0x80, 0x7F
_DEV_LEN_MASK, _IFACE_LEN_MASK = 0x1F, 0x3F
_NULL_RESOURCE = 0xFF
_MAX_RESOURCES, _MAX_LANES, _MAX_MDS, _MAX_PATHS = 128, 64, 64, 64
_ATTR_V1, _ATTR_V2 = 16, 8  # ucp_address_packed_iface_attr_t, ucp_address_v2_packed_iface_attr_t


@dataclass(frozen=True)
class Transport:
    """One transport entry of an address: its name checksum and the lengths of what UCX will read for it."""

    csum: int
    dev_len: int
    iface_len: int
    ep_lens: tuple[int, ...]
    iface: bytes = b""  # the interface address itself (shared-memory transports name their segment in it)
    at: int = 0  # where ``iface`` starts in the packed address
    dev: bytes = b""  # its device's address (shared-memory transports: the machine's system id)
    md: int = 0  # the sender's index of the memory domain it belongs to (what its packed rkeys name)


@dataclass(frozen=True)
class Address:
    version: int
    uuid: int
    transports: tuple[Transport, ...] = field(default=())


class _Reader:
    __slots__ = ("buf", "p")

    def __init__(self, buf: bytes) -> None:
        self.buf, self.p = buf, 0

    def byte(self, what: str) -> int:
        if self.p >= len(self.buf):
            raise InvalidMetadata(f"UCX address ends inside its {what} (at byte {self.p})")
        self.p += 1
        return self.buf[self.p - 1]

    def take(self, n: int, what: str) -> bytes:
        if self.p + n > len(self.buf):
            raise InvalidMetadata(f"UCX address ends inside its {what} ({n} bytes at byte {self.p})")
        self.p += n
        return self.buf[self.p - n : self.p]

    def extended(self, first: int, mask: int, version: int, what: str) -> int:
        """A value packed in the low bits of ``first``, or (v2, all those bits set) in the next byte."""
        value = first & mask
        if version == _V2 and value == mask:
            value = self.byte(what)
        return value


def parse(buf: bytes) -> Address:
    """Walk a packed worker address the way ``ucp_address_unpack`` will; raises InvalidMetadata."""
    if not isinstance(buf, bytes) or not 2 <= len(buf) <= MAX_ADDRESS:
        raise InvalidMetadata(f"a UCX address must be 2..{MAX_ADDRESS} bytes")
    r = _Reader(buf)
    head = r.byte("header")
    version = head & 0x0F
    if version == _V1:
        flags = head >> 4
    elif version == _V2:
        flags = r.byte("header flags")
    else:
        raise InvalidMetadata(f"UCX address version {version} is neither 1 nor 2 (UCX would abort on it)")
    if flags & ~(_HDR_DEBUG_INFO | _HDR_WORKER_UUID | _HDR_CLIENT_ID | _HDR_AM_ONLY):
        raise InvalidMetadata(f"UCX address header has unknown flags {flags:#x}")
    uuid = 0
    if version == _V1 or flags & _HDR_WORKER_UUID:
        (uuid,) = struct.unpack("<Q", r.take(8, "worker uuid"))
    if flags & _HDR_CLIENT_ID:
        r.take(8, "client id")
    if flags & _HDR_DEBUG_INFO:
        r.take(r.byte("worker name length"), "worker name")
    if r.p < len(buf) and buf[r.p] == _NULL_RESOURCE:
        raise InvalidMetadata("UCX address lists no transport")
    attr_len = _ATTR_V1 if version == _V1 else _ATTR_V2
    out: list[Transport] = []
    last_dev = False
    while not last_dev:
        md_byte = r.byte("memory domain index")
        empty = bool(md_byte & _MD_EMPTY_DEV)
        md = r.extended(md_byte, _MD_MASK, version, "memory domain index")
        dev_byte = r.byte("device address length")
        last_dev = bool(dev_byte & _FLAG_LAST)
        dev_len = r.extended(dev_byte, _DEV_LEN_MASK, version, "device address length")
        if dev_byte & _FLAG_NUM_PATHS:
            paths = r.byte("path count")
            if not 1 <= paths <= _MAX_PATHS:
                raise InvalidMetadata(f"UCX address gives a device {paths} paths")
        if dev_byte & _FLAG_SYS_DEVICE:
            r.byte("system device")
        if empty:
            if not last_dev or dev_len:
                raise InvalidMetadata("UCX address has an empty device that is not its last entry")
            continue  # the release version, carried in the md bits of the trailing empty device
        if md >= _MAX_MDS:
            raise InvalidMetadata(f"UCX address names memory domain {md} (UCX has at most {_MAX_MDS})")
        dev = r.take(dev_len, "device address")
        last_tl = False
        while not last_tl:
            if len(out) >= _MAX_RESOURCES:
                raise InvalidMetadata(f"UCX address lists more than {_MAX_RESOURCES} transports")
            (csum,) = struct.unpack("<H", r.take(2, "transport name checksum"))
            r.take(attr_len, "interface attributes")
            tl_byte = r.byte("interface address length")
            last_tl = bool(tl_byte & _FLAG_LAST)
            iface_len = r.extended(tl_byte, _IFACE_LEN_MASK, version, "interface address length")
            at = r.p
            iface = r.take(iface_len, "interface address")
            ep_lens: list[int] = []
            last_ep = not tl_byte & _FLAG_HAS_EP
            while not last_ep:
                if len(ep_lens) >= _MAX_LANES:
                    raise InvalidMetadata(f"UCX address lists more than {_MAX_LANES} endpoint addresses")
                n = r.byte("endpoint address length")
                r.take(n, "endpoint address")
                lane = r.byte("lane index")
                last_ep = bool(lane & _FLAG_LAST)
                if lane & _IFACE_LEN_MASK >= _MAX_LANES:
                    raise InvalidMetadata(f"UCX address names lane {lane & _IFACE_LEN_MASK}")
                ep_lens.append(n)
            out.append(Transport(csum, dev_len, iface_len, tuple(ep_lens), iface, at, dev, md))
    if r.p != len(buf):
        raise InvalidMetadata(f"UCX address has {len(buf) - r.p} bytes after its last device")
    if not out:
        raise InvalidMetadata("UCX address lists no transport")
    return Address(version, uuid, tuple(out))


class AddressCheck:
    """Peers' addresses checked against this worker's own: same format, only transports it has, same lengths."""

    def __init__(self, own: bytes) -> None:
        mine = parse(own)  # raises where this UCX packs addresses in a layout not known here (e.g. unified mode)
        self.version = mine.version
        self.uuid = mine.uuid
        self._known: dict[int, set[tuple[int, int, tuple[int, ...]]]] = {}
        for t in mine.transports:
            self._known.setdefault(t.csum, set()).add((t.dev_len, t.iface_len, t.ep_lens))
        self._segments = Segments(mine)  # measured now, while this worker's own FIFO segments exist

    def check(self, buf: bytes, who: str) -> Address:
        """``buf`` parsed, or InvalidMetadata naming ``who`` and the reason."""
        try:
            addr = parse(buf)
        except InvalidMetadata as exc:
            raise InvalidMetadata(f"{who} sent a malformed UCX worker address: {exc.reason}") from None
        if addr.version != self.version:
            raise InvalidMetadata(f"{who} sent a UCX address of version {addr.version + 1}, not {self.version + 1}")
        for t in addr.transports:
            shapes = self._known.get(t.csum)
            # a transport this worker lacks is skipped by UCX (its bytes are walked, not read); one it has is read
            # with that transport's own sizes, except posix's interface address, read as its flags say
            if shapes is None:
                continue
            if t.csum == POSIX:
                known = any(d == t.dev_len and e == t.ep_lens for d, _, e in shapes) and _posix_iface_ok(t.iface)
            else:
                known = (t.dev_len, t.iface_len, t.ep_lens) in shapes
            if not known:
                raise InvalidMetadata(
                    f"{who} sent a UCX address whose transport {t.csum:#06x} has addresses of unexpected lengths"
                )
        self._segments.check(addr, who)
        return addr


def _posix_iface_ok(iface: bytes) -> bool:
    """Whether a posix interface address is as long as its segment id's flags say: UCX packs 8 more bytes (the pid
    namespace) for a process outside the initial pid namespace (a container) and a directory name where the
    segment is a file outside /dev/shm, and reads them by those flags."""
    want = posix_iface_length(iface)
    return want is not None and want == len(iface)
