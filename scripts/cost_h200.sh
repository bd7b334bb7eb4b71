#!/usr/bin/env bash
# The layer checks' cost (benchmarks/selftest_cost.py) and the canary's longest idle-point pause
# (benchmarks/canary_cost.py), Humming as the served kernel, for this checkout and, when BEFORE names a
# folder holding an older export of the package and its benchmarks
# (`git archive REV sm120_fp4 benchmarks | tar -x -C .before`), for that one too, in one run: the
# before/after columns come from the same GPU. Usage on the device machine, from the repo root, with the
# wheels (pydantic and its deps, wrapt, humming-kernels) in .whl/ or the folders WHEELS names:
#   BEFORE=.before bash scripts/cost_h200.sh     (logs and JSON under $OUT, or ./gpu-results)
set -uo pipefail
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
WHEELS="${WHEELS:-.whl}"
wheels=$(for d in $WHEELS; do ls "$d"/*.whl 2>/dev/null; done)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 2
fi
export PYTHONUNBUFFERED=1
here=$PWD
status=0
# arm NAME DIR SECONDS ARGS...: selftest_cost.py of the package in DIR, bounded in time.
arm() {
  local name=$1 dir=$2 limit=$3
  shift 3
  echo "=== $name: selftest_cost.py $*"
  (cd "$dir" && BENCH_OUT="$OUT/$name" PYTHONPATH="/tmp/site:$PWD" timeout "$limit" \
    python3 benchmarks/selftest_cost.py "$@" 2>&1 | tee "$OUT/$name.md") || { echo "!!! $name failed"; status=1; }
}
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
COST_ARGS=(--kernel humming --tp 1 --layers "${LAYERS:-8}")
if [ -n "${BEFORE:-}" ]; then
  arm before "$BEFORE" "${ARM_S:-240}" "${COST_ARGS[@]}"
fi
arm after "$here" "${ARM_S:-240}" "${COST_ARGS[@]}"
if [ "${CANARY:-1}" = "1" ]; then
  echo "=== canary_cost.py --kernel humming --tp 1"
  BENCH_OUT="$OUT/after" PYTHONPATH="/tmp/site:$here" timeout "${CANARY_S:-200}" \
    python3 benchmarks/canary_cost.py --kernel humming --tp 1 2>&1 | tee "$OUT/canary.md" || status=1
fi
exit $status
