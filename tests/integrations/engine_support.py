"""Engine tests need vLLM or SGLang, which `scripts/setup.sh --engines` installs (scripts/test.sh does).

Where setup installed them it sets DATAMOVER_ENGINE_TESTS=1 for the run, and then a missing engine is a failure,
not a skip: CI must never pass these tests by not running them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(package: str) -> None:
    """Skip the calling test module unless `package` is installed (fail instead when the run promised engines).
    Found, not imported: an engine imported while pytest collects (vLLM, SGLang and what they pull in, half a
    million objects) would slow every garbage collection of the whole run; the tests import it when they run, and
    an engine that is found but does not import fails them."""
    try:
        if importlib.util.find_spec(package) is not None:
            return
        why = "not found"
    except (ImportError, ValueError) as exc:
        why = str(exc)
    if os.environ.get("DATAMOVER_ENGINE_TESTS") == "1":
        pytest.fail(f"DATAMOVER_ENGINE_TESTS=1 but {package} is not installed ({why})")
    pytest.skip(
        f"{package} not installed ({why}); `bash scripts/setup.sh --engines` installs it", allow_module_level=True
    )
