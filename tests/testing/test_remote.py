"""RemotePeer's own lifecycle: a peer process that does not come up is not left behind."""

from __future__ import annotations

import pytest

from datamover.errors import RemoteDisconnected
from datamover.testing import remote


def hung_peer(conn, name, config, env) -> None:
    """A peer process that never answers (spawned: imported by name from this module)."""
    import threading

    threading.Event().wait()


def test_a_peer_that_never_answers_its_first_call_is_killed(monkeypatch):
    """Before: RemotePeer raised RemoteDisconnected after its timeout but left the hung process running until the
    test session ended (``with RemotePeer(...)`` never reached ``__exit__``)."""
    started = []
    real = remote.mp.context.SpawnProcess.start
    monkeypatch.setattr(remote.mp.context.SpawnProcess, "start", lambda self: (started.append(self), real(self))[1])
    monkeypatch.setattr(remote, "_serve", hung_peer)
    try:
        with pytest.raises(RemoteDisconnected, match="did not answer 'ping'"):
            remote.RemotePeer("hung", timeout=1.0)
        (proc,) = started
        assert not proc.is_alive()
    finally:
        for proc in started:
            proc.kill()
            proc.join(5)
