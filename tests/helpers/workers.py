"""The preflight's self-test workers run in this process (cli.use_worker_runner), for the tests of
what the preflight makes of their results: exit codes, the table, launch's gating; and so do
``selftest --model``'s workers (the same seam).

The worker is the real one (``cli._worker``, the same arguments a worker process gets, the
environment the parent gives it), one at a time, on the preflight's own thread; its JSON lines are
collected instead of printed. Crashes, hangs, signals and exec keep real processes (test_cli's
background jobs): a worker in this process cannot show them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import sm120_fp4
from sm120_fp4 import cli, devices, serving

_one_at_a_time = threading.Lock()  # a worker process is alone in its process; here, one after the other


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """os.environ as the parent gives it to the worker: only the variables that differ are set or
    removed (SM120_FP4=1, no SM120_FP4_REPORT), and put back after; never an emptied environment
    another thread could see (background jobs copy the session's environment, helpers.procs)."""
    changed = {k: os.environ.get(k) for k in set(env) | set(os.environ) if os.environ.get(k) != env.get(k)}
    for k in changed:
        if k in env:
            os.environ[k] = env[k]
        else:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in changed.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _as_a_worker_process(env: dict[str, str]):
    """One worker at a time, in the environment its parent gives it, starting as a worker process
    does: nothing decided (its report is its own), no device cached."""
    with _one_at_a_time, _environment(env):
        serving.STATE.reset()
        devices.clear_cache()
        yield


@contextlib.contextmanager
def _runner(use, runner):
    """`use(runner)` for the block (the cli seam use_worker_runner), then the previous one."""
    previous = use(runner)
    try:
        yield
    finally:
        use(previous)


def in_process(
    argv: list[str], label: str, env: dict[str, str], stop=None
) -> tuple[dict | None, dict | None, int, str]:
    """A cli WorkerRunner: (result, last candidate event, exit code, stderr tail) of one worker, self-test or model
    check. A model-check worker installs the library (a worker process then exits); here it is uninstalled after,
    unless it was installed before."""
    args = cli._parser().parse_args(argv)
    worker = cli._model_worker if argv[0] == "_model-worker" else cli._worker
    output = cli.WorkerOutput(label)  # what the preflight makes of a worker process's lines
    with _as_a_worker_process(env):
        installed = sm120_fp4.status().installed
        try:
            code = worker(args, emit=lambda payload: output.feed(json.dumps(payload)))
        finally:
            if not installed and sm120_fp4.status().installed:
                sm120_fp4.uninstall()
    assert output.result is not None, f"the worker {argv} gave no result"
    return output.result, output.event, code, ""


def workers_in_process():
    """Every preflight and ``selftest --model`` of the block runs its workers in this process."""
    return _runner(cli.use_worker_runner, in_process)


model_workers_in_process = workers_in_process  # the same seam runs ``selftest --model``'s workers
