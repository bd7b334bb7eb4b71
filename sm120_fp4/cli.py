"""``sm120-fp4 doctor | selftest | launch | demo | patches | bench`` (also ``python -m sm120_fp4``).

Exit codes (docs/operations.md):
  0  verified: every GPU this library serves has a verified backend (or there is none to serve)
  1  refused: no candidate verified on some GPU (a kernel failed, or crashed its process), or
     doctor --strict found a problem
  2  bad usage or environment: an invalid setting or argument, no such device, a worker that died
     outside any candidate; under SM120_FP4_SELFTEST=strict, an SGLang release outside the supported
     range (unless SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified)
  3  unverified: a decision would serve without verification (SM120_FP4_SELFTEST=warn or off), or
     the SGLang release is outside the supported range and not refused; `launch` does not start the
     command on it unless given --allow-unverified (or, for the release, the opt-out setting)
  128+N  interrupted by signal N (130: SIGINT, 143: SIGTERM): the workers were stopped and nothing
     was recorded for the candidates they were running
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
from typing import Any, Callable, Sequence

from . import locks

__all__ = ["main", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "EXIT_UNVERIFIED", "use_worker_runner", "worker_argv", "WorkerOutput",
           "use_model_worker_runner", "model_worker_argv"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 3


def _eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def _emit(payload: dict) -> None:
    print(json.dumps(payload), flush=True)  # flushed: the parent reads it even if this process dies next


# ---- selftest: the worker (one device, one family, one short-lived process) -----------------

def _worker(args: argparse.Namespace, emit: Callable[[dict], None] = _emit) -> int:
    """Run decide() for one device and family in this (short-lived) process; `emit` JSON lines
    (standard output): one event per candidate right before it runs, then the result."""
    from . import backends, deciding, devices, serving, verdicts
    from .config import check_flashinfer_env, load_settings
    from .errors import ConfigError, RefusedToServe

    family = "moe" if args.moe else "dense"
    key: dict = {}
    try:
        settings = load_settings(toggle=True)  # the preflight verifies what workers would run with the toggle on
        check_flashinfer_env()
        # This process is about to use CUDA: CUDA itself says which GPU the ordinal is.
        device = devices.get_device(args.device, settings.simulated_capability, init_cuda=True)
        if args.uuid and device.uuid is not None and not devices.same_uuid(device.uuid, args.uuid):
            raise LookupError(f"cuda:{args.device} is GPU {device.uuid} ({device.name!r}) in this self-test worker, but the "
                              f"preflight numbered GPU {args.uuid} cuda:{args.device}: CUDA's numbering differs between the two "
                              f"processes; not self-testing a GPU other than the one named ({devices.PCI_ORDER_FIX})")
        key = verdicts.device_key(device)
        for item in args.crashed or []:
            name, _, why = item.partition("=")
            verdicts.note_crash(family, name, why)
        if args.backend:
            deciding.candidate_names(settings, args.backend, deciding.FAMILIES[family], device, source="--backend")
        kind = backends.get_moe if family == "moe" else backends.get

        def announce(event, fam, dev, name):
            emit({"event": event, "family": fam, "backend": name, "flashinfer": kind(name).kind == "flashinfer", "key": key})

        deciding.candidate_hook = announce
        try:
            decision = serving.decide(device, args.backend or None, settings=settings, family=family)
        finally:
            deciding.candidate_hook = None
    except ConfigError as exc:
        emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    except RefusedToServe as exc:
        reports = [r.model_dump(mode="json") for r in getattr(exc, "reports", [])]
        emit({"ok": False, "usage": False, "message": str(exc), "device": args.device, "key": key,
               "rejected": getattr(exc, "rejected", {}), "reports": reports, "report": _own_report()})
        return EXIT_REFUSED
    except LookupError as exc:
        emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    emit({"ok": True, "decision": decision.model_dump(mode="json"), "key": key, "report": _own_report()})
    return EXIT_OK if decision.verified else EXIT_UNVERIFIED


def _model_worker(args: argparse.Namespace, emit: Callable[[dict], None] = _emit) -> int:
    """Verify the checkpoint `args.model` on one device in this (short-lived) process; `emit` one JSON
    result (standard output)."""
    import sm120_fp4

    from . import devices, serving
    from .config import load_settings
    from .errors import CheckpointError, ConfigError, RefusedToServe
    from .sglang import model_check

    try:
        settings = load_settings(toggle=True)
        device = devices.get_device(args.device, settings.simulated_capability)
        status = sm120_fp4.install()
        if not status.installed:
            raise ConfigError(f"sm120_fp4 could not patch SGLang here: {status.message}")
        checked = model_check.check_model(args.model, device.torch_device)
    except (CheckpointError, ConfigError) as exc:
        emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    except RefusedToServe as exc:
        emit({"ok": False, "usage": False, "message": str(exc), "device": args.device})
        return EXIT_REFUSED
    decisions = [d.model_dump(mode="json") for d in serving.decisions() if d.device_index == args.device]
    emit({"ok": True, "checked": checked, "decisions": decisions})
    return EXIT_OK if all(d["verified"] for d in decisions) else EXIT_UNVERIFIED


def _settings_and_devices(args: argparse.Namespace):
    """(settings, the device indices to verify), or the exit code after saying why not."""
    from . import devices
    from .config import check_flashinfer_env, load_settings
    from .errors import ConfigError

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
    return settings, indices


# What `selftest --model DIR` needs to run on a machine without a 12.x GPU: a simulated device and the
# backends that run on a CPU (FlashInfer's and Humming's kernels need a real GPU, so the default chain refuses).
SIMULATE_ON_CPU = "SM120_FP4_SIMULATE=12.0 SM120_FP4_BACKENDS=emulated SM120_FP4_MOE_BACKENDS=emulated"


def cmd_selftest_model(args: argparse.Namespace) -> int:
    """``selftest --model DIR``: each distinct NVFP4 layer configuration of DIR, built and verified per GPU."""
    from . import checkpoints
    from .errors import CheckpointError, ConfigError

    if not os.path.isdir(args.model):
        _eprint(f"sm120-fp4 selftest: --model {args.model!r} is not a directory")
        return EXIT_USAGE
    try:  # the checkpoint's faults are named here, in one line, before any worker or kernel runs
        checkpoints.inspect(args.model)
    except (CheckpointError, ConfigError) as exc:
        _eprint(f"sm120-fp4 selftest: {exc}")
        return EXIT_USAGE
    found = _settings_and_devices(args)
    if isinstance(found, int):
        return found
    settings, indices = found
    if not indices:
        _eprint("sm120-fp4 selftest: no compute-capability 12.x GPU visible; nothing to verify "
                f"(to verify the checkpoint on this CPU, in simulation: {SIMULATE_ON_CPU})")
        return EXIT_OK
    engine = _unverified_engine()
    if engine is not None:  # the checkpoint's layers are built through SGLang's: nothing of it is patched to verify them
        return _refuse_engine("selftest", settings, engine) or _say_unverified_engine(engine, "nothing was verified")
    env = {**os.environ, "SM120_FP4": "1"}
    model = os.path.abspath(args.model)

    def run(index: int) -> dict:
        _eprint(f"[{'cpu (simulated)' if index < 0 else f'cuda:{index}'}] building and verifying {model}'s NVFP4 layers ...")
        return (_model_worker_runner or _run_model_worker)(index, model, env)

    with ThreadPoolExecutor(max_workers=len(indices)) as pool:
        results = dict(zip(indices, pool.map(run, indices)))
    if args.json:
        print(json.dumps({str(i): r for i, r in results.items()}, indent=2))
    else:
        from .tables import markdown_table

        rows = []
        for index, r in results.items():
            for d in r.get("decisions", []):
                rows += [(d["device"], d["family"], layer["config"], d["backend"], layer["passed"] and d["verified"],
                          len(layer["shapes"])) for layer in d["layers"]]
            if not r.get("ok") and not r.get("usage"):  # a usage error is no verdict: its message follows
                rows.append((index, "-", "-", "-", "REFUSED", r["message"].splitlines()[0]))
        print("\n".join(markdown_table(("device", "kernel", "layer configuration", "backend", "verified", "batch sizes"), rows)))
    for r in results.values():
        if not r.get("ok"):
            _eprint("\n" + r["message"])
    if any(r.get("usage") for r in results.values()):
        return EXIT_USAGE
    if any(not r.get("ok") for r in results.values()):
        return EXIT_REFUSED
    if any(not d["verified"] for r in results.values() for d in r["decisions"]):
        return EXIT_UNVERIFIED
    return EXIT_OK


def model_worker_argv(index: int, model: str) -> list[str]:
    """The arguments of one model-check worker (after ``python -m sm120_fp4``)."""
    return ["_model-worker", "--device", str(index), "--model", model]


def _run_model_worker(index: int, model: str, env: dict[str, str]) -> dict:
    """One model-check worker process: its result line, or why it gave none."""
    cmd = [sys.executable, "-m", "sm120_fp4", *model_worker_argv(index, model)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"ok": False, "usage": False, "message": f"model check worker (device {index}) {_died(proc.returncode)} "
                                                       f"before a result:\n{proc.stderr[-2000:]}"}


def _own_report() -> dict:
    """This worker's decisions and refusals, for the one report the preflight parent writes."""
    from . import serving

    return {"decisions": [d.model_dump(mode="json") for d in serving.decisions()],
            "refusals": [r.model_dump(mode="json") for r in serving.refusals()]}


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


# A worker that dies by one of these was stopped from outside (Ctrl-C, a service manager's SIGTERM to
# the whole group): an interruption, never a verdict on the candidate it was running.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Retry policy for a worker killed by SIGKILL (the kernel's out-of-memory killer, or kill -9): not a
# verdict either; the worker is re-run this many times with the same candidates, then the preflight
# stops (exit 2) without recording anything (docs/operations.md).
SIGKILL_RETRIES = 1


class _Stop:
    """The preflight's stop switch: SIGINT, SIGTERM or SIGHUP in the parent stops every worker (each
    runs in its own session, so a terminal's Ctrl-C reaches only the parent), and nothing is recorded
    for the candidates they were running. A second signal kills them at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._procs: set = set()
        self._lock = locks.lock()

    def add(self, proc) -> None:
        with self._lock:
            self._procs.add(proc)
            stopped = self.signal is not None
        if stopped:
            self._kill(proc, signal.SIGTERM)

    def discard(self, proc) -> None:
        with self._lock:
            self._procs.discard(proc)

    def __call__(self, signum, frame=None) -> None:
        with self._lock:
            first = self.signal is None
            self.signal = self.signal or signum
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc, signal.SIGTERM if first else signal.SIGKILL)

    @staticmethod
    def _kill(proc, signum) -> None:
        try:
            os.killpg(proc.pid, signum)  # the worker and anything it started (an nvcc JIT compile)
        except (ProcessLookupError, PermissionError):
            pass

    def handle_signals(self):
        """Install this switch for SIGINT/SIGTERM/SIGHUP (main thread only); returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]


def worker_argv(index: int, family: str, backend_args: list[str], crashed: dict[str, str], uuid: str | None) -> list[str]:
    """The arguments of one self-test worker (after ``python -m sm120_fp4``)."""
    argv = ["_selftest-worker", "--device", str(index), *backend_args]
    argv += ["--moe"] if family == "moe" else []
    argv += ["--uuid", uuid] if uuid else []
    return argv + [a for name, why in crashed.items() for a in ("--crashed", f"{name}={why}")]


WorkerRunner = Callable[..., "tuple[dict | None, dict | None, int, str]"]
_worker_runner: WorkerRunner | None = None


def use_worker_runner(runner: WorkerRunner | None) -> WorkerRunner | None:
    """Run the preflight's workers through `runner` (None: each its own short-lived process, the
    default); returns the previous one. The seam for tests of what the preflight makes of its
    workers' results (exit codes, the table, launch's gating): they run the worker in-process
    (tests/helpers/workers.py), and the crash, hang, signal and exec cases keep real processes.
    `runner(index, family, backend_args, crashed, label, env, stop, uuid)` returns what
    :func:`_run_worker` returns."""
    global _worker_runner
    previous, _worker_runner = _worker_runner, runner
    return previous


ModelWorkerRunner = Callable[[int, str, "dict[str, str]"], dict]
_model_worker_runner: ModelWorkerRunner | None = None


def use_model_worker_runner(runner: ModelWorkerRunner | None) -> ModelWorkerRunner | None:
    """Run ``selftest --model``'s workers through `runner` (None: each its own short-lived process,
    the default); returns the previous one. The same seam as :func:`use_worker_runner`, for the
    model check: `runner(index, model_dir, env)` returns the worker's result (what
    :func:`_run_model_worker` returns)."""
    global _model_worker_runner
    previous, _model_worker_runner = _model_worker_runner, runner
    return previous


class WorkerOutput:
    """What one worker's JSON lines say, read as they come: the result, the last candidate event
    (the one running when a worker dies), and a progress line on stderr for each event."""

    def __init__(self, label: str) -> None:
        self.label, self.result, self.event = label, None, None

    def feed(self, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            data = json.loads(line)
        except ValueError:
            return
        if "event" in data:
            self.event = data
            jit = " (the first FlashInfer use JIT-compiles kernels with nvcc: this can take minutes)" if data.get("flashinfer") else ""
            _eprint(f"[{self.label}] {data['event']} of {data['backend']}{jit} ...")
        else:
            self.result = data


def _run_worker(index: int, family: str, backend_args: list[str], crashed: dict[str, str], label: str,
                env: dict[str, str], stop: _Stop | None = None, uuid: str | None = None,
                heartbeat_s: float = 30.0) -> tuple[dict | None, dict | None, int, str]:
    """One worker run: (result, last candidate event, returncode, stderr tail)."""
    cmd = [sys.executable, "-m", "sm120_fp4", *worker_argv(index, family, backend_args, crashed, uuid)]
    lines: queue.Queue = queue.Queue()
    stop = stop or _Stop()
    output = WorkerOutput(label)
    with tempfile.TemporaryFile("w+") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                                               start_new_session=True) as proc:
        stop.add(proc)

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        start = time.perf_counter()
        while True:
            try:
                line = lines.get(timeout=heartbeat_s)
            except queue.Empty:  # a first FlashInfer call may be compiling kernels
                _eprint(f"[{label}] still running after {time.perf_counter() - start:.0f} s ...")
                continue
            if line is None:
                break
            output.feed(line)
        code = proc.wait()
        stop.discard(proc)
        err.seek(0)
        stderr = err.read()[-2000:]
    return output.result, output.event, code, stderr


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
        _store_failed(path, exc)


_told_stores: set[str] = set()


def _store_failed(path, exc: OSError) -> str:
    """Why the verdict store at `path` could not be written, said once per store and process."""
    why = f"the verdict store {path} cannot be written ({exc})"
    if str(path) not in _told_stores:
        _told_stores.add(str(path))
        _eprint(f"sm120-fp4: {why}")
    return why


def _interrupted(code: int, stop: _Stop) -> int | None:
    """The signal that interrupted a worker (the parent's, or one the worker died of), or None."""
    if stop.signal is not None:
        return stop.signal
    if code < 0 and -code in INTERRUPTS:
        return -code
    return None


def _preflight(index: int, family: str, backend_args: list[str], settings, env: dict[str, str],
               stop: _Stop | None = None, uuid: str | None = None) -> dict:
    """Self-test `family` on device `index` in short-lived worker processes: a candidate that kills
    its worker (a crash signal or exit code) is recorded as crashed (verdict file) and the worker
    re-runs without it. An interruption (SIGINT/SIGTERM/SIGHUP/SIGQUIT, or the parent stopping)
    records nothing and stops; SIGKILL (out of memory) records nothing and retries (SIGKILL_RETRIES)."""
    from . import verdicts

    stop = stop or _Stop()
    label = ("cpu (simulated)" if index < 0 else f"cuda:{index}") + ("" if family == "dense" else " moe")
    crashed: dict[str, str] = {}
    unrecorded: dict[str, str] = {}  # crashed candidates the verdict store does not hold: serving workers would load them
    killed: dict[str, int] = {}
    while True:
        if stop.signal is not None:
            return _stopped(label, stop.signal, None)
        result, event, code, stderr = (_worker_runner or _run_worker)(index, family, backend_args, crashed, label, env, stop, uuid)
        if result is not None:
            result["crashed"], result["unrecorded"] = dict(crashed), dict(unrecorded)
            _record(settings, family, result)
            return result
        interrupted = _interrupted(code, stop)
        if interrupted is not None:
            return _stopped(label, interrupted, event)
        if event is None or event["backend"] in crashed:
            return {"ok": False, "usage": True, "message": f"self-test worker ({label}) {_died(code)} outside any candidate:\n{stderr}"}
        name = event["backend"]
        if code == -signal.SIGKILL:
            killed[name] = killed.get(name, 0) + 1
            what = (f"[{label}] the self-test worker was killed by SIGKILL during the {event['event']} of {name} (the "
                    "out-of-memory killer, or kill -9): not a verdict on the kernel, nothing recorded")
            if killed[name] <= SIGKILL_RETRIES:
                _eprint(f"{what}; running it again")
                continue
            return {"ok": False, "usage": True, "killed": True,
                    "message": f"{what}; it happened {killed[name]} times, so the preflight stops here. Check the memory "
                               "(dmesg, the container's limit) and run it again"}
        why = f"the {event['event']} of {name} {_died(code)}"
        crashed[name] = why
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
    running = f" during the {event['event']} of {event['backend']}" if event else ""
    return {"ok": False, "usage": False, "interrupted": signal.Signals(signum).name, "signal": int(signum),
            "message": f"[{label}] interrupted by {signal.Signals(signum).name}{running}: stopped, nothing recorded for it"}


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
    from .tables import markdown_table

    rows = []
    for (family, index), result in results.items():
        if result.get("usage"):
            continue  # a usage error is not a verdict on the device: its message follows the table
        if result.get("ok"):
            d = result["decision"]
            mine = [r for r in d["reports"] if r["backend"] == d["backend"]]
            err = f"{mine[0]['max_rel_err']:.2e}" if mine and mine[0]["max_rel_err"] is not None else "-"
            shapes = f"{sum(s['passed'] for s in mine[0]['shapes'])}/{len(mine[0]['shapes'])}" if mine else "-"
            verified = "True" if d["verified"] else "UNVERIFIED"
            rows.append((family, d["device"], d["backend"], verified, err, shapes, f"{d['duration_s']:.2f}", d["reason"]))
        else:
            rows.append((family, index, "-", "REFUSED", "-", "-", "-", result["message"].splitlines()[0]))
    return markdown_table(("kernel", "device", "backend", "verified", "max rel error", "shapes", "time (s)", "note"), rows)


def cmd_selftest(args: argparse.Namespace, quiet: bool = False, families: Sequence[str] | None = None,
                 seen: list[tuple[str, dict]] | None = None) -> int:
    """``selftest``: each family on each device in short-lived workers; `seen` (launch) gets each job's (family, result)."""
    from . import deciding, devices, verdicts

    families = list(families or (["moe"] if getattr(args, "moe", False) else ["dense"]))
    found = _settings_and_devices(args)
    if isinstance(found, int):
        return found
    settings, indices = found
    if not indices:
        _eprint("sm120-fp4 selftest: no compute-capability 12.x GPU visible; nothing to verify (workers leave SGLang untouched)")
        return EXIT_OK
    engine = _unverified_engine()
    refused = _refuse_engine("selftest", settings, engine) if engine is not None else None
    if refused is not None:
        return refused
    uuids = {d.index: d.uuid for d in devices.list_devices(settings.simulated_capability) if d.uuid}
    store = verdicts.trouble(settings.verdicts_path)
    if store is not None:
        _eprint(f"sm120-fp4 selftest: {store}; verdicts are neither read nor recorded there (docs/operations.md, files)")
    backend_args = [a for name in (args.backend or []) for a in ("--backend", name)]
    # The workers write no report: this process writes one holding every worker's decisions.
    env = {k: v for k, v in os.environ.items() if k != "SM120_FP4_REPORT"}
    env["SM120_FP4"] = "1"
    jobs = [(family, index) for family in families for index in indices]
    for family, index in jobs:
        what = ", ".join(args.backend) if args.backend else f"the configured {deciding.FAMILIES[family].what} backends"
        _eprint(f"[{'cpu (simulated)' if index < 0 else f'cuda:{index}'}] self-testing {what} in a subprocess ...")
    start = time.perf_counter()
    stop = _Stop()
    restore = stop.handle_signals()
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # each its own short-lived process, all at once
            futures = {job: pool.submit(_preflight, job[1], job[0], backend_args, settings, env, stop, uuids.get(job[1]))
                       for job in jobs}
            results = {job: futures[job].result() for job in jobs}  # the table keeps device order
    finally:
        restore()
    if seen is not None:
        seen.extend((family, r) for (family, _), r in results.items())
    _eprint(f"sm120-fp4 selftest: done in {time.perf_counter() - start:.1f} s")
    _write_preflight_report(settings, results)
    interrupted = [r for r in results.values() if r.get("interrupted")]
    if stop.signal is not None or interrupted:
        signum = stop.signal or interrupted[0]["signal"]
        for r in interrupted:
            _eprint(r["message"])
        _eprint(f"sm120-fp4 selftest: interrupted by {signal.Signals(signum).name}: the self-test workers were stopped; "
                f"nothing was recorded for the candidates they were running (exit {128 + signum})")
        return 128 + signum
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
    if engine is not None:
        return _say_unverified_engine(engine, "the table verifies the kernels, not what SGLang will serve")
    if unverified:
        _eprint(f"sm120-fp4 selftest: {len(unverified)} decision(s) would serve UNVERIFIED (SM120_FP4_SELFTEST="
                f"{settings.selftest}): exit {EXIT_UNVERIFIED}")
        return EXIT_UNVERIFIED
    return EXIT_OK


def _unverified_engine() -> tuple[str, str] | None:
    """(what it means, what makes it verified) when the installed SGLang is a release this library cannot patch."""
    from .sglang import unverified_release

    return unverified_release()


def _refuse_engine(command: str, settings, engine: tuple[str, str]) -> int | None:
    """Under SM120_FP4_SELFTEST=strict, unless the operator opted out (SM120_FP4_UNSUPPORTED_RELEASE=
    serve-unverified): refuse to start, saying what it means and how to proceed (exit 2, an environment
    to change, not a verdict on a kernel). None: not refused."""
    if settings.selftest != "strict" or settings.unsupported_release != "refuse":
        return None
    from .sglang import OPT_OUT_SAYS

    means, remedy = engine
    _eprint(f"sm120-fp4 {command}: refusing to start: {means}.\nTo proceed: {remedy}; or {OPT_OUT_SAYS}.")
    return EXIT_USAGE


def _say_unverified_engine(engine: tuple[str, str], what: str) -> int:
    """The engine outside the supported range, not refused: say so; the exit is 'unverified' (3),
    since nothing of what SGLang serves was verified."""
    means, remedy = engine
    _eprint(f"sm120-fp4 selftest: {means}; {what}: exit {EXIT_UNVERIFIED}.\nTo verify them: {remedy}.")
    return EXIT_UNVERIFIED


def _write_preflight_report(settings, results: dict[tuple[str, int], dict]) -> None:
    """SM120_FP4_REPORT: one report of the whole preflight (every worker's decisions and refusals,
    and each job's outcome), merged into the file the serving processes write to after it."""
    if settings.report is None:
        return
    from . import report

    section: dict = {"decisions": [], "refusals": [], "preflight": []}
    for (family, index), r in results.items():
        own = r.get("report") or {}
        section["decisions"] += own.get("decisions", [])
        section["refusals"] += own.get("refusals", [])
        outcome = ("interrupted" if r.get("interrupted") else "error" if r.get("usage") else "refused" if not r.get("ok")
                   else "passed" if r["decision"]["verified"] else "unverified")
        section["preflight"].append({"family": family, "device": index, "outcome": outcome, "crashed": r.get("crashed", {}),
                                     "message": None if r.get("ok") else r.get("message")})
    try:
        written = report.write(settings.report, section, settings.report_is_dir, role="preflight")
        _eprint(f"sm120-fp4 selftest: report written to {written}")
    except OSError as exc:
        _eprint(f"sm120-fp4: could not write the report to {settings.report}: {exc}")


# ---- launch --------------------------------------------------------------------------------

def cmd_launch(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        _eprint("sm120-fp4 launch: give the command to run after --, e.g. "
                "sm120-fp4 launch -- python -m sglang.launch_server --model-path ...")
        return EXIT_USAGE
    problem = _command_problem(command[0])
    if problem is not None:  # said now, not after minutes of preflight
        _eprint(f"sm120-fp4 launch: {problem}; not running the preflight")
        return EXIT_USAGE
    os.environ["SM120_FP4"] = "1"
    problem = _canary_problem()
    if problem is not None:  # refused now, not in every scheduler after the preflight
        _eprint(f"sm120-fp4 launch: {problem}; not starting the server")
        return EXIT_USAGE
    found = _settings_and_devices(argparse.Namespace(device=None))
    if isinstance(found, int):
        return found
    settings, indices = found
    engine = _unverified_engine() if indices else None
    if engine is not None:  # nothing of this library runs in that server: no preflight would mean anything
        return _launch_unverified_engine(command, settings, engine, args.allow_unverified)
    # Both families: the server may load NVFP4 MoE layers as well as linear ones.
    seen: list[tuple[str, dict]] = []
    code = cmd_selftest(argparse.Namespace(device=None, backend=None, json=False, moe=False), families=("dense", "moe"),
                        seen=seen)
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
    return _exec(command)


def _exec(command: list[str]) -> int:
    if COREDUMP_WAIT_VAR not in os.environ:
        # SGLang 0.5.x sleeps this long (default 60 s) for CUDA coredumps before it kills its process tree
        # when a scheduler fails -- a canary's exit among them -- while the port stays open: shortened here.
        os.environ[COREDUMP_WAIT_VAR] = LAUNCH_COREDUMP_WAIT_S
    _eprint(f"sm120-fp4 launch: exec {' '.join(command)} with SM120_FP4=1 and {COREDUMP_WAIT_VAR}={os.environ[COREDUMP_WAIT_VAR]}")
    try:
        os.execvpe(command[0], command, os.environ)
    except OSError as exc:
        _eprint(f"sm120-fp4 launch: cannot run {command[0]!r}: {exc}")
        return EXIT_USAGE
    return EXIT_OK  # pragma: no cover - exec does not return


COREDUMP_WAIT_VAR = "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS"
LAUNCH_COREDUMP_WAIT_S = "0"  # what launch sets unless the operator did (docs/operations.md)


def _command_problem(name: str) -> str | None:
    """Why `name` cannot be executed as the launched command (not found on PATH, not an executable file), or None."""
    import shutil

    if shutil.which(name) is not None:
        return None
    if os.sep in name:
        what = "does not exist" if not os.path.exists(name) else "is not an executable file"
        return f"the command {name!r} {what}"
    return f"the command {name!r} is not found on PATH ({os.environ.get('PATH', '')!r}) as an executable file"


def _unrecorded_crashes(seen: list[tuple[str, dict]]) -> str | None:
    """Why the server must not start: candidates that crashed the preflight and that the verdict
    store does not hold (the server's workers read only the store, so they would load them and
    crash), or None."""
    from .deciding import FAMILIES

    lost: dict[str, dict[str, str]] = {}
    for family, result in seen:
        for name, why in (result.get("unrecorded") or {}).items():
            lost.setdefault(family, {})[name] = why
    if not lost:
        return None
    names = "; ".join(f"{FAMILIES[f].what} {', '.join(sorted(n))}" for f, n in lost.items())
    why = next(iter(next(iter(lost.values())).values()))
    leave_out = " or ".join(f"{FAMILIES[f].backends_var} without {', '.join(sorted(n))}" for f, n in lost.items())
    return (f"candidate(s) crashed the preflight and are not recorded ({names}): {why}. The server's workers would "
            f"load them and crash; make the verdict store writable (SM120_FP4_VERDICTS, a file in a writable directory), "
            f"or leave them out ({leave_out})")


def _launch_unverified_engine(command: list[str], settings, engine: tuple[str, str], allow_unverified: bool) -> int:
    """launch with an SGLang this library cannot patch: refused under strict (unless opted out); else
    started only when the operator said so (the opt-out setting, or --allow-unverified), never silently."""
    from .sglang import OPT_OUT, OPT_OUT_SAYS

    refused = _refuse_engine("launch", settings, engine)
    if refused is not None:
        _eprint("sm120-fp4 launch: not starting the server")
        return refused
    means, remedy = engine
    if settings.unsupported_release == "serve-unverified" or allow_unverified:
        why = OPT_OUT if settings.unsupported_release == "serve-unverified" else "--allow-unverified"
        _eprint(f"sm120-fp4 launch: {means}.\nStarting the server anyway ({why} was given): no preflight ran, and nothing "
                f"of what it serves is verified. To verify it: {remedy}.")
        return _exec(command)
    _eprint(f"sm120-fp4 launch: {means}; not starting the server (exit {EXIT_UNVERIFIED}).\nTo proceed: {remedy}; or "
            f"{OPT_OUT_SAYS} (or pass --allow-unverified).")
    return EXIT_UNVERIFIED


def _canary_problem() -> str | None:
    """Why the serving canary the settings ask for cannot run with this SGLang (a bad setting is
    the preflight's to report)."""
    from .canary import settings_problem
    from .config import load_settings
    from .errors import ConfigError
    from .sglang import idle_point_problem, release_support

    try:
        settings = load_settings(toggle=True)
    except ConfigError:
        return None
    return settings_problem(settings) or (idle_point_problem(settings) if release_support()[0] else None)


# ---- entry point ---------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(prog="sm120-fp4", description="Verified NVFP4 GEMM for SGLang on SM120/SM121 GPUs.")
    parser.add_argument("--version", action="version", version=f"sm120-fp4 {__version__}")
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
    selftest.add_argument("--model", metavar="DIR",
                          help="verify this local NVFP4 checkpoint's own layers (ModelOpt or compressed-tensors), no server")
    launch = sub.add_parser("launch", help="preflight (dense and MoE), then exec COMMAND with SM120_FP4=1")
    launch.add_argument("--allow-unverified", action="store_true",
                        help="start COMMAND even when a decision would serve unverified (SM120_FP4_SELFTEST=warn/off)")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    demo = sub.add_parser("demo", help="SGLang's real FP4 linear layer, patched and self-tested on a simulated SM120 (CPU)")
    demo.add_argument("--server", action="store_true",
                      help="a real SGLang server on this CPU (simulation): an answer, then a broken kernel refused")
    demo.add_argument("--model-path", help="with --server: serve this local NVFP4 checkpoint once instead")
    demo.add_argument("server_args", nargs=argparse.REMAINDER, help="with --server: after --, arguments for SGLang")
    patches = sub.add_parser("patches", help="the same fix as upstream-ready diffs: check the installed SGLang, or apply")
    patches.add_argument("action", choices=["check", "apply"])
    patches.add_argument("--dry-run", action="store_true", help="apply: show whether the diff applies, change nothing")
    patches.add_argument("--target", help="apply: a site-packages, unpacked wheel or SGLang source tree (default: installed)")
    bench = sub.add_parser("bench", help="verify, then time, each candidate backend and bf16 at the served shapes and batch sizes")
    bench.add_argument("--model", metavar="DIR", help="the layer configurations of this local NVFP4 checkpoint (default: one dense, one MoE)")
    bench.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    bench.add_argument("--plot", metavar="PNG", help="also plot TFLOP/s against M per backend into PNG (needs matplotlib)")
    bench.add_argument("--device", type=int, help="CUDA ordinal (default: the first 12.x GPU)")
    bench.add_argument("--backend", action="append", help="candidate backend (repeatable); default: the configured candidates")
    bench.add_argument("--sizes", type=int, nargs="+", metavar="M", help="batch sizes (default: 1..256 by powers of two, 512..8192)")
    bench.add_argument("--allow-any-gpu", action="store_true", help="measure a GPU that is not compute-capability 12.x")
    worker = sub.add_parser("_selftest-worker")
    worker.add_argument("--device", type=int, required=True)
    worker.add_argument("--backend", action="append")
    worker.add_argument("--moe", action="store_true")
    worker.add_argument("--crashed", action="append", help="NAME=REASON: a candidate that crashed an earlier worker")
    model_worker = sub.add_parser("_model-worker")
    model_worker.add_argument("--device", type=int, required=True)
    model_worker.add_argument("--model", required=True)
    worker.add_argument("--uuid", help="the UUID of the GPU the parent numbered --device (checked against CUDA's numbering)")
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
        if args.model:
            if args.moe or args.backend:
                _eprint("sm120-fp4 selftest: --model verifies the checkpoint with the configured backends "
                        "(SM120_FP4_BACKENDS, SM120_FP4_MOE_BACKENDS); --moe and --backend do not apply")
                return EXIT_USAGE
            return cmd_selftest_model(args)
        return cmd_selftest(args)
    if args.cmd == "bench":
        from .bench import main as bench

        return bench(args)
    if args.cmd == "_model-worker":
        return _worker_exit(_model_worker(args))
    if args.cmd == "launch":
        return cmd_launch(args)
    if args.cmd == "patches":
        from .upstream import main as patches

        return patches(args.action, dry_run=args.dry_run, target=args.target)
    if args.cmd == "demo":
        if args.server or args.model_path or args.server_args:
            if not args.server:
                _eprint("sm120-fp4 demo: --model-path and SGLang arguments go with --server")
                return EXIT_USAGE
            from .demo.server import main as server_demo

            return server_demo(args.model_path, args.server_args)
        from .demo import main as demo

        return demo()
    return _worker_exit(_worker(args))


def _worker_exit(code: int) -> int:
    """The worker's exit code, kept: a call that outlived its bound may still be running and would
    abort the interpreter's shutdown (verify.calls_still_running), so the worker, always its own
    short-lived process, then ends at once, after its result line is flushed."""
    from . import verify

    if verify.calls_still_running():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
