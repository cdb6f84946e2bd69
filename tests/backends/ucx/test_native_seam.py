"""The one-sided path's seam for a native data path: a poster given the prepared request as numpy columns."""

from __future__ import annotations

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.backends.ucx import one_sided, rma
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


def test_a_native_poster_gets_the_columns_and_moves_the_bytes(monkeypatch):
    calls = []

    def poster(get: bool, ep: int, cols: one_sided.Columns) -> int:
        calls.append((get, cols))
        rows = list(map(rma.make_row, cols.laddr.tolist(), cols.length.tolist(), cols.raddr.tolist(),
                        cols.rkey.tolist(), [None] * len(cols.laddr)))  # fmt: skip
        return rma.post_rows(get, ep, rows)

    monkeypatch.setattr(one_sided, "native_post", poster)
    cfg = {"backends": {"ucx": {"direct_cma": False, "data_worker": False}}}  # the seam posts on ucxx's worker
    with RemotePeer("seam-target", cfg) as peer, Agent("seam", cfg) as agent:
        n, bs = 64, 4096
        remote, local = RemoteBuffer(peer, n * bs), HostBuffer(agent, n * bs)
        agent.add_remote(peer.metadata())
        data = random_bytes(n * bs, 11)
        local.write(0, data)
        perm = np.random.default_rng(1).permutation(n)
        xfer = agent.transfer("WRITE", local.descs(np.arange(n) * bs, bs), remote.descs(perm * bs, bs), peer.name)
        assert xfer.wait() == XferState.DONE
        got = np.frombuffer(remote.read(0, n * bs), np.uint8).reshape(n, bs)
        assert np.array_equal(got[perm], np.frombuffer(data, np.uint8).reshape(n, bs))
        ((get, cols),) = calls
        assert not get and cols.host and len(cols.laddr) == n
        assert np.array_equal(cols.raddr, remote.addr + perm * bs)
        assert np.array_equal(cols.laddr, local.array.ctypes.data + np.arange(n) * bs)
        assert np.all(cols.length == bs) and np.all(cols.rkey != 0)
