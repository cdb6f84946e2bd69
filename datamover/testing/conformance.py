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

The late-bytes tests check the lifecycle contract itself: once a transfer was released or ended ERR, no byte of it
touches the caller's memory (a READ's destination), nor reaches a WRITE's destination. They park the transfer's
parts at a known point before they touch the caller's memory (``park_parts``, which a subclass may move), hold what
the backend moves on its own inside its fence until that fence waits for it (``hold_in_flight``), cut the transfer
short, let everything go once the test has written a sentinel or taken a snapshot, bring the backend to rest
(``quiesce``) and compare.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import pytest

from ..agents import Agent, XferState
from ..backends.base import Backend, Completion
from ..backends.fence import ReadFence
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
from .waiting import BOUND_S, Parked

#: what a READ's destination is overwritten with once the READ was cut short: a byte landing after it shows
SENTINEL = 0x5A


def random_bytes(nbytes: int, seed: int) -> bytes:
    """Deterministic random bytes (never zeros), so a missed copy cannot pass."""
    return np.random.default_rng(seed).bytes(nbytes)


@contextmanager
def completions_of(backend: Backend) -> Iterator[list[Completion]]:
    """Every completion ``backend.post`` returns meanwhile (its public ``post`` wrapped on this instance only)."""
    seen: list[Completion] = []
    real = backend.post

    def post(req: Any) -> Completion:
        completion = real(req)
        seen.append(completion)
        return completion

    backend.post = post  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del backend.post


def _let_go_once_fenced(fences: list[threading.Event], held: Parked, ended: threading.Event) -> None:
    """Let ``held`` go as soon as one of ``fences`` is set (a cancel waits for what is held), but never once the test
    saw the transfer end without that (``ended``): then what is held stays held until the test has looked."""
    while not ended.is_set():
        if any(f.is_set() for f in fences):
            held.let_go()
            return
        ended.wait(0.001)


def changed_bytes(before: bytes, after: bytes) -> int:
    """How many bytes differ between two snapshots of one range."""
    assert len(before) == len(after), f"the snapshot changed size ({len(before)} -> {len(after)} bytes)"
    return int(np.count_nonzero(np.frombuffer(before, np.uint8) != np.frombuffer(after, np.uint8)))


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
    #: the deadline (seconds) of a transfer the late-bytes tests cut short while its parts are parked. The default
    #: suits parts parked before they move a byte (``park_parts``): every part gets there before the deadline, which
    #: then passes with nothing moved, and ``release`` waits for the parked parts until it and as long again. A
    #: backend that moves its bytes inside ``post`` (copies enqueued, I/Os submitted), whose parts park only as they
    #: report, sets 100 us: the deadline passes with those bytes in flight
    cut_timeout: ClassVar[float] = 0.5

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

    def park_parts(self, monkeypatch: pytest.MonkeyPatch, parked: Parked) -> bool:
        """Park the parts of the transfer posted next (until ``parked.let_go``) where each is about to touch the
        caller's memory, outside any fence a cancel waits for: True when a part surely gets there.

        A byte a part moves after that point is a byte moved after the test cut the transfer short. The default
        parks ``ReadFence.enter`` and ``join`` (before every piece a fenced part copies into or out of the caller's
        memory) and ``Completion.finish_part`` (a part that moved its bytes inside ``post``, or inside a fence it
        left, reports only once let go: the deadline passes first). A backend whose parts pass none of these, or
        whose cancel waits for its whole request (a part parked there would hold ERR up), parks elsewhere or
        returns False: its tests then cut the transfer short while it really runs.
        """
        monkeypatch.setattr(ReadFence, "enter", parked.wrap(ReadFence.enter))
        monkeypatch.setattr(ReadFence, "join", parked.wrap(ReadFence.join))
        monkeypatch.setattr(Completion, "finish_part", parked.wrap(Completion.finish_part))
        return True

    def hold_in_flight(self, monkeypatch: pytest.MonkeyPatch, held: Parked) -> bool:
        """Hold the bytes of the transfer posted next that its backend moves on its own, inside the transfer's fence
        (a device's queued copies, I/Os submitted inside ``post`` and reaped on a pool thread): True when they surely
        get there. The test lets them go once a cancel's fence waits for them (``ReadFence.fencing``), and else only
        after it wrote its sentinel or took its snapshot: a byte of theirs that lands then landed after the caller
        was told. Default: nothing is held."""
        return False

    def quiesce(self, agent: Agent, peer, completions: list[Completion], spare_local, spare_remote) -> None:
        """Bring the backend to rest after a transfer was cut short and its parts let go: every completion its
        ``post`` returned finished, then a full round trip on the same agent and backend, run to its end. A subclass
        adds what its backend says of its own workers being idle."""
        for c in completions:
            assert c.wait(BOUND_S), f"a cut-short transfer's parts did not finish within {BOUND_S:g} s"
        self.roundtrip(agent, peer, spare_local, spare_remote, 0, 4096, seed=33)

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

    # -- no byte after ERR or release ------------------------------------------
    def cut_short(self, agent, peer, make_local, make_remote, monkeypatch, op: str, end: str) -> int:
        """Post a big ``op`` in many rows (never merged), end it (``end``: "release" while in flight, or "timeout"),
        then look at its destination; how many bytes changed there after the caller was told.

        A READ's destination (the caller's memory) is overwritten with ``SENTINEL`` right after ``release`` returned or
        the ``TransferTimeout`` was raised; a WRITE's (remote) is snapshotted then. Only after that are the parked
        parts let go; once the backend is at rest (``quiesce``) the destination is compared again.
        """
        size, bs = self.big, 1 << 16
        n = size // bs
        local, remote = make_local(size), make_remote(size)
        spare_local, spare_remote = make_local(4096), make_remote(4096)
        rows_l = local.descs(np.arange(n) * bs, bs)
        rows_r = remote.descs(np.arange(n)[::-1] * bs, bs)  # reversed: rows are not merged, parts are many
        dst = remote if op == "WRITE" else local
        if op == "READ":
            remote.write(0, random_bytes(size, 31))
        else:
            local.write(0, random_bytes(size, 31))
        # a full round trip first: connected and warm, the post below starts moving bytes at once
        self.roundtrip(agent, peer, spare_local, spare_remote, 0, 4096, seed=30)
        parked = Parked(f"the parts of a {op} cut short")
        held = Parked(f"the bytes of a {op} in flight")
        parks = self.park_parts(monkeypatch, parked)
        holds = self.hold_in_flight(monkeypatch, held)
        # parked, a post outlasts its deadline; unparked, ``big`` cannot move in 100 us (released, it runs meanwhile)
        timeout = self.cut_timeout if parks or holds or end == "release" else 1e-4
        ended, letting = threading.Event(), None
        try:
            with completions_of(agent.backend(self.backend)) as posted:
                xfer = agent.transfer(op, rows_l, rows_r, agent=peer, backends=self.backend, timeout=timeout)
                if holds:  # parts parked as they report come after the bytes held
                    assert held.reached.wait(BOUND_S), f"none of the {op}'s bytes in flight was held"
                    fences = [f for c in posted if isinstance(f := getattr(c, "fencing", None), threading.Event)]
                    letting = threading.Thread(target=_let_go_once_fenced, args=(fences, held, ended), name="let-go")
                    letting.start()
                elif parks:
                    assert parked.reached.wait(BOUND_S), f"no part of the {op} reached its park"
                if end == "release":
                    xfer.release()
                    assert xfer.state == XferState.RELEASED
                else:
                    with pytest.raises(TransferTimeout):
                        xfer.wait(BOUND_S)  # with a timeout: the waiter only looks, it runs no part itself
                    assert xfer.state == XferState.ERR
                ended.set()
                if letting is not None:
                    letting.join(BOUND_S)
                    assert not letting.is_alive(), "the thread letting the held bytes go did not end"
                if op == "READ":  # from here on the caller's memory must hold exactly what the caller wrote
                    told = bytes([SENTINEL]) * size
                    dst.write(0, told)
                else:
                    told = dst.read(0, size)
                held.let_go()
                parked.let_go()
                xfer.release()
                self.quiesce(agent, peer, posted, spare_local, spare_remote)
        finally:
            ended.set()
            held.let_go()  # a failed assertion must not leave parts parked until their bound
            parked.let_go()
            if letting is not None:
                letting.join(BOUND_S)
        return changed_bytes(told, dst.read(0, size))

    def test_read_released_in_flight_lands_nothing_after(self, agent, peer, make_local, make_remote, monkeypatch):
        """``release`` returns while the READ's parts are parked before their copies: none lands once let go."""
        changed = self.cut_short(agent, peer, make_local, make_remote, monkeypatch, "READ", "release")
        assert changed == 0, f"{changed} bytes of a READ landed in the caller's memory after release() returned"

    def test_read_timed_out_lands_nothing_after(self, agent, peer, make_local, make_remote, monkeypatch):
        """The READ ends ERR (TransferTimeout) while its parts are parked: none lands once let go."""
        changed = self.cut_short(agent, peer, make_local, make_remote, monkeypatch, "READ", "timeout")
        assert changed == 0, f"{changed} bytes of a READ landed in the caller's memory after it reported ERR"

    def test_write_released_in_flight_sends_nothing_after(self, agent, peer, make_local, make_remote, monkeypatch):
        """A WRITE's destination may hold part of it once ``release`` returned, but nothing more arrives after."""
        changed = self.cut_short(agent, peer, make_local, make_remote, monkeypatch, "WRITE", "release")
        assert changed == 0, f"{changed} bytes of a WRITE reached its destination after release() returned"

    def test_write_timed_out_sends_nothing_after(self, agent, peer, make_local, make_remote, monkeypatch):
        """The same for a WRITE ended ERR (TransferTimeout) while its parts are parked."""
        changed = self.cut_short(agent, peer, make_local, make_remote, monkeypatch, "WRITE", "timeout")
        assert changed == 0, f"{changed} bytes of a WRITE reached its destination after it reported ERR"

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
