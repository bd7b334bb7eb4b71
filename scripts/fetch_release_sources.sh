#!/usr/bin/env bash
# Download the SGLang release wheels that patches/ has diffs for into .cache/sglang-wheels/
# (git-ignored), so tests/test_upstream_patches.py can check every diff offline.
#
# Usage: bash scripts/fetch_release_sources.sh [VERSION ...]   (default: every release with a diff)
#
# - The release list is read from the DIFFS entries of scripts/upstream_patches.py as text: no venv needed.
# - A wheel already in the cache is not downloaded again; only the wheel itself (--no-deps).
# - 0.5.11+ wheels are cp311 manylinux ones: the platform flags make any host fetch the same file.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SGLANG_WHEEL_CACHE:-$ROOT/.cache/sglang-wheels}"
PYTHON_BIN="${PYTHON:-python3}"

if [ "$#" -gt 0 ]; then
  VERSIONS=("$@")
else
  # release="X", also=("Y", ...) in DIFFS, read as text (the package needs its venv to import).
  mapfile -t VERSIONS < <("$PYTHON_BIN" -c '
import re, sys
text = open(sys.argv[1]).read()
for release, also in re.findall(r"release=\"([^\"]+)\",\s*also=\(([^)]*)\)", text):
    print("\n".join([release, *re.findall(r"\"([^\"]+)\"", also)]))
' "$ROOT/scripts/upstream_patches.py")
fi

mkdir -p "$CACHE"
for version in "${VERSIONS[@]}"; do
  if compgen -G "$CACHE/sglang-$version-*.whl" >/dev/null; then
    echo "[fetch_release_sources] sglang $version: cached"
    continue
  fi
  echo "[fetch_release_sources] sglang $version: downloading"
  "$PYTHON_BIN" -m pip download --disable-pip-version-check --quiet --no-deps \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_34_x86_64 --platform any \
    --dest "$CACHE" "sglang==$version"
  if ! compgen -G "$CACHE/sglang-$version-*.whl" >/dev/null; then
    echo "[fetch_release_sources] sglang $version: no wheel arrived in $CACHE" >&2
    exit 1
  fi
done
