"""The backend registry: names resolve to classes, and a name that does not resolve says why, typed."""

import pytest

from datamover import Agent
from datamover.backends import backend_names, backend_status, get_backend_class
from datamover.errors import BackendUnavailable, UnknownBackend


def test_an_unknown_backend_is_a_typed_error_naming_the_known_ones():
    with pytest.raises(UnknownBackend) as info:
        get_backend_class("no-such-backend")
    err = info.value
    assert isinstance(err, BackendUnavailable) and isinstance(err, LookupError)
    assert err.backend == "no-such-backend" and "memcpy" in err.reason
    ok, reason = backend_status("no-such-backend")
    assert not ok and "unknown backend 'no-such-backend'" in reason


def test_an_agent_configured_with_an_unknown_backend_says_so_when_it_is_built():
    """A misspelt backend name is refused by the config (it used to build, and fail at the first transfer)."""
    with pytest.raises(UnknownBackend, match="'no-such-backend', which no installed backend is; known: memcpy"):
        Agent("u", {"backends": {"no-such-backend": {}}})
    with Agent("u", {"backends": {"memcpy": {}}}) as agent:
        with pytest.raises(BackendUnavailable, match="'posix' is not enabled"):
            agent.backend("posix")


def test_the_builtins_come_first_in_preference_order():
    assert backend_names()[:6] == ["memcpy", "posix", "cuda", "gds", "ucx", "s3"]
