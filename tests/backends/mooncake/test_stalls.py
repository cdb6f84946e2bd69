"""mooncake with store calls that do not return (a stalled master holds one ~30 s, Mooncake's RPC timeout): the
caller is held to its deadline, not to the store; retries stop at the deadline; close and existence checks are
bounded. The fault is a store call parked on an Event at a known point (never a real SIGSTOP: what is tested is
datamover's behaviour around the call, not Mooncake's timeout)."""

from __future__ import annotations

import threading

import pytest

from datamover import DescList, XferState
from datamover.backends.mooncake import codes
from datamover.backends.mooncake.client import Asker
from datamover.errors import TransferTimeout
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.waiting import BOUND_S

from .test_backend import mooncake_agent, signal_get_returned, until

SIZE = 4096
START_S = 2.0  # the READ's timeout: long enough for a pool thread to reach the store call on a loaded machine


class Parked:
    """The client's real store with every ``method`` call parked until ``go`` is set, then answering ``answer``
    for every key (or making the real call when ``answer`` is None); ``calls`` counts them."""

    def __init__(self, real, method: str, answer: int | None = None) -> None:
        self.real, self.method, self.answer = real, method, answer
        self.reached, self.go = threading.Event(), threading.Event()
        self.calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self.real, name)
        if name != self.method:
            return attr

        def parked(keys, *args, **kwargs):
            self.calls += 1
            self.reached.set()
            assert self.go.wait(60), "the test never let the store call go"
            return attr(keys, *args, **kwargs) if self.answer is None else [self.answer] * len(keys)

        return parked


@pytest.fixture(scope="module")
def agent(mooncake_master):
    a = mooncake_agent(mooncake_master, "stalls", transfer_mode="staged", inline_bytes=0)  # never on the caller's
    yield a
    a.close()


def _one_object(agent, key: str):
    reg = agent.register_objects("stall", prefix="")
    buf = HostBuffer(agent, SIZE)
    buf.write(0, random_bytes(SIZE, 7))
    dst = DescList.objects(reg, [SIZE], 0, keys=[key])
    assert agent.transfer("WRITE", buf.descs([0], [SIZE]), dst).wait() == XferState.DONE
    return buf, dst


def test_a_read_stuck_in_the_store_ends_at_its_deadline_and_is_not_retried_past_it(agent, monkeypatch):
    """A small READ whose get is stuck: wait() returns ERR TransferTimeout while the get is still parked (before:
    the READ ran inside post() on the caller's thread, held it for the store call and read_retries more, and
    ended as RPC_TIMEOUT); when the get then fails with RPC_TIMEOUT it is not asked again."""
    buf, dst = _one_object(agent, "stuck-read")
    client = agent.backend("mooncake").client
    parked = Parked(client._store, "batch_get_into", codes.RPC_TIMEOUT)
    monkeypatch.setattr(client, "_store", parked)
    done = signal_get_returned(client, monkeypatch)
    xfer = agent.transfer("READ", buf.descs([0], [SIZE]), dst, timeout=START_S)
    assert parked.reached.wait(60), "the READ never reached the store"
    with pytest.raises(TransferTimeout):
        xfer.wait()
    assert not parked.go.is_set() and not done.is_set()  # the caller came back with the store call still parked
    xfer.release()
    parked.go.set()
    assert done.wait(60)
    assert parked.calls == 1, f"the get was asked {parked.calls} times, past the deadline"


def test_exists_is_bounded_and_does_not_pile_up(agent, monkeypatch):
    """An existence check whose store call is stuck answers -1 ('could not tell') after its timeout; while it is
    still stuck the next one answers -1 at once without calling the store; once it returned, answers are real
    again (before: each check blocked as long as the store call)."""
    _one_object(agent, "there")
    client = agent.backend("mooncake").client
    parked = Parked(client._store, "batch_is_exist")
    monkeypatch.setattr(client, "_store", parked)
    assert client.exists(["stall/there", "stall/nope"], 0.2) == [-1, -1]
    assert client.exists(["stall/there"], 60) == [-1]  # at once: the store call before it is still stuck
    assert parked.calls == 1
    parked.go.set()
    until(lambda: client.exists(["stall/there", "stall/nope"], 5) == [1, 0], what="a real answer")


def test_close_does_not_wait_for_a_stuck_store_call(mooncake_master, monkeypatch):
    """The backend's close with a READ's get stuck in the store returns after CLOSE_S, leaving the client open
    (before: it waited for the pool thread, then for Mooncake's close: Agent.close took 79 s with the master
    stopped)."""
    from datamover.backends.mooncake import backend

    monkeypatch.setattr(backend, "CLOSE_S", 0.5)
    a = mooncake_agent(mooncake_master, "stall-close", transfer_mode="staged", inline_bytes=0)
    buf, dst = _one_object(a, "stuck-close")
    client = a.backend("mooncake").client
    parked = Parked(client._store, "batch_get_into", codes.RPC_TIMEOUT)
    monkeypatch.setattr(client, "_store", parked)
    xfer = a.transfer("READ", buf.descs([0], [SIZE]), dst, timeout=60)
    assert parked.reached.wait(60), "the READ never reached the store"
    closing = threading.Thread(target=a.backend("mooncake").close)
    closing.start()
    closing.join(30)
    try:
        assert not closing.is_alive(), "Agent.close waited for a store call stuck in the store"
        assert not parked.go.is_set()
    finally:
        parked.go.set()
        closing.join(60)
        xfer.release()
        a.close()


def test_asker_answers_raises_and_waits_no_longer_than_asked():
    """The asking thread on its own (no store): an answer in time, an exception handed over, a call parked on an
    Event answered "not in time" while it stays parked, no second call started meanwhile, a timeout of 0 or less
    a check without a wait (not an error), and real answers again once the parked call returned."""
    asker = Asker("test-asker")
    go = threading.Event()
    calls = []

    def parked():
        calls.append("parked")
        assert go.wait(BOUND_S), "the test never let the call go"
        return "late"

    try:
        assert asker.ask(lambda: 7, BOUND_S) == (True, 7)
        with pytest.raises(ZeroDivisionError):
            asker.ask(lambda: 1 / 0, BOUND_S)
        assert asker.ask(parked, 0.05) == (False, None)
        assert asker.ask(lambda: calls.append("second"), BOUND_S) == (False, None)  # at once: one is stuck
        assert asker.ask(lambda: calls.append("third"), -1.0) == (False, None)
        assert calls == ["parked"] and not go.is_set()
        go.set()
        until(lambda: asker.ask(lambda: 8, BOUND_S) == (True, 8), what="a real answer after the parked call")
        assert asker.ask(lambda: 9, -0.5) in ((True, 9), (False, None))
        until(lambda: asker.ask(lambda: 10, BOUND_S) == (True, 10), what="a real answer after a check without a wait")
    finally:
        go.set()
        asker.stop(BOUND_S)


@pytest.mark.parametrize("stuck", [True, False])
def test_asker_stop_says_a_call_is_stuck_and_leaves_no_thread(stuck):
    """stop with a call parked answers False without waiting for it, and the thread ends once the call returned;
    with nothing in flight stop answers True and the thread ends."""
    asker = Asker("test-asker-stop")
    go, reached = threading.Event(), threading.Event()

    def parked():
        reached.set()
        assert go.wait(BOUND_S), "the test never let the call go"

    if stuck:
        assert asker.ask(parked, 0.05) == (False, None)
        assert reached.wait(BOUND_S)
    else:
        assert asker.ask(lambda: 1, BOUND_S) == (True, 1)
    thread = asker._thread
    assert asker.stop(0.05) is not stuck
    go.set()
    thread.join(BOUND_S)
    assert not thread.is_alive()
