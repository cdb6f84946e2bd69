"""``python -m datamover`` is the CLI, and what needs no extra library runs without it (issue 14, item 10).

scripts/check_extras.sh checks every extra alone in clean virtual environments; these run in the suite's own
environment, with an extra's library blocked from import where the check is about working without it.
"""

import json
import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_python_dash_m_datamover_is_the_cli():
    run = subprocess.run([sys.executable, "-m", "datamover", "info", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "memcpy" in {r["backend"] for r in json.loads(run.stdout)["backends"]}


def test_policy_and_alerts_work_without_prometheus_client(tmp_path):
    """datamover[policy] does not bring prometheus_client: the tier cache, replay and alert rules must not need it."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [0, i]}) + "\n" for i in range(50)))
    run = _python(
        "import sys; sys.modules['prometheus_client'] = None\n"  # import of it raises ImportError
        "import datamover.policy\n"
        "from datamover.cli import main\n"
        f"assert main(['replay', {str(trace)!r}, '--json']) == 0\n"
        f"assert main(['alerts', '-o', {str(tmp_path / 'rules.yaml')!r}]) == 0\n"
    )
    assert run.returncode == 0, run.stderr
    assert "datamover_cache_hits" in (tmp_path / "rules.yaml").read_text()


def test_service_helpers_import_without_pytest():
    """datamover[mooncake] and [s3] bring no pytest: ``datamover.testing.mooncake`` (what check_extras.sh runs the
    mooncake extra against) and ``.s3server`` must import without it; the conformance kit still needs it."""
    run = _python(
        "import sys; sys.modules['pytest'] = None\n"
        "from datamover.testing.mooncake import MooncakeMaster, mooncake_available\n"
        "from datamover.testing.s3server import S3Server\n"
        "import datamover.testing as t\n"
        "try:\n"
        "    t.BackendConformance\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('the conformance kit imported without pytest')\n"
    )
    assert run.returncode == 0, run.stderr


def test_a_trace_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path, capsys):
    from datamover.cli import main

    missing = tmp_path / "nope.jsonl"
    assert main(["replay", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"datamover replay: No such file or directory: {missing}"
