"""``sm120-fp4 doctor | selftest | launch | demo | patches`` (also ``python -m sm120_fp4``).

Exit codes (docs/operations.md):
  0  verified: every GPU this library serves has a verified backend (or there is none to serve)
  1  refused: no candidate verified on some GPU (a kernel failed, or crashed its process), or
     doctor --strict found a problem
  2  bad usage or environment: an invalid setting or argument, no such device, a worker that died
     outside any candidate
  3  unverified: a decision would serve without verification (SM120_FP4_SELFTEST=warn or off);
     `launch` does not start the command on it unless given --allow-unverified
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

__all__ = ["main", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "EXIT_UNVERIFIED"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 3
FAMILY_LABEL = {"dense": "FP4 GEMM", "moe": "NVFP4 fused MoE"}


def _eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def _emit(payload: dict) -> None:
    print(json.dumps(payload), flush=True)  # flushed: the parent reads it even if this process dies next


# ---- selftest: the worker (one device, one family, one short-lived process) -----------------

def _worker(args: argparse.Namespace) -> int:
    """Run decide() for one device and family in this (short-lived) process; print JSON lines:
    one event per candidate right before it runs, then the result."""
    from . import backends, devices, selection, verdicts
    from .config import load_settings
    from .errors import ConfigError, RefusedToServe

    family = "moe" if args.moe else "dense"
    key: dict = {}
    try:
        settings = load_settings(toggle=True)  # the preflight verifies what workers would run with the toggle on
        device = devices.get_device(args.device, settings.simulated_capability)
        key = verdicts.device_key(device)
        for item in args.crashed or []:
            name, _, why = item.partition("=")
            verdicts.note_crash(family, name, why)
        if args.backend:
            selection.candidate_names(settings, args.backend, selection.FAMILIES[family], device, source="--backend")
        kind = backends.get_moe if family == "moe" else backends.get

        def announce(event, fam, dev, name):
            _emit({"event": event, "family": fam, "backend": name, "flashinfer": kind(name).kind == "flashinfer", "key": key})

        selection.candidate_hook = announce
        decision = selection.decide(device, args.backend or None, settings=settings, family=family)
    except ConfigError as exc:
        _emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    except RefusedToServe as exc:
        reports = [r.model_dump(mode="json") for r in getattr(exc, "reports", [])]
        _emit({"ok": False, "usage": False, "message": str(exc), "device": args.device, "key": key,
               "rejected": getattr(exc, "rejected", {}), "reports": reports})
        return EXIT_REFUSED
    except LookupError as exc:
        _emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    _emit({"ok": True, "decision": decision.model_dump(mode="json"), "key": key})
    return EXIT_OK if decision.verified else EXIT_UNVERIFIED


# ---- selftest: the parent -------------------------------------------------------------------

def _died(code: int) -> str:
    from .errors import EXIT_HUNG

    if code == EXIT_HUNG:  # selftest's watchdog: a call still running past the bound held the thread
        return f"did not return within the self-test's time bound (its worker exited with code {EXIT_HUNG})"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _run_worker(index: int, family: str, backend_args: list[str], crashed: dict[str, str], label: str,
                env: dict[str, str], heartbeat_s: float = 30.0) -> tuple[dict | None, dict | None, int, str]:
    """One worker run: (result, last candidate event, returncode, stderr tail)."""
    cmd = [sys.executable, "-m", "sm120_fp4", "_selftest-worker", "--device", str(index), *backend_args]
    cmd += ["--moe"] if family == "moe" else []
    cmd += [a for name, why in crashed.items() for a in ("--crashed", f"{name}={why}")]
    lines: queue.Queue = queue.Queue()
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        start, result, event = time.perf_counter(), None, None
        while True:
            try:
                line = lines.get(timeout=heartbeat_s)
            except queue.Empty:  # a first FlashInfer call may be compiling kernels
                _eprint(f"[{label}] still running after {time.perf_counter() - start:.0f} s ...")
                continue
            if line is None:
                break
            if not line.startswith("{"):
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if "event" in data:
                event = data
                jit = " (the first FlashInfer use JIT-compiles kernels with nvcc: this can take minutes)" if data.get("flashinfer") else ""
                _eprint(f"[{label}] {data['event']} of {data['backend']}{jit} ...")
            else:
                result = data
        code = proc.wait()
        err.seek(0)
        stderr = err.read()[-2000:]
    return result, event, code, stderr


def _record(settings, family: str, result: dict) -> None:
    """Record the passed and failed verdicts of one worker's result (crashes are recorded as they happen)."""
    from . import verdicts

    path, key = settings.verdicts_path, result.get("key")
    if path is None or not key:
        return
    reports = result["decision"]["reports"] if result.get("ok") else result.get("reports", [])
    try:
        for r in reports:
            verdicts.record(path, key, family, r["backend"], verdicts.PASSED if r["passed"] else verdicts.FAILED, r.get("reason"))
    except OSError as exc:
        _eprint(f"sm120-fp4: could not record verdicts in {path}: {exc}")


def _preflight(index: int, family: str, backend_args: list[str], settings, env: dict[str, str]) -> dict:
    """Self-test `family` on device `index` in short-lived worker processes: a candidate that kills
    its worker is recorded as crashed (verdict file) and the worker re-runs without it."""
    from . import verdicts

    label = ("cpu (simulated)" if index < 0 else f"cuda:{index}") + ("" if family == "dense" else " moe")
    crashed: dict[str, str] = {}
    while True:
        result, event, code, stderr = _run_worker(index, family, backend_args, crashed, label, env)
        if result is not None:
            result["crashed"] = dict(crashed)
            _record(settings, family, result)
            return result
        if event is None or event["backend"] in crashed:
            return {"ok": False, "usage": True, "message": f"self-test worker ({label}) {_died(code)} outside any candidate:\n{stderr}"}
        why = f"the {event['event']} of {event['backend']} {_died(code)}"
        crashed[event["backend"]] = why
        _eprint(f"[{label}] {why}: recorded as crashed; re-running the self-test without it")
        try:
            verdicts.record(settings.verdicts_path, event["key"], family, event["backend"], verdicts.CRASHED, why)
        except OSError as exc:
            _eprint(f"sm120-fp4: could not record the crash in {settings.verdicts_path}: {exc}")


def _selftest_devices(settings, indices: list[int] | None) -> tuple[list[int], str | None]:
    """The devices to verify. One rule (docs/operations.md): every GPU a worker would serve -- each
    12.x GPU (any GPU with SM120_FP4_ENABLE=on); none visible is "nothing to verify", unless
    ENABLE=on asks for a GPU that is not there, or --device names one that is not visible."""
    from . import devices
    from .errors import capped

    found = devices.list_devices(settings.simulated_capability)
    known = [d.index for d in found]
    if indices:
        missing = [i for i in indices if i not in known]
        if missing:
            return [], f"--device {capped(missing)} not visible; visible: {known}"
        return indices, None
    if not found and settings.enable == "on":
        return [], "SM120_FP4_ENABLE=on but no CUDA device is visible (set SM120_FP4_SIMULATE=12.0 to simulate one)"
    return [d.index for d in found if settings.enable == "on" or devices.is_sm12x(d.capability)], None


def _decision_rows(results: dict[tuple[str, int], dict]) -> list[str]:
    rows = ["| kernel | device | backend | verified | max rel error | shapes | time (s) | note |", "|---|---|---|---|---|---|---|---|"]
    for (family, index), result in results.items():
        if result.get("usage"):
            continue  # a usage error is not a verdict on the device: its message follows the table
        if result.get("ok"):
            d = result["decision"]
            mine = [r for r in d["reports"] if r["backend"] == d["backend"]]
            err = f"{mine[0]['max_rel_err']:.2e}" if mine and mine[0]["max_rel_err"] is not None else "-"
            shapes = f"{sum(s['passed'] for s in mine[0]['shapes'])}/{len(mine[0]['shapes'])}" if mine else "-"
            verified = "True" if d["verified"] else "UNVERIFIED"
            rows.append(f"| {family} | {d['device']} | {d['backend']} | {verified} | {err} | {shapes} | {d['duration_s']:.2f} | {d['reason']} |")
        else:
            first = result["message"].splitlines()[0]
            rows.append(f"| {family} | {index} | - | REFUSED | - | - | - | {first} |")
    return rows


def cmd_selftest(args: argparse.Namespace, quiet: bool = False, families: Sequence[str] | None = None) -> int:
    from .config import load_settings
    from .errors import ConfigError

    families = list(families or (["moe"] if getattr(args, "moe", False) else ["dense"]))
    try:
        # The preflight verifies what workers would do with the toggle on; garbage in SM120_FP4 is still named.
        settings = load_settings(toggle=True) if os.environ.get("SM120_FP4") in ("0", "off") else load_settings()
        indices, problem = _selftest_devices(settings, args.device)
    except ConfigError as exc:
        _eprint(str(exc))
        return EXIT_USAGE
    if problem:
        _eprint(f"sm120-fp4 selftest: {problem}")
        return EXIT_USAGE
    if not indices:
        _eprint("sm120-fp4 selftest: no compute-capability 12.x GPU visible; nothing to verify (workers leave SGLang untouched)")
        return EXIT_OK
    backend_args = [a for name in (args.backend or []) for a in ("--backend", name)]
    env = {**os.environ, "SM120_FP4": "1"}
    jobs = [(family, index) for family in families for index in indices]
    for family, index in jobs:
        what = ", ".join(args.backend) if args.backend else f"the configured {FAMILY_LABEL[family]} backends"
        _eprint(f"[{'cpu (simulated)' if index < 0 else f'cuda:{index}'}] self-testing {what} in a subprocess ...")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # each its own short-lived process, all at once
        futures = {job: pool.submit(_preflight, job[1], job[0], backend_args, settings, env) for job in jobs}
        results = {job: futures[job].result() for job in jobs}  # the table keeps device order
    _eprint(f"sm120-fp4 selftest: done in {time.perf_counter() - start:.1f} s")
    usage = [r for r in results.values() if not r.get("ok") and r.get("usage")]
    refused = [r for r in results.values() if not r.get("ok") and not r.get("usage")]
    unverified = [r for r in results.values() if r.get("ok") and not r["decision"]["verified"]]
    if args.json:
        key = (lambda f, i: str(i)) if len(families) == 1 else (lambda f, i: f"{f}:{i}")
        print(json.dumps({key(*job): v for job, v in results.items()}, indent=2))
    elif not quiet:
        print("\n".join(_decision_rows(results)))
    for r in usage + refused:
        _eprint("\n" + r["message"])
    if usage:
        return EXIT_USAGE
    if refused:
        return EXIT_REFUSED
    if unverified:
        _eprint(f"sm120-fp4 selftest: {len(unverified)} decision(s) would serve UNVERIFIED (SM120_FP4_SELFTEST="
                f"{settings.selftest}): exit {EXIT_UNVERIFIED}")
        return EXIT_UNVERIFIED
    return EXIT_OK


# ---- launch --------------------------------------------------------------------------------

def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _eprint("sm120-fp4 launch: give the command to run after --, e.g. "
                "sm120-fp4 launch -- python -m sglang.launch_server --model-path ...")
        return EXIT_USAGE
    os.environ["SM120_FP4"] = "1"
    # Both families: the server may load NVFP4 MoE layers as well as linear ones.
    code = cmd_selftest(argparse.Namespace(device=None, backend=None, json=False, moe=False), families=("dense", "moe"))
    if code == EXIT_UNVERIFIED and args.allow_unverified:
        _eprint("sm120-fp4 launch: preflight UNVERIFIED; starting anyway because --allow-unverified was given")
    elif code != EXIT_OK:
        hint = " (pass --allow-unverified to start it anyway)" if code == EXIT_UNVERIFIED else ""
        _eprint(f"sm120-fp4 launch: preflight failed (exit {code}); not starting the server{hint}")
        return code
    else:
        _eprint("sm120-fp4 launch: preflight passed")
    _eprint(f"sm120-fp4 launch: exec {' '.join(command)} with SM120_FP4=1")
    try:
        os.execvpe(command[0], command, os.environ)
    except OSError as exc:
        _eprint(f"sm120-fp4 launch: cannot run {command[0]!r}: {exc}")
        return EXIT_USAGE
    return EXIT_OK  # pragma: no cover - exec does not return


# ---- entry point ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sm120-fp4", description="Verified NVFP4 GEMM for SGLang on SM120/SM121 GPUs.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    doctor = sub.add_parser("doctor", help="report GPUs, versions, settings, patch targets and backends")
    doctor.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    doctor.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    doctor.add_argument("--quick", action="store_true", help="skip importing SGLang to check each patch target")
    selftest = sub.add_parser("selftest", help="self-test each GPU in a short-lived subprocess")
    selftest.add_argument("--device", type=int, action="append", help="CUDA ordinal (repeatable); default: every 12.x GPU")
    selftest.add_argument("--backend", action="append",
                          help="candidate backend (repeatable); default: SM120_FP4_BACKENDS (with --moe: MoE backends, default SM120_FP4_MOE_BACKENDS)")
    selftest.add_argument("--moe", action="store_true", help="the NVFP4 fused-MoE family instead of the dense FP4 GEMM")
    selftest.add_argument("--json", action="store_true")
    launch = sub.add_parser("launch", help="preflight (dense and MoE), then exec COMMAND with SM120_FP4=1")
    launch.add_argument("--allow-unverified", action="store_true",
                        help="start COMMAND even when a decision would serve unverified (SM120_FP4_SELFTEST=warn/off)")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("demo", help="SGLang's real FP4 linear layer, patched and self-tested on a simulated SM120 (CPU)")
    patches = sub.add_parser("patches", help="the same fix as upstream-ready diffs: check the installed SGLang, or apply")
    patches.add_argument("action", choices=["check", "apply"])
    patches.add_argument("--dry-run", action="store_true", help="apply: show whether the diff applies, change nothing")
    patches.add_argument("--target", help="apply: a site-packages, unpacked wheel or SGLang source tree (default: installed)")
    worker = sub.add_parser("_selftest-worker")
    worker.add_argument("--device", type=int, required=True)
    worker.add_argument("--backend", action="append")
    worker.add_argument("--moe", action="store_true")
    worker.add_argument("--crashed", action="append", help="NAME=REASON: a candidate that crashed an earlier worker")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    if args.cmd == "doctor":
        from .doctor import run as doctor

        return doctor(as_json=args.json, strict=args.strict, deep=not args.quick)
    if args.cmd == "selftest":
        return cmd_selftest(args)
    if args.cmd == "launch":
        return cmd_launch(args)
    if args.cmd == "patches":
        from .upstream import main as patches

        return patches(args.action, dry_run=args.dry_run, target=args.target)
    if args.cmd == "demo":
        from .demo import main as demo

        return demo()
    return _worker_exit(_worker(args))


def _worker_exit(code: int) -> int:
    """The worker's exit code, kept: a call that outlived its bound may still be running and would
    abort the interpreter's shutdown (selftest.calls_still_running), so the worker, always its own
    short-lived process, then ends at once, after its result line is flushed."""
    from . import selftest

    if selftest.calls_still_running():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
