"""The preflight's self-test workers run in this process (cli.use_worker_runner), for the tests of
what the preflight makes of their results: exit codes, the table, launch's gating; and so do
``selftest --model``'s workers (cli.use_model_worker_runner).

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
    """`use(runner)` for the block (a cli seam: use_worker_runner, use_model_worker_runner), then the previous one."""
    previous = use(runner)
    try:
        yield
    finally:
        use(previous)


def in_process(
    index: int,
    family: str,
    backend_args: list[str],
    crashed: dict[str, str],
    label: str,
    env: dict[str, str],
    stop=None,
    uuid: str | None = None,
) -> tuple[dict | None, dict | None, int, str]:
    """A cli WorkerRunner: (result, last candidate event, exit code, stderr tail) of one worker."""
    args = cli._parser().parse_args(cli.worker_argv(index, family, backend_args, crashed, uuid))
    output = cli.WorkerOutput(label)  # what the preflight makes of a worker process's lines
    with _as_a_worker_process(env):
        code = cli._worker(args, emit=lambda payload: output.feed(json.dumps(payload)))
    return output.result, output.event, code, ""


def workers_in_process():
    """Every preflight of the block runs its workers in this process."""
    return _runner(cli.use_worker_runner, in_process)


def model_in_process(index: int, model: str, env: dict[str, str]) -> dict:
    """A cli ModelWorkerRunner: the result of one model-check worker. The worker installs the library
    (a worker process then exits); here it is uninstalled after, unless it was installed before."""
    args = cli._parser().parse_args(cli.model_worker_argv(index, model))
    results: list[dict] = []
    with _as_a_worker_process(env):
        installed = sm120_fp4.status().installed
        try:
            cli._model_worker(args, emit=results.append)
        finally:
            if not installed and sm120_fp4.status().installed:
                sm120_fp4.uninstall()
    assert results, "the model-check worker gave no result"
    return results[-1]


def model_workers_in_process():
    """Every ``selftest --model`` of the block runs its workers in this process."""
    return _runner(cli.use_model_worker_runner, model_in_process)
