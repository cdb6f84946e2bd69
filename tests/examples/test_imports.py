"""Every examples/*.py imports (its main not run): an example importing a name datamover moved fails here, not in
a new user's first run. An example whose optional engine (torch, sglang, vllm) is absent is skipped."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 6, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports(path):
    name = f"_datamover_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing == "datamover" or not missing:
            raise  # a name datamover no longer has (or an import error of unknown origin): the example is broken
        pytest.skip(f"{path.name} needs {exc.name}, not installed here")
    finally:
        sys.modules.pop(name, None)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
