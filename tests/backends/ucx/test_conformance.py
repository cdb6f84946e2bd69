"""ucx passes the conformance kit with the two agents in separate processes, on each of its three data paths.

The initiator runs here; the target Agent runs in a spawned process
(``RemotePeer``), and the test reads and writes the target's memory through
a pipe to that process, never through the backend under test.
"""

import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.testing import BackendConformance, HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer
from datamover.testing.waiting import until

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


PATHS = {
    "direct-cma": {},  # the default on one host: process_vm_writev/readv, IOV_MAX rows per call
    "one-sided": {"direct_cma": False},  # UCP put/get per row
    "served": {"one_sided": False},  # tag send/recv, the owner checking every descriptor
}


@pytest.fixture(scope="module", params=list(PATHS))
def data_path(request):
    return request.param


@pytest.fixture(scope="module")
def remote(data_path):
    with RemotePeer("ucx-target", {"backends": {"ucx": PATHS[data_path]}}) as peer:
        yield peer


@pytest.fixture(scope="module")
def initiator(remote, data_path):
    with Agent("ucx-initiator", {"backends": {"ucx": PATHS[data_path]}}) as agent:
        agent.add_remote(remote.metadata())
        if data_path == "direct-cma":
            # the path under test is really taken (the probe at connect time can fail, e.g. under ptrace limits)
            mine, theirs = HostBuffer(agent, 8), RemoteBuffer(remote, 8)
            agent.add_remote(remote.metadata())
            agent.transfer("WRITE", mine.descs([0], [8]), theirs.descs([0], [8]), remote.name).wait()
            theirs.free()
            agent.deregister_memory(mine.registration)
            state = agent.backend("ucx").describe()["direct cma"][remote.name]
            if not state.startswith("pid "):
                pytest.skip(f"direct cma unavailable here: {state}")
        yield agent


class TestUcx(BackendConformance):
    backend = "ucx"
    sizes = (1, 4096, 12345, 1 << 20, 64 << 20)

    @pytest.fixture
    def agent(self, initiator):
        return initiator

    @pytest.fixture
    def peer(self, remote):
        return remote.name

    @pytest.fixture
    def make_local(self, agent):
        made = []

        def make(n):
            made.append(HostBuffer(agent, n))
            return made[-1]

        yield make
        for buf in made:
            agent.deregister_memory(buf.registration)

    @pytest.fixture
    def make_remote(self, agent, remote):
        self.target = remote  # for quiesce: the target's own account of what it serves
        made = []

        def make(n):
            made.append(RemoteBuffer(remote, n))
            agent.add_remote(remote.metadata())  # the new region becomes reachable once refreshed
            return made[-1]

        yield make
        for buf in made:
            buf.free()
        agent.add_remote(remote.metadata())

    def park_parts(self, monkeypatch, parked):
        """Nothing parks: every part of a ucx request (a cma chunk, a get, a receive) is inside the request's fence,
        which a cancel waits for as a whole (a part parked there would hold ERR up for the fence's bound). The
        late-bytes tests cut a request short while it really runs: 64 MiB across processes, released at once or
        timed out after 100 us."""
        return False

    def quiesce(self, agent, peer, completions, spare_local, spare_remote):
        """As the kit's, and until ucx says no cancelled request is draining and no request let go in flight is held
        here, and the target serves no row of ours any more."""
        super().quiesce(agent, peer, completions, spare_local, spare_remote)
        ucx = agent.backend(self.backend)

        def idle() -> bool:
            facts = ucx.describe()
            return facts["cancelled requests draining"] == 0 and facts["requests let go in flight"]["held"] == 0

        until(idle, what="the ucx backend's cancelled requests all settled")
        until(
            lambda: self.target.call("describe", "ucx")["rows served for peers"]["now"] == 0,
            what="the target done serving the cut-short request's rows",
        )
