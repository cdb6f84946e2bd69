"""The shared-memory segments a peer's UCX address names, looked at on this host before UCX maps them.

UCX's shared-memory transports attach the FIFO segment a peer's address names
and read its header at once (``uct_mm_ep_t`` init, src/uct/sm/mm/base/mm_ep.c),
trusting the id: a posix id is ``/proc/<pid>/fd/<fd>`` (or a file name) that
UCX opens and maps for the FIFO's length whatever file it is, so an id naming an
empty file of the claimed process faults on that first read (SIGBUS: the
process dies) and a short file or sysv segment lets UCX read and write past its
end. So each segment UCX would attach is checked first: a posix one that can be
opened must be a UCX posix segment file (by its name), regular, at least as
long as this worker's own FIFO, whose FIFO header names the claimed process,
alive (one that cannot be opened UCX finds unreachable and does not attach: the
other transports carry the traffic); a sysv one (UCX always attaches those)
must be in this host's segment table and at least as long as this worker's
own. Addresses of another machine (another system id) or of a pid namespace
UCX cannot reach are not attached by UCX and are left alone.

Left open: a hostile process on this host can still swap its own fd between
this check and UCX's open of it; and once connected, UCX attaches the segment
each of the peer's receive FIFO elements names (``elem->desc.seg_id`` when
sending a bcopy message), which no check here sees. Shared memory trusts a
connected local peer: README "Not covered" says how to leave it out.
"""

from __future__ import annotations

import os
import stat
import struct

from ...errors import InvalidMetadata
from ...processes import pid_alive as alive

_PROCFS, _SHM_OPEN, _PID_NS = 1 << 63, 1 << 62, 1 << 60  # uct_posix seg_id flags (src/uct/sm/mm/posix/mm_posix.c)
_MMID = (1 << 60) - 1
_PID_BITS = 30
_FIFO_PID_AT = 136  # uct_mm_fifo_ctl_t: head, the signal socket address (padded to a 64-byte line), tail, pid
_POSIX_NAME = "ucx_shm_posix_"
_DEFAULT_PID_NS = 0xEFFFFFFC  # the initial pid namespace's inode (ucs_sys_ns_is_default)


def crc16(name: str) -> int:
    """UCX's transport name checksum (ucs_crc16_string: CRC-16-CCITT, reflected)."""
    crc = 0xFFFF
    for b in name.encode():
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


POSIX, SYSV = crc16("posix"), crc16("sysv")


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return _DEFAULT_PID_NS


def _sysv_sizes() -> dict[int, int]:
    """shmid -> size of this IPC namespace's System V segments (/proc/sysvipc/shm)."""
    out: dict[int, int] = {}
    try:
        with open("/proc/sysvipc/shm") as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) > 3:
                    out[int(cols[1])] = int(cols[3])
    except OSError:
        pass
    return out


def posix_iface_length(iface: bytes) -> int | None:
    """The length a posix interface address must have by its segment id's flags (uct_posix_iface_addr_pack): the
    id; the pid namespace after it where flagged; else, for a file outside /dev/shm, its NUL-terminated directory.
    None where it cannot be told (too short, no terminator)."""
    if len(iface) < 8:
        return None
    (seg,) = struct.unpack_from("<Q", iface)
    if seg & _PID_NS:
        return 16
    if seg & (_PROCFS | _SHM_OPEN):
        return 8
    end = iface.find(b"\0", 8)
    return None if end < 0 else end + 1


class _Posix:
    """Where a posix segment id points: the path UCX would open and the process it claims, or None (unreachable)."""

    @staticmethod
    def locate(iface: bytes, pid_ns: int) -> tuple[str, int | None] | None:
        (seg,) = struct.unpack_from("<Q", iface)
        if seg & _PID_NS:
            if len(iface) < 16 or struct.unpack_from("<Q", iface, 8)[0] != pid_ns:
                return None  # UCX: another pid namespace, not reachable
        elif pid_ns != _DEFAULT_PID_NS:
            return None
        mmid = seg & _MMID
        if seg & _PROCFS:
            pid, fd = mmid & ((1 << _PID_BITS) - 1), mmid >> _PID_BITS
            return f"/proc/{pid}/fd/{fd}", pid
        if seg & _SHM_OPEN:
            return f"/dev/shm/{_POSIX_NAME}{mmid:x}", None
        folder = iface[8:].split(b"\0", 1)[0].decode(errors="replace")
        return f"{folder}/{_POSIX_NAME}{mmid:x}", None

    @staticmethod
    def problem(path: str, claimed: int | None, min_size: int) -> str | None:
        """Why UCX must not map ``path`` as a FIFO, or None (also where it cannot be opened: UCX's reachability
        check opens it first, finds the transport unreachable and attaches nothing; other transports go on)."""
        try:
            target = os.readlink(path) if path.startswith("/proc/") else path
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not os.path.basename(target).startswith(_POSIX_NAME):
                return f"is not a UCX segment ({target})"
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "is not a regular file"
            if st.st_size < min_size:
                return f"holds {st.st_size} bytes, less than a FIFO ({min_size})"
            head = os.pread(fd, 4, _FIFO_PID_AT)
        except OSError as exc:
            return f"cannot be read ({exc.strerror})"
        finally:
            os.close(fd)
        (owner,) = struct.unpack("<i", head)
        if claimed is not None and owner != claimed:
            return f"holds the FIFO of process {owner}, not of process {claimed}"
        if owner <= 0 or not alive(owner):
            return f"belongs to process {owner}, which is gone"
        return None


class Segments:
    """This worker's own FIFO sizes and system id, measured once; ``check`` looks at a peer's segments."""

    def __init__(self, own) -> None:
        self._pid_ns = _pid_ns()
        self._system: dict[int, bytes] = {}
        self._min: dict[int, int | None] = {}
        for t in own.transports:
            if t.csum == POSIX and POSIX not in self._min:
                self._system[POSIX] = t.dev
                where = _Posix.locate(t.iface, self._pid_ns)
                self._min[POSIX] = _size(where[0]) if where else None
            elif t.csum == SYSV and SYSV not in self._min:
                self._system[SYSV] = t.dev
                self._min[SYSV] = _sysv_sizes().get(struct.unpack_from("<Q", t.iface)[0]) if t.iface_len >= 8 else None

    def check(self, addr, who: str) -> None:
        """Raise InvalidMetadata naming ``who`` where UCX would attach a segment that is not a live peer's FIFO."""
        table: dict[int, int] | None = None
        for t in addr.transports:
            if t.csum not in self._min or t.dev != self._system[t.csum] or t.iface_len < 8:
                continue  # a transport this worker lacks, or another machine's segment: UCX does not attach it
            need = self._min[t.csum]
            if t.csum == POSIX:
                where = _Posix.locate(t.iface, self._pid_ns)
                if where is None:
                    continue
                why = "cannot be checked here" if need is None else _Posix.problem(where[0], where[1], need)
                if why:
                    raise InvalidMetadata(f"{who} sent a UCX address whose posix segment {where[0]} {why}")
            else:
                (shmid,) = struct.unpack_from("<Q", t.iface)
                table = _sysv_sizes() if table is None else table
                size = table.get(shmid)
                if need is None or size is None or size < need:
                    why = (
                        "cannot be checked here"
                        if need is None
                        else "does not exist on this host"
                        if size is None
                        else f"holds {size} bytes, less than a FIFO ({need})"
                    )
                    raise InvalidMetadata(f"{who} sent a UCX address whose sysv segment {shmid} {why}")


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
