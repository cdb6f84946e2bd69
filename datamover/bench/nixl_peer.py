"""The remote end of NIXL's DRAM -> remote DRAM pair: a NIXL agent in its own process, driven over a pipe.

``NixlPeer`` starts ``python -m datamover.bench.nixl_peer``, which registers
one DRAM buffer with NIXL's UCX backend and prints its agent metadata and the
buffer's address. It then waits on its stdin for one-line commands (zero,
fill, digest, quit), so the initiator can prepare the target's bytes and
check them after a transfer. Between commands it does not touch UCX at all
when RMA can complete without it: error-handling mode ``none`` and cma
allowed by UCX_TLS (the initiator then copies into the target itself, the
way NIXL is meant to be used). Otherwise (``peer`` mode, or no cma) UCX
needs the target to progress, so it polls NIXL every ``poll_s`` seconds,
except while told to rest (``rest``, until ``wake``): while the other
library's transfers are timed, a target polling on the same cores would
take CPU from that library's target and preempt it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import select
import subprocess
import sys
from typing import Any

import numpy as np

from ..errors import NixlError
from .nixl_api import NixlSettings, make_agent, ucx_params


def tls_allows_cma(tls: str) -> bool:
    """Whether a UCX_TLS value lets UCX use cma ('^a,b' excludes; 'all', 'sm', 'shm', 'cma' include)."""
    from ..backends.ucx import tls_includes

    return tls_includes(tls, "cma", frozenset({"sm", "shm"}))


def needs_progress(settings: NixlSettings) -> bool:
    """Whether the target must progress UCX for a one-sided transfer to complete."""
    return settings.ucx_err_mode == "peer" or not tls_allows_cma(settings.ucx_tls)


def digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(arr), digest_size=16).hexdigest()


class NixlPeer:
    """A NIXL target process holding ``nbytes`` of registered DRAM."""

    def __init__(
        self,
        nbytes: int,
        settings: NixlSettings,
        name: str = "bench-nixl-target",
        poll_s: float = 1e-4,
        host: Any = None,
    ):
        """``host``: a ``datamover.testing.hosts.Host`` to run the target on (default: this host)."""
        env = dict(os.environ, UCX_TLS=settings.ucx_tls)
        self.host = host
        self.polls = needs_progress(settings)
        self.poll_s = poll_s
        poll = str(poll_s if self.polls else 0)
        cmd = [sys.executable, "-m", "datamover.bench.nixl_peer", name, str(nbytes), settings.ucx_err_mode, poll]
        if host is not None:
            cmd = host.argv(cmd)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            line = self._reply(timeout=settings.timeout)
            meta, addr = line.split()
        except (NixlError, ValueError) as exc:
            self.proc.kill()
            self.proc.wait()
            raise NixlError(f"the NIXL target process did not start: {exc}", backend="nixl") from None
        self.metadata = base64.b64decode(meta)
        self.addr = int(addr)
        self.nbytes = nbytes
        self.name = name
        self.resting = False

    def _reply(self, timeout: float = 120.0) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise NixlError(f"the NIXL target process did not answer (exit code {code})", backend="nixl")
        return line.strip()

    def command(self, *words: Any) -> str:
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def zero(self, n: int) -> None:
        self.command("zero", n)

    def fill(self, n: int, seed: int) -> None:
        """Random bytes (``np.random.default_rng(seed)``) in the first ``n`` bytes."""
        self.command("fill", n, seed)

    def digest(self, n: int) -> str:
        return self.command("digest", n)

    def rest(self) -> None:
        """Stop polling UCX until ``wake()``: NIXL transfers to this peer cannot complete meanwhile."""
        if self.polls and not self.resting:
            self.command("rest")
            self.resting = True

    def wake(self) -> None:
        """Poll UCX again (a no-op for a peer that never needs to)."""
        if self.resting:
            self.command("wake")
            self.resting = False

    def polled(self) -> int:
        """How many times the peer has progressed UCX so far."""
        return int(self.command("polled"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def serve(name: str, nbytes: int, err_mode: str, poll_s: float) -> None:
    """The target's main loop; replies go to the original stdout, and anything else printed goes to stderr."""
    from ..descriptors import aligned_empty

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # native libraries and NIXL's stdout logger must not write into the reply pipe
    sys.stdout = sys.stderr

    settings = NixlSettings(ucx_tls=os.environ.get("UCX_TLS", ""), ucx_err_mode=err_mode)
    agent = make_agent(name, settings, {"UCX": ucx_params(settings)})
    buf = aligned_empty(nbytes)
    buf[:] = 0
    reg = agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
    print(base64.b64encode(agent.get_agent_metadata()).decode(), int(buf.ctypes.data), file=out, flush=True)
    resting, polled = False, 0
    try:
        while True:
            polling = bool(poll_s) and not resting
            ready, _, _ = select.select([sys.stdin], [], [], poll_s if polling else None)
            if polling:
                agent.get_new_notifs()  # progresses the UCX worker
                polled += 1
            if not ready:
                continue
            words = sys.stdin.readline().split()
            if not words or words[0] == "quit":
                return
            if words[0] == "zero":
                buf[: int(words[1])] = 0
                print("ok", file=out, flush=True)
            elif words[0] == "fill":
                n = int(words[1])
                buf[:n] = np.frombuffer(np.random.default_rng(int(words[2])).bytes(n), dtype=np.uint8)
                print("ok", file=out, flush=True)
            elif words[0] == "digest":
                print(digest(buf[: int(words[1])]), file=out, flush=True)
            elif words[0] in ("rest", "wake"):
                resting = words[0] == "rest"
                print("ok", file=out, flush=True)
            elif words[0] == "polled":
                print(polled, file=out, flush=True)
            else:
                print(f"error unknown command {words[0]!r}", file=out, flush=True)
    finally:
        agent.deregister_memory(reg)


if __name__ == "__main__":
    try:
        serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the bench says it was stopped, we need not
        sys.exit(128 + 2)
