"""etcd going away and coming back (issue 14, item 4): a real etcd is stopped and restarted at known points.

The watch must re-watch (reading the key first, then watching from the revision after it), the publisher must put
again what it could not publish while etcd was down, and a lease etcd lost must be replaced.
"""

import time
import uuid

import numpy as np
import pytest

from datamover import Agent
from datamover.testing.services import EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd server binary not installed (etcd-server)")
MEMCPY = {"backends": {"memcpy": {}}}


@pytest.fixture
def etcd():
    with EtcdServer() as server:
        yield server


def _until(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _regions(agent, peer):
    return len(agent.remote_metadata(peer).regions) if peer in agent.remotes else -1


def test_watch_and_publish_survive_an_etcd_restart(etcd):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    bufs = [np.zeros(4096 * (i + 1), np.uint8) for i in range(3)]
    with Agent("pub", MEMCPY) as pub, Agent("sub", MEMCPY) as sub:
        pub.register_memory(bufs[0])
        pub.publish(etcd.endpoint, ns, ttl=2)
        assert sub.fetch_remote("pub", etcd=etcd.endpoint, namespace=ns, timeout=5) == "pub"
        assert _regions(sub, "pub") == 1
        etcd.stop()
        pub.register_memory(bufs[1])  # cannot be published now: etcd is down (logged, retried)
        etcd.start()
        assert _until(lambda: _regions(sub, "pub") == 2, 20), "a region registered while etcd was down never arrived"
        pub.register_memory(bufs[2])  # the watch is live again after the restart
        assert _until(lambda: _regions(sub, "pub") == 3, 10), "the watch did not resume after the restart"
        pub._peers.publisher.close(revoke=False)  # the publisher dies without unpublishing: its lease runs out
        assert _until(lambda: "pub" not in sub.remotes, 2 + 10), "a dead peer was not dropped after the restart"


def test_a_lost_lease_is_replaced_and_the_blob_put_again(etcd):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    with Agent("pub", MEMCPY) as pub, Agent("sub", MEMCPY) as sub:
        pub.register_memory(np.zeros(4096, np.uint8))
        pub.publish(etcd.endpoint, ns, ttl=2)
        sub.fetch_remote("pub", etcd=etcd.endpoint, namespace=ns, timeout=5)
        old = pub._peers.publisher.lease.id
        pub._peers.publisher.lease.revoke()  # as if etcd had expired it during an outage: the key goes with it
        assert _until(lambda: "pub" not in sub.remotes, 10), "the watcher missed the deletion"
        assert _until(lambda: "pub" in sub.remotes, 10), "the publisher did not republish under a new lease"
        assert pub._peers.publisher.lease.id != old
        assert _regions(sub, "pub") == 1
