"""``sm120-fp4 launch``: the preflight (dense and MoE), then the command as a child with ``SM120_FP4=1``; on its
failure, which rank refused and why (from the report its processes wrote)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile

from .common import EXIT_OK, EXIT_UNVERIFIED, EXIT_USAGE, _eprint
from .selftest import _engine_home, _refuse_engine, _settings_and_devices, cmd_selftest


def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        example = "sm120-fp4 launch -- python -m sglang.launch_server --model-path ..."
        _eprint(f"sm120-fp4 launch: give the command to run after --, e.g. {example}")
        return EXIT_USAGE
    problem = _command_problem(command[0])
    if problem is not None:  # said now, not after minutes of preflight
        _eprint(f"sm120-fp4 launch: {problem}; not running the preflight")
        return EXIT_USAGE
    os.environ["SM120_FP4"] = "1"
    from ..api import ENGINES
    from ..vllm.allowlist import plugin_problem

    name = _engine_of(command)  # None: a command it cannot attribute, which may start any installed engine
    # else the installed engines' names (SGLang's where none is: nothing then to refuse)
    names = [name] if name is not None else [h.name for h in ENGINES if h.release.version() is not None] or ["sglang"]
    problem = next((p for p in map(_canary_problem, names) if p is not None), None)
    if problem is not None:  # refused now, not in every scheduler after the preflight
        _eprint(f"sm120-fp4 launch: {problem}; not starting the server")
        return EXIT_USAGE
    found = _settings_and_devices(argparse.Namespace(device=None))
    if isinstance(found, int):
        return found
    settings, indices = found
    engine = next((e for e in (_engine_home(n).release.unverified() for n in names) if e), None) if indices else None
    if engine is not None:  # nothing of this library runs in that server: no preflight would mean anything
        if name is None:
            _eprint(f"sm120-fp4 launch: {_UNATTRIBUTED % command[0]}")
        return _launch_unverified_engine(command, settings, engine, args.allow_unverified)
    # SGLang: the .pth start-up hook activates this library anyway; vLLM only through its plugin
    problem = plugin_problem() if indices and "vllm" in names else None
    if problem is not None:  # the server would serve every NVFP4 layer without this library: refused now
        _eprint(f"sm120-fp4 launch: {problem}; not starting the server")
        return EXIT_USAGE
    # Both families: the server may load NVFP4 MoE layers as well as linear ones.
    seen: list[tuple[str, dict]] = []
    preflight = argparse.Namespace(device=None, backend=None, json=False, moe=False, engine=name or names[0])
    code = cmd_selftest(preflight, families=("dense", "moe"), seen=seen)
    unrecorded = _unrecorded_crashes(seen)
    if unrecorded is not None and code in (EXIT_OK, EXIT_UNVERIFIED):
        _eprint(f"sm120-fp4 launch: {unrecorded}; not starting the server")
        return EXIT_USAGE
    if code == EXIT_UNVERIFIED and args.allow_unverified:
        _eprint("sm120-fp4 launch: preflight UNVERIFIED; starting anyway because --allow-unverified was given")
    elif code != EXIT_OK:
        hint = " (pass --allow-unverified to start it anyway)" if code == EXIT_UNVERIFIED else ""
        _eprint(f"sm120-fp4 launch: preflight failed (exit {code}); not starting the server{hint}")
        return code
    else:
        _eprint("sm120-fp4 launch: preflight passed")
    if settings.simulated_capability is not None:  # the engine's CPU ranks: each its share of the cores
        binding = {var: value for n in names for var, value in _engine_home(n).cpu_tp_env(command).items()}
        for var, value in binding.items():
            _eprint(f"sm120-fp4 launch: {var}={value} (this machine's cores split over the command's CPU ranks)")
            os.environ[var] = value
    return _exec(command)


def _exec(command: list[str]) -> int:
    if COREDUMP_WAIT_VAR not in os.environ:
        # SGLang 0.5.x sleeps this long (default 60 s) for CUDA coredumps before it kills its process tree
        # when a scheduler fails -- a canary's exit among them -- while the port stays open: shortened here.
        os.environ[COREDUMP_WAIT_VAR] = LAUNCH_COREDUMP_WAIT_S
    wait = f"{COREDUMP_WAIT_VAR}={os.environ[COREDUMP_WAIT_VAR]}"
    _eprint(f"sm120-fp4 launch: run {' '.join(command)} with SM120_FP4=1 and {wait}")
    own_report = None if os.environ.get("SM120_FP4_REPORT") else tempfile.mkdtemp(prefix="sm120_fp4_launch_")
    report = os.environ["SM120_FP4_REPORT"] = own_report or os.environ["SM120_FP4_REPORT"]  # where ranks say why
    try:
        code = _spawn(command, os.environ)
        if code:
            _eprint(f"sm120-fp4 launch: the server exited with code {code}")
            for line in _refusal_lines(report):
                _eprint(f"sm120-fp4 launch: {line}")
    except OSError as exc:
        _eprint(f"sm120-fp4 launch: cannot run {command[0]!r}: {exc}")
        return EXIT_USAGE
    finally:
        if own_report is not None:  # a private folder of this run: gone with it
            del os.environ["SM120_FP4_REPORT"]
            shutil.rmtree(own_report, ignore_errors=True)
    return code or EXIT_OK


def _spawn(argv: list[str], environ) -> int:
    """Run the server as this process's child, forwarding SIGTERM, SIGINT and SIGHUP; return its exit status."""
    proc = subprocess.Popen(argv, env=environ, preexec_fn=_end_with_launcher)  # found on `environ`'s PATH
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum)) for s in forwarded}
    try:
        code = proc.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


def _end_with_launcher() -> None:
    """In the server's process: SIGTERM it when launch ends (even by SIGKILL), as when launch was the server."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # Linux's prctl(PR_SET_PDEATHSIG); elsewhere nothing
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _refusal_lines(report: str) -> list[str]:
    """Return, from the report the server's processes wrote, which rank refused and why, and which were stopped."""
    from ..devices import rank_text
    from ..report import read_all

    group = f"{os.getpgid(0)}@"
    lines, stopped = [], []
    for _, payload in read_all(report):
        processes = [p for p in payload.get("processes", []) if str(p.get("run", "")).startswith(group)]
        for proc in processes:
            who = f"{rank_text(proc.get('rank') or {}) or 'process'} (pid {proc.get('pid')})"
            mine = [r for r in payload.get("refusals", []) if r.get("pid") == proc.get("pid")]
            for r in mine:
                why = "; ".join(f"{name}: {reason}" for name, reason in (r.get("rejected") or {}).items())
                lines.append(f"{who} refused: {str(r.get('message', '')).splitlines()[0]}{f' ({why})' if why else ''}")
            if not mine and proc.get("verifying"):
                stopped.append(f"{who} was stopped while verifying {', '.join(proc['verifying'])}")
    return lines + stopped


COREDUMP_WAIT_VAR = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS"
LAUNCH_COREDUMP_WAIT_S = "0"  # what launch sets unless the operator did (docs/operations.md)


def _command_problem(name: str) -> str | None:
    """Return why `name` cannot be executed as the launched command, or None."""
    if shutil.which(name) is not None:
        return None
    if os.sep in name:
        what = "does not exist" if not os.path.exists(name) else "is not an executable file"
        return f"the command {name!r} {what}"
    return f"the command {name!r} is not found on PATH ({os.environ.get('PATH', '')!r}) as an executable file"


def _unrecorded_crashes(seen: list[tuple[str, dict]]) -> str | None:
    """Return why the server must not start: crashed candidates the verdict store does not hold, or None."""
    from ..deciding import FAMILIES

    lost: dict[str, dict[str, str]] = {}
    for family, result in seen:
        for name, why in (result.get("unrecorded") or {}).items():
            lost.setdefault(family, {})[name] = why
    if not lost:
        return None
    names = "; ".join(f"{FAMILIES[f].what} {', '.join(sorted(n))}" for f, n in lost.items())
    why = next(iter(next(iter(lost.values())).values()))
    leave_out = " or ".join(f"{FAMILIES[f].backends_var} without {', '.join(sorted(n))}" for f, n in lost.items())
    return (
        f"candidate(s) crashed the preflight and are not recorded ({names}): {why}. The server's workers would "
        f"load them and crash; make the verdict store writable (SM120_FP4_VERDICTS, a file in a writable directory), "
        f"or leave them out ({leave_out})"
    )


def _launch_unverified_engine(command: list[str], settings, engine: tuple[str, str], allow_unverified: bool) -> int:
    """Launch with an SGLang this library cannot patch only when the operator said so; else refuse."""
    from ..engines import OPT_OUT, OPT_OUT_SAYS

    refused = _refuse_engine("launch", settings, engine)
    if refused is not None:
        _eprint("sm120-fp4 launch: not starting the server")
        return refused
    means, remedy = engine
    if settings.unsupported_release == "serve-unverified" or allow_unverified:
        why = OPT_OUT if settings.unsupported_release == "serve-unverified" else "--allow-unverified"
        _eprint(
            f"sm120-fp4 launch: {means}.\nStarting the server anyway ({why} was given): no preflight ran, and nothing "
            f"of what it serves is verified. To verify it: {remedy}."
        )
        return _exec(command)
    _eprint(
        f"sm120-fp4 launch: {means}; not starting the server (exit {EXIT_UNVERIFIED}).\nTo proceed: {remedy}; or "
        f"{OPT_OUT_SAYS} (or pass --allow-unverified)."
    )
    return EXIT_UNVERIFIED


_UNATTRIBUTED = (
    "which engine %r starts cannot be told (a script, or a wrapper or option launch does not know), so every "
    "installed engine's release was checked; run the engine's own command (vllm serve, python -m sglang...) under "
    "launch, through env, nice, nohup, numactl, taskset, timeout, stdbuf, uv run or sh -c, to check only its release"
)


def _engine_of(command: list[str]) -> str | None:
    """Return the engine the command starts, its known wrappers unwrapped; None where it cannot be told."""
    from ..api import ENGINES

    inner = _unwrapped(command)
    if not inner:
        return None
    starts = [home.name for home in ENGINES if home.launches(inner)]
    return starts[0] if len(starts) == 1 else None


# The wrappers launch looks through, each with the options that take a value (short letters, long names), the
# options that take none, and how many arguments come before the wrapped command; an option it does not know,
# or a wrapper it does not know, leaves the command unattributed (every installed engine is then checked).
_WRAPPERS: dict[str, tuple[str, set[str], str, set[str], int]] = {
    "env": ("uC", {"unset", "chdir"}, "i0v", {"ignore-environment", "null", "debug"}, 0),  # not -S: env splits it
    "nice": ("n", {"adjustment"}, "", set(), 0),
    "nohup": ("", set(), "", set(), 0),
    "setsid": ("", set(), "cfw", {"ctty", "fork", "wait"}, 0),
    "exec": ("a", set(), "cl", set(), 0),
    "numactl": (
        "imNCpPw",
        {"interleave", "membind", "cpunodebind", "physcpubind", "preferred", "preferred-many", "weighted-interleave"},
        "lab",
        {"localalloc", "all", "balancing", "huge", "touch", "strict"},
        0,
    ),
    "taskset": ("", set(), "ac", {"all-tasks", "cpu-list"}, 1),
    "timeout": ("ks", {"kill-after", "signal"}, "v", {"preserve-status", "foreground", "verbose"}, 1),
    "stdbuf": ("ioe", {"input", "output", "error"}, "", set(), 0),
    "uv run": (
        "pC",
        {"python", "with", "with-editable", "with-requirements", "env-file", "package", "project", "directory"}
        | {"extra", "group", "index", "index-url", "extra-index-url", "config-setting", "cache-dir", "config-file"},
        "qv",
        {"frozen", "locked", "no-sync", "isolated", "no-project", "no-dev", "all-extras", "active", "offline"}
        | {"quiet", "verbose", "no-cache", "exact", "no-editable", "all-packages"},
        0,
    ),
}
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
_SHELL_SYNTAX = frozenset(";&|<>()$`{}\n")


def _unwrapped(command: list[str], depth: int = 0) -> list[str] | None:
    """Return the command its known wrappers run (`command` itself if none), or None where it cannot be told."""
    while command and depth < 16:
        depth += 1
        head = os.path.basename(command[0])
        head = "uv run" if head == "uv" and command[1:2] == ["run"] else head
        if head in _SHELLS:
            return _shell_command(command[1:], depth)
        if head not in _WRAPPERS:
            return command
        rest = _after_options(command[2 if head == "uv run" else 1 :], *_WRAPPERS[head], head)
        if rest is None:
            return None
        command = rest
    return None


def _after_options(args, short_values, long_values, short_flags, long_flags, positional, head):
    """Return what follows a wrapper's options, NAME=VALUE assignments (env) and positional arguments, or None."""
    i = 0
    while i < len(args) and args[i].startswith("-") and (args[i] != "-" or head == "env"):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if head == "uv run" and arg in ("-m", "--module"):  # uv run -m MODULE: python -m MODULE
            return ["python", *args[i:]]
        if arg == "-" or (head == "nice" and arg[1:].isdigit()):  # env - COMMAND; nice -10 COMMAND
            i += 1
        elif arg.startswith("--"):
            name, eq, _ = arg[2:].partition("=")
            if name not in long_values | long_flags or (name in long_flags and eq):
                return None
            i += 1 if eq or name in long_flags else 2
        elif arg[1] in short_values:
            i += 1 if len(arg) > 2 else 2
        elif all(c in short_flags for c in arg[1:]):
            i += 1
        else:
            return None
    if head == "env":
        while i < len(args) and "=" in args[i] and not args[i].startswith("="):
            i += 1
    return args[i + positional :] if len(args) > i + positional else None


def _shell_command(args: list[str], depth: int) -> list[str] | None:
    """Return the command ``sh -c STRING`` runs when STRING is one plain command (no shell syntax), else None."""
    import shlex

    i = 0
    while i < len(args) and args[i].startswith("-") and "c" not in args[i][1:]:
        i += 2 if args[i] == "-o" else 1  # set -o OPTION
    if i + 1 >= len(args) or not args[i].startswith("-") or args[i].startswith("--") or "c" not in args[i]:
        return None  # a script file, or stdin: what it starts cannot be told
    text = args[i + 1]
    if any(c in _SHELL_SYNTAX for c in text):  # ; && | $( ... : more than one plain command
        return None
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    while words and "=" in words[0] and not words[0].startswith("="):
        words = words[1:]  # FOO=1 COMMAND
    return _unwrapped(words, depth) if words else None


def _canary_problem(name: str = "sglang") -> str | None:
    """Return why the serving canary asked for cannot run with the engine `name` starts, or None."""
    from ..canary import settings_problem
    from ..config import load_settings
    from ..errors import ConfigError

    try:
        settings = load_settings(toggle=True)
    except ConfigError:
        return None
    home = _engine_home(name)
    return settings_problem(settings) or (home.canary_problem(settings) if home.release.support()[0] else None)
