"""BackendConformance: the pytest suite every backend passes, in the manner of zarr's StoreTests.

A backend's test module subclasses it, names ``backend`` and supplies
``make_remote(nbytes)``: a factory of ``TestBuffer`` objects (a registered
file, objects, a peer's memory) whose ``read``/``write`` bypass the backend
under test. Defaults it may override:

- ``agent``: an Agent running only the backend under test, with ``params``;
- ``peer``: the remote agent's name; None when the backend moves bytes
  within one agent;
- ``make_local(nbytes)``: registered host memory (``HostBuffer``).

Class attributes tune sizes for slow media; what needs absent hardware is
skipped by the subclass's fixtures, with the reason. Object stores subclass
``ObjectStoreConformance``, where a remote descriptor is a whole object.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np
import pytest

from ..agents import Agent, XferState
from ..backends.base import Completion
from ..descriptors import DescList
from ..errors import (
    DatamoverError,
    LengthMismatch,
    NotRegistered,
    OverlappingDestination,
    TransferStateError,
    TransferTimeout,
)
from .buffers import HostBuffer


def random_bytes(nbytes: int, seed: int) -> bytes:
    """Deterministic random bytes (never zeros), so a missed copy cannot pass."""
    return np.random.default_rng(seed).bytes(nbytes)


class BackendConformance:
    """Round trips, batches, bad input, timeouts, concurrency and release, for one backend."""

    backend: ClassVar[str]
    sizes: ClassVar[tuple[int, ...]] = (1, 4096, 12345, 1 << 20, 64 << 20)
    offsets: ClassVar[tuple[int, ...]] = (0, 1, 4093)
    batch_block: ClassVar[int] = 4096
    batch_count: ClassVar[int] = 4096
    concurrent_threads: ClassVar[int] = 4
    big: ClassVar[int] = 64 << 20
    params: ClassVar[dict] = {}

    # -- fixtures a subclass may override -------------------------------------
    @pytest.fixture
    def agent(self):
        with Agent(f"{self.backend}-conformance", {"backends": {self.backend: dict(self.params)}}) as agent:
            yield agent

    @pytest.fixture
    def peer(self):
        return None

    @pytest.fixture
    def make_local(self, agent):
        return lambda n: HostBuffer(agent, n)

    @pytest.fixture
    def make_remote(self, agent):
        raise NotImplementedError(f"{type(self).__name__} must define the make_remote fixture")

    # -- helpers -------------------------------------------------------------
    def roundtrip(self, agent: Agent, peer, local, remote, offset: int, size: int, seed: int) -> None:
        data = random_bytes(size, seed)
        local.write(0, data)
        xfer = agent.transfer(
            "WRITE", local.descs([0], [size]), remote.descs([offset], [size]), agent=peer, backends=self.backend
        )
        assert xfer.wait() == XferState.DONE
        assert remote.read(offset, size) == data, "WRITE did not land byte for byte"
        back = random_bytes(size, seed + 1)
        remote.write(offset, back)
        local.write(0, random_bytes(size, seed + 2))
        xfer = agent.transfer(
            "READ", local.descs([0], [size]), remote.descs([offset], [size]), agent=peer, backends=self.backend
        )
        assert xfer.wait() == XferState.DONE
        assert local.read(0, size) == back, "READ did not land byte for byte"

    # -- round trips ---------------------------------------------------------
    @pytest.mark.parametrize("size_index", range(5))
    def test_roundtrip_sizes(self, agent, peer, make_local, make_remote, size_index):
        if size_index >= len(self.sizes):
            pytest.skip("size not in this backend's list")
        size = self.sizes[size_index]
        local, remote = make_local(size), make_remote(size)
        self.roundtrip(agent, peer, local, remote, 0, size, seed=size)

    def test_roundtrip_odd_offsets(self, agent, peer, make_local, make_remote):
        size = 10_007
        local, remote = make_local(size), make_remote(size + max(self.offsets))
        for k, off in enumerate(self.offsets):
            self.roundtrip(agent, peer, local, remote, off, size, seed=100 + k)

    @pytest.mark.parametrize("count", [1, "batch"])
    def test_batch_permuted(self, agent, peer, make_local, make_remote, count):
        n = self.batch_count if count == "batch" else 1
        bs = self.batch_block
        local, remote = make_local(n * bs), make_remote(n * bs)
        data = random_bytes(n * bs, seed=n)
        local.write(0, data)
        perm = np.random.default_rng(n).permutation(n)
        lp = agent.prepare(local.descs(np.arange(n) * bs, bs))
        rp = agent.prepare(remote.descs(np.arange(n) * bs, bs), peer)
        with agent.make_transfer("WRITE", lp, np.arange(n), rp, perm, backends=self.backend) as xfer:
            xfer.post()
            assert xfer.wait() == XferState.DONE
            assert xfer.telemetry.descriptors == n and xfer.telemetry.bytes == n * bs
        got = np.frombuffer(remote.read(0, n * bs), dtype=np.uint8).reshape(n, bs)
        want = np.frombuffer(data, dtype=np.uint8).reshape(n, bs)
        assert np.array_equal(got[perm], want), "a block landed in the wrong place"
        local.write(0, bytes(n * bs))
        with agent.make_transfer("READ", lp, perm, rp, np.arange(n), backends=self.backend) as xfer:
            xfer.post()
            xfer.wait()
        back = np.frombuffer(local.read(0, n * bs), dtype=np.uint8).reshape(n, bs)
        assert np.array_equal(back[perm], got), "READ gathered the wrong blocks"

    def test_repost_runs_again(self, agent, peer, make_local, make_remote):
        size = 1 << 16
        local, remote = make_local(size), make_remote(size)
        lp = agent.prepare(local.descs([0], [size]))
        rp = agent.prepare(remote.descs([0], [size]), peer)
        xfer = agent.make_transfer("WRITE", lp, [0], rp, [0], backends=self.backend)
        assert xfer.state == XferState.INIT
        for seed in (1, 2):
            data = random_bytes(size, seed)
            local.write(0, data)
            xfer.post()
            assert xfer.wait() == XferState.DONE
            assert remote.read(0, size) == data
        xfer.release()
        assert xfer.state == XferState.RELEASED
        with pytest.raises(TransferStateError):
            xfer.post()

    # -- bad input -----------------------------------------------------------
    def test_outside_registered_memory(self, agent, peer, make_local, make_remote):
        local, remote = make_local(4096), make_remote(4096)
        with pytest.raises(NotRegistered) as info:
            agent.prepare(local.descs([0, 4000], [4096, 200]))
        assert info.value.index == 0 or info.value.index == 1
        with pytest.raises(NotRegistered) as info:
            agent.prepare(remote.descs([0, 0, 4000], [10, 10, 200]), peer)
        assert info.value.index == 2

    def test_length_mismatch(self, agent, peer, make_local, make_remote):
        local, remote = make_local(8192), make_remote(8192)
        with pytest.raises(LengthMismatch) as info:
            agent.transfer(
                "WRITE",
                local.descs([0, 100], [50, 60]),
                remote.descs([0, 100], [50, 61]),
                agent=peer,
                backends=self.backend,
            )
        assert info.value.index == 1
        with pytest.raises(LengthMismatch):
            agent.transfer(
                "WRITE", local.descs([0, 100], [50, 50]), remote.descs([0], [50]), agent=peer, backends=self.backend
            )

    def test_overlapping_destinations_refused(self, agent, peer, make_local, make_remote):
        local, remote = make_local(8192), make_remote(8192)
        before = remote.read(0, 8192)
        with pytest.raises(OverlappingDestination) as info:
            agent.transfer(
                "WRITE",
                local.descs([0, 1000, 5000], [100, 100, 100]),
                remote.descs([0, 2000, 2050], [100, 100, 100]),
                agent=peer,
                backends=self.backend,
            )
        assert info.value.index == 2
        assert remote.read(0, 8192) == before, "a refused transfer touched the destination"

    def test_error_names_backend_and_descriptor(self, agent, peer, make_local, make_remote):
        local, remote = make_local(4096), make_remote(4096)
        with pytest.raises(DatamoverError) as info:
            agent.transfer(
                "WRITE", local.descs([0, 0], [8, 8]), remote.descs([0, 5000], [8, 8]), agent=peer, backends=self.backend
            )
        assert info.value.index == 1 and "descriptor 1" in str(info.value)

    # -- lifecycle under load ------------------------------------------------
    def test_timeout_never_hangs(self, agent, peer, make_local, make_remote, monkeypatch):
        """A post past its deadline ends in TransferTimeout, never hangs, and leaves the agent usable.

        No part of it may report (``Completion.finish_part`` waits on a gate, off the test's thread) until the
        timeout was raised (the gate opens once a cancel recorded its error, before any fence waits for the parts
        in flight): it is timed out by construction, not because 64 MiB happened to outlast 100 us.
        """
        size = self.big
        local, remote = make_local(size), make_remote(size)
        bs = 1 << 16
        descs_l = local.descs(np.arange(size // bs) * bs, bs)
        descs_r = remote.descs(np.arange(size // bs)[::-1] * bs, bs)
        gate, finish_part, cancel = threading.Event(), Completion.finish_part, Completion.cancel

        def held(completion, error=None):
            if threading.current_thread() is not threading.main_thread():
                gate.wait(60)
            finish_part(completion, error)

        def cancelled(completion, error=None):
            cancel(completion, error)
            if isinstance(completion.error, TransferTimeout):
                gate.set()

        monkeypatch.setattr(Completion, "finish_part", held)
        monkeypatch.setattr(Completion, "cancel", cancelled)
        t0 = time.monotonic()
        try:
            xfer = agent.transfer("WRITE", descs_l, descs_r, agent=peer, backends=self.backend, timeout=1e-4)
            with pytest.raises(TransferTimeout):
                xfer.wait(60)  # with a timeout: the waiter only looks, it runs no part itself
            assert xfer.state == XferState.ERR and isinstance(xfer.error, TransferTimeout)
        finally:
            gate.set()
            Completion.finish_part = finish_part  # undo only these patches: the fixtures' own ones stay
            Completion.cancel = cancel
        xfer.release()
        assert time.monotonic() - t0 < 60
        self.roundtrip(agent, peer, local, remote, 0, 4096, seed=7)  # the agent is still usable

    def test_release_in_flight(self, agent, peer, make_local, make_remote):
        size = self.big
        local, remote = make_local(size), make_remote(size)
        bs = 1 << 16
        threads_before = threading.active_count()
        xfer = agent.transfer(
            "WRITE",
            local.descs(np.arange(size // bs) * bs, bs),
            remote.descs(np.arange(size // bs) * bs, bs),
            agent=peer,
            backends=self.backend,
        )
        xfer.release()
        assert xfer.state == XferState.RELEASED
        xfer.release()  # idempotent
        self.roundtrip(agent, peer, local, remote, 0, 4096, seed=8)
        assert threading.active_count() <= threads_before + 16, "release leaked threads"

    def test_post_while_in_flight(self, agent, peer, make_local, make_remote):
        size = self.big
        local, remote = make_local(size), make_remote(size)
        bs = 1 << 16
        data = random_bytes(size, 9)
        local.write(0, data)
        xfer = agent.transfer(
            "WRITE",
            local.descs(np.arange(size // bs) * bs, bs),
            remote.descs(np.arange(size // bs) * bs, bs),
            agent=peer,
            backends=self.backend,
        )
        if xfer.state == XferState.PROC:
            with pytest.raises(TransferStateError):
                xfer.post()
        assert xfer.wait() == XferState.DONE
        assert remote.read(0, size) == data

    def test_concurrent_posts(self, agent, peer, make_local, make_remote):
        k = self.concurrent_threads
        part = 256 << 10
        local, remote = make_local(k * part), make_remote(k * part)
        data = random_bytes(k * part, 11)
        local.write(0, data)
        errors: list[BaseException] = []
        barrier = threading.Barrier(k)

        def one(i: int) -> None:
            try:
                barrier.wait()
                for _ in range(3):
                    x = agent.transfer(
                        "WRITE",
                        local.descs([i * part], [part]),
                        remote.descs([i * part], [part]),
                        agent=peer,
                        backends=self.backend,
                    )
                    x.wait()
                    x.release()
            except BaseException as exc:  # collected and re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert remote.read(0, k * part) == data


class ObjectStoreConformance(BackendConformance):
    """The kit for object stores (s3, mooncake): each remote descriptor (offset, length) is its own object.

    ``make_remote(nbytes)`` gives an object buffer that also has ``key(offset, length)`` (the object a
    descriptor names) and ``registration`` (its ``register_objects`` entry). Two tests become their object-store
    equivalents: distinct keys never overlap while two WRITE descriptors of one key do, and a WRITE is a whole
    object, so odd offsets are ranged READs inside one.
    """

    def test_overlapping_destinations_refused(self, agent, peer, make_local, make_remote):
        """Distinct keys never overlap; two WRITE descriptors for the same key do, and are refused untouched."""
        local, remote = make_local(8192), make_remote(8192)
        local.write(0, random_bytes(8192, 3))
        key, other = remote.key(0, 100), remote.key(100, 100)
        before = remote.read(0, 200)
        dst = DescList.objects(remote.registration, [100, 100, 100], 0, keys=[key, other, key])
        with pytest.raises(OverlappingDestination) as info:
            agent.transfer("WRITE", local.descs([0, 1000, 5000], [100, 100, 100]), dst, backends=self.backend)
        assert info.value.index == 2
        assert remote.read(0, 200) == before, "a refused transfer touched the destination"

    def test_roundtrip_odd_offsets(self, agent, peer, make_local, make_remote):
        """A WRITE is a whole object; odd offsets are ranged READs inside it, landing at odd local offsets."""
        size = 10_007 + max(self.offsets)
        local, remote = make_local(size + 8), make_remote(size)
        data = random_bytes(size, 100)
        remote.write(0, data)
        obj = remote.key(0, size)
        for k, off in enumerate(self.offsets):
            n = size - off - k
            dst = 1 + k
            local.write(0, bytes(size + 8))
            src = DescList.objects(remote.registration, [n], [off], keys=[obj])
            xfer = agent.transfer("READ", local.descs([dst], [n]), src, backends=self.backend)
            assert xfer.wait() == XferState.DONE
            got = local.read(0, size + 8)
            assert got[dst : dst + n] == data[off : off + n], f"ranged READ at offset {off} returned wrong bytes"
            assert got[:dst] == bytes(dst) and got[dst + n :] == bytes(size + 8 - dst - n), "READ wrote outside"
