"""The workers (``_selftest-worker``, ``_model-worker``): their arguments, running and stopping them."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from .. import locks
from .common import EXIT_OK, EXIT_REFUSED, EXIT_UNVERIFIED, EXIT_USAGE, _emit, _eprint


def _worker(args: argparse.Namespace, emit: Callable[[dict], None] = _emit) -> int:
    """Run decide() for one device and family here; `emit` one JSON event per candidate, then the result."""
    from .. import deciding, serving, verdicts
    from ..config import check_flashinfer_env, load_settings
    from ..errors import ConfigError, RefusedToServe

    family = "moe" if args.moe else "dense"
    key: dict = {}
    try:
        settings = load_settings(toggle=True)  # the preflight verifies what workers would run with the toggle on
        check_flashinfer_env()
        device = _worker_device(args, settings)
        key = verdicts.device_key(device)
        for item in args.crashed or []:
            name, _, why = item.partition("=")
            serving.STATE.crashes[(family, name)] = why  # this process was told: skipped with or without a file
        if args.backend:
            deciding.candidate_names(settings, args.backend, deciding.FAMILIES[family], device, source="--backend")
        decision = _decide_announcing(args, settings, device, family, key, emit)
    except (ConfigError, LookupError) as exc:
        emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    except RefusedToServe as exc:
        reports = [r.model_dump(mode="json") for r in getattr(exc, "reports", [])]
        refused = {"device": args.device, "key": key, "rejected": getattr(exc, "rejected", {}), "reports": reports}
        emit({"ok": False, "usage": False, "message": str(exc), **refused, "report": _own_report()})
        return EXIT_REFUSED
    emit({"ok": True, "decision": decision.model_dump(mode="json"), "key": key, "report": _own_report()})
    return EXIT_OK if decision.verified else EXIT_UNVERIFIED


def _worker_device(args: argparse.Namespace, settings):
    """Return the worker's device, or raise LookupError where CUDA numbers it as another GPU than the parent's."""
    from .. import devices

    # This process is about to use CUDA: CUDA itself says which GPU the ordinal is.
    device = devices.get_device(args.device, settings.simulated_capability, init_cuda=True)
    if args.uuid and device.uuid is not None and not devices.same_uuid(device.uuid, args.uuid):
        raise LookupError(
            f"cuda:{args.device} is GPU {device.uuid} ({device.name!r}) in this self-test worker, but the "
            f"preflight numbered GPU {args.uuid} cuda:{args.device}: CUDA's numbering differs between the two "
            f"processes; not self-testing a GPU other than the one named ({devices.PCI_ORDER_FIX})"
        )
    return device


def _decide_announcing(args: argparse.Namespace, settings, device, family: str, key: dict, emit: Callable):
    """Return serving.decide()'s decision, emitting an event right before each candidate runs (self-test, timing)."""
    from .. import backends, deciding, serving

    kind = backends.get_moe if family == "moe" else backends.get

    def announce(event, fam, dev, name):
        flashinfer = kind(name).kind == "flashinfer"
        emit({"event": event, "family": fam, "backend": name, "flashinfer": flashinfer, "key": key})

    deciding.candidate_hook = announce
    try:
        return serving.decide(device, args.backend or None, settings=settings, family=family)
    finally:
        deciding.candidate_hook = None


def _where_am_i() -> dict:
    """Return this worker's pid and its ranks in the engine's parallel groups (the table's columns)."""
    from ..api import rank

    return {"pid": os.getpid(), "rank": rank()}


def _model_worker(args: argparse.Namespace, emit: Callable[[dict], None] = _emit) -> int:
    """Verify the checkpoint `args.model` on one device here; `emit` one JSON result."""
    import sm120_fp4

    from .. import devices, serving
    from ..config import load_settings
    from ..errors import CheckpointError, ConfigError, RefusedToServe

    model_check = importlib.import_module(f"sm120_fp4.{args.engine}.model_check")
    try:
        settings = load_settings(toggle=True)
        device = devices.get_device(args.device, settings.simulated_capability)
        status = sm120_fp4.install()
        if not status.installed:
            raise ConfigError(f"sm120_fp4 could not patch {args.engine} here: {status.message}")
        checked = model_check.check_model(args.model, device.torch_device)
    except (CheckpointError, ConfigError) as exc:
        emit({"ok": False, "usage": True, "message": str(exc)})
        return EXIT_USAGE
    except RefusedToServe as exc:
        emit({"ok": False, "usage": False, "message": str(exc), "device": args.device, **_where_am_i()})
        return EXIT_REFUSED
    decisions = [d.model_dump(mode="json") for d in serving.decisions() if d.device_index == args.device]
    emit({"ok": True, "checked": checked, "decisions": decisions, **_where_am_i()})
    return EXIT_OK if all(d["verified"] for d in decisions) else EXIT_UNVERIFIED


def _own_report() -> dict:
    """Return this worker's decisions and refusals, for the report the preflight parent writes."""
    from .. import serving

    return {name: section() for name, section in serving.report_sections().items()}


def _worker_exit(code: int) -> int:
    """Return the worker's exit code, or end at once where a call outlived its bound (it would abort shutdown)."""
    from .. import verify

    if verify.calls_still_running():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def model_worker_argv(index: int, model: str, engine: str = "sglang") -> list[str]:
    """Return the arguments of one model-check worker (after ``python -m sm120_fp4``)."""
    return ["_model-worker", "--device", str(index), "--model", model, "--engine", engine]


def worker_argv(index: int, family: str, backend_args: list[str], crashed: dict, uuid: str | None) -> list[str]:
    """Return the arguments of one self-test worker (after ``python -m sm120_fp4``)."""
    argv = ["_selftest-worker", "--device", str(index), *backend_args]
    argv += ["--moe"] if family == "moe" else []
    argv += ["--uuid", uuid] if uuid else []
    return argv + [a for name, why in crashed.items() for a in ("--crashed", f"{name}={why}")]


def _died(code: int) -> str:
    from ..errors import EXIT_HUNG

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


class _Stop:
    """The preflight's stop switch: a signal in the parent stops every worker; a second kills them."""

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


class WorkerOutput:
    """What one worker's JSON lines say, read as they come: the result and the last candidate event."""

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
            jit = " (the first FlashInfer use JIT-compiles kernels with nvcc: this can take minutes)"
            jit = jit if data.get("flashinfer") else ""
            _eprint(f"[{self.label}] {data['event']} of {data['backend']}{jit} ...")
        else:
            self.result = data


def _run_worker(argv: list[str], label: str, env: dict, stop: _Stop):
    """Run one worker process (`argv` after ``python -m sm120_fp4``, :func:`worker_argv` or :func:`model_worker_argv`);
    return (result, last candidate event, returncode, stderr tail)."""
    cmd = [sys.executable, "-m", "sm120_fp4", *argv]
    lines: queue.Queue = queue.Queue()
    output = WorkerOutput(label)
    with (
        tempfile.TemporaryFile("w+") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True) as proc,
    ):
        stop.add(proc)

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        start = time.perf_counter()
        while True:
            try:
                line = lines.get(timeout=30.0)  # a line every 30 s while the worker says nothing
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
