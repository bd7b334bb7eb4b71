# Sourced by scripts/setup_env.sh and scripts/setup_vllm_env.sh (not run on its own): `pipq NAME ARGS...` installs
# ARGS into the venv of $VENV_PY, with uv where it can be had, else with pip; the full output goes to
# $LOG_DIR/NAME.log and its tail is shown on failure. The caller defines say() and sets VENV_PY and LOG_DIR.
#
# uv (pinned below, installed into the venv itself with the venv's pip) unpacks wheels in parallel into one cache
# shared by the three venvs (UV_CACHE_DIR, default ~/.cache/uv) and hard-links them from there: measured on 2 cores
# in docs/development.md. uv does not read pip's configuration, so the settings that decide where packages come
# from are carried over from `pip config list` (pip.conf files and PIP_* variables: index-url, extra-index-url,
# find-links, no-index, constraint, cert, default-timeout), and `--index-strategy unsafe-best-match` takes the
# newest version over every index as pip does. A machine with only Python and PyPI has none of these set: both
# then use PyPI alone.
# SETUP_ENV_PIP=1 uses pip throughout; so does a machine where uv cannot be installed (said once, in the log).
UV_VERSION="0.13.8"
INSTALLER=""
UV_ARGS=()
UV_ENV=()   # for uv only: pip's cert and timeout

installer_init() {
  [ -z "$INSTALLER" ] || return 0
  INSTALLER=pip
  if [ "${SETUP_ENV_PIP:-0}" = 1 ]; then
    say "installing with pip (SETUP_ENV_PIP=1)"
    return 0
  fi
  local uv="$(dirname "$VENV_PY")/uv" line key value
  if ! { [ -x "$uv" ] && [ "$("$uv" --version 2>/dev/null)" = "uv $UV_VERSION" ]; } \
     && ! "$VENV_PY" -m pip install --disable-pip-version-check "uv==$UV_VERSION" >"$LOG_DIR/uv.log" 2>&1; then
    say "uv $UV_VERSION could not be installed (log: $LOG_DIR/uv.log); installing with pip"
    return 0
  fi
  # No --compile-bytecode (pip's default at install): compiling every module of the three venvs (torch three times,
  # FlashInfer twice, vLLM's 28,000 files) was most of the set-up's time on 2 cores (in .venv: torch 45 s,
  # FlashInfer 37 s and SGLang 26 s of its 145 s). The import checks of the set-up and the test processes write the
  # bytecode of what they import, the only modules ever read (both with PYTHONDONTWRITEBYTECODE unset; where it
  # stayed set, as on the CI machine, nothing was ever written and every test subprocess compiled torch and SGLang
  # from source: the full gate went from 14 to 25 minutes).
  UV_ARGS=(--python "$VENV_PY" --index-strategy unsafe-best-match)
  # `pip config list` prints key='value' lines, global files first and PIP_* variables last (the later one wins).
  declare -A pipconf=()
  while IFS= read -r line; do
    key="${line%%=*}"; key="${key##*.}"; value="${line#*=}"; value="${value#\'}"; value="${value%\'}"
    pipconf[$key]="$value"
  done < <("$VENV_PY" -m pip config list 2>/dev/null)
  if [ -n "${pipconf[index-url]:-}" ]; then UV_ARGS+=(--index-url "${pipconf[index-url]}"); fi
  for value in ${pipconf[extra-index-url]:-}; do UV_ARGS+=(--extra-index-url "$value"); done
  for value in ${pipconf[find-links]:-}; do UV_ARGS+=(--find-links "$value"); done
  for value in ${pipconf[constraint]:-}; do UV_ARGS+=(--constraints "$value"); done
  case "${pipconf[no-index]:-}" in 1 | true | yes | on) UV_ARGS+=(--no-index) ;; esac
  if [ -n "${pipconf[cert]:-}" ]; then UV_ENV+=("SSL_CERT_FILE=${pipconf[cert]}"); fi
  if [ -n "${pipconf[default-timeout]:-}" ]; then UV_ENV+=("UV_HTTP_TIMEOUT=${pipconf[default-timeout]}"); fi
  UV_BIN="$uv"
  INSTALLER=uv
  say "installing with uv $UV_VERSION (pip's index settings carried over: ${UV_ARGS[*]:2})"
}

pipq() {
  local name="$1"; shift
  local log="$LOG_DIR/$name.log"
  installer_init
  if [ "$INSTALLER" = uv ]; then
    # uv's own output names, per package, which index or link it came from.
    if ! env "${UV_ENV[@]}" "$UV_BIN" pip install "${UV_ARGS[@]}" "$@" >"$log" 2>&1; then
      say "uv pip install failed ($name); last lines of $log:"
      tail -n 30 "$log" >&2
      exit 1
    fi
  elif ! "$VENV_PY" -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
    say "pip install failed ($name); last lines of $log:"
    tail -n 30 "$log" >&2
    exit 1
  fi
}

# `pipq_uninstall NAME DIST...`: uninstall with the same installer (nothing to do for one not installed).
pipq_uninstall() {
  local name="$1"; shift
  installer_init
  if [ "$INSTALLER" = uv ]; then
    env "${UV_ENV[@]}" "$UV_BIN" pip uninstall --python "$VENV_PY" "$@" >"$LOG_DIR/$name.log" 2>&1 || true
  else
    "$VENV_PY" -m pip uninstall -y "$@" >"$LOG_DIR/$name.log" 2>&1 || true
  fi
}

# `import_check_python ARGS...`: the venv's Python for a set-up's import check, writing the bytecode of what it imports
# (uv compiles none at install, above) even where PYTHONDONTWRITEBYTECODE is set.
import_check_python() {
  env -u PYTHONDONTWRITEBYTECODE "$VENV_PY" "$@"
}
