"""examples/pd_disaggregation.py runs end to end (two processes) and checks every byte."""

import subprocess
import sys
from pathlib import Path

import pytest

from datamover.backends import backend_status
from datamover.testing.services import etcd_binary

ok, why = backend_status("ucx")
pytestmark = pytest.mark.skipif(not ok, reason=f"ucx backend unusable here: {why}")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd_disaggregation.py"


@pytest.mark.parametrize("exchange", ["tcp", "etcd"])
def test_pd_example(exchange):
    if exchange == "etcd" and etcd_binary() is None:
        pytest.skip("etcd server binary not installed (apt-get install etcd-server)")
    args = ["--requests", "3", "--layers", "4", "--blocks", "64", "--exchange", exchange]
    res = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "every byte checked" in res.stdout
    assert res.stdout.count(" ok") == 3, res.stdout
