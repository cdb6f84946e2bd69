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


# -- loading and forgetting a peer while transfers go on ------------------------------------------------------------
class ConnectingRemote(RecordingRemote):
    """A remote backend that keeps each peer's connection info, and calls ``during_add`` (a fault point) once it has
    taken new info and before ``add_remote`` returns: what a transfer posted by another thread meanwhile sees."""

    name = "connecting-remote"

    def __init__(self, host, params=None) -> None:
        super().__init__(host, params)
        self.infos: dict[str, dict] = {}
        self.during_add = None

    def add_remote(self, name, info):
        if info.get("refuse"):
            from datamover.errors import InvalidMetadata

            raise InvalidMetadata(f"{self.name}: connection info of {name!r} refused")
        self.infos[name] = dict(info)
        if self.during_add is not None:
            self.during_add()

    def remove_remote(self, name):
        self.infos.pop(name, None)


class SecondRemote(ConnectingRemote):
    name = "second-remote"


@pytest.fixture
def connecting():
    for cls in (ConnectingRemote, SecondRemote):
        register_backend(cls.name, cls)
    config = {"backends": {ConnectingRemote.name: {}, SecondRemote.name: {}}}
    with Agent("me", config) as agent:
        yield agent


def _blob_with(ident: bytes, backends: dict, *regions: tuple[int, int, int]) -> bytes:
    return encode_metadata("peer", backends, [(MemType.DRAM, 0, a, n, rid) for rid, a, n in regions], ident=ident)


def test_a_transfer_of_the_earlier_process_posted_while_its_restart_is_loaded_is_refused(connecting):
    """add_remote of the restarted peer handed the new process's connection info to the backends first and only
    then replaced the metadata: a transfer made against the earlier process, posted in between, passed the check
    (the earlier metadata still there) and went to the new process, onto whatever its memory now holds there."""
    agent = connecting
    first, second = os.urandom(32), os.urandom(32)
    agent.add_remote(_blob_with(first, {ConnectingRemote.name: {"port": 1}}, (1, ADDR, SIZE)))
    _buf, local, remote = _lists(agent)
    xfer = agent.make_transfer("WRITE", local, None, remote, None)
    assert xfer.post().wait() == XferState.DONE
    backend = agent.backend(ConnectingRemote.name)
    seen = []

    def post_meanwhile():  # another thread's post, at the point the backend holds the new process's info
        assert backend.infos["peer"] == {"port": 2}
        try:
            xfer.post()
            seen.append("posted")
        except NotRegistered as exc:
            seen.append(exc)

    backend.during_add = post_meanwhile
    agent.add_remote(_blob_with(second, {ConnectingRemote.name: {"port": 2}}, (1, ADDR, SIZE)))
    assert len(seen) == 1 and isinstance(seen[0], NotRegistered), seen
    assert len(backend.posted) == 1


def test_a_blob_one_backend_refuses_changes_nothing_in_the_others(connecting):
    """The first backend took the new connection info, the second refused it: add_remote raised, the agent kept the
    earlier metadata, and the first backend went on with the info of a blob that was refused (a bad blob is meant
    to change nothing)."""
    agent = connecting
    ident = os.urandom(32)
    good = {ConnectingRemote.name: {"port": 1}, SecondRemote.name: {"port": 1}}
    agent.add_remote(_blob_with(ident, good, (1, ADDR, SIZE)))
    known = agent.remote_metadata("peer")
    from datamover.errors import InvalidMetadata

    bad = {ConnectingRemote.name: {"port": 9}, SecondRemote.name: {"refuse": True}}
    with pytest.raises(InvalidMetadata, match="second-remote: connection info of 'peer' refused"):
        agent.add_remote(_blob_with(os.urandom(32), bad, (1, ADDR, SIZE)))
    assert agent.remote_metadata("peer") is known
    assert agent.backend(ConnectingRemote.name).infos["peer"] == {"port": 1}
    assert agent.backend(SecondRemote.name).infos["peer"] == {"port": 1}
    # and a peer not known before is not left half-loaded either
    with pytest.raises(InvalidMetadata):
        agent.add_remote(encode_metadata("other", bad, [], ident=os.urandom(32)))
    assert "other" not in agent.remotes
    assert "other" not in agent.backend(ConnectingRemote.name).infos


def test_a_transfer_to_a_removed_peer_is_refused(agent):
    """After remove_remote, a transfer made before (and lists prepared before) went on to the backend: the agent no
    longer knows the peer, yet posted to it."""
    ident = os.urandom(32)
    agent.add_remote(_blob(ident, (1, ADDR, SIZE)))
    _buf, local, remote = _lists(agent)
    xfer = agent.make_transfer("WRITE", local, None, remote, None)
    assert xfer.post().wait() == XferState.DONE
    agent.remove_remote("peer")
    with pytest.raises(NotRegistered, match="'peer'") as info:
        xfer.post()
    assert info.value.backend == RecordingRemote.name
    with pytest.raises(NotRegistered, match="'peer'"):
        agent.make_transfer("WRITE", local, None, remote, None)
    assert len(agent.backend(RecordingRemote.name).posted) == 1
    agent.add_remote(_blob(ident, (1, ADDR, SIZE)))  # the same process again: its transfers go on
    assert xfer.post().wait() == XferState.DONE
