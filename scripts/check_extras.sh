#!/usr/bin/env bash
# Each extra installs and works alone: the base package, then datamover[policy], [s3], [telemetry], [ucx],
# [mooncake], each in its own clean virtual environment (no other datamover extra, no test tools), running what
# that extra is for (scripts/extras_smoke.py; [mooncake] moves bytes through a real mooncake_master, and its one
# system package, Debian's libibverbs1, is installed first as setup.sh does). `check_extras.sh ucx mooncake` checks
# only those. The wheel is built once; pip's cache and the machine's wheel index make the installs cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d -t datamover-extras-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
ONLY=${*:-base policy s3 telemetry ucx mooncake}
case " $ONLY " in *" mooncake "*) bash scripts/ensure_libibverbs.sh ;; esac
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" . >/dev/null 2>&1 \
  || "$PY" -m pip wheel -q --no-deps -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/datamover-*.whl)
fail=0
for extra in $ONLY; do
  venv="$WORK/venv-$extra"
  "$PY" -m venv --without-pip "$venv"
  spec="$WHEEL"
  [ "$extra" = base ] || spec="$WHEEL[$extra]"
  t0=$(date +%s)
  if ! "$PY" -m pip --python "$venv/bin/python" install -q "$spec" >"$WORK/$extra.log" 2>&1; then
    echo "extras: installing $extra failed:"; cat "$WORK/$extra.log"; fail=1; continue
  fi
  t1=$(date +%s)
  # run from outside the checkout so the installed wheel, not the source tree, is imported
  if (cd "$WORK" && "$venv/bin/python" "$ROOT/scripts/extras_smoke.py" "$extra") >"$WORK/$extra.out" 2>&1; then
    echo "extras: $extra ok (install $(( t1 - t0 )) s, run $(( $(date +%s) - t1 )) s)"
  else
    echo "extras: $extra FAILED:"; cat "$WORK/$extra.out"; fail=1
  fi
done
exit $fail
