"""A UCX that did not load its cma module (not built, or left out by UCX_MODULES): the backend still comes up.

Our default CMA_TX_QUOTA made such a UCX refuse the whole context ("Invalid parameter"), so the ucx backend
could not be made at all there.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.testing import HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

NO_CMA_MODULE = {"UCX_MODULES": "^cma"}

PROBE = """
from datamover.backends.ucx.config import import_ucxx, make_context
u, _ = import_ucxx()
ctx, cfg = make_context(u, {}, False)
print("ours:", "CMA_TX_QUOTA" in cfg)
try:
    make_context(u, {"CMA_TX_QUOTA": 8}, False)
    print("users: made")
except u.UCXInvalidParamError:
    print("users: refused")
"""


@pytest.mark.parametrize("env, want", [({}, "ours: True\nusers: made"), (NO_CMA_MODULE, "ours: False\nusers: refused")])
def test_our_cma_default_is_left_out_only_where_ucx_refuses_it_and_the_users_own_is_kept(env, want):
    base = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env={**base, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert [ln for ln in out.stdout.splitlines() if ln.startswith(("ours:", "users:"))] == want.splitlines()


def test_a_peer_whose_ucx_has_no_cma_module_serves_reads_and_writes():
    n = 1 << 20
    data = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8).tobytes()
    with (
        RemotePeer("no-cma-module", {"backends": {"ucx": {}}}, env=NO_CMA_MODULE) as peer,
        Agent("with-cma-module", {"backends": {"ucx": {}}}) as agent,
    ):
        mine, theirs = HostBuffer(agent, n), RemoteBuffer(peer, n)
        agent.add_remote(peer.metadata())
        mine.write(0, data)
        assert agent.transfer("WRITE", mine.descs([0], n), theirs.descs([0], n), peer.name).wait() == XferState.DONE
        assert theirs.read(0, n) == data
        mine.write(0, bytes(n))
        assert agent.transfer("READ", mine.descs([0], n), theirs.descs([0], n), peer.name).wait() == XferState.DONE
        assert mine.read(0, n) == data
