"""``sm120-fp4 selftest``: a worker per device and family, crash verdicts, table, report; ``--model DIR``; engines."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from .common import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED, EXIT_USAGE, _eprint, _where
from .workers import INTERRUPTS, _died, _run_worker, _Stop, model_worker_argv, worker_argv

# The engines selftest and launch verify for (api.engine(name)); unpatchable releases: refused or unverified.
ENGINE_NAMES = ("sglang", "vllm")  # the names of api.ENGINES, listed here so that parsing imports no engine home


def _engine_home(name: str):
    from ..api import engine

    return engine(name)


def _refuse_engine(command: str, settings, engine: tuple[str, str]) -> int | None:
    """Refuse to start under SELFTEST=strict unless opted out (exit 2, saying how to proceed); None: not refused."""
    if settings.selftest != "strict" or settings.unsupported_release != "refuse":
        return None
    from ..engines import OPT_OUT_SAYS

    means, remedy = engine
    _eprint(f"sm120-fp4 {command}: refusing to start: {means}.\nTo proceed: {remedy}; or {OPT_OUT_SAYS}.")
    return EXIT_USAGE


def _say_unverified_engine(engine: tuple[str, str], what: str) -> int:
    """Say that the engine release is outside the supported range; return exit 3 (unverified)."""
    means, remedy = engine
    _eprint(f"sm120-fp4 selftest: {means}; {what}: exit {EXIT_UNVERIFIED}.\nTo verify them: {remedy}.")
    return EXIT_UNVERIFIED


def _model_engine_problem(name: str, settings) -> int | None:
    """The exit code when the engine `name` cannot build the checkpoint's layers verified here (None: it can)."""
    if _engine_home(name).release.version() is None:
        _eprint(f"sm120-fp4 selftest: --engine {name}: {name} is not installed for {sys.executable}; run it there")
        return EXIT_USAGE
    engine = _engine_home(name).release.unverified()  # (what it means, what makes it verified), or None
    if engine is not None:  # the checkpoint's layers are built through the engine's: nothing of it is patched
        return _refuse_engine("selftest", settings, engine) or _say_unverified_engine(engine, "nothing was verified")
    return None


def _settings_and_devices(args: argparse.Namespace, nothing: str | None = None):
    """Return (settings, the device indices to verify), or the exit code after saying why not."""
    from .. import devices
    from ..config import check_flashinfer_env, load_settings
    from ..errors import ConfigError

    try:
        # The preflight verifies what workers would do with the toggle on; garbage in SM120_FP4 is still named.
        settings = load_settings(toggle=True) if os.environ.get("SM120_FP4") in ("0", "off") else load_settings()
        indices, problem = _selftest_devices(settings, args.device)
        if indices:  # a 12.x GPU to verify on: FlashInfer's own FP4 knobs would make every candidate fail
            check_flashinfer_env()
    except (ConfigError, devices.DeviceMappingError) as exc:
        _eprint(str(exc))
        return EXIT_USAGE
    if problem:
        _eprint(f"sm120-fp4 selftest: {problem}")
        return EXIT_USAGE
    if not indices and nothing is not None:
        _eprint(f"sm120-fp4 selftest: no compute-capability 12.x GPU visible; nothing to verify ({nothing})")
        return EXIT_OK
    return settings, indices


# What `selftest --model DIR` needs without a 12.x GPU: a simulated device and the backends that run on a CPU.
SIMULATE_ON_CPU = "SM120_FP4_SIMULATE=12.0 SM120_FP4_BACKENDS=emulated SM120_FP4_MOE_BACKENDS=emulated"


def cmd_selftest_model(args: argparse.Namespace) -> int:
    """Run ``selftest --model DIR``: build and verify each NVFP4 layer configuration of DIR per GPU."""
    from .. import checkpoints
    from ..errors import CheckpointError, ConfigError

    if not os.path.isdir(args.model):
        _eprint(f"sm120-fp4 selftest: --model {args.model!r} is not a directory")
        return EXIT_USAGE
    try:  # the checkpoint's faults are named here, in one line, before any worker or kernel runs
        checkpoints.inspect(args.model)
    except (CheckpointError, ConfigError) as exc:
        _eprint(f"sm120-fp4 selftest: {exc}")
        return EXIT_USAGE
    found = _settings_and_devices(args, f"to verify the checkpoint on this CPU, in simulation: {SIMULATE_ON_CPU}")
    if isinstance(found, int):
        return found
    settings, indices = found
    name = getattr(args, "engine", "sglang")
    refused = _model_engine_problem(name, settings)
    if refused is not None:
        return refused
    env = {**os.environ, "SM120_FP4": "1"}
    model = os.path.abspath(args.model)
    stop = _Stop()

    def run(index: int) -> dict:
        _eprint(f"[{_where(index)}] building and verifying {model}'s NVFP4 layers through {name}'s layers ...")
        argv = model_worker_argv(index, model, name)
        result, _, code, stderr = (_worker_runner or _run_worker)(argv, _where(index), env, stop)
        message = f"model check worker ({_where(index)}) {_died(code)} before a result:\n{stderr}"
        return result or {"ok": False, "usage": False, "message": message}

    results = _in_workers(indices, run, stop)
    if stop.signal is not None:
        return _interrupted(stop.signal, [])
    text = json.dumps({str(i): r for i, r in results.items()}, indent=2) if args.json else None
    print(text if text is not None else "\n".join(_model_rows(results)))
    failed = _failed(results.values())  # each failure printed
    if failed is None and any(not d["verified"] for r in results.values() for d in r["decisions"]):
        return EXIT_UNVERIFIED
    return EXIT_OK if failed is None else failed


def _model_rows(results: dict[int, dict]) -> list[str]:
    """Return the table of ``selftest --model``: a row per device, kernel and layer configuration."""
    from ..devices import rank_text
    from ..tables import markdown_table

    rows = []
    for index, r in results.items():
        where = r.get("pid", "-"), rank_text(r.get("rank") or {}, every=True) or "-"
        for d in r.get("decisions", []):
            fields = *where, d["device"], d["family"]
            rows += [
                (*fields, c["config"], d["backend"], c["passed"] and d["verified"], len(c["shapes"]))
                for c in d["layers"]
            ]
        if not r.get("ok") and not r.get("usage"):  # a usage error is no verdict: its message follows
            rows.append((*where, index, "-", "-", "-", "REFUSED", r["message"].splitlines()[0]))
    header = ("pid", "rank", "device", "kernel", "layer configuration", "backend", "verified", "batch sizes")
    return markdown_table(header, rows)


def _failed(results) -> int | None:
    """Print the message of each result that failed; return EXIT_USAGE (a usage error among them), EXIT_REFUSED, or
    None where none failed."""
    failed = [r for r in results if not r.get("ok")]
    for r in failed:
        _eprint("\n" + r["message"])
    if any(r.get("usage") for r in failed):
        return EXIT_USAGE
    return EXIT_REFUSED if failed else None


WorkerRunner = Callable[..., "tuple[dict | None, dict | None, int, str]"]  # (argv, label, env, stop) -> _run_worker's
_worker_runner: WorkerRunner | None = None


def use_worker_runner(runner: WorkerRunner | None) -> WorkerRunner | None:
    """Run the workers of ``selftest`` (with ``--model`` too) and ``launch`` through `runner` (None: own processes);
    return the previous one (a test seam)."""
    global _worker_runner
    previous, _worker_runner = _worker_runner, runner
    return previous


def _in_workers(jobs: list, run: Callable, stop: _Stop) -> dict:
    """Return {job: run(job)}, every job at once (each runs its own short-lived worker), in the jobs' order."""
    restore = stop.handle_signals()  # a signal stops every worker (the second kills them)
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            futures = {job: pool.submit(run, job) for job in jobs}
            return {job: futures[job].result() for job in jobs}
    finally:
        restore()


def _interrupted(signum: int, results: list[dict]) -> int:
    """Say which workers an interrupt by `signum` stopped (nothing recorded for them); return 128 + signum."""
    for r in results:
        _eprint(r["message"])
    _eprint(
        f"sm120-fp4 selftest: interrupted by {signal.Signals(signum).name}: the workers were stopped; "
        f"nothing was recorded for the candidates they were running (exit {128 + signum})"
    )
    return 128 + signum


# A worker killed by SIGKILL (out of memory, kill -9) is no verdict: re-run this many times, then exit 2.
SIGKILL_RETRIES = 1


def _record(settings, family: str, result: dict) -> None:
    """Record the passed and failed verdicts of one worker's result (crashes are recorded as they happen)."""
    from .. import verdicts

    path, key = settings.verdicts_path, result.get("key")
    if path is None or not key:
        return
    reports = result["decision"]["reports"] if result.get("ok") else result.get("reports", [])
    try:
        for r in reports:
            verdict = verdicts.PASSED if r["passed"] else verdicts.FAILED
            verdicts.record(path, key, family, r["backend"], verdict, r.get("reason"))
    except OSError as exc:
        _store_failed(path, exc)


_told_stores: set[str] = set()


def _store_failed(path, exc: OSError) -> str:
    """Return why the verdict store at `path` could not be written, said once per store and process."""
    why = f"the verdict store {path} cannot be written ({exc})"
    if str(path) not in _told_stores:
        _told_stores.add(str(path))
        _eprint(f"sm120-fp4: {why}")
    return why


def _preflight(index: int, family: str, backend_args: list[str], settings, env: dict, stop: _Stop, uuid) -> dict:
    """Self-test `family` on device `index` in workers, recording and skipping candidates that crash one."""
    # An interruption records nothing and stops; SIGKILL records nothing and retries (SIGKILL_RETRIES).
    label = _where(index) + ("" if family == "dense" else " moe")
    crashed: dict[str, str] = {}
    unrecorded: dict[str, str] = {}  # crashed, but not in the verdict store: serving workers would load them
    killed: dict[str, int] = {}
    while True:
        if stop.signal is not None:
            return _stopped(label, stop.signal, None)
        argv = worker_argv(index, family, backend_args, crashed, uuid)
        result, event, code, stderr = (_worker_runner or _run_worker)(argv, label, env, stop)
        if result is not None:
            result["crashed"], result["unrecorded"] = dict(crashed), dict(unrecorded)
            _record(settings, family, result)
            return result
        # the parent's signal, or one the worker died of
        interrupted = stop.signal if stop.signal is not None else -code if code < 0 and -code in INTERRUPTS else None
        if interrupted is not None:
            return _stopped(label, interrupted, event)
        if event is None or event["backend"] in crashed:
            message = f"self-test worker ({label}) {_died(code)} outside any candidate:\n{stderr}"
            return {"ok": False, "usage": True, "message": message}
        name = event["backend"]
        if code != -signal.SIGKILL:
            _note_crash(settings, family, label, event, code, crashed, unrecorded)
            continue
        killed[name] = killed.get(name, 0) + 1
        gave_up = _killed(label, event, killed[name])
        if gave_up is not None:
            return gave_up


def _killed(label: str, event: dict, times: int) -> dict | None:
    """Say a worker was killed by SIGKILL; return None to run it again, or the result that stops the preflight."""
    what = (
        f"[{label}] the self-test worker was killed by SIGKILL during the {event['event']} of {event['backend']} (the "
        "out-of-memory killer, or kill -9): not a verdict on the kernel, nothing recorded"
    )
    if times <= SIGKILL_RETRIES:
        _eprint(f"{what}; running it again")
        return None
    again = "(dmesg, the container's limit) and run it again"
    message = f"{what}; it happened {times} times, so the preflight stops here. Check the memory {again}"
    return {"ok": False, "usage": True, "killed": True, "message": message}


def _note_crash(settings, family: str, label: str, event: dict, code: int, crashed: dict, unrecorded: dict) -> None:
    """Add the candidate that crashed a worker to `crashed`, record it (or why not in `unrecorded`), and say so."""
    from .. import verdicts

    name = event["backend"]
    crashed[name] = why = f"the {event['event']} of {name} {_died(code)}"
    path = settings.verdicts_path
    if path is None:
        unrecorded[name] = "no verdict store (SM120_FP4_VERDICTS=off, or no home directory for the default one)"
    else:
        try:
            verdicts.record(path, event["key"], family, name, verdicts.CRASHED, why)
        except OSError as exc:
            unrecorded[name] = _store_failed(path, exc)
    # Said once: recorded, or not (and why); serving workers skip only what the store holds.
    where = f"NOT recorded as crashed: {unrecorded[name]}" if name in unrecorded else f"recorded as crashed in {path}"
    _eprint(f"[{label}] {why}: {where}; re-running the self-test without it")


def _stopped(label: str, signum: int, event: dict | None) -> dict:
    name, running = signal.Signals(signum).name, f" during the {event['event']} of {event['backend']}" if event else ""
    message = f"[{label}] interrupted by {name}{running}: stopped, nothing recorded for it"
    return {"ok": False, "usage": False, "interrupted": name, "signal": int(signum), "message": message}


def _selftest_devices(settings, indices: list[int] | None) -> tuple[list[int], str | None]:
    """Return the devices to verify (every GPU a worker would serve), or why `indices` cannot be."""
    from .. import devices
    from ..errors import capped

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
    from ..tables import markdown_table

    rows = []
    for (family, index), result in results.items():
        if result.get("usage"):
            continue  # a usage error is not a verdict on the device: its message follows the table
        if result.get("ok"):
            d = result["decision"]
            mine = [r for r in d["reports"] if r["backend"] == d["backend"]]
            err = f"{mine[0]['max_rel_err']:.2e}" if mine and mine[0]["max_rel_err"] is not None else "-"
            shapes = f"{sum(s['passed'] for s in mine[0]['shapes'])}/{len(mine[0]['shapes'])}" if mine else "-"
            verified, took = "True" if d["verified"] else "UNVERIFIED", f"{d['duration_s']:.2f}"
            rows.append((family, d["device"], d["backend"], verified, err, shapes, took, d["reason"]))
        else:
            rows.append((family, index, "-", "REFUSED", "-", "-", "-", result["message"].splitlines()[0]))
    header = ("kernel", "device", "backend", "verified", "max rel error", "shapes", "time (s)", "note")
    return markdown_table(header, rows)


def cmd_selftest(args: argparse.Namespace, families: Sequence[str] | None = None, seen: list | None = None) -> int:
    """Run ``selftest``: each family on each device in workers; `seen` (launch) gets each (family, result)."""
    from .. import deciding, devices, verdicts

    families = list(families or (["moe"] if getattr(args, "moe", False) else ["dense"]))
    found = _settings_and_devices(args, "workers leave SGLang untouched")
    if isinstance(found, int):
        return found
    settings, indices = found
    engine = _engine_home(getattr(args, "engine", "sglang")).release.unverified()
    refused = _refuse_engine("selftest", settings, engine) if engine is not None else None
    if refused is not None:
        return refused
    uuids = {d.index: d.uuid for d in devices.list_devices(settings.simulated_capability) if d.uuid}
    store = verdicts.trouble(settings.verdicts_path)
    if store is not None:
        _eprint(
            f"sm120-fp4 selftest: {store}; verdicts are neither read nor recorded there (docs/operations.md, files)"
        )
    backend_args = [a for name in (args.backend or []) for a in ("--backend", name)]
    # The workers write no report: this process writes one holding every worker's decisions.
    env = {**{k: v for k, v in os.environ.items() if k != "SM120_FP4_REPORT"}, "SM120_FP4": "1"}
    jobs = [(family, index) for family in families for index in indices]
    for family, index in jobs:
        what = ", ".join(args.backend) if args.backend else f"the configured {deciding.FAMILIES[family].what} backends"
        _eprint(f"[{_where(index)}] self-testing {what} in a subprocess ...")
    start, stop = time.perf_counter(), _Stop()

    def run(job: tuple[str, int]) -> dict:
        family, index = job
        return _preflight(index, family, backend_args, settings, env, stop, uuids.get(index))

    results = _in_workers(jobs, run, stop)
    if seen is not None:
        seen.extend((family, r) for (family, _), r in results.items())
    _eprint(f"sm120-fp4 selftest: done in {time.perf_counter() - start:.1f} s")
    _write_preflight_report(settings, results)
    interrupted = [r for r in results.values() if r.get("interrupted")]
    if stop.signal is not None or interrupted:
        return _interrupted(stop.signal or interrupted[0]["signal"], interrupted)
    return _outcome(args, results, families, settings, engine)


def _outcome(args: argparse.Namespace, results: dict, families: list[str], settings, engine) -> int:
    """Print the preflight's table (or JSON) and each failure; return the exit code of ``selftest``."""
    if args.json:
        key = (lambda f, i: str(i)) if len(families) == 1 else (lambda f, i: f"{f}:{i}")
        print(json.dumps({key(*job): v for job, v in results.items()}, indent=2))
    else:
        print("\n".join(_decision_rows(results)))
    failed = _failed(results.values())
    if failed is not None:
        return failed
    if engine is not None:
        return _say_unverified_engine(engine, "the table verifies the kernels, not what SGLang will serve")
    unverified = [r for r in results.values() if not r["decision"]["verified"]]
    if unverified:
        n, mode = len(unverified), f"SM120_FP4_SELFTEST={settings.selftest}"
        _eprint(f"sm120-fp4 selftest: {n} decision(s) would serve UNVERIFIED ({mode}): exit {EXIT_UNVERIFIED}")
        return EXIT_UNVERIFIED
    return EXIT_OK


def _write_preflight_report(settings, results: dict[tuple[str, int], dict]) -> None:
    """Write one report of the whole preflight (every worker's decisions, each job's outcome) to SM120_FP4_REPORT."""
    if settings.report is None:
        return
    from .. import report

    section: dict = {"decisions": [], "refusals": [], "preflight": []}
    for (family, index), r in results.items():
        own = r.get("report") or {}
        section["decisions"] += own.get("decisions", [])
        section["refusals"] += own.get("refusals", [])
        verdict = ("passed" if r["decision"]["verified"] else "unverified") if r.get("ok") else "refused"
        outcome = "interrupted" if r.get("interrupted") else "error" if r.get("usage") else verdict
        message = None if r.get("ok") else r.get("message")
        row = dict(family=family, device=index, outcome=outcome, crashed=r.get("crashed", {}), message=message)
        section["preflight"].append(row)
    try:
        written = report.write(settings.report, section, settings.report_is_dir, role="preflight")
        _eprint(f"sm120-fp4 selftest: report written to {written}")
    except OSError as exc:
        _eprint(f"sm120-fp4: could not write the report to {settings.report}: {exc}")
