#!/usr/bin/env bash
# `sm120-fp4 bench` on a GPU that is not 12.x (an H200, SM90): FlashInfer's FP4 kernels cannot run there,
# so the rows are Humming's, the emulation's and bf16's, for the default dense and MoE configuration.
# Usage on the device machine, from the repo root, with the wheels in .whl/ (or the folders WHEELS names;
# humming-kernels among them for Humming's rows, matplotlib for the plot):
#   bash scripts/bench_h200.sh          (writes bench.json, bench.png and bench.md under $OUT, or ./gpu-results)
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
export PYTHONUNBUFFERED=1
plot=()
python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/bench.png") || echo "matplotlib not installed: no plot"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -m sm120_fp4 bench --allow-any-gpu --backend humming --backend emulated --json "$OUT/bench.json" "${plot[@]}" \
  2> >(tee "$OUT/bench.log" >&2) | tee "$OUT/bench.md"
exit "${PIPESTATUS[0]}"
