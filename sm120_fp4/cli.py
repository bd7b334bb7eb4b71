"""``sm120-fp4 doctor | selftest | launch | demo | patches`` (also ``python -m sm120_fp4``).

Exit codes: 0 success; 1 a refusal (a kernel failed verification, or doctor --strict found a
problem); 2 bad usage or environment (invalid setting, no device, unsupported release).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

__all__ = ["main"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def _eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---- selftest ------------------------------------------------------------------------------

def _worker(args: argparse.Namespace) -> int:
    """Run decide() for one device in this (short-lived) process; print one JSON line."""
    from . import devices, selection
    from .config import load_settings
    from .errors import ConfigError, RefusedToServe

    try:
        settings = load_settings()
        device = devices.get_device(args.device, settings.simulated_capability)
        decision = selection.decide(device, args.backend or None, settings=settings)
    except ConfigError as exc:
        print(json.dumps({"ok": False, "usage": True, "message": str(exc)}))
        return EXIT_USAGE
    except RefusedToServe as exc:
        print(json.dumps({"ok": False, "usage": False, "message": str(exc), "device": args.device}))
        return EXIT_REFUSED
    except LookupError as exc:
        print(json.dumps({"ok": False, "usage": True, "message": str(exc)}))
        return EXIT_USAGE
    print(json.dumps({"ok": True, "decision": decision.model_dump(mode="json")}))
    return EXIT_OK


def _run_worker(index: int, backend_args: list[str], label: str, heartbeat_s: float = 30.0) -> dict:
    cmd = [sys.executable, "-m", "sm120_fp4", "_selftest-worker", "--device", str(index), *backend_args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy()) as proc:
        start = time.perf_counter()
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:  # a first FlashInfer call may be compiling kernels
                _eprint(f"[{label}] still running after {time.perf_counter() - start:.0f} s ...")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "usage": True, "message": f"self-test worker exited {proc.returncode}:\n{stderr[-2000:]}"}
    return json.loads(lines[-1])


def _selftest_devices(indices: list[int] | None) -> tuple[list[int], str | None]:
    from . import devices
    from .config import load_settings

    settings = load_settings()
    found = devices.list_devices(settings.simulated_capability)
    if not found:
        return [], "no CUDA device is visible (set SM120_FP4_SIMULATE=12.0 to simulate one)"
    known = [d.index for d in found]
    if indices:
        missing = [i for i in indices if i not in known]
        if missing:
            return [], f"--device {missing} not visible; visible: {known}"
        return indices, None
    wanted = [d.index for d in found if settings.enable == "on" or devices.is_sm12x(d.capability)]
    return wanted, None


def _decision_rows(results: dict[int, dict]) -> list[str]:
    rows = ["| device | backend | verified | max rel error | shapes | time (s) | note |", "|---|---|---|---|---|---|---|"]
    for index, result in results.items():
        if result.get("ok"):
            d = result["decision"]
            mine = [r for r in d["reports"] if r["backend"] == d["backend"]]
            err = f"{mine[0]['max_rel_err']:.2e}" if mine and mine[0]["max_rel_err"] is not None else "-"
            shapes = f"{sum(s['passed'] for s in mine[0]['shapes'])}/{len(mine[0]['shapes'])}" if mine else "-"
            rows.append(f"| {d['device']} | {d['backend']} | {d['verified']} | {err} | {shapes} | {d['duration_s']:.2f} | {d['reason']} |")
        else:
            first = result["message"].splitlines()[0]
            rows.append(f"| {index} | - | REFUSED | - | - | - | {first} |")
    return rows


def cmd_selftest(args: argparse.Namespace, quiet: bool = False) -> int:
    from .config import load_settings
    from .errors import ConfigError

    try:
        load_settings()
        indices, problem = _selftest_devices(args.device)
    except ConfigError as exc:
        _eprint(str(exc))
        return EXIT_USAGE
    if problem:
        _eprint(f"sm120-fp4 selftest: {problem}")
        return EXIT_USAGE
    if not indices:
        _eprint("sm120-fp4 selftest: no compute-capability 12.x GPU visible; nothing to verify")
        return EXIT_OK
    backend_args = [a for name in (args.backend or []) for a in ("--backend", name)]
    results: dict[int, dict] = {}
    for index in indices:
        label = "cpu (simulated)" if index < 0 else f"cuda:{index}"
        _eprint(f"[{label}] self-testing {', '.join(args.backend or ['the configured backends'])} "
                "(the first FlashInfer use JIT-compiles kernels with nvcc: this can take minutes) ...")
        start = time.perf_counter()
        results[index] = _run_worker(index, backend_args, label)
        _eprint(f"[{label}] done in {time.perf_counter() - start:.1f} s")
    usage = [r for r in results.values() if not r.get("ok") and r.get("usage")]
    refused = [r for r in results.values() if not r.get("ok") and not r.get("usage")]
    if args.json:
        print(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    elif not quiet:
        print("\n".join(_decision_rows(results)))
    for r in usage + refused:
        _eprint("\n" + r["message"])
    if usage:
        return EXIT_USAGE
    return EXIT_REFUSED if refused else EXIT_OK


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
    code = cmd_selftest(argparse.Namespace(device=None, backend=None, json=False))
    if code != EXIT_OK:
        _eprint("sm120-fp4 launch: preflight failed; not starting the server")
        return code
    _eprint(f"sm120-fp4 launch: preflight passed; exec {' '.join(command)} with SM120_FP4=1")
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
    selftest.add_argument("--backend", action="append", help="candidate backend (repeatable); default: SM120_FP4_BACKENDS")
    selftest.add_argument("--json", action="store_true")
    launch = sub.add_parser("launch", help="preflight, then exec COMMAND with SM120_FP4=1")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("demo", help="SGLang's real FP4 linear layer, patched and self-tested on a simulated SM120 (CPU)")
    patches = sub.add_parser("patches", help="the same fix as upstream-ready diffs: check the installed SGLang, or apply")
    patches.add_argument("action", choices=["check", "apply"])
    patches.add_argument("--dry-run", action="store_true", help="apply: show whether the diff applies, change nothing")
    patches.add_argument("--target", help="apply: a site-packages, unpacked wheel or SGLang source tree (default: installed)")
    worker = sub.add_parser("_selftest-worker")
    worker.add_argument("--device", type=int, required=True)
    worker.add_argument("--backend", action="append")
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
    return _worker(args)
