"""mooncake beyond the kit, against real Mooncake processes: integrity, typed misses, write modes, bounds,
replicas with a holder killed, a master restart, and P2PHANDSHAKE metadata.

Faults are injected at known points: a holder is SIGKILLed and reaped before anything is read, the master is
stopped and started again between two steps. Where the pool takes time to notice (the master drops a dead
client's segment after its TTL, a client re-mounts after a master restart), the test waits for that
condition itself, with a deadline, never for a fixed sleep.
"""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest

from datamover import Agent, DescList, XferState
from datamover.errors import ChecksumMismatch, DatamoverError, InvalidDescriptor, ObjectStoreError
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.mooncake import MooncakeMaster, PoolMember

from .conftest import RawStore, pack

MiB = 1 << 20


def mooncake_agent(master: MooncakeMaster, name: str = "mc", **params) -> Agent:
    """An agent running only the mooncake backend, started now (so its client lends its memory at once)."""
    params.setdefault("global_segment_size", 64 * MiB)
    agent = Agent(name, {"backends": {"mooncake": master.config(**params)}})
    agent.backend("mooncake")
    return agent


def signal_get_returned(client, monkeypatch) -> threading.Event:
    """An event set each time ``client.get`` returns or raises (everything that get would copy is copied by then)."""
    done = threading.Event()
    real_get = client.get

    def get(*args, **kwargs):
        try:
            return real_get(*args, **kwargs)
        finally:
            done.set()

    monkeypatch.setattr(client, "get", get)
    return done


def until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Wait for ``cond()`` to hold (polling, bounded): for the pool to notice a fault, not a race."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:g} s")
        time.sleep(0.05)


def read(agent: Agent, buf: HostBuffer, reg, keys: list[str], size: int, at: int = 0):
    """READ ``keys`` (``size`` bytes each) into ``buf`` from offset ``at`` on, one after the other."""
    dst = DescList.objects(reg, [size] * len(keys), 0, keys=keys)
    return agent.transfer("READ", buf.descs(at + np.arange(len(keys)) * size, size), dst, backends="mooncake")


def write(agent: Agent, buf: HostBuffer, reg, keys: list[str], size: int) -> None:
    dst = DescList.objects(reg, [size] * len(keys), 0, keys=keys)
    assert agent.transfer("WRITE", buf.descs(np.arange(len(keys)) * size, size), dst).wait() == XferState.DONE


@pytest.fixture(scope="module")
def agents(mooncake_master):
    """One agent per transfer mode, alive for the whole module (a client that leaves takes the replicas in its
    memory with it, and takes ~1 s to close)."""
    made = {}
    try:
        for mode in ("auto", "zero_copy"):
            made[mode] = mooncake_agent(mooncake_master, f"mc-{mode}", transfer_mode=mode)
        yield made
    finally:
        for a in made.values():
            a.close()


@pytest.fixture(params=["auto", "zero_copy"])
def agent(agents, request):
    return agents[request.param]


def after_failure(agent: Agent, before: bytes) -> bytes:
    """What a row whose read failed holds after: untouched when staged (checked before it is copied), zeros
    with zero-copy (the bytes landed, then failed)."""
    staged = agent.backend("mooncake").client.staged(len(before))
    return before if staged else bytes(len(before))


def test_corrupt_object_is_a_miss(agent, raw):
    """An object whose CRC32C does not match fails with ChecksumMismatch naming the key; the row never keeps its
    bytes."""
    reg = agent.register_objects("it", prefix="crc/")
    payload = random_bytes(5000, 1)
    raw.put("it/crc/bad", pack("it/crc/bad", payload, crc=12345))
    raw.put("it/crc/good", pack("it/crc/good", payload))
    buf = HostBuffer(agent, 10_000)
    buf.write(0, b"\xff" * 10_000)
    with pytest.raises(ChecksumMismatch) as info:
        read(agent, buf, reg, ["crc/good", "crc/bad"], 5000).wait()
    assert info.value.index == 1 and "it/crc/bad" in str(info.value) and info.value.key == "crc/bad"
    assert buf.read(5000, 5000) == after_failure(agent, b"\xff" * 5000), "bytes that failed their checksum stayed"


def test_object_under_another_key_is_a_miss(agent, raw):
    """An intact object of key A found under key B (copied or misplaced) fails its check under B: the CRC32C
    covers the key. Staged and zero-copy sizes both."""
    reg = agent.register_objects("it", prefix="moved/")
    for size in (5000, 2 * MiB):
        payload = random_bytes(size, 7)
        buf = HostBuffer(agent, size)
        buf.write(0, payload)
        write(agent, buf, reg, [f"moved/a{size}"], size)
        raw.put(f"it/moved/b{size}", raw.get(f"it/moved/a{size}"))
        buf.write(0, b"\xee" * size)
        with pytest.raises(ChecksumMismatch) as info:
            read(agent, buf, reg, [f"moved/b{size}"], size).wait()
        assert f"it/moved/b{size}" in str(info.value)
        assert buf.read(0, size) == after_failure(agent, b"\xee" * size), "another key's bytes were served"
        read(agent, buf, reg, [f"moved/a{size}"], size).wait()
        assert buf.read(0, size) == payload


def test_foreign_objects_refused(agent, raw):
    """Objects not in datamover's format are misses: no trailer of the right size, or a wrong magic."""
    reg = agent.register_objects("it", prefix="foreign/")
    raw.put("it/foreign/bare", random_bytes(4096 + 16, 2))  # the right size, no magic
    raw.put("it/foreign/short", random_bytes(100, 3))
    buf = HostBuffer(agent, 4096)
    buf.write(0, b"\x05" * 4096)
    with pytest.raises(ChecksumMismatch, match="not a datamover object"):
        read(agent, buf, reg, ["foreign/bare"], 4096).wait()
    with pytest.raises(ObjectStoreError) as info:
        read(agent, buf, reg, ["foreign/short"], 4096).wait()
    assert "it/foreign/short" in str(info.value)
    assert buf.read(0, 4096) in (after_failure(agent, b"\x05" * 4096), bytes(4096))


def test_missing_key_is_typed(agent):
    reg = agent.register_objects("it", prefix="miss/")
    buf = HostBuffer(agent, 8192)
    buf.write(0, b"\x07" * 8192)
    with pytest.raises(ObjectStoreError) as info:
        read(agent, buf, reg, ["miss/none", "miss/never"], 4096).wait()
    err = info.value
    assert err.code == "OBJECT_NOT_FOUND" and err.errno == errno.ENOENT and err.key == "miss/none"
    assert err.bucket == "it" and err.index == 0 and "2 of 2 keys" in str(err)
    assert buf.read(0, 8192) == after_failure(agent, b"\x07" * 8192), "a miss wrote to the destination"


def test_write_modes(mooncake_master, agent):
    """replace (default): a WRITE's bytes are what the key holds after; keep: Mooncake's first writer wins."""
    with mooncake_agent(mooncake_master, "wm-keep", write_mode="keep") as keeper:
        for a, mode, second_wins in ((agent, "replace", True), (keeper, "keep", False)):
            reg = a.register_objects("wm", prefix=f"{mode}/")
            buf = HostBuffer(a, 4096)
            first, second = random_bytes(4096, 10), random_bytes(4096, 11)
            for data in (first, second):
                buf.write(0, data)
                write(a, buf, reg, [f"{mode}/k"], 4096)
            buf.write(0, bytes(4096))
            read(a, buf, reg, [f"{mode}/k"], 4096).wait()
            assert buf.read(0, 4096) == (second if second_wins else first), mode
        # replace with another size: the key holds the new object, whole
        reg = agent.register_objects("wm", prefix="resize/")
        buf = HostBuffer(agent, 6000)
        for n, seed in ((4096, 12), (6000, 13), (3000, 14)):
            data = random_bytes(n, seed)
            buf.write(0, data)
            write(agent, buf, reg, ["resize/k"], n)
            buf.write(0, bytes(6000))
            read(agent, buf, reg, ["resize/k"], n).wait()
            assert buf.read(0, n) == data, n


def test_replace_whose_remove_is_refused_fails_naming_the_key(agents, monkeypatch):
    """write_mode replace, zero-copy (removed, then put): a key the store refuses to remove (OBJECT_HAS_LEASE) fails
    the WRITE with a typed error naming it and is not put; the other key of the call is replaced. Before: the
    refusal was ignored, Mooncake's put of the existing key answered 0 and kept the old object: DONE, old bytes."""
    from datamover.backends.mooncake import codes

    agent = agents["zero_copy"]
    reg = agent.register_objects("wm", prefix="refused/")
    size = 64 << 10
    buf = HostBuffer(agent, 2 * size)
    old = random_bytes(2 * size, 20)
    buf.write(0, old)
    write(agent, buf, reg, ["refused/a", "refused/b"], size)
    client = agent.backend("mooncake").client
    real = client._store

    class Refusing:  # the fault: the store refuses to remove refused/b (a lease on it)
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_remove(self, keys, force):
            out = real.batch_remove([k for k in keys if not k.endswith("/b")], force)
            it = iter(out)
            return [codes.OBJECT_HAS_LEASE if k.endswith("/b") else next(it) for k in keys]

    monkeypatch.setattr(client, "_store", Refusing())
    new = random_bytes(2 * size, 21)
    buf.write(0, new)
    dst = DescList.objects(reg, [size, size], 0, keys=["refused/a", "refused/b"])
    with pytest.raises(ObjectStoreError) as info:
        agent.transfer("WRITE", buf.descs([0, size], size), dst).wait()
    assert info.value.key == "refused/b" and info.value.code == "OBJECT_HAS_LEASE" and info.value.index == 1
    monkeypatch.undo()
    buf.write(0, bytes(2 * size))
    assert read(agent, buf, reg, ["refused/a", "refused/b"], size).wait() == XferState.DONE
    assert buf.read(0, size) == new[:size], "the key whose remove went through was not replaced"
    assert buf.read(size, size) == old[size:], "the key whose remove was refused changed"


class Spy:
    """The store client, with the buffers every batched put/get was given recorded (nothing else changed)."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name: str):
        fn = getattr(self.store, name)
        if not name.startswith(("batch_put", "batch_upsert", "batch_get_into")):
            return fn

        def spied(keys, ptrs, sizes, *rest):
            self.calls.append((name, list(ptrs), list(sizes)))
            return fn(keys, ptrs, sizes, *rest)

        return spied


def test_staged_slots_sit_at_the_callers_page_offsets(agents):
    """A staged object's arena slot starts at its caller buffer's offset in a page (so the copy between them is
    never a few bytes apart modulo a page), slots never overlap, and the bytes round-trip."""
    agent = agents["auto"]
    client = agent.backend("mooncake").client
    reg = agent.register_objects("it", prefix="slots/")
    buf = HostBuffer(agent, 1 * MiB, shift=24)
    offsets = np.array([0, 5000, 70_000, 200_000, 300_001])
    sizes = np.array([5000, 65_000, 130_000, 100_000, 16])
    payload = random_bytes(1 * MiB, 15)
    buf.write(0, payload)
    keys = [f"slots/{i}" for i in range(len(offsets))]
    spy = client._store = Spy(client._store)
    try:
        dst = DescList.objects(reg, sizes, 0, keys=keys)
        assert agent.transfer("WRITE", buf.descs(offsets, sizes), dst).wait() == XferState.DONE
        buf.write(0, bytes(1 * MiB))
        assert agent.transfer("READ", buf.descs(offsets, sizes), dst).wait() == XferState.DONE
    finally:
        client._store = spy.store
    assert [c[0] for c in spy.calls] == ["batch_upsert_from", "batch_get_into"]
    addrs = buf.descs(offsets, sizes).addr
    for _, ptrs, lens in spy.calls:
        assert lens == [int(s) + 16 for s in sizes]
        assert [(p - int(a)) % 4096 for p, a in zip(ptrs, addrs)] == [0] * len(ptrs)
        assert all(ptrs[i] + lens[i] <= ptrs[i + 1] for i in range(len(ptrs) - 1)), "slots overlap"
    for o, n in zip(offsets, sizes):
        assert buf.read(int(o), int(n)) == payload[o : o + n]


def test_a_reposted_transfer_reuses_its_plan_s_call_groups(agents, monkeypatch):
    """A prepared transfer's store calls are cut into groups once, when it is planned: posting it again asks
    the client for none (the groups travel with the plan), and every post still moves and checks the bytes."""
    agent = agents["auto"]
    client = agent.backend("mooncake").client
    reg = agent.register_objects("it", prefix="regroup/")
    buf = HostBuffer(agent, 256 * 1024)
    data = random_bytes(256 * 1024, 16)
    buf.write(0, data)
    dst = agent.prepare(DescList.objects(reg, [64 * 1024] * 4, 0, keys=[f"regroup/{i}" for i in range(4)]))
    src = agent.prepare(buf.descs([i * 64 * 1024 for i in range(4)], [64 * 1024] * 4))
    with (
        agent.make_transfer("WRITE", src, None, dst, None) as put,
        agent.make_transfer("READ", src, None, dst, None) as get,
    ):
        asked = []
        monkeypatch.setattr(client, "groups", lambda sizes: asked.append(sizes) or [])
        for _ in range(3):
            assert put.post().wait() == XferState.DONE
            buf.write(0, bytes(256 * 1024))
            assert get.post().wait() == XferState.DONE
            assert buf.read(0, 256 * 1024) == data
        assert asked == [], "a post cut its calls into groups again"


def test_write_with_offset_refused(agent):
    reg = agent.register_objects("it", prefix="off/")
    buf = HostBuffer(agent, 4096)
    dst = DescList.objects(reg, [100, 100], [0, 7], keys=["off/a", "off/b"])
    with pytest.raises(InvalidDescriptor) as info:
        agent.transfer("WRITE", buf.descs([0, 100], [100, 100]), dst)
    assert info.value.index == 1 and "offset 0" in str(info.value) and "it/off/b" in str(info.value)


def test_sizes_from_the_store_are_bounded(mooncake_master, raw):
    """An object larger than max_object_bytes is refused before anything is allocated for it."""
    with mooncake_agent(mooncake_master, "bound", max_object_bytes=1 * MiB) as a:
        reg = a.register_objects("it", prefix="big/")
        raw.put("it/big/x", pack("it/big/x", random_bytes(2 * MiB, 4)))
        buf = HostBuffer(a, 4096)
        src = DescList.objects(reg, [100], [10], keys=["big/x"])
        with pytest.raises(ObjectStoreError, match="max_object_bytes"):
            a.transfer("READ", buf.descs([0], [100]), src).wait()
        with pytest.raises(ObjectStoreError, match="max_object_bytes"):
            read(a, buf, reg, ["big/x"], 4096).wait()


def test_prefix_and_past_the_end(agent, raw):
    """A READ of fewer bytes than the object is its prefix (verified whole first); past the end is refused."""
    reg = agent.register_objects("it", prefix="pre/")
    data = random_bytes(9000, 5)
    raw.put("it/pre/o", pack("it/pre/o", data))
    buf = HostBuffer(agent, 10_000)
    read(agent, buf, reg, ["pre/o"], 4000).wait()
    assert buf.read(0, 4000) == data[:4000]
    with pytest.raises(ObjectStoreError, match="reads past its end"):
        read(agent, buf, reg, ["pre/o"], 10_000).wait()


def test_p2p_handshake_metadata():
    """Without a metadata server (P2PHANDSHAKE) a second client reads what the agent wrote."""
    with MooncakeMaster(metadata="p2p") as m, mooncake_agent(m, "p2p") as a:
        assert m.metadata_url == "P2PHANDSHAKE"
        reg = a.register_objects("p2p", prefix="")
        buf = HostBuffer(a, 3 * 65536)
        data = random_bytes(3 * 65536, 6)
        buf.write(0, data)
        write(a, buf, reg, ["a", "b", "c"], 65536)
        other = RawStore(m)
        try:
            from .conftest import unpack

            assert unpack("p2p/b", other.get("p2p/b")) == data[65536:131072]
        finally:
            other.close()


# -- faults ----------------------------------------------------------------------------------------------
@pytest.fixture
def fault_master():
    with MooncakeMaster() as m:
        yield m


def test_killed_holder_reads_other_replica_or_miss(fault_master):
    """Two replicas on two holder processes; one holder is killed: every read is the right bytes or a typed
    miss (zeros in the row), never wrong bytes; once the master has dropped the dead segment, every key reads
    from the surviving replica."""
    m = fault_master
    n, size = 32, 65536
    a, b = PoolMember.start_many(m, 2, 32 * MiB)
    try:
        with mooncake_agent(m, "writer", global_segment_size=0, replica_count=2) as agent:
            reg = agent.register_objects("rep", prefix="")
            keys = [f"k{i}" for i in range(n)]
            buf = HostBuffer(agent, n * size)
            data = random_bytes(n * size, 7)
            buf.write(0, data)
            write(agent, buf, reg, keys, size)
            client = agent.backend("mooncake").client
            holders = client.replicas([f"rep/{k}" for k in keys])
            assert all(sorted(h) == sorted([a.hostname, b.hostname]) for h in holders.values()), holders

            a.kill()  # the fault: one replica of every key is gone with its process
            outcomes = {"bytes": 0, "miss": 0}
            for i, key in enumerate(keys):
                buf.write(i * size, b"\xee" * size)
                xfer = read(agent, buf, reg, [key], size, at=i * size)
                try:
                    xfer.wait()
                    outcomes["bytes"] += 1
                    assert buf.read(i * size, size) == data[i * size : (i + 1) * size], f"{key}: wrong bytes"
                except DatamoverError:
                    outcomes["miss"] += 1
                    assert buf.read(i * size, size) == after_failure(agent, b"\xee" * size), f"{key}: bytes left"
                xfer.release()
            assert outcomes["bytes"] + outcomes["miss"] == n

            def dropped() -> bool:
                return all(h == [b.hostname] for h in client.replicas([f"rep/{k}" for k in keys]).values())

            until(dropped, what="the master dropping the killed holder's replicas")
            buf.write(0, bytes(n * size))
            assert read(agent, buf, reg, keys, size).wait() == XferState.DONE
            assert buf.read(0, n * size) == data, "the surviving replica returned wrong bytes"
    finally:
        a.kill()
        b.kill()


def test_master_restart_misses_then_recovers(fault_master):
    """After the master restarts, what it knew reads as misses (typed), and the pool takes writes again."""
    m = fault_master
    with mooncake_agent(m, "restart", global_segment_size=32 * MiB) as agent:
        reg = agent.register_objects("mr", prefix="")
        buf = HostBuffer(agent, 2 * 4096)
        data = random_bytes(4096, 8)
        buf.write(0, data)
        write(agent, buf, reg, ["before"], 4096)

        m.restart()  # the fault: every object the old master placed is forgotten
        with pytest.raises(ObjectStoreError) as info:
            read(agent, buf, reg, ["before"], 4096).wait()
        assert info.value.key == "before"
        assert buf.read(0, 4096) == data, "a miss wrote to the destination"

        def writes() -> bool:
            buf.write(4096, data)
            dst = DescList.objects(reg, [4096], 0, keys=["after"])
            try:
                return agent.transfer("WRITE", buf.descs([4096], [4096]), dst).wait() == XferState.DONE
            except ObjectStoreError:
                return False

        until(writes, what="a write after the master restart")
        buf.write(0, bytes(8192))
        read(agent, buf, reg, ["after"], 4096).wait()
        assert buf.read(0, 4096) == data


def test_auto_mode_stages_what_stays_in_cache(agents):
    """auto: 1 MiB values are staged in a call that stays in the CPU's caches (4 MiB, ``cached_copy_bytes``)
    and move zero-copy in one past them; 4 MiB values always move zero-copy. The bytes round-trip either way."""
    agent = agents["auto"]
    client = agent.backend("mooncake").client
    reg = agent.register_objects("it", prefix="auto/")
    buf = HostBuffer(agent, 8 * MiB)
    payload = random_bytes(8 * MiB, 16)
    spy = client._store = Spy(client._store)
    try:
        for size, count in ((MiB, 4), (MiB, 8), (4 * MiB, 1)):
            buf.write(0, payload)
            keys = [f"auto/{size}/{count}/{i}" for i in range(count)]
            dst = DescList.objects(reg, [size] * count, 0, keys=keys)
            descs = buf.descs(np.arange(count) * size, size)
            assert agent.transfer("WRITE", descs, dst).wait() == XferState.DONE
            buf.write(0, bytes(8 * MiB))
            assert agent.transfer("READ", descs, dst).wait() == XferState.DONE
            assert buf.read(0, size * count) == payload[: size * count]
    finally:
        client._store = spy.store
    assert [c[0] for c in spy.calls] == [
        "batch_upsert_from", "batch_get_into",
        "batch_put_from_multi_buffers", "batch_get_into_multi_buffers",
        "batch_put_from_multi_buffers", "batch_get_into_multi_buffers",
    ]  # fmt: skip


def test_master_takes_fresh_ports_when_one_was_taken(mooncake_master):
    """A free port another process takes before the master binds it (the race of ``free_port``) costs a second
    start on fresh ports, not a failed test; a restart keeps the ports clients know."""
    import socket

    with socket.socket() as squatter:
        m = MooncakeMaster()
        squatter.bind(("127.0.0.1", m.http_port))
        squatter.listen()
        taken = m.http_port
        try:
            m.start()
            assert m.starts == 2 and m.http_port != taken
            ports = (m.rpc_port, m.http_port, m.metrics_port)
            m.restart()
            assert (m.rpc_port, m.http_port, m.metrics_port) == ports
        finally:
            m.close()


def test_memory_registered_while_the_master_is_down(fault_master):
    """With the master gone the store refuses register_buffer: registering memory with the agent still works
    (before: the client's OSError failed the agent's registration, so a TieredCache could not serve even its
    local tiers), a READ is a typed error that leaves the buffer untouched, and once the master is back that
    memory moves again (a zero-copy agent), every byte checked."""
    m = fault_master
    with mooncake_agent(m, "down", global_segment_size=32 * MiB, transfer_mode="zero_copy") as agent:
        reg = agent.register_objects("down", prefix="")
        m.kill()
        buf = HostBuffer(agent, 4 * 65536)
        assert buf.registration.handles["mooncake"] is None
        buf.write(0, b"\x33" * (4 * 65536))
        with pytest.raises(DatamoverError):
            read(agent, buf, reg, [f"k{i}" for i in range(4)], 65536).wait()
        assert buf.read(0, 4 * 65536) == b"\x33" * (4 * 65536)
        m.start()
        data = random_bytes(4 * 65536, 9)
        buf.write(0, data)
        keys = [f"k{i}" for i in range(4)]

        def written() -> bool:
            try:
                write(agent, buf, reg, keys, 65536)
                return True
            except DatamoverError:
                return False  # the client re-mounts its segment on the new master first

        until(written, what="a WRITE after the master came back")
        buf.write(0, bytes(4 * 65536))
        assert read(agent, buf, reg, keys, 65536).wait() == XferState.DONE
        assert buf.read(0, 4 * 65536) == data
