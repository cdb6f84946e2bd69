"""What each extra is for, run in a virtual environment holding datamover with that extra alone.

``python scripts/extras_smoke.py EXTRA`` (base, policy, s3, telemetry, ucx or mooncake) exits non-zero, saying
why, when the extra does not work on its own. scripts/check_extras.sh runs it once per extra in clean environments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def cli(*args: str) -> str:
    """``python -m datamover ARGS`` (the CLI as a module); its stdout, or SystemExit with its stderr."""
    run = subprocess.run([sys.executable, "-m", "datamover", *args], capture_output=True, text=True, timeout=300)
    if run.returncode:
        raise SystemExit(f"python -m datamover {' '.join(args)} exited {run.returncode}:\n{run.stderr}")
    return run.stdout


def usable() -> dict[str, bool]:
    return {r["backend"]: r["usable"] for r in json.loads(cli("info", "--json"))["backends"]}


def base() -> None:
    from datamover import Agent

    with Agent("base", {"backends": {"memcpy": {}}}) as agent:
        src, dst = np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
        agent.register_memory([src, dst])
        agent.transfer("WRITE", src, dst).wait()
        assert (src == dst).all()
    assert usable()["memcpy"]


def policy() -> None:
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.jsonl")
        with open(trace, "w") as f:
            for i in range(200):
                f.write(json.dumps({"timestamp": i, "hash_ids": [0, 1, 2 + i % 7, 10 + i]}) + "\n")
        report = json.loads(cli("replay", trace, "--json"))
        assert report, "replay printed an empty report"
        cli("alerts", "-o", os.path.join(d, "rules.yaml"))


def s3() -> None:
    assert usable()["s3"], "the s3 backend is not usable with datamover[s3]"
    from datamover import Agent

    cfg = {"endpoint_url": "http://127.0.0.1:1", "access_key_id": "k", "secret_access_key": "s", "region": "us-east-1"}
    with Agent("s3", {"backends": {"s3": cfg}}) as agent:
        assert agent.backend("s3").describe()["endpoint"] == "http://127.0.0.1:1"


def telemetry() -> None:
    from datamover.telemetry.metrics import CacheMetrics, exposed

    m = CacheMetrics()
    m.record_move("l1_hbm", "l2_dram", "memcpy", 2, 8192, 0.001)
    assert exposed("datamover_chunk_moves").encode() in m.render()


def ucx() -> None:
    assert usable()["ucx"], "the ucx backend is not usable with datamover[ucx]"
    from datamover import Agent

    with Agent("a", {"backends": {"ucx": {}}}) as a, Agent("b", {"backends": {"ucx": {}}}) as b:
        src, dst = np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
        a.register_memory(src)
        b.register_memory(dst)
        a.add_remote(b.metadata())
        a.transfer("WRITE", src, dst, agent="b").wait()
        assert (src == dst).all()


def mooncake() -> None:
    """A WRITE then READ through the mooncake backend against a real mooncake_master (the wheel's own)."""
    assert usable()["mooncake"], "the mooncake backend is not usable with datamover[mooncake]"
    from datamover import Agent, DescList
    from datamover.testing.mooncake import MooncakeMaster, mooncake_available

    ok, why = mooncake_available()
    assert ok, why
    n = 1 << 16
    with MooncakeMaster() as master:
        cfg = master.config(global_segment_size=16 << 20, local_buffer_size=16 << 20)
        with Agent("mc", {"backends": {"mooncake": cfg}}) as agent:
            src, dst = np.arange(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
            agent.register_memory([src, dst])
            reg = agent.register_objects("extras", prefix="smoke/")
            obj = DescList.objects(reg, [n], 0, keys=["smoke/0"])
            agent.transfer("WRITE", src, obj, backends="mooncake").wait()
            agent.transfer("READ", dst, obj, backends="mooncake").wait()
            assert (src == dst).all(), "the bytes read back differ from those written"


EXTRAS = {"base": base, "policy": policy, "s3": s3, "telemetry": telemetry, "ucx": ucx, "mooncake": mooncake}

if __name__ == "__main__":
    name = sys.argv[1]
    EXTRAS[name]()
    print(f"{name}: ok")
