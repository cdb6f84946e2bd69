"""A real Mooncake Store on loopback for tests and benchmarks: ``mooncake_master`` in its own process.

``MooncakeMaster`` starts the master that ships in the ``mooncake-transfer-engine`` wheel on free ports of
127.0.0.1, with its built-in HTTP metadata server (``metadata="http"``, the default) or none
(``metadata="p2p"``: clients use ``P2PHANDSHAKE``), waits until both answer, and stops it at the end.
``restart()`` brings it back on the same ports (every object it knew is gone: clients re-mount their
segments, old keys read as misses), ``kill()`` drops it at once. ``config()`` gives the ``mooncake``
backend parameters that reach it.

``PoolMember`` is a store client in another process that lends its memory to the pool (a "holder"): tests
kill it to take away the replicas it holds. ``CacheInstance`` is an inference instance's TieredCache in
another process, with L4 on the pool: tests share prefixes across instances and drain one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from .services import ServiceError, free_port, last_line, temp_path, tied_to_parent

#: seconds a client stays alive on the master after its last heartbeat: short, so a killed holder's
#: replicas leave the pool within seconds of its death (Mooncake's default is 10)
TEST_CLIENT_TTL_S = 2


def master_binary() -> str | None:
    """The ``mooncake_master`` executable: ``$MOONCAKE_MASTER_BIN``, the wheel's own, or PATH's."""
    cands = [os.environ.get("MOONCAKE_MASTER_BIN")]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        cands += [str(Path(p) / "mooncake_master") for p in spec.submodule_search_locations]
    cands.append(shutil.which("mooncake_master"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK) and not _is_script(c):
            return c
    return None


def _is_script(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def mooncake_available() -> tuple[bool, str]:
    """Whether a real Mooncake Store can run here: the wheel, its import (needs libibverbs1) and the master."""
    from ..backends.mooncake.client import store_import_error

    why = store_import_error()
    if why:
        return False, why
    if master_binary() is None:
        return False, "mooncake_master not found (it ships in mooncake-transfer-engine-non-cuda)"
    return True, "ok"


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """``mooncake_master`` on 127.0.0.1 with free ports; a context manager."""

    def __init__(
        self,
        metadata: str = "http",
        *,
        client_ttl: int = TEST_CLIENT_TTL_S,
        lease_ttl_ms: int = 10_000,
        startup_timeout: float = 30.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if metadata not in ("http", "p2p"):
            raise ValueError(f"metadata must be 'http' (the master's built-in server) or 'p2p', got {metadata!r}")
        self.metadata = metadata
        self.client_ttl = int(client_ttl)
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.rpc_port = free_port()
        self.http_port = free_port() if metadata == "http" else None
        self.metrics_port = free_port()
        self.dir = temp_path("mooncake")
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self.starts = 0
        self._started = False

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What clients pass as ``metadata_server``: the HTTP endpoint, or ``P2PHANDSHAKE``."""
        return f"http://127.0.0.1:{self.http_port}/metadata" if self.http_port else "P2PHANDSHAKE"

    @property
    def admin_url(self) -> str:
        """The master's HTTP admin endpoint (its metrics port): /get_all_keys, /get_all_segments, /query_key."""
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "master.log")

    def config(self, **params: Any) -> dict[str, Any]:
        """``mooncake`` backend parameters that reach this master (plus ``params``)."""
        return {"master_server_addr": self.master_addr, "metadata_server": self.metadata_url, **params}

    def start(self) -> MooncakeMaster:
        """Start the master and wait until it answers. Before its first start succeeded no client knows its
        ports, so a master that exits at once (another process took a free port between ``free_port`` and
        its bind) is started again on fresh ports, up to 3 times; a restart keeps its ports."""
        for attempt in range(3):
            try:
                return self._start()
            except ServiceError as exc:
                if self._started or attempt == 2 or not exc.exited:
                    raise
                self.rpc_port, self.metrics_port = free_port(), free_port()
                self.http_port = free_port() if self.metadata == "http" else None
        raise AssertionError("unreachable")

    def _start(self) -> MooncakeMaster:
        binary = master_binary()
        if binary is None:
            raise ServiceError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        args = [
            binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]  # fmt: skip
        if self.http_port:
            args += [
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]  # fmt: skip
        args += list(self.extra_args)
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(tied_to_parent(args), stdout=self._log, stderr=subprocess.STDOUT, cwd=self.dir)
        self.starts += 1
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # an interrupted start leaves no master behind either
            raise
        self._started = True
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready():
            if self._proc.poll() is not None:  # type: ignore[union-attr]
                code = self._proc.returncode  # type: ignore[union-attr]
                why = last_line(self.tail())
                raise ServiceError(f"mooncake_master exited with {code} at start: {why}", exited=True)
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"mooncake_master did not answer on {self.master_addr} within {self.startup_timeout:g} s: "
                    f"{last_line(self.tail())}"
                )
            time.sleep(0.02)

    def _ready(self) -> bool:
        if not _accepts(self.rpc_port):
            return False
        if self.http_port is None:
            return True
        try:
            urllib.request.urlopen(f"{self.metadata_url}?key=probe", timeout=0.5).close()
        except urllib.error.HTTPError:
            return True  # 404 for the probe key: the server answers
        except OSError:
            return False
        return True

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the master and wait for it: what it held is gone, clients see RPC failures."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()
        self._drop()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._drop()

    def restart(self) -> MooncakeMaster:
        """Stop and start again on the same ports (a new master: no object survives)."""
        self.stop()
        return self.start()

    def _drop(self) -> None:
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> MooncakeMaster:
        try:
            return self.start()
        except BaseException:
            self.close()  # its directory, made in __init__
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


_MEMBER = r"""
import sys, json
from datamover.backends.mooncake.client import PoolClient
cfg = json.loads(sys.argv[1])
client = PoolClient(cfg)
print("READY " + client.hostname, flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        break
client.close()
"""


class PoolMember:
    """A store client in its own process that lends ``segment_bytes`` of its memory to the pool.

    ``hostname`` is its segment's name (what replica descriptors show); ``kill()`` SIGKILLs it, taking its
    replicas with it; ``close()`` lets it leave cleanly (Mooncake's close takes about a second).
    ``PoolMember.start_many`` starts several at once.
    """

    def __init__(self, master: MooncakeMaster, segment_bytes: int = 64 << 20, timeout: float = 30.0) -> None:
        self._launch(master, segment_bytes)
        self._wait_ready(timeout)

    @classmethod
    def start_many(
        cls, master: MooncakeMaster, n: int, segment_bytes: int = 64 << 20, timeout: float = 30.0
    ) -> list[PoolMember]:
        """``n`` members started in parallel (each process takes a second or two to import and set up)."""
        members = []
        for _ in range(n):
            m = cls.__new__(cls)
            m._launch(master, segment_bytes)
            members.append(m)
        try:
            for m in members:
                m._wait_ready(timeout)
        except BaseException:
            for m in members:
                m.kill()
            raise
        return members

    def _launch(self, master: MooncakeMaster, segment_bytes: int) -> None:
        import json

        cfg = master.config(global_segment_size=int(segment_bytes), local_buffer_size=4 << 20)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _MEMBER, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.hostname = ""

    def _wait_ready(self, timeout: float) -> None:
        import selectors

        deadline = time.monotonic() + timeout
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            while time.monotonic() < deadline and sel.select(max(0.0, deadline - time.monotonic())):
                line = self._proc.stdout.readline() if self._proc.stdout else ""
                if line.startswith("READY ") or not line:
                    break
        if not line.startswith("READY "):
            code = self._proc.poll()
            self.kill()
            if code is not None:
                raise ServiceError(f"mooncake pool member exited with {code} before it was ready", exited=True)
            raise ServiceError(f"mooncake pool member did not report ready within {timeout:g} s (got {line!r})")
        self.hostname = line.split()[1]

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the member and reap it: when this returns, its memory and replicas are gone."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("close\n")  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
                self._proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> PoolMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunk_bytes(key: Any, page: int) -> np.ndarray:
    """A chunk's bytes as every test instance "computes" them: its key's digest repeated, so any instance can
    check every byte of a chunk another one put."""
    return np.frombuffer(bytes.fromhex(key.digest()) * (page // 16), dtype=np.uint8)


_INSTANCE = r"""
import json, sys, threading
import numpy as np
from datamover.policy.cache import TieredCache
from datamover.policy.config import GIB, TierConfig, with_overrides
from datamover.policy.keys import chunk_keys
from datamover.testing.mooncake import chunk_bytes

opts = json.loads(sys.argv[1])
page = opts["page"]
config = with_overrides(
    TierConfig(),
    l1_hbm={"page_size_bytes": page, "block_pool_size": opts["l1_chunks"], "device": "dram"},
    l2_dram={"pinned_pool_gb": opts["l2_chunks"] * page / GIB},
    l4_pool={"enabled": True, "backend": "mooncake", "capacity_gb": 65536 * page / GIB, **opts["l4"]},
)
cache = TieredCache(config)
print(json.dumps({"ready": cache.pool.hostname}), flush=True)

def keys_of(cmd):
    return chunk_keys(cmd["hashes"], cmd.get("model", "model@1"), cmd.get("tokenizer", "tok@1"))

for line in sys.stdin:
    cmd = json.loads(line)
    op, out = cmd["op"], {}
    if op == "close":
        break
    keys = keys_of(cmd) if "hashes" in cmd else []
    if op == "put":
        out["stored"] = cache.put(keys, np.stack([chunk_bytes(k, page) for k in keys]))
    elif op == "lookup":
        out["n"], out["tiers"] = cache.lookup(keys)
    elif op == "get":
        dst = np.full((len(keys), page), 0xEE, dtype=np.uint8)
        n = cache.get(keys, dst)
        out["delivered"] = n
        out["wrong"] = [i for i in range(n) if not np.array_equal(dst[i], chunk_bytes(keys[i], page))]
    elif op == "drain":
        seen = []
        done = threading.Event()
        def lookups():
            while not done.is_set():
                seen.append(cache.lookup(keys)[0])
        t = threading.Thread(target=lookups)
        t.start()
        try:
            out["copied"] = cache.drain("l4_pool")
        finally:
            done.set()
            t.join()
        out["lookups_during"] = len(seen)
        out["min_prefix_during"] = min(seen) if seen else None
    elif op == "stats":
        out = cache.stats()
    print(json.dumps(out), flush=True)
cache.close()
"""


class CacheInstance:
    """An inference instance's TieredCache in its own process, with L4 on the shared pool of ``master``.

    ``call(op, **args)`` sends one command (put / lookup / get / drain / stats with ``hashes``, ``model``,
    ``tokenizer``) and returns its answer; chunk bytes are ``chunk_bytes(key)``, and ``get`` answers which
    delivered chunks were not byte for byte what their key says.
    """

    def __init__(
        self,
        master: MooncakeMaster,
        *,
        page: int = 16 << 10,
        l1_chunks: int = 64,
        l2_chunks: int = 64,
        segment_bytes: int = 32 << 20,
        timeout: float = 60.0,
        wait: bool = True,
        **l4: Any,
    ) -> None:
        import json

        l4 = {
            "bucket": "kv-shared", "master_server_addr": master.master_addr,
            "metadata_service_url": master.metadata_url, "segment_gb": segment_bytes / (1 << 30), **l4,
        }  # fmt: skip
        if master.admin_url:
            l4.setdefault("master_admin_url", master.admin_url)
        opts = {"page": page, "l1_chunks": l1_chunks, "l2_chunks": l2_chunks, "l4": l4}
        self.timeout = timeout
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _INSTANCE, json.dumps(opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.hostname = ""
        if wait:
            self.wait_ready()

    def wait_ready(self) -> CacheInstance:
        """Wait for the instance's cache to be set up (its memory lent to the pool)."""
        try:
            self.hostname = self._answer()["ready"]
        except BaseException:
            self.kill()
            raise
        return self

    @classmethod
    def start_many(cls, master: MooncakeMaster, n: int, **kw: Any) -> list[CacheInstance]:
        """``n`` instances started in parallel (each takes a few seconds to import and set up)."""
        return cls.start_each(master, [kw] * n)

    @classmethod
    def start_each(cls, master: MooncakeMaster, options: list[dict[str, Any]]) -> list[CacheInstance]:
        """One instance per mapping of keyword arguments, started in parallel; if any fails to start, every one
        is killed before the error is raised (a fixture erring in its setup leaves no process behind)."""
        out: list[CacheInstance] = []
        try:
            for kw in options:
                out.append(cls(master, wait=False, **kw))
            for inst in out:
                inst.wait_ready()
        except BaseException:
            for inst in out:
                inst.kill()
            raise
        return out

    @staticmethod
    def close_all(instances: list[CacheInstance]) -> None:
        """Close several at once (Mooncake's client takes about a second to leave)."""
        for inst in instances:
            inst._send_close()
        for inst in instances:
            inst.close()

    def _answer(self) -> dict:
        import json
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            if not sel.select(self.timeout):
                raise TimeoutError(f"cache instance did not answer within {self.timeout:g} s")
        line = self._proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"cache instance exited with {self._proc.wait()}")
        return json.loads(line)

    def call(self, op: str, **args: Any) -> dict:
        import json

        self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")  # type: ignore[union-attr]
        self._proc.stdin.flush()  # type: ignore[union-attr]
        return self._answer()

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def _send_close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write('{"op": "close"}\n')  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                self.kill()

    def close(self) -> None:
        """Leave the pool cleanly (this instance's memory goes with it)."""
        self._send_close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> CacheInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
