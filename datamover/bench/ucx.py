"""ucx workload: initiator here, target in a second process; raw ucxx tag send/recv beside it.

The target runs on this host (loopback, shared memory, cma), or with
``--ucx-peer-host`` on a second test host (``datamover.testing.hosts``: its
own network and pid namespace, reached over a veth pair), as NIXL's does.

Both sides move the same bytes from the same local buffer, one message per
block; at the target raw ucxx has a buffer of its own, as NIXL's target (another
process) has, so that no side's timed copy finds its destination's cache lines
last written by another core (the raw target's, which copies received blocks in).
Raw ucxx runs on its own workers with the backend's UCX settings
(endpoints from worker addresses, error handling off, same transports) and
the smallest protocol that is still correct: the initiator says "go" over a
socket (the backend's requests travel over TCP too), both sides post one tag
send/recv per block, and for WRITE the target acknowledges over UCX once
every block has landed, as the backend does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np

from ..agents import Agent
from ..backends.ucx import transports_in_use
from ..backends.ucx.rma import data_path
from ..descriptors import DescList, aligned_empty
from ..testing.services import temp_path
from .workload import Case, Workload, fill_random, timed_transfer

_ACK_TAG = 1 << 61
TARGET = "bench-ucx-target"


def _raw_worker(params: dict[str, Any]):
    """A plain ucxx worker with the same UCX settings as the backend's, so both use the same transports."""
    from ..backends.ucx import UcxBackend, import_ucxx
    from ..backends.ucx.config import make_context

    ucx_api, Array = import_ucxx()
    p = {**UcxBackend.default_params, **params}
    ctx, _ = make_context(
        ucx_api, p["ucx_config"], bool(p["cma"]), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
    )
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return ucx_api, Array, ctx, worker


def _wait(worker, reqs: list) -> None:
    for r in reqs:
        while not r.completed:
            worker.progress()
        r.check_error()


def _raw_serve(ucx_api, Array, worker, ep, buf: np.ndarray, op: str, block: int, slots: np.ndarray, go) -> None:
    """Target side of raw ucxx: per iteration wait for go (a socket, as the backend's control is), post one
    recv/send per block, ack a WRITE over UCX."""
    mv = memoryview(buf)
    views = [Array(mv[s * block : (s + 1) * block]) for s in slots.tolist()]
    ack = Array(np.ones(1, dtype=np.uint64))
    it = 0
    while go.recv_bytes() == b"1":
        base = it << 32
        if op == "WRITE":
            _wait(worker, [worker.tag_recv(v, ucx_api.UCXXTag(base | i)) for i, v in enumerate(views)])
            _wait(worker, [ep.tag_send(ack, ucx_api.UCXXTag(_ACK_TAG | it))])
        else:
            _wait(worker, [ep.tag_send(v, ucx_api.UCXXTag(base | i)) for i, v in enumerate(views)])
        it += 1


def _target_main(conn, go, nbytes: int, log_path: str, params: dict[str, Any]) -> None:
    """The target process: an Agent with registered memory plus a raw ucxx worker, driven over a pipe. Its first
    message is ``(True, (metadata, address, raw worker address))``, or ``(False, exception)`` when it cannot start."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for std in (1, 2):  # UCX logs (and the UCX_PROTO_INFO tables) go here: the header reads them
        os.dup2(fd, std)
    try:
        agent = Agent(TARGET, {"backends": {"ucx": dict(params)}})
        buf, raw_buf = aligned_empty(nbytes), aligned_empty(nbytes)
        fill_random(buf, seed=2)
        fill_random(raw_buf, seed=3)
        agent.register_memory(buf)
        ucx_api, Array, _ctx, worker = _raw_worker(params)
        hello = (agent.metadata(), int(buf.ctypes.data), worker.address.tobytes())  # the backend starts here
    except BaseException as exc:  # the initiator raises it, a bad --param included, instead of an EOFError
        try:
            conn.send((False, exc))
        except Exception:
            conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    conn.send((True, hello))
    ep = worker.create_endpoint_from_worker_address(ucx_api.UCXAddress.create_from_buffer(conn.recv()), False)
    server: threading.Thread | None = None
    while True:
        cmd, args = conn.recv()
        if cmd == "raw":
            t = threading.Thread(target=_raw_serve, args=(ucx_api, Array, worker, ep, raw_buf, *args, go), daemon=True)
            t.start()
            server = t
            conn.send(None)
        elif cmd == "raw_end":
            if server is not None:
                server.join(10)
                server = None
            conn.send(None)
        elif cmd == "read":
            off, n = args
            conn.send(buf[off : off + n].tobytes())
        elif cmd == "progress":
            conn.send(dict(agent.backend("ucx").describe()["native progress"]))
        elif cmd == "fill":
            fill_random(buf[: args[0]], seed=args[1])
            conn.send(None)
        elif cmd == "close":
            agent.close()
            conn.send(None)
            return


class UcxWorkload(Workload):
    """Blocks at permuted slots of the target's buffer in another process, WRITE and READ."""

    backend = "ucx"
    raw_name = "raw ucxx tag send/recv, one per block (same process pair, its own target buffer)"
    #: seconds the target process may take to start, or to answer one command, before it is taken for hung
    answer_timeout_s = 120.0

    def __init__(self, max_bytes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(max_bytes, options)
        self._params = dict(self.options.get("ucx", {}))  # backend params, e.g. {"cma": True}
        # test hosts (--ucx-peer-host): the targets run on host 1, this process is on host 0
        self.hosts = self.options.get("test_hosts")
        target_params, self._here_params = dict(self._params), dict(self._params)
        if self.hosts is not None:
            target_params["host"] = self.hosts[1].address
            self._here_params["host"] = self.hosts[0].address
        self._log = temp_path("ucx-bench", ".log", directory=False)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._go, go_child = ctx.Pipe()
        env_before = os.environ.get("UCX_PROTO_INFO")
        os.environ["UCX_PROTO_INFO"] = "y"  # inherited by the spawned target only
        try:
            args = (child, go_child, max_bytes, self._log, target_params)
            if self.hosts is None:
                self.process = ctx.Process(target=_target_main, args=args, daemon=True)
            else:
                self.process = self.hosts[1].process(_target_main, args, daemon=True)
            self.process.start()
        finally:
            if env_before is None:
                os.environ.pop("UCX_PROTO_INFO", None)
            else:
                os.environ["UCX_PROTO_INFO"] = env_before
        child.close()
        self.agent: Agent | None = None
        self.worker = None
        self._hung = False
        try:
            ok, answer = self._answer("start")
            if not ok:
                raise answer
            blob, self.remote_addr, raw_address = answer
            self.agent = Agent("bench-ucx-initiator", {"backends": {"ucx": self._here_params}})
            self.mem = aligned_empty(max_bytes)
            fill_random(self.mem, seed=1)
            self.agent.register_memory(self.mem)
            self.agent.add_remote(blob)
            self.ucx_api, self.Array, self._raw_ctx, self.worker = _raw_worker(self._params)
            self._conn.send(self.worker.address.tobytes())
            self.ep = self.worker.create_endpoint_from_worker_address(
                self.ucx_api.UCXAddress.create_from_buffer(raw_address), False
            )
            self._iter = 0
            # one small and one large transfer so the target's protocol tables are printed and parsed
            for n in (64, min(max_bytes, 1 << 20)):
                self.agent.transfer("WRITE", DescList.blocks(self.mem[:n], n), self._remote([0], n), TARGET).wait()
                self.agent.transfer("READ", DescList.blocks(self.mem[:n], n), self._remote([0], n), TARGET).wait()
        except BaseException:
            self.close()  # the caller gets no workload to close: the target, its log and our agent go here
            raise

    def _answer(self, what: str) -> Any:
        """The target's next message, within ``answer_timeout_s``; ServiceError naming the target if it exited or
        hung (with the last line of its log: its traceback's, for one that crashed)."""
        from ..testing.services import ServiceError, last_line

        try:
            if self._conn.poll(self.answer_timeout_s):
                return self._conn.recv()
            self._hung = True  # close() does not wait for it again
            why = f"did not answer {what} within {self.answer_timeout_s:g} s"
        except (EOFError, OSError):
            self.process.join(5)
            why = f"exited with {self.process.exitcode} before it answered {what}"
        raise ServiceError(f"the ucx bench target (pid {self.process.pid}) {why}: {last_line(_read(self._log))}")

    def _remote(self, slots: Any, block: int) -> DescList:
        return DescList.from_columns(self.remote_addr + np.asarray(slots, dtype=np.int64) * block, block, 0, "DRAM")

    def target_progress(self) -> dict[str, Any]:
        """The target's native progress counters now (wakeups, bursts, polls, events; {} without the thread)."""
        return self._call("progress")

    def _call(self, cmd: str, *args: Any) -> Any:
        try:
            self._conn.send((cmd, args))
        except OSError:
            pass  # it is gone: _answer says how
        return self._answer(repr(cmd))

    def header(self) -> dict[str, Any]:
        desc = self.agent.backend("ucx").describe()
        return {
            "transports in use": "; ".join(transports_in_use(_read(self._log))) or "unknown",
            "UCX_TLS": desc["UCX_TLS"],
            "direct cma": desc["direct cma"].get(TARGET, "-"),
            "endpoint error handling": desc["error_handling"],
            "target": f"pid {self.process.pid}" + (f" on test host {self.hosts[1]}" if self.hosts else ""),
            "native data path": data_path(),
            "tcp congestion control": self._congestion(),
        }

    def _congestion(self) -> str:
        """TCP congestion control where the initiator and the target run: it paces (bbr) or not (cubic)."""
        key = "net.ipv4.tcp_congestion_control"
        if self.hosts is None:
            from ..testing.hosts import sysctl

            return sysctl(key) or "unknown"
        here, there = self.hosts[0].sysctl(key) or "unknown", self.hosts[1].sysctl(key) or "unknown"
        return here if here == there else f"{here} (initiator), {there} (targets)"

    def case(self, op: str, block: int, batch: int) -> Case:
        n = block * batch
        perm = np.random.default_rng(1).permutation(batch)
        lp = self.agent.prepare(DescList.blocks(self.mem[:n], block))
        rp = self.agent.prepare(self._remote(perm, block), TARGET)
        xfer = self.agent.make_transfer(op, lp, None, rp, None)
        mv = memoryview(self.mem)
        views = [self.Array(mv[i * block : (i + 1) * block]) for i in range(batch)]
        self._call("raw", op, block, perm)
        ucx_api, worker, ep = self.ucx_api, self.worker, self.ep
        ack = self.Array(np.zeros(1, dtype=np.uint64))
        Tag = ucx_api.UCXXTag

        def raw() -> float:
            it = self._iter
            self._iter += 1
            base = it << 32
            t0 = time.perf_counter()
            self._go.send_bytes(b"1")
            reqs = []
            if op == "WRITE":
                reqs += [ep.tag_send(v, Tag(base | i)) for i, v in enumerate(views)]
                reqs.append(worker.tag_recv(ack, Tag(_ACK_TAG | it)))
            else:
                reqs += [worker.tag_recv(v, Tag(base | i)) for i, v in enumerate(views)]
            _wait(worker, reqs)
            return time.perf_counter() - t0

        def verify() -> bool:
            if op == "WRITE":
                xfer.post()
                xfer.wait()
                got = np.frombuffer(self._call("read", 0, n), dtype=np.uint8).reshape(batch, block)
                return bool(np.array_equal(got[perm], self.mem[:n].reshape(batch, block)))
            self._call("fill", n, 99)
            self.mem[:n] = 0
            xfer.post()
            xfer.wait()
            want = np.frombuffer(self._call("read", 0, n), dtype=np.uint8).reshape(batch, block)
            return bool(np.array_equal(self.mem[:n].reshape(batch, block), want[perm]))

        def close() -> None:
            xfer.release()
            self._go.send_bytes(b"0")
            self._call("raw_end")
            self._iter = 0

        return Case(
            op, block, batch, timed_transfer(xfer), raw, verify, raw_name=self.raw_name, close=close,
            notes={"descriptors": batch},
        )  # fmt: skip

    def close(self) -> None:
        """Stop the target (killed if it does not end within bounds), close our agent, remove the target's log."""
        from ..testing.services import ServiceError

        try:
            if self.process.is_alive() and not self._hung:
                self._call("close")
        except ServiceError:
            pass  # gone or hung: killed below
        try:
            # the target's raw endpoint closes as it exits, and that close needs this side's raw worker progressed
            deadline = time.monotonic() + 10
            while self.process.is_alive() and time.monotonic() < deadline:
                if self.worker is not None:
                    self.worker.progress()
                self.process.join(0.001)
        finally:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
            self._conn.close()
            try:
                if self.agent is not None:
                    self.agent.close()
            finally:
                try:
                    os.unlink(self._log)
                except OSError:
                    pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
