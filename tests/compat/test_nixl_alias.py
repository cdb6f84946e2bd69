"""``import nixl`` as datamover: NIXL's package layout, ``datamover nixl-run``, the alias for engine processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from datamover.compat.nixl import alias

# every import line of NIXL's examples/python and test/python (ai-dynamo/nixl), as they are written there
NIXL_IMPORT_LINES = """
from nixl import nixl_agent, nixl_agent_config
from nixl.logging import get_logger
from nixl._api import nixl_agent, nixl_agent_config
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
import nixl._utils as nixl_utils
import nixl._bindings as nixl
import nixl._bindings as bindings
import nixl._utils as utils
from nixl._bindings import nixlNotFoundError
from nixl._bindings import DRAM_SEG
from nixl._bindings import nixlXferTelemetry
from nixl._api import nixl_agent as NixlWrapper
from nixl import nixl_prepped_dlist_handle, nixl_xfer_handle, nixl_backend_handle, DEFAULT_COMM_PORT
from nixl._bindings import nixlAgent, nixlAgentConfig, nixlXferDList, nixlRegDList, nixlRemoteDList
from nixl._bindings import HAVE_UCX_GPU_DEVICE_API, NIXL_INIT_AGENT, NIXL_SUCCESS, NIXL_IN_PROG, NIXL_WRITE, NIXL_READ
from nixl._bindings import nixlBackendError, nixlInvalidParamError, nixlNoTelemetryError, nixlRemoteDisconnectError
from nixl._utils import malloc_passthru, free_passthru, ba_buf, verify_transfer
"""


def run(args: list[str], env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop(alias.ENV_FLAG, None)
    return env


def test_every_nixl_import_line_maps_under_nixl_run(tmp_path):
    prog = tmp_path / "imports.py"
    prog.write_text(NIXL_IMPORT_LINES + "\nimport nixl as n\nprint(n.__name__, n._api.__name__, n.logging.__name__)\n")
    got = run([sys.executable, "-m", "datamover", "nixl-run", str(prog)], env=clean_env(), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [
        "datamover.compat.nixl",
        "datamover.compat.nixl._api",
        "datamover.compat.nixl.logging",
    ]


def test_each_line_maps_one_to_one_onto_the_facade():
    # with only the import lines changed ("nixl" -> "datamover.compat.nixl"), each one imports in this process
    for line in NIXL_IMPORT_LINES.strip().splitlines():
        changed = line.replace("from nixl", "from datamover.compat.nixl").replace(
            "import nixl.", "import datamover.compat.nixl."
        )
        exec(changed, {})


def test_nixl_run_reaches_python_children_but_not_other_processes(tmp_path):
    prog = tmp_path / "children.py"
    prog.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp, subprocess, sys

            def child(q):
                import nixl
                q.put(nixl.__name__)

            if __name__ == "__main__":
                q = mp.get_context("spawn").Queue()
                p = mp.get_context("spawn").Process(target=child, args=(q,))
                p.start(); p.join()
                sub = subprocess.run([sys.executable, "-c", "import nixl; print(nixl.__name__)"],
                                     capture_output=True, text=True)
                print(q.get(), sub.stdout.strip())
            """
        )
    )
    got = run([sys.executable, "-m", "datamover.compat.nixl", str(prog)], env=clean_env(), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["datamover.compat.nixl", "datamover.compat.nixl"]
    if alias.real_nixl() is None:  # outside nixl-run, nothing changed
        plain = run([sys.executable, "-c", "import nixl"], env=clean_env(), cwd=tmp_path)
        assert plain.returncode != 0 and "No module named 'nixl'" in plain.stderr


def test_install_never_shadows_a_real_nixl_unless_asked(tmp_path):
    fake = tmp_path / "site" / "nixl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    env = clean_env() | {"PYTHONPATH": str(tmp_path / "site")}
    code = "from datamover.compat.nixl import alias; alias.install(); import nixl; print(nixl.__name__)"
    refused = run([sys.executable, "-c", code], env=env, cwd=tmp_path)
    assert refused.returncode != 0 and "a real NIXL is installed" in refused.stderr
    forced = run([sys.executable, "-c", code.replace("install()", "install(force=True)")], env=env, cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "datamover.compat.nixl"
    untouched = run([sys.executable, "-c", "import nixl; print(nixl.REAL)"], env=env, cwd=tmp_path)
    assert untouched.stdout.strip() == "True"


def test_install_sets_up_children(tmp_path, monkeypatch):
    if alias.real_nixl() is not None:
        pytest.skip("a real NIXL is installed here")
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {k: v for k, v in sys.modules.items() if k == "nixl" or k.startswith("nixl.")}
    try:
        alias.install()
        import nixl
        import nixl._bindings

        assert alias.is_active() and nixl._bindings.nixlAgent.__module__ == "datamover.compat.nixl._agent"
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == alias.SHIM_DIR and sys.path[0] == alias.SHIM_DIR
    finally:
        for k in [k for k in sys.modules if k == "nixl" or k.startswith("nixl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_nixl_run_path_and_usage():
    got = run([sys.executable, "-m", "datamover", "nixl-run", "--path"])
    assert got.returncode == 0 and got.stdout.strip() == alias.SHIM_DIR
    assert os.path.isfile(os.path.join(alias.SHIM_DIR, "nixl", "__init__.py"))
    usage = run([sys.executable, "-m", "datamover", "nixl-run"])
    assert usage.returncode != 0 and "usage" in usage.stderr
