"""Shared fixtures: a fixed seed, clean library state, the devices to run tensor tests on, the
reliability case properties, the test tiers (helpers.tiers: the `subprocess` and `server` marks) and
the background subprocess jobs (helpers.procs.background)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Bytecode caches (the test modules' rewritten asserts, this package's and the helpers' modules) even where
# PYTHONDONTWRITEBYTECODE is set: without them every run and every child process compiled them again, a third
# of the inner loop's collection on 2 cores. They go in __pycache__ folders, which git ignores.
sys.dont_write_bytecode = False  # before the imports below (ruff's E402 is off for them in pyproject.toml)
# The same for every process the tests start (helpers.procs reads the environment when imported): the set-up
# compiles no bytecode at install (scripts/pip_or_uv.sh), so the first process to import a module writes its bytecode.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import torch
from helpers.cases import fields
from helpers.procs import JOBS as _JOBS
from helpers.procs import TIMEOUT, JobPool, Queued
from helpers.tiers import Guard, tiers

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# One intra-op thread: the tests run thousands of small tensor ops, which two threads (on two shared
# cores) make several times slower, and one thread makes every float reduction order the same.
torch.set_num_threads(1)

# The SGLang test files import SGLang's modules on a CPU. SGLang 0.5.8-0.5.10.post1 bring a CUDA-only
# kernel package (sgl_kernel) that cannot load here and import it on the way to the FP4 module
# (every one scripts/sglang_matrix.py ran, docs/RELEASES.md): the simulation's stand-in covers it for the session, as install(simulate=...)
# does for a process. Inert where no such package is installed (the pinned 0.5.23) or CUDA exists.
_KERNEL_STAND_IN = None
if not torch.cuda.is_available():
    from sm120_fp4.sglang import simulation as _simulation

    _KERNEL_STAND_IN = _simulation.kernel_package_stand_in()


def pytest_unconfigure(config):
    if _KERNEL_STAND_IN is not None:
        _KERNEL_STAND_IN()


@pytest.fixture(autouse=True)
def _seed():
    random.seed(1234)
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _prefill_chunk(request, monkeypatch):
    """Where no SGLang settings are visible, the layer checks run the prefill sizes up to SGLang's
    chunk on 90-160 GB GPUs (8192: hooks.DEFAULT_CHUNKED_PREFILL); on the CPU the sizes 4096-8192 were
    a quarter of the in-process tests' time. So the in-process tests run as on an SM120 GPU under
    20 GB (an RTX 5080), where SGLang 0.5.23 picks a chunk of 2048: every power-of-two bucket up to 2048
    still runs (serving.policy). The tests of the larger sizes and of the 8192 default are marked `default_prefill`; the
    real-server tests run SGLang's own choice, in processes of their own."""
    if request.node.get_closest_marker("default_prefill") is None:
        from sm120_fp4.sglang import hooks  # ours: imports no SGLang module

        monkeypatch.setattr(hooks, "DEFAULT_CHUNKED_PREFILL", 2048)
    yield


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each tensor test runs on the CPU, and on CUDA where a GPU is present (the H200 run)."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _clean_library_state(monkeypatch):
    """No SM120_FP4* variable leaks in from the shell; decisions and device caches start empty."""
    for name in list(os.environ):
        if name.startswith("SM120_FP4"):
            monkeypatch.delenv(name)
    from sm120_fp4 import backends, devices, errors, serving, versions

    registered, registered_moe = set(backends.names()), set(backends.moe_names())
    serving.STATE.reset()
    devices.clear_cache()
    versions.clear_cache()  # a test's stand-in for importlib.metadata.version is asked afresh
    errors._said.clear()  # each test sees the library's once-per-process warnings as a fresh process would
    yield
    for name in set(backends.names()) - registered:
        backends.unregister(name)
    for name in set(backends.moe_names()) - registered_moe:
        backends.unregister_moe(name)
    serving.STATE.reset()
    devices.clear_cache()
    versions.clear_cache()


@pytest.fixture(autouse=True)
def _no_call_outlives_its_test(request):
    """No checked call is still running past its bound when its test ends (checked calls run on the
    calling thread; one held past its bound and grace ends the process, which no test may cause)."""
    yield
    from sm120_fp4 import verify

    left = verify.calls_still_running()
    assert not left, f"{left} checked call(s) still running past their bound after {request.node.nodeid}"


@pytest.fixture
def sglang_unpatched():
    """SGLang unpatched before and after the test, and its runner enum as SGLang left it."""
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant")
    import importlib

    import sm120_fp4

    try:  # the runner enum exists from 0.5.8
        fp4_utils = importlib.import_module("sglang.srt.layers.quantization.fp4_utils")
    except ImportError:
        fp4_utils = None
    enum_before = getattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", None)
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    yield
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    if fp4_utils is not None:
        fp4_utils.FP4_GEMM_RUNNER_BACKEND = enum_before


# ---- reliability cases: @case(...) -> JUnit properties (scripts/reliability_table.py) ----------


@pytest.fixture(autouse=True)
def _tier_marks_are_complete(request, monkeypatch):
    """A test not marked `subprocess` that starts a process anyway (through a library call the marks
    cannot see) fails, naming the mark to add: the inner loop (-m "not slow and not subprocess")
    stays free of process starts."""
    if request.node.get_closest_marker("subprocess") is not None:
        yield
        return
    guard = Guard()
    guard.install(monkeypatch)
    yield
    if guard.started:
        pytest.fail(
            f"{request.node.nodeid} started a process ({', '.join(sorted(set(guard.started)))}) "
            "without the mark: add @pytest.mark.subprocess (@pytest.mark.server if it is a real server)"
        )


@pytest.fixture(autouse=True)
def _record_case(request):
    described = getattr(request.function, "reliability_case", None)
    if described is not None:
        params = getattr(getattr(request.node, "callspec", None), "params", {})
        request.node.user_properties += list(zip(("area", "case", "expected"), fields(described, params)))
    yield


# ---- background subprocess jobs: every selected one starts right after collection ------------

_FOLDER: list[Path] = []


def _job(item):
    """The item's background job start function (@background), or None."""
    return getattr(getattr(item, "function", None), "background_job", None)


def _shared(item) -> bool:
    """Whether the item's background job is one run that every test with the same start function reads."""
    return bool(getattr(getattr(item, "function", None), "background_shared", False))


def _heavy(item) -> int:
    """How heavy the item's background job is: 0 (not heavy), or about how many real-server starts."""
    return int(getattr(getattr(item, "function", None), "background_heavy", False))


@pytest.hookimpl(tryfirst=True)  # the tier marks are in place before `-m` deselects by them
def pytest_collection_modifyitems(session, config, items):
    """Each test gets the tier marks of what it uses (helpers.tiers). The in-process tests run first,
    while every background job runs; then the tests of background jobs, those of heavy jobs (real
    servers) last. (A test of a job that is still running waits for
    it: early in the session the main thread waited minutes so, and then ran alone on one core of
    two for the last minutes.) Where SGLang is not installed (the GPU machine's run of
    scripts/gpu_check.sh), the tests marked `sglang` are skipped saying so, rather than failing on
    the import."""
    for item in items:
        for name in sorted(tiers(item)):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
    items.sort(key=lambda item: (_job(item) is not None, _heavy(item) > 0))  # stable: the order is otherwise unchanged
    if importlib.util.find_spec("sglang") is None:
        skip = pytest.mark.skip(reason="needs the real SGLang release, not installed here")
        for item in items:
            if item.get_closest_marker("sglang") is not None:
                item.add_marker(skip)


_POOL = JobPool(limit=max(2, os.cpu_count() or 2), nice=5)
# Real servers (minutes of CPU each, in several processes): two at a time, from the start, beside the
# other jobs; waiting for those first left one core idle for the last several minutes of the session.
# They run niced: they use what the main thread's in-process tests leave, and those ran last alone
# (the session's critical path) when the servers took their share of its core.
_HEAVY = JobPool(limit=2, timeout=None, nice=5)
# Under pytest-xdist (`-n auto`: the inner loop, docs/development.md) each worker collects every test and runs
# its share: a background job then runs inside its own test, on that worker, with its pool's bound.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_finish(session):
    if session.config.option.collectonly or _XDIST_WORKER:
        return
    root = Path(tempfile.mkdtemp(prefix="sm120-fp4-jobs-"))
    _FOLDER.append(root)
    # Heavy jobs start the longest first (a job of two server starts before one of one), then in order.
    heavy_first = sorted(enumerate(session.items), key=lambda pair: -int(_heavy(pair[1])))
    shared = {}  # start function -> its one job (@background(..., shared=True))
    for n, item in heavy_first:
        start = _job(item)
        if start is not None and _shared(item) and start in shared:
            _JOBS[item.nodeid] = shared[start]
        elif start is not None:
            folder = root / str(n)
            folder.mkdir()
            params = getattr(getattr(item, "callspec", None), "params", {})
            _JOBS[item.nodeid] = (_HEAVY if _heavy(item) else _POOL).add(functools.partial(start, folder, **params))
            _JOBS[item.nodeid].folder = folder
            if _shared(item):
                shared[start] = _JOBS[item.nodeid]
    _POOL.run()
    _HEAVY.run()


def pytest_sessionfinish(session):
    if os.environ.get("JOB_TIMES"):  # where each background job ran, for tuning the pools (JOB_TIMES=path.json)
        t0 = min((j.started_at for j in _JOBS.values() if j.started_at is not None), default=0.0)
        Path(os.environ["JOB_TIMES"]).write_text(
            json.dumps(
                [
                    [
                        node,
                        None if j.started_at is None else j.started_at - t0,
                        None if j.ended_at is None else j.ended_at - t0,
                        getattr(j.job, "cpu_s", None),
                    ]
                    for node, j in _JOBS.items()
                ],
                indent=1,
            )
        )
    _POOL.stop()
    _HEAVY.stop()
    for job in _JOBS.values():
        job.kill()
    _JOBS.clear()
    for root in _FOLDER:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def background(request) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of this test's background job (started at session start; under xdist, now)."""
    job = _JOBS.get(request.node.nodeid)
    if job is None and _XDIST_WORKER and _shared(request.node):  # a shared job this worker already ran
        job = next((j for j in _JOBS.values() if getattr(j, "start_function", None) is _job(request.node)), None)
        if job is not None:
            _JOBS[request.node.nodeid] = job
    if job is None and _XDIST_WORKER and _job(request.node) is not None:
        folder = Path(tempfile.mkdtemp(prefix="sm120-fp4-job-"))
        _FOLDER.append(folder)
        params = getattr(getattr(request.node, "callspec", None), "params", {})
        start = functools.partial(_job(request.node), folder, **params)
        job = _JOBS[request.node.nodeid] = Queued(start, (_HEAVY if _heavy(request.node) else _POOL).timeout)
        job.folder, job.start_function = folder, _job(request.node)
        job.start_and_finish()
    assert job is not None, f"{request.node.nodeid} has no @background job (or it was not selected)"
    return job.wait(TIMEOUT)


@pytest.fixture
def background_job(request, background):
    """This test's background job itself, once it ended: its folder and its start and end times."""
    return _JOBS[request.node.nodeid]
