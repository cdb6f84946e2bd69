"""Which of a UCX worker's tcp sockets lead to a peer: those a READ's gets are corked on while they are posted.

UCX gives no handle on its tcp sockets. Its worker's event fd is an epoll set holding each transport's own
event fd; tcp's is an epoll set of its connection sockets. ``/proc/self/fdinfo`` lists what each epoll set
watches, so the sockets are found by walking those sets and keeping the connected TCP sockets whose peer
address is the peer's. A UCX that nests its sets otherwise yields nothing (no socket, nothing corked).
"""

from __future__ import annotations

import os
import socket
import stat

_MAX_DEPTH = 3  # the worker's set, a transport's set, its sockets
_MAX_FDS = 256  # fds looked at in one walk; a worker with more connections is not searched further
_MAX_SOCKETS = 8  # sockets handed to one post (``_ucp.post`` takes at most this many)


def _watched(fd: int) -> list[int]:
    """The fds epoll set ``fd`` watches (its ``tfd:`` lines), [] for anything else."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            text = f.read(1 << 16)
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.startswith("tfd:"):
            field = line[4:].split(None, 1)[0]
            if field.isdigit():
                out.append(int(field))
    return out


def _is_epoll(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
    except OSError:
        return False


def _peer_ip(fd: int) -> str | None:
    """The peer address of TCP socket ``fd``, or None (not a connected TCP socket)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return str(sock.getpeername()[0])
    except OSError:
        return None
    finally:
        sock.close()  # the duplicate only


def sockets_to(event_fd: int, peer_ip: str | None) -> tuple[tuple[int, int], ...]:
    """(fd, inode) of each connected TCP socket to ``peer_ip`` (None: to anyone) inside epoll set ``event_fd`` (a
    UCX worker's event fd) and the sets it holds; the inode lets a later user tell the fd still names the same
    socket."""
    found: list[tuple[int, int]] = []
    seen: set[int] = set()
    level = [event_fd]
    for _ in range(_MAX_DEPTH):
        nested = []
        for fd in level:
            for t in _watched(fd):
                if t in seen or len(seen) >= _MAX_FDS:
                    continue
                seen.add(t)
                if _is_epoll(t):
                    nested.append(t)
                    continue
                try:
                    st = os.fstat(t)
                except OSError:
                    continue
                if not stat.S_ISSOCK(st.st_mode) or len(found) >= _MAX_SOCKETS:
                    continue
                ip = _peer_ip(t)
                if ip is not None and peer_ip in (None, ip):
                    found.append((t, st.st_ino))
        level = nested
    return tuple(found)


def names(found: tuple[tuple[int, int], ...]) -> list[str]:
    """Each socket (local -> peer, host:port each) in ``found`` that its fd still names, for describe()."""
    out = []
    for fd, ino in found:
        try:
            if os.fstat(fd).st_ino != ino:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            here, there = sock.getsockname(), sock.getpeername()
            out.append(f"{here[0]}:{here[1]} -> {there[0]}:{there[1]}")
        except OSError:
            continue
        finally:
            sock.close()
    return out
