"""What a TieredCache takes (regions of its Agent, files, threads) it gives back: at close, and when it fails to
start, also on an Agent the caller owns and goes on using."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from datamover import Agent
from datamover.errors import InvalidDescriptor
from datamover.policy.cache import TieredCache
from datamover.policy.keys import chunk_keys
from datamover.policy.l3_index import L3Index
from tests.policy.test_cache import PAGE, check_get, chunks, tiers

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc/self/fd")


def open_under(path: Path) -> list[str]:
    """The files under `path` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def spans_on(tmp: Path, **kw) -> object:
    return tiers(tmp, observability={"spans": True, "span_path": str(tmp / "spans.jsonl")}, **kw)


def test_a_cache_on_the_callers_agent_gives_its_regions_and_files_back_at_close(tmp_path):
    """Was: close released the cache's regions only by closing an Agent of its own: on the caller's, every cache
    left its four slabs and its staging area registered (host arenas kept alive) and the L3 data file open,
    one more of each per cache the caller opened and closed."""
    keys = chunk_keys(range(12), "m", "t")
    with Agent("kv-caller", {"backends": {"memcpy": {}, "posix": {}}}) as agent:
        mine = agent.register_memory(np.zeros(PAGE, np.uint8))  # the caller's own: it stays
        threads = threading.active_count()
        for run in range(3):
            with TieredCache(spans_on(tmp_path), agent=agent) as cache:
                cache.put(keys, chunks(keys))
                assert check_get(cache, keys) > 0
            assert set(agent.registrations) == {mine.id}, run
            assert open_under(tmp_path) == [], run
        assert threading.active_count() <= threads
        with TieredCache(spans_on(tmp_path), agent=agent) as cache:  # and the next one still finds L3's chunks
            assert cache.engine.resident[cache.names.index("l3_nvme")]


def test_a_cache_that_fails_to_start_gives_back_what_it_took(tmp_path, monkeypatch):
    """Was: a start that failed once the slabs were made (here the L3 index log cannot be compacted on a full
    disk) left the span file open and, on the caller's Agent, every slab made so far registered."""

    def full(self, entries):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(L3Index, "rewrite", full)
    with Agent("kv-caller", {"backends": {"memcpy": {}, "posix": {}}}) as agent:
        for _ in range(2):
            with pytest.raises(OSError, match="No space left"):
                TieredCache(spans_on(tmp_path), agent=agent)
            assert agent.registrations == {}
            assert open_under(tmp_path) == []
        with pytest.raises(OSError, match="No space left"):
            TieredCache(spans_on(tmp_path))  # an Agent of its own: closed
        assert open_under(tmp_path) == []


def test_a_list_of_buffers_that_cannot_be_registered_leaves_none_of_them_registered(tmp_path):
    """Was: get/put register the caller's unregistered buffers for the call; a list of them that could not all
    be registered (two that overlap) failed after the first was registered, and that one stayed registered with
    the cache's Agent for good (the caller's memory held, and taken as registered by every later call)."""
    keys = chunk_keys(range(2), "m", "t")
    with TieredCache(tiers(tmp_path)) as cache:
        cache.put(keys, chunks(keys))
        before = set(cache.agent.registrations)
        out = np.zeros(2 * PAGE, np.uint8)
        for call in (cache.get, cache.put):
            with pytest.raises(InvalidDescriptor, match="overlaps"):
                call(keys, [out[:PAGE], out[PAGE // 2 : PAGE // 2 + PAGE]])
            assert set(cache.agent.registrations) == before, call.__name__
        assert check_get(cache, keys) == 2
        assert set(cache.agent.registrations) == before
