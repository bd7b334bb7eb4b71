#!/usr/bin/env bash
# Everything that needs a real CUDA device, in one run (on an H200, SM90, the
# FP4 kernels themselves cannot run; this proves the reference, emulation, graphs, no-sync and
# timings on a GPU). Usage on the device machine, from the repo root, with the wheels in .whl/
# (or in the folders WHEELS names, separated by spaces; with humming-kernels among them the
# humming GPU tests run too):
#   bash scripts/gpu_check.sh            (writes logs and JSON under $OUT, or ./gpu-results)
# The cost benchmarks run first: a run stopped at a time limit keeps the measurements.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
WHEELS="${WHEELS:-.whl}"
wheels=$(for d in $WHEELS; do ls "$d"/*.whl 2>/dev/null; done)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 2
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 BENCH_OUT="$OUT"
status=0
started=$(date +%s)
step() {
  local name=$1 begin
  shift
  begin=$(date +%s)
  echo; echo "=== $name"
  "$@" || { echo "!!! step failed: $?"; status=1; }
  echo "--- $(( $(date +%s) - begin )) s (${name%% (*})"
}
step "nvidia-smi" bash -c "nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee '$OUT/nvidia-smi.csv'"
step "versions" python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
# The targets' kernel: Humming where humming-kernels is installed (its compile cache warm after the first run),
# else `emulated`; TP1 and 8 layers per dense configuration, as BENCHMARKS.md's table. GPU_CHECK_ALL=1: TP8 and
# 80 layers too.
KERNEL=$(python3 -c "import importlib.util as u; print('humming' if u.find_spec('humming') else 'emulated')")
step "benchmark: selftest cost (generic self-tests, dense and MoE layer checks), $KERNEL" python3 benchmarks/selftest_cost.py --kernel "$KERNEL" --tp 1 --layers 8
step "benchmark: the serving canary's share and slices, $KERNEL" python3 benchmarks/canary_cost.py --kernel "$KERNEL" --tp 1
step "pytest on CUDA (oracles, self-tests, deciding, serving, dispatch, gpu)" bash -c "python3 -m pytest -q -rs -p no:cacheprovider tests/test_nvfp4.py tests/test_nvfp4_moe.py tests/test_selftest.py tests/test_moe_selftest.py tests/test_deciding.py tests/test_serving.py tests/test_dispatch.py tests/test_backends.py tests/test_gpu.py tests/test_graphs.py tests/test_humming.py 2>&1 | tee '$OUT/pytest-gpu.log' | tail -40"
step "doctor (simulated sm_120 on the real CUDA device)" bash -c "SM120_FP4_SIMULATE=12.0 python3 -m sm120_fp4 doctor | tee '$OUT/doctor-sim.md'"
step "doctor --json (no simulation)" bash -c "python3 -m sm120_fp4 doctor --json > '$OUT/doctor.json'; python3 -c \"import json; d=json.load(open('$OUT/doctor.json')); print(d['devices'], d['problems'])\""
step "selftest --backend emulated (simulated sm_120)" bash -c "SM120_FP4_SIMULATE=12.0 python3 -m sm120_fp4 selftest --backend emulated 2>&1 | tee '$OUT/selftest.txt'"
if [ "${GPU_CHECK_ALL:-0}" = "1" ]; then
  step "benchmark: selftest cost, emulated, TP1 and TP8, 80 layers" python3 benchmarks/selftest_cost.py
  step "benchmark: the serving canary, emulated, TP1 and TP8" python3 benchmarks/canary_cost.py
  step "benchmark: dispatch overhead" python3 benchmarks/dispatch_overhead.py
  step "benchmark: emulated gemm" python3 benchmarks/emulated_gemm.py
  step "benchmark: start-up" python3 benchmarks/startup.py
fi
echo "gpu_check.sh: $(( $(date +%s) - started )) s in all, status $status"
exit $status
