"""memcpy and input it cannot copy as asked: parameters out of range, sources that overlap destinations."""

from __future__ import annotations

import pytest

from datamover import Agent
from datamover.errors import InvalidParameter


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_below_one_are_refused_when_the_backend_starts(threads):
    """The pool cannot have no thread: a ValueError from ThreadPoolExecutor came out of the first transfer."""
    with Agent("m", {"backends": {"memcpy": {"threads": threads}}}) as agent:
        with pytest.raises(InvalidParameter, match="threads") as info:
            agent.backend("memcpy")
        assert info.value.backend == "memcpy"
