"""A peer Agent in another process, for testing remote backends.

``RemotePeer`` starts an Agent in a spawned process and drives it through a
multiprocessing pipe: allocate and register memory, read and write it, hand
out metadata, drain notifications. The pipe never touches the backend under
test, so a test can check what a transfer really did to the peer's memory.
``RemoteBuffer`` is the conformance kit's TestBuffer for such memory.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..descriptors import DescList, aligned_empty
from ..errors import RemoteDisconnected
from .stopped import freeze

if TYPE_CHECKING:
    from .hosts import Host


def _map_at(addr: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed anonymous memory mapped at ``addr`` exactly (never freed: the process is a test's)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fixed_noreplace = 0x100000  # MAP_FIXED_NOREPLACE: fails where something is mapped already
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed_noreplace
    got = libc.mmap(addr, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {nbytes} bytes at {addr:#x}: {os.strerror(err)}")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _serve(conn, name: str, config: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    from ..agents import Agent

    agent = Agent(name, config)
    bufs: dict[int, tuple[np.ndarray, Any]] = {}
    next_id = 1

    def alloc(nbytes: int) -> tuple[int, int]:
        nonlocal next_id
        arr = aligned_empty(nbytes)
        arr[:] = 0
        reg = agent.register_memory(arr)
        bufs[next_id] = (arr, reg)
        next_id += 1
        return next_id - 1, int(arr.ctypes.data)

    def alloc_at(addr: int, nbytes: int) -> tuple[int, int]:
        """Like ``alloc``, at address ``addr`` (mapped for the purpose: OSError if anything is there already)."""
        nonlocal next_id
        arr = _map_at(addr, nbytes)
        reg = agent.register_memory(arr)
        bufs[next_id] = (arr, reg)
        next_id += 1
        return next_id - 1, addr

    def free(handle: int) -> None:
        _, reg = bufs.pop(handle)
        agent.deregister_memory(reg)

    def read(handle: int, offset: int, nbytes: int) -> bytes:
        return bufs[handle][0][offset : offset + nbytes].tobytes()

    def write(handle: int, offset: int, data: bytes) -> None:
        bufs[handle][0][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def notified_then_read(prefix: bytes, timeout: float, handle: int, offset: int, nbytes: int):
        """Wait for a notification, then read memory: what the peer saw when the notification came."""
        got = agent.wait_notification(prefix, timeout)
        return got, read(handle, offset, nbytes)

    xfers: dict[int, Any] = {}

    def start_transfer(op: str, handle: int, peer: str, remote_addrs: Any, lengths: Any) -> int:
        """Post ``op`` between this peer's buffer (packed from offset 0) and ``peer``'s addresses."""
        lengths = np.asarray(lengths, dtype=np.int64)
        base = int(bufs[handle][0].ctypes.data)
        local = DescList.from_columns(base + np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths, 0, "DRAM")
        remote = DescList.from_columns(np.asarray(remote_addrs, dtype=np.int64), lengths, 0, "DRAM")
        xfers[len(xfers)] = agent.transfer(op, local, remote, agent=peer)
        return len(xfers) - 1

    def wait_transfer(xid: int) -> str:
        return str(xfers[xid].wait())

    def transfer_state(xid: int) -> str:
        return str(xfers[xid].state)

    pause: list = []

    def pause_mid_transfer() -> None:
        """From now on this peer's one-sided data movement stops halfway and never goes on (see MidTransferPause)."""
        from .pause import MidTransferPause

        pause.append(MidTransferPause().install())

    def start_transfer_paused(op: str, handle: int, peer: str, remote_addrs: Any, lengths: Any) -> bool:
        """``start_transfer`` from a thread; True once its data movement is parked halfway (``pause_mid_transfer``)."""
        threading.Thread(target=start_transfer, args=(op, handle, peer, remote_addrs, lengths), daemon=True).start()
        return pause[-1].reached.wait(60)

    commands = {
        "pause_mid_transfer": pause_mid_transfer,
        "start_transfer_paused": start_transfer_paused,
        "start_transfer": start_transfer,
        "wait_transfer": wait_transfer,
        "transfer_state": transfer_state,
        "ping": lambda: os.getpid(),
        "attr": lambda name: getattr(agent, name),
        "describe": lambda backend: agent.backend(backend).describe(),
        "notified_then_read": notified_then_read,
        "alloc": alloc,
        "alloc_at": alloc_at,
        "free": free,
        "read": read,
        "write": write,
    }
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            agent.close()
            conn.send((True, None))
            break
        try:
            fn = commands.get(cmd) or getattr(agent, cmd)
            conn.send((True, fn(*args)))
        except BaseException as exc:  # the caller re-raises it
            try:
                conn.send((False, exc))
            except Exception:
                conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


class RemotePeer:
    """An Agent named ``name`` running in its own process (on test host ``host`` if given); methods run there.

    Besides the helpers below, ``call(method, *args)`` runs any Agent method
    in the peer (``metadata``, ``add_remote``, ``transfer`` is not picklable,
    ``send_notification``, ``wait_notification``, ``get_notifications``...).
    """

    def __init__(
        self,
        name: str,
        config: Any = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        host: Host | None = None,
    ):
        ctx = mp.get_context("spawn")
        self.name = name
        self.timeout = timeout
        self.host = host
        self._conn, child = ctx.Pipe()
        args = (child, name, config, env or {})
        if host is None:
            self.process = ctx.Process(target=_serve, args=args, daemon=True)
        else:
            self.process = host.process(_serve, args, daemon=True)
        self.process.start()
        child.close()
        try:
            pid = self.call("ping")
        except BaseException:
            self.kill()  # hung or crashed while starting: the caller gets no peer to close
            self._conn.close()
            raise
        # the pid as this process sees it (on a test host the peer reads its own pid as 1)
        self.pid = pid if host is None else host.pid_here(self.process.pid)

    def call(self, cmd: str, *args: Any, timeout: float | None = None) -> Any:
        """Run ``cmd`` in the peer and return its result (its exception is raised here)."""
        try:
            self._conn.send((cmd, args))
            answered = self._conn.poll(self.timeout if timeout is None else timeout)
            if answered:
                ok, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise RemoteDisconnected(f"peer process {self.name!r} is gone ({type(exc).__name__})") from None
        if not answered:  # alive but hung (frozen, stuck): not "gone"
            raise RemoteDisconnected(f"peer {self.name!r} did not answer {cmd!r}")
        if not ok:
            raise value
        return value

    def metadata(self) -> bytes:
        return self.call("metadata")

    def freeze(self) -> None:
        """SIGSTOP the peer process and return once every thread of it stopped (see ``stopped.freeze``)."""
        freeze(self.pid)

    def kill(self) -> None:
        """SIGKILL the peer process (no cleanup: its sockets close, its memory vanishes)."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", timeout=15)
            except Exception:
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.kill()
        self._conn.close()

    def __enter__(self) -> RemotePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteBuffer:
    """``nbytes`` of registered DRAM in a RemotePeer; read/write go through the peer's pipe."""

    def __init__(self, peer: RemotePeer, nbytes: int) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.handle, self.addr = peer.call("alloc", nbytes)

    def descs(self, offsets: Any, lengths: Any) -> DescList:
        return DescList.from_columns(self.addr + np.asarray(offsets), lengths, 0, "DRAM")

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.peer.call("read", self.handle, offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self.peer.call("write", self.handle, offset, bytes(data))

    def free(self) -> None:
        self.peer.call("free", self.handle)
