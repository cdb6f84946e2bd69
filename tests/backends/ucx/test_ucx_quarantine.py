"""Cancelled READs from frozen peers do not pile up UCX workers (issue 14: a quarantined worker per timeout).

A READ whose bytes are still in flight when it is cancelled is fenced (see test_ucx_cancel.py): its UCX worker is
replaced and kept, never progressed again. Here the fault is repeated: the peer is thawed, serves a small READ
(the data connection is up again), is frozen at a known point (idle, having answered on its pipe), and a 32 MiB
READ from it times out. After ``max_quarantines_per_peer`` of those, READs from that peer are refused at once
(typed, saying why) instead of costing another worker: the agent's fds stay flat, its other peers are served, no
byte of a cancelled READ lands in the caller's memory, and WRITEs to the thawed peer are refused too (a cut-off
WRITE with sends queued keeps a worker the same way) while WRITEs to the others run.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from datamover import Agent, XferState
from datamover.backends import backend_status
from datamover.errors import BackendUnavailable, TransferTimeout
from datamover.testing import HostBuffer, random_bytes
from datamover.testing.remote import RemoteBuffer, RemotePeer

from .test_ucx_cancel import PATHS

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")

SIZE, BS, ROUNDS, PER_PEER = 32 << 20, 1 << 20, 8, 2


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("path", list(PATHS))
def test_many_cancelled_reads_from_a_frozen_peer_keep_fds_bounded(path):
    cfg = {"backends": {"ucx": {**PATHS[path], "max_quarantines_per_peer": PER_PEER}}}
    with (
        RemotePeer("freezer", cfg) as frozen,
        RemotePeer("steady", cfg) as steady,
        Agent("reader", cfg) as agent,
    ):
        fbuf, sbuf = RemoteBuffer(frozen, SIZE), RemoteBuffer(steady, 4096)
        fbuf.write(0, b"\xaa" * SIZE)
        sbuf.write(0, b"\x55" * 4096)
        agent.add_remote(frozen.metadata())
        agent.add_remote(steady.metadata())
        local, small = HostBuffer(agent, SIZE), HostBuffer(agent, 4096)
        n = SIZE // BS
        fds = []
        for k in range(ROUNDS):
            warm = agent.transfer("READ", small.descs([0], [4096]), fbuf.descs([0], [4096]), "freezer")
            if k < PER_PEER:
                assert warm.wait() == XferState.DONE
            else:
                with pytest.raises(BackendUnavailable, match="stopped answering 2 time"):
                    warm.wait()
            assert frozen.call("ping") == frozen.pid  # idle in its command loop, the data connection up
            frozen.freeze()
            try:
                xfer = agent.transfer(
                    "READ", local.descs(np.arange(n) * BS, BS), fbuf.descs(np.arange(n) * BS, BS), "freezer",
                    timeout=0.5,
                )  # fmt: skip
                with pytest.raises(TransferTimeout if k < PER_PEER else BackendUnavailable):
                    xfer.wait()
                xfer.release()
                local.write(0, b"\x00" * SIZE)  # the caller reuses its buffer at once
                # the other peer is served meanwhile
                got = agent.transfer("READ", small.descs([0], [4096]), sbuf.descs([0], [4096]), "steady")
                assert got.wait() == XferState.DONE and small.read(0, 4096) == b"\x55" * 4096
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
            fds.append(_fds())
        assert frozen.call("ping") == frozen.pid
        # a WRITE needs UCX puts or sends too, which a cut-off WRITE would leave on a worker to keep: refused
        with pytest.raises(BackendUnavailable, match="WRITE to agent 'freezer' refused"):
            agent.transfer("WRITE", local.descs([0], [BS]), fbuf.descs([0], [BS]), "freezer").wait()
        data = random_bytes(4096, 3)
        small.write(0, data)
        assert agent.transfer("WRITE", small.descs([0], [4096]), sbuf.descs([0], [4096]), "steady").wait()
        assert sbuf.read(0, 4096) == data
        assert int(np.count_nonzero(np.frombuffer(local.read(0, SIZE), np.uint8))) == 0, (
            "bytes of a cancelled READ landed after it ended"
        )
        held = agent.backend("ucx").describe()["quarantined workers"]
        assert held == {"held": PER_PEER, "by peer": {"freezer": PER_PEER}}
        assert fds[-1] <= fds[PER_PEER - 1] + 2, f"{ROUNDS} cancelled READs took fds {fds}"


@pytest.mark.parametrize("path", list(PATHS))
def test_a_peer_restarted_under_its_name_is_served_again(path):
    """The quarantines count against the process that stopped answering, not its name: once a peer process made
    ``max_quarantines_per_peer`` its transfers are refused, and the process that replaces it under the same name
    (a restarted decode instance) is served (before: refused for as long as this agent lived)."""
    cfg = {"backends": {"ucx": {**PATHS[path], "max_quarantines_per_peer": 1}}}
    with Agent("reader", cfg) as agent:
        local = HostBuffer(agent, SIZE)
        n = SIZE // BS
        with RemotePeer("flaky", cfg) as old:
            fbuf = RemoteBuffer(old, SIZE)
            agent.add_remote(old.metadata())
            warm = agent.transfer("READ", local.descs([0], [4096]), fbuf.descs([0], [4096]), "flaky")
            assert warm.wait() == XferState.DONE
            assert old.call("ping") == old.pid
            old.freeze()
            try:
                xfer = agent.transfer(
                    "READ", local.descs(np.arange(n) * BS, BS), fbuf.descs(np.arange(n) * BS, BS), "flaky",
                    timeout=0.5,
                )  # fmt: skip
                with pytest.raises(TransferTimeout):
                    xfer.wait()
                xfer.release()
            finally:
                os.kill(old.pid, signal.SIGCONT)
            with pytest.raises(BackendUnavailable, match="stopped answering 1 time"):
                agent.transfer("READ", local.descs([0], [4096]), fbuf.descs([0], [4096]), "flaky").wait()
            old.kill()
        with RemotePeer("flaky", cfg) as new:
            nbuf = RemoteBuffer(new, 4096)
            nbuf.write(0, b"\x5a" * 4096)
            agent.add_remote(new.metadata())
            got = agent.transfer("READ", local.descs([0], [4096]), nbuf.descs([0], [4096]), "flaky")
            assert got.wait() == XferState.DONE and local.read(0, 4096) == b"\x5a" * 4096
        held = agent.backend("ucx").describe()["quarantined workers"]
        assert held == {"held": 1, "by peer": {"flaky": 1}}
