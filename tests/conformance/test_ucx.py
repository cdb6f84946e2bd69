"""ucx passes the conformance kit with the two agents in separate processes, one-sided and owner-served.

The initiator runs here; the target Agent runs in a spawned process
(``RemotePeer``), and the test reads and writes the target's memory through
a pipe to that process, never through the backend under test.
"""

import pytest

from datamover import Agent
from datamover.backends import backend_status
from datamover.testing import BackendConformance, HostBuffer
from datamover.testing.remote import RemoteBuffer, RemotePeer

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")


@pytest.fixture(scope="module", params=[True, False], ids=["one-sided", "served"])
def one_sided(request):
    return request.param


@pytest.fixture(scope="module")
def remote(one_sided):
    with RemotePeer("ucx-target", {"backends": {"ucx": {"one_sided": one_sided}}}) as peer:
        yield peer


@pytest.fixture(scope="module")
def initiator(remote, one_sided):
    with Agent("ucx-initiator", {"backends": {"ucx": {"one_sided": one_sided}}}) as agent:
        agent.add_remote(remote.metadata())
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
        made = []

        def make(n):
            made.append(RemoteBuffer(remote, n))
            agent.add_remote(remote.metadata())  # the new region becomes reachable once refreshed
            return made[-1]

        yield make
        for buf in made:
            buf.free()
        agent.add_remote(remote.metadata())
