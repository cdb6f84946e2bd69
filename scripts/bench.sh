#!/usr/bin/env bash
# The main job from a fresh clone: installs what it needs, then runs the throughput benchmark
# over every backend usable here (local files, a loopback UCX peer, a local S3-compatible server),
# with a byte check, and writes bench-results/bench.json. Extra arguments go to `datamover bench`
# (e.g. --vs nixl, --backend posix, --model llama-3.1-70b --isl 8192 --tp 8).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p bench-results
datamover info
# exec: a signal to this script (SIGTERM, SIGINT) reaches the bench, which stops what it started; run as a child
# it went on, orphaned, after bash ended
exec datamover bench --check --json bench-results/bench.json "$@"
