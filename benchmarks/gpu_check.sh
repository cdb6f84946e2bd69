#!/usr/bin/env bash
# GPU check for the cuda and gds backends, in one go on a borrowed GPU machine (about 5 minutes at most):
#   1. report the GPU, the driver, python and torch found there;
#   2. make a virtualenv (seeing the system's torch) with cuda-python, kvikio and the test tools;
#   3. run the GPU tests (conformance for cuda and gds, tests/backends/{cuda,gds}/);
#   4. run the GPU benchmarks: H2D/D2H against torch copy_ from pinned memory, GDS against kvikio,
#      4 KiB..64 MiB blocks, and judge them (>= 0.9 x raw at blocks >= 1 MiB).
# Usage: benchmarks/gpu_check.sh            (results in $OUT, else /tmp/datamover-gpu-check)
# Env:   PYTHON (default python3), DM_BENCH_DIR (directory for the gds test and benchmark files, default
#        the repository's directory, usually on a real disk, unlike /tmp), DM_VENV, DM_SKIP_INSTALL=1.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/datamover-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
VENV=${DM_VENV:-/tmp/dm-gpu-venv}
START=$(date +%s)
status=0

stage() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }
note_fail() { echo "!!! $*"; status=1; }

stage "machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 || note_fail "nvidia-smi failed"
CUDA_DRIVER=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\.\([0-9]*\).*/\1.\2/p' | head -1)
echo "driver supports CUDA ${CUDA_DRIVER:-unknown}"
"$PY" --version
"$PY" - <<'EOF'
try:
    import torch
    print(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}); torch.cuda.is_available() = {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        print(f"  {torch.cuda.device_count()} device(s): {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
except Exception as exc:
    print(f"torch not usable: {type(exc).__name__}: {exc}")
EOF
df -h "${DM_BENCH_DIR:-$REPO}" | tail -1

stage "virtualenv $VENV (system site-packages visible, for torch)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV" || note_fail "cannot create $VENV"
fi
VPY=$VENV/bin/python
if [ "${DM_SKIP_INSTALL:-0}" != 1 ]; then
  pip_in() { timeout 180 "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
  pip_in "numpy>=1.24" "msgpack>=1.0" "pytest>=8" "hypothesis>=6.100" || note_fail "test tools did not install"
  # cuda-bindings 12.x runs on any 12.x or newer driver; 12.8+ has cudaMemcpyBatchAsync
  pip_in "cuda-python>=12.8,<13" || note_fail "cuda-python did not install"
  # kvikio without its cupy dependency (only CuFile is used), then its library of the same release with
  # that library's own (small) dependencies: cuFile, rapids-logger, cuda-pathfinder
  if pip_in --no-deps kvikio-cu12; then
    KV=$("$VPY" -c "import importlib.metadata as m; print(m.version('kvikio-cu12'))")
    pip_in "libkvikio-cu12==$KV" packaging || note_fail "libkvikio-cu12 $KV did not install"
  else
    note_fail "kvikio did not install"
  fi
  if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no torch with CUDA here: trying pip install torch (the VRAM tests and benchmarks need it)"
    timeout 240 "$VPY" -m pip install -q torch || note_fail "torch did not install; VRAM tests and benchmarks will skip"
  fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
"$VPY" - <<'EOF'
import importlib
for name in ("cuda.bindings", "kvikio", "torch"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
EOF

stage "datamover info"
timeout 60 "$VPY" -m datamover.cli info | tee "$OUT/info.txt"

stage "GPU tests"
# of the simulator tests (CPU-only, run with the CPU suite) only the checks against the installed APIs
timeout 150 "$VPY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
  --basetemp "${DM_BENCH_DIR:-$REPO}/.gpu-check-tmp" \
  tests/backends/cuda/test_conformance.py tests/backends/gds/test_conformance.py tests/backends/cuda/test_device.py tests/backends/cuda/test_nodevice.py \
  tests/backends/cuda/test_simulated.py::test_backend_and_simulator_use_the_real_api \
  tests/backends/gds/test_simulated.py::test_simulator_matches_real_kvikio 2>&1 | tee "$OUT/gpu-tests.txt" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || note_fail "GPU tests failed (see $OUT/gpu-tests.txt)"
rm -rf "${DM_BENCH_DIR:-$REPO}/.gpu-check-tmp"

BLOCKS=4K,64K,256K,1M,4M,16M,64M
bench() {
  local backend=$1
  stage "benchmark $backend"
  TMPDIR=${DM_BENCH_DIR:-$REPO} timeout 100 "$VPY" -m datamover.cli bench --backend "$backend" \
    --block-sizes "$BLOCKS" --batch-sizes 1,16 --max-bytes 256M --min-time 0.15 --max-iters 40 \
    --check --quiet --json "$OUT/bench-$backend.json" | tee "$OUT/bench-$backend.txt"
  if [ -s "$OUT/bench-$backend.json" ]; then
    "$VPY" -m datamover.bench.gpu "$OUT/bench-$backend.json" | tee "$OUT/targets-$backend.txt" \
      || note_fail "$backend below target (see $OUT/targets-$backend.txt)"
  else
    note_fail "$backend benchmark produced no results"
  fi
}
bench cuda
bench gds

stage "done in $(( $(date +%s) - START ))s; results in $OUT; status $status"
exit $status
