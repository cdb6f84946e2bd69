"""mooncake READs that time out or are released while a store call is in flight: once the transfer reports ERR
(or ``release`` returned), no byte of it reaches the caller's memory, against a real mooncake_master.

The fault is a store call held at a known point (the client's real store behind a proxy that parks one call
until the test lets it go): staged, after the object landed in the arena and before it is copied out;
zero-copy, before Mooncake writes into the destination. Nothing waits for a fixed time: the test polls the
transfer's state until its deadline has turned it ERR.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from datamover import DescList, XferState
from datamover.errors import TransferTimeout
from datamover.testing import HostBuffer, random_bytes

from .test_backend import mooncake_agent, signal_get_returned, until

SIZE = 64 << 10
#: the READ's timeout: its part checks the deadline before it calls the store, so the pool thread must reach that
#: call within it (on a loaded machine 0.5 s can pass before a pool thread starts it)
START_S = 2.0


class HeldStore:
    """The client's real store with its first ``method`` call parked (``before`` or after the real call) until
    ``go`` is set; ``reached`` tells the test it is parked."""

    def __init__(self, real, method: str, before: bool) -> None:
        self.real, self.method, self.before = real, method, before
        self.reached, self.go = threading.Event(), threading.Event()
        self.armed = True

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if name != self.method:
            return attr

        def held(*args, **kwargs):
            hold, self.armed = self.armed, False
            if hold and self.before:
                self.reached.set()
                assert self.go.wait(60), "the test never let the store call go"
            out = attr(*args, **kwargs)
            if hold and not self.before:
                self.reached.set()
                assert self.go.wait(60), "the test never let the store call go"
            return out

        return held


@pytest.fixture(scope="module")
def late_agents(mooncake_master):
    """Agents whose READs run on the backend's pool (no inline post), one per transfer mode."""
    made = {}
    try:
        for mode in ("staged", "zero_copy"):
            made[mode] = mooncake_agent(mooncake_master, f"late-{mode}", transfer_mode=mode, inline_bytes=0)
        yield made
    finally:
        for a in made.values():
            a.close()


def _setup(agent, key: str, store_call: str, before: bool, monkeypatch):
    """One object ``key`` holding known bytes, a destination full of 0xAA, the store call held, and an event
    set when the part's ``client.get`` returned (everything it would copy is copied by then)."""
    reg = agent.register_objects("late", prefix="")
    buf = HostBuffer(agent, SIZE)
    data = random_bytes(SIZE, 41)
    buf.write(0, data)
    dst = DescList.objects(reg, [SIZE], 0, keys=[key])
    assert agent.transfer("WRITE", buf.descs([0], [SIZE]), dst).wait() == XferState.DONE
    buf.write(0, b"\xaa" * SIZE)
    client = agent.backend("mooncake").client
    held = HeldStore(client._store, store_call, before)
    monkeypatch.setattr(client, "_store", held)
    done = signal_get_returned(client, monkeypatch)
    return buf, data, dst, held, done


@pytest.mark.parametrize("end", ["timeout", "release"])
def test_staged_read_cut_short_leaves_the_destination_untouched(late_agents, monkeypatch, end):
    """The object is in the arena, verified next, when the READ times out (or is released): the copy to the
    caller must not happen after that (before: all 65,536 bytes landed after ERR)."""
    agent = late_agents["staged"]
    buf, data, dst, held, done = _setup(agent, f"staged-{end}", "batch_get_into", False, monkeypatch)
    xfer = agent.transfer("READ", buf.descs([0], [SIZE]), dst, timeout=START_S)
    assert held.reached.wait(60), "the READ never reached the store"
    if end == "timeout":
        until(lambda: xfer.state == XferState.ERR, what="the READ timing out")
        assert isinstance(xfer.error, TransferTimeout)
    else:
        xfer.release()
        assert xfer.state == XferState.RELEASED
    held.go.set()
    assert done.wait(60), "the held part never finished"
    assert buf.read(0, SIZE) == b"\xaa" * SIZE, "bytes of a READ reached the caller after it reported ERR"
    # the same READ, not held, delivers: the destination above stayed as it was only because of the cut
    monkeypatch.undo()
    assert agent.transfer("READ", buf.descs([0], [SIZE]), dst).wait() == XferState.DONE
    assert buf.read(0, SIZE) == data


def test_zero_copy_read_timing_out_mid_call_reports_err_after_its_bytes(late_agents, monkeypatch):
    """Zero-copy, Mooncake writes into the destination itself, so a READ whose store call is in flight when its
    deadline passes reports ERR only once that call returned: what the destination holds when ERR is seen is
    what it holds after (before: ERR at once, then all 65,536 bytes landed)."""
    agent = late_agents["zero_copy"]
    buf, _, dst, held, done = _setup(agent, "zero-copy", "batch_get_into_multi_buffers", True, monkeypatch)
    xfer = agent.transfer("READ", buf.descs([0], [SIZE]), dst, timeout=START_S)
    assert held.reached.wait(60), "the READ never reached the store"
    seen: dict[str, bytes] = {}

    def watch() -> None:
        until(lambda: xfer.state == XferState.ERR, what="the READ timing out")
        seen["at ERR"] = buf.read(0, SIZE)

    watcher = threading.Thread(target=watch)
    watcher.start()
    # the watcher's cancel either waits on the fence for the held call, or (no fence) has already seen ERR
    fencing = getattr(xfer._completion, "fencing", None)
    until(lambda: (fencing is not None and fencing.is_set()) or not watcher.is_alive(), what="ERR or the fence")
    held.go.set()
    watcher.join(60)
    assert done.wait(60), "the held part never finished"
    assert isinstance(xfer.error, TransferTimeout)
    after = buf.read(0, SIZE)
    changed = int(np.count_nonzero(np.frombuffer(after, np.uint8) != np.frombuffer(seen["at ERR"], np.uint8)))
    assert changed == 0, f"{changed} bytes of a READ reached the caller after it reported ERR"


def test_zero_copy_get_failing_after_the_fence_gave_up_leaves_the_released_buffer_alone(late_agents, monkeypatch):
    """A zero-copy get stuck past the fence's bound (a stalled master): ``cancel`` gives up waiting, the READ is
    released; then the get returns a failure. The part must not zero the released buffer (before: all 65,536
    bytes were set to zero after release returned)."""
    from datamover.backends import fence
    from datamover.backends.mooncake import codes

    monkeypatch.setattr(fence, "FENCE_S", 0.2)
    agent = late_agents["zero_copy"]
    buf, _, dst, held, done = _setup(agent, "zero-copy-late-fail", "batch_get_into_multi_buffers", True, monkeypatch)
    real = held.real

    class Failing:  # the held call answers a failure for every key once let go (it never reached the store)
        def __getattr__(self, name):
            if name == "batch_get_into_multi_buffers":
                return lambda keys, *_: [codes.RPC_TIMEOUT] * len(keys)
            return getattr(real, name)

    held.real = Failing()
    xfer = agent.transfer("READ", buf.descs([0], [SIZE]), dst, timeout=START_S)
    assert held.reached.wait(60), "the READ never reached the store"
    until(lambda: xfer.state == XferState.ERR, what="the READ timing out")
    assert isinstance(xfer.error, TransferTimeout)
    xfer.release()
    held.go.set()
    assert done.wait(60), "the held part never finished"
    assert buf.read(0, SIZE) == b"\xaa" * SIZE, "a failed get zeroed the caller's buffer after release"
