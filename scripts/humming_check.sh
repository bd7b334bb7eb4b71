#!/usr/bin/env bash
# The humming fallback on a real CUDA GPU, in one run (an H200, SM90, is enough:
# Humming's bf16-activation kernels and its JIT compiler run there). From a directory holding sm120_fp4/,
# tests/, benchmarks/, pyproject.toml and the wheels in whl/common (our dependencies) and
# whl/w<VERSION> (one humming-kernels release):
#   bash scripts/humming_check.sh 19 ["--part dense" | --quick]   (logs and JSON under $OUT, or ./humming-results)
#   bash scripts/humming_check.sh 19 --tune [TUNE ARGS]          (only benchmarks/humming_tune.py)
#   bash scripts/humming_check.sh 19 --tests | --bench [ARGS]     (the steps before / from the benchmark:
#                                                                  two calls, each under a 10-minute limit)
# Steps: doctor; the GPU tests of tests/test_humming.py (self-tests, a wrong scale layout refused,
# both routed fronts captured and replayed, no host sync, the layer check and re-check) and of
# tests/test_gpu.py; the benchmark in a fresh kernel cache (first start); the same configurations
# again in a second process over that cache (second start).
set -uo pipefail
VER="${1:?humming release suffix, e.g. 19 for whl/w19}"
BENCH_ARGS="${2:-}"
OUT="${OUT:-$PWD/humming-results}"
mkdir -p "$OUT"
SITE="/tmp/site-$VER"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" whl/common/*.whl whl/w"$VER"/*.whl || exit 2
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 BENCH_OUT="$OUT" HUMMING_CACHE_DIR="/tmp/humming-cache-$VER"
rm -rf "$HUMMING_CACHE_DIR"
LOG="$OUT/log-$VER"
status=0
step() { local limit="$1" name="$2"; shift 2; echo; echo "=== $name (limit ${limit}s)"; timeout "$limit" "$@" || { echo "!!! step failed: $?"; status=1; }; }
if [ "$BENCH_ARGS" = "--tune" ]; then
  shift 2
  {
  step 30 "versions" python3 -c "import torch, sys, humming; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0), 'humming', humming.__version__)"
  step 470 "tuning sweep" python3 benchmarks/humming_tune.py "$@"
  } 2>&1 | tee "$OUT/tune-$VER.txt"
  exit $status
fi
MODE=all
case "$BENCH_ARGS" in --tests) MODE=tests; BENCH_ARGS="" ;; --bench) MODE=bench; BENCH_ARGS="${3:-}" ;; esac
{
step 30 "versions" python3 -c "import torch, sys, humming; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), 'humming', humming.__version__)"
if [ "$MODE" != bench ]; then
step 40 "doctor (simulated sm_120 on the real CUDA device)" bash -c "SM120_FP4_SIMULATE=12.0 python3 -m sm120_fp4 doctor --quick"
step 330 "GPU tests: tests/test_humming.py and tests/test_gpu.py -m gpu" python3 -m pytest -q -rs -s -p no:cacheprovider -p no:randomly -m gpu tests/test_humming.py tests/test_gpu.py
step 90 "the dequantization kernels and the served call's host time" python3 benchmarks/humming_tune.py --skip sweep
fi
if [ "$MODE" != tests ]; then
step 420 "benchmark (first start: empty kernel cache for the benchmark's shapes)" python3 benchmarks/humming_fallback.py $BENCH_ARGS
step 60 "second start: a new process over the same kernel cache" python3 benchmarks/humming_fallback.py --part startup
fi
} 2>&1 | tee "$LOG-$MODE.txt"
exit $status
