"""Remote descriptors belong to one process of a peer: once its metadata names another (it restarted), descriptors
checked against the earlier one are refused, prepared lists at ``make_transfer`` and made transfers at ``post``.

The peer here is metadata only (``encode_metadata`` with an ``ident`` per process), moved by a backend that records
what it is asked to post: what is tested is what reaches a backend.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from datamover import Agent, DescList, MemType, XferState
from datamover.agents.metadata import encode_metadata
from datamover.backends import Backend, register_backend
from datamover.backends.base import finished_completion
from datamover.errors import NotRegistered

ADDR, SIZE = 0x7F0000000000, 1 << 16


class RecordingRemote(Backend):
    """A remote backend that moves nothing and remembers every request posted to it."""

    name = "recording-remote"
    pairs = frozenset({(MemType.DRAM, MemType.DRAM)})
    supports_local = False
    supports_remote = True

    @classmethod
    def available(cls):
        return True, "ok"

    def __init__(self, host, params=None) -> None:
        super().__init__(host, params)
        self.posted: list = []

    def post(self, req):
        self.posted.append(req)
        return finished_completion()


@pytest.fixture
def agent():
    register_backend(RecordingRemote.name, RecordingRemote)
    with Agent("me", {"backends": {RecordingRemote.name: {}}}) as agent:
        yield agent


def _blob(ident: bytes, *regions: tuple[int, int, int]) -> bytes:
    """Metadata of peer 'peer' as its process ``ident`` publishes it: regions as (id, address, length)."""
    return encode_metadata("peer", {}, [(MemType.DRAM, 0, a, n, rid) for rid, a, n in regions], ident=ident)


def _lists(agent):
    buf = np.zeros(SIZE, np.uint8)
    agent.register_memory(buf)
    local = agent.prepare(DescList.from_buffers(buf))
    return buf, local, agent.prepare(DescList.from_columns([ADDR], [SIZE], 0, "DRAM"), "peer")


def test_lists_prepared_against_an_earlier_process_are_refused_by_make_transfer(agent):
    first, second = os.urandom(32), os.urandom(32)
    agent.add_remote(_blob(first, (1, ADDR, SIZE)))
    _buf, local, remote = _lists(agent)
    agent.add_remote(_blob(second, (1, ADDR, SIZE)))  # restarted: its new memory at the very same address
    with pytest.raises(NotRegistered, match="earlier process of agent 'peer'"):
        agent.make_transfer("WRITE", local, None, remote, None)
    assert agent.backend(RecordingRemote.name).posted == []
    again = agent.prepare(remote.descs, "peer")
    assert agent.make_transfer("WRITE", local, None, again, None).post().wait() == XferState.DONE


def test_a_transfer_made_before_the_peer_restarted_is_refused_when_posted_after(agent):
    first, second = os.urandom(32), os.urandom(32)
    agent.add_remote(_blob(first, (1, ADDR, SIZE)))
    _buf, local, remote = _lists(agent)
    xfer = agent.make_transfer("WRITE", local, None, remote, None)
    assert xfer.post().wait() == XferState.DONE
    backend = agent.backend(RecordingRemote.name)
    agent.add_remote(_blob(second, (1, ADDR, SIZE)))
    with pytest.raises(NotRegistered, match="earlier process of agent 'peer'") as info:
        xfer.post()
    assert info.value.backend == RecordingRemote.name
    assert len(backend.posted) == 1
    # a one-shot transfer of the same lists is checked against the current metadata: it goes
    assert agent.transfer("WRITE", local.descs, remote.descs, "peer").wait() == XferState.DONE
    assert len(backend.posted) == 2


def test_metadata_of_the_same_process_loaded_again_keeps_its_descriptors_usable(agent):
    """A refresh (a region added), the same blob after remove_remote, or a partial blob of the same process: the
    lists and transfers made before it go on (nothing restarted)."""
    ident = os.urandom(32)
    agent.add_remote(_blob(ident, (1, ADDR, SIZE)))
    _buf, local, remote = _lists(agent)
    xfer = agent.make_transfer("WRITE", local, None, remote, None)
    for blob in (
        _blob(ident, (1, ADDR, SIZE), (2, ADDR + SIZE, SIZE)),
        encode_metadata("peer", {}, [(MemType.DRAM, 0, ADDR + 4 * SIZE, SIZE, 3)], ident=ident, partial=True),
    ):
        agent.add_remote(blob)
        assert xfer.post().wait() == XferState.DONE
        assert agent.make_transfer("WRITE", local, None, remote, None).post().wait() == XferState.DONE
    agent.remove_remote("peer")
    agent.add_remote(_blob(ident, (1, ADDR, SIZE)))
    assert xfer.post().wait() == XferState.DONE
