"""Engine tests need vLLM or SGLang, which `scripts/setup.sh --engines` installs (scripts/test.sh does).

Where setup installed them it sets DATAMOVER_ENGINE_TESTS=1 for the run, and then a missing engine is a failure,
not a skip: CI must never pass these tests by not running them.
"""

from __future__ import annotations

import importlib
import os

import pytest


def require(module: str) -> None:
    """Import `module` or skip the test (fail instead when the run promised engines)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("DATAMOVER_ENGINE_TESTS") == "1":
            pytest.fail(f"DATAMOVER_ENGINE_TESTS=1 but {module} does not import: {exc}")
        pytest.skip(
            f"{module} not installed ({exc}); `bash scripts/setup.sh --engines` installs it", allow_module_level=True
        )
