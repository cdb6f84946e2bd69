"""A region outlives every transfer on it: deregistering one in use is refused, a transfer made before its region
was deregistered is refused at post, closing the agent cuts transfers in flight short before it closes their
files; one transfer is posted by one thread at a time; timeouts are bounded numbers."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from datamover import Agent, DescList, XferState, aligned_empty
from datamover.backends.posix import rows as posix_rows
from datamover.errors import InvalidParameter, NotRegistered, TransferAborted, TransferStateError
from datamover.testing.waiting import BOUND_S, HeldOnce

POOLED = {"inline_bytes": 0, "inline_batch_bytes": 0, "aio": False, "threads": 1}
MiB = 1 << 20


@pytest.fixture
def held_write(monkeypatch):
    """The first posix vectored syscall waits until the test lets it go."""
    held = HeldOnce("the posix write")
    monkeypatch.setattr(posix_rows, "vectored", held.wrap(posix_rows.vectored))
    yield held
    held.go.set()


def _file_agent(tmp_path, name="p"):
    agent = Agent(name, {"backends": {"posix": POOLED}})
    buf = aligned_empty(MiB)
    buf[:] = 0x41
    agent.register_memory(buf)
    fa = agent.register_file(tmp_path / "A", MiB)
    return agent, buf, fa


def _deregister_under_a_held_write(agent, buf, fa, held_write):
    """(a WRITE into file `fa` held in its syscall, a thread deregistering `fa` meanwhile, still waiting)."""
    xfer = agent.transfer("WRITE", DescList.from_buffers(buf), DescList.file(fa, [0], [MiB]))
    assert held_write.reached.wait(BOUND_S)
    gone = threading.Thread(target=agent.deregister_memory, args=(fa,))
    gone.start()
    gone.join(0.2)
    return xfer, gone


def test_deregistering_a_file_a_write_is_using_waits_for_the_write(tmp_path, held_write):
    agent, buf, fa = _file_agent(tmp_path)
    with agent:
        xfer, gone = _deregister_under_a_held_write(agent, buf, fa, held_write)
        assert gone.is_alive() and not held_write.returned.is_set()  # A's descriptor is still open
        with pytest.raises(NotRegistered, match="has no FILE memory registered on device"):
            # a new transfer on the region going away is refused meanwhile
            agent.transfer("WRITE", DescList.from_buffers(buf), DescList.file(fa, [0], [MiB]))
        agent.register_file(tmp_path / "B", MiB)
        held_write.go.set()
        gone.join(BOUND_S)
        assert not gone.is_alive() and fa.id not in agent.regions
        assert xfer.state == XferState.DONE
    assert (tmp_path / "A").read_bytes() == b"A" * MiB
    assert (tmp_path / "B").read_bytes() == bytes(MiB)


def test_deregistering_waits_no_longer_than_the_transfers_deadline(tmp_path, held_write):
    agent, buf, fa = _file_agent(tmp_path)
    with agent:
        xfer = agent.transfer("WRITE", DescList.from_buffers(buf), DescList.file(fa, [0], [MiB]), timeout=0.2)
        assert held_write.reached.wait(BOUND_S)
        gone = threading.Thread(target=agent.deregister_memory, args=(fa,))
        gone.start()
        gone.join(1.0)
        # past the deadline the write times out; its fenced cancel still waits for the held syscall
        assert gone.is_alive()
        held_write.go.set()
        gone.join(BOUND_S)
        assert not gone.is_alive() and fa.id not in agent.regions
        assert xfer.state == XferState.ERR and "did not complete within 0.2 s" in str(xfer.error)


def test_a_transfer_made_before_its_region_was_deregistered_is_refused_at_post(tmp_path):
    agent, buf, fa = _file_agent(tmp_path)
    with agent:
        prepped = agent.prepare(DescList.file(fa, [0], [MiB]))
        local = agent.prepare(DescList.from_buffers(buf))
        xfer = agent.make_transfer("WRITE", local, [0], prepped, [0])
        assert xfer.post().wait() == XferState.DONE
        agent.deregister_memory(fa)
        agent.register_file(tmp_path / "B", MiB)  # may take A's file descriptor number
        with pytest.raises(NotRegistered, match=f"region {fa.id} was deregistered from agent 'p'"):
            xfer.post()
    assert (tmp_path / "B").read_bytes() == bytes(MiB)


def test_closing_the_agent_cuts_a_write_in_flight_short_before_closing_its_file(tmp_path, held_write):
    agent, buf, fa = _file_agent(tmp_path)
    xfer = agent.transfer("WRITE", DescList.from_buffers(buf), DescList.file(fa, [0], [MiB]), timeout=BOUND_S)
    assert held_write.reached.wait(BOUND_S)
    closed = threading.Thread(target=agent.close)
    closed.start()
    # close waits for the write (fenced): it has not closed A's descriptor under it
    assert not held_write.returned.is_set()
    closed.join(0.2)
    assert closed.is_alive()
    held_write.go.set()
    closed.join(BOUND_S)
    assert not closed.is_alive()
    assert xfer.state == XferState.ERR
    assert isinstance(xfer.error, TransferAborted) and "agent 'p' closed" in str(xfer.error)
    with pytest.raises(TransferStateError, match="agent 'p' is closed"):
        xfer.post()


def test_one_transfer_is_posted_by_one_thread_at_a_time(tmp_path):
    agent, buf, fa = _file_agent(tmp_path)
    with agent:
        local, remote = DescList.from_buffers(buf), DescList.file(fa, [0], [MiB])
        xfer = agent.make_transfer("WRITE", agent.prepare(local), [0], agent.prepare(remote), [0])
        # the first post is inside the backend's post when a second thread posts: refused, not a second post
        # whose completion would replace the first one's (release would then not wait for the first)
        held = HeldOnce("the backend's post")
        backend = agent.backend("posix")
        backend.post = held.wrap(backend.post)
        posted = threading.Thread(target=xfer.post)
        posted.start()
        assert held.reached.wait(BOUND_S)
        with pytest.raises(TransferStateError, match="being posted or released by another thread"):
            xfer.post()
        released = threading.Thread(target=xfer.release)
        released.start()
        released.join(0.1)
        assert released.is_alive()  # release waits for the post, then for its write
        held.go.set()
        posted.join(BOUND_S)
        released.join(BOUND_S)
        assert xfer.state == XferState.RELEASED


@pytest.mark.parametrize("timeout", [0, -1, math.inf, math.nan, 1e300, "soon"])
def test_a_timeout_must_be_a_bounded_number_of_seconds(timeout):
    with Agent("m") as agent:
        a, b = np.zeros(64, np.uint8), np.ones(64, np.uint8)
        agent.register_memory([a, b])
        with pytest.raises(InvalidParameter, match="timeout must be a number of seconds"):
            agent.transfer("WRITE", DescList.from_buffers(a), DescList.from_buffers(b), timeout=timeout)


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, 0])
def test_the_agents_default_timeout_is_bounded_too(timeout_s):
    with pytest.raises(InvalidParameter, match="timeout_s"):
        Agent("m", {"timeout_s": timeout_s})


def test_the_dead_region_check_names_only_this_agents_regions():
    """A transfer on a buffer pair of one region each keeps working after an unrelated region goes."""
    with Agent("m") as agent:
        a, b, c = np.zeros(64, np.uint8), np.ones(64, np.uint8), np.ones(8, np.uint8)
        ra, rb, rc = agent.register_memory([a, b, c])
        x = agent.make_transfer(
            "WRITE", agent.prepare(DescList.from_buffers(a)), [0], agent.prepare(DescList.from_buffers(b)), [0]
        )
        agent.deregister_memory(rc)
        assert x.post().wait() == XferState.DONE and not b.any()
        assert sorted(x.request.own_regions) == sorted([ra.id, rb.id])


def test_a_backend_still_finds_a_region_going_while_the_transfers_on_it_finish(tmp_path, held_write):
    """While deregistration waits, the region is gone for new transfers but still in `regions` for the backends
    (ucx's service thread looks a queued post's regions up there: it failed the post with NotRegistered)."""
    agent, buf, fa = _file_agent(tmp_path)
    with agent:
        xfer, gone = _deregister_under_a_held_write(agent, buf, fa, held_write)
        assert gone.is_alive() and fa.id in agent.regions
        with pytest.raises(NotRegistered):
            agent.deregister_memory(fa)  # once is enough: a second deregistration meanwhile is refused
        held_write.go.set()
        gone.join(BOUND_S)
        assert fa.id not in agent.regions and xfer.state == XferState.DONE
