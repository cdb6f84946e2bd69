"""``datamover.testing.waiting.until``: returns once the condition holds, fails naming it when it never does."""

from __future__ import annotations

import pytest

from datamover.testing.waiting import until


def test_until_returns_once_the_condition_holds() -> None:
    calls = []
    until(lambda: calls.append(1) or len(calls) >= 3, timeout=5)
    assert len(calls) == 3


def test_until_names_what_never_held() -> None:
    with pytest.raises(AssertionError, match=r"the flag did not hold within 0\.05 s"):
        until(lambda: False, timeout=0.05, what="the flag")
