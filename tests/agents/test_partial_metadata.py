"""Partial metadata: a blob of some registrations only, merged by the peer into what it knows (NIXL's partial MD)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from datamover import Agent
from datamover.agents.metadata import decode_metadata
from datamover.descriptors import DescList
from datamover.errors import InvalidMetadata, NotRegistered


@pytest.fixture
def pair():
    with Agent("target", {"backends": {"memcpy": {}}}) as target, Agent("init", {"backends": {"memcpy": {}}}) as init:
        yield target, init


def test_partial_blobs_add_regions_and_a_full_one_replaces(pair):
    target, init = pair
    bufs = [np.zeros(256, dtype=np.uint8) for _ in range(3)]
    regs = [target.register_memory(b) for b in bufs]
    dl = [DescList.from_buffers([b]) for b in bufs]

    first = target.metadata(regs[:1])
    meta = decode_metadata(first)
    assert meta.partial and [r[4] for r in meta.regions] == [regs[0].id]
    init.add_remote(first)
    init.prepare(dl[0], "target")
    with pytest.raises(NotRegistered):
        init.prepare(dl[1], "target")

    init.add_remote(target.metadata(regs[1:2], connection=False))  # merged: the first region stays known
    init.prepare(dl[0], "target")
    init.prepare(dl[1], "target")
    with pytest.raises(NotRegistered):
        init.prepare(dl[2], "target")

    target.deregister_memory(regs[0])
    init.add_remote(target.metadata())  # a full blob is the truth: region 0 is gone, region 2 is there
    assert not decode_metadata(target.metadata()).partial
    with pytest.raises(NotRegistered):
        init.prepare(dl[0], "target")
    init.prepare(dl[2], "target")


def test_partial_blob_of_a_foreign_registration_is_refused(pair):
    target, init = pair
    other = init.register_memory(np.zeros(64, dtype=np.uint8))
    with pytest.raises(NotRegistered):
        target.metadata([other])


def test_partial_field_must_be_a_boolean(pair):
    target, _ = pair
    doc = msgpack.unpackb(target.metadata([]))
    doc["partial"] = 1
    with pytest.raises(InvalidMetadata, match="partial"):
        decode_metadata(msgpack.packb(doc))


def test_a_partial_blob_of_a_restarted_peer_replaces_what_its_earlier_process_published(pair):
    """A partial blob whose identity is another process's (the peer restarted): nothing of the earlier process's
    metadata is kept (before: its regions were merged in under the new identity, so descriptors of the old
    process's memory were checked and sent to the new process)."""
    target, init = pair
    old_bufs = [np.zeros(256, dtype=np.uint8) for _ in range(2)]
    regs = [target.register_memory(b) for b in old_bufs]
    init.add_remote(target.metadata(regs))
    old_buf = old_bufs[1]  # its region id is one the restarted process has not given again
    init.prepare(DescList.from_buffers([old_buf]), "target")
    with Agent("target", {"backends": {"memcpy": {}}}) as restarted:
        new_buf = np.zeros(256, dtype=np.uint8)
        init.add_remote(restarted.metadata([restarted.register_memory(new_buf)]))
        meta = init.remote_metadata("target")
        assert meta.ident == decode_metadata(restarted.metadata()).ident
        assert [r[2] for r in meta.regions] == [new_buf.ctypes.data]
        with pytest.raises(NotRegistered):
            init.prepare(DescList.from_buffers([old_buf]), "target")
        init.prepare(DescList.from_buffers([new_buf]), "target")
