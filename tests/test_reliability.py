"""Reliability (#8): bad input, faults and concurrency, tried on purpose.

Every test carries a ``@case(area, case, expected)`` that ``scripts/reliability_table.py`` turns into
the table in RELIABILITY.md (from a real pytest run's JUnit XML). Heavy subprocesses (a spawned
scheduler, SGLang imports with a corrupted package or without FlashInfer) start together when the
module starts and run while the in-process tests do; their tests only collect the results.

Dispatch input checks (issue item 2) and the self-test timeout (item 3, hangs) are tested elsewhere.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings as hsettings, strategies as st

import faults
from threads import run_concurrently
import reliability_child
import sm120_fp4
from sm120_fp4 import backends, bootstrap, devices, kernels, nvfp4, selection, selftest
from sm120_fp4.sglang import layers, plugin, release
from sm120_fp4.sglang import targets as sglang_targets
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.config import Settings
from sm120_fp4.devices import Device
from sm120_fp4.errors import ConfigError, InvalidArgument

mq = pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)")
fp4_utils = pytest.importorskip("sglang.srt.layers.quantization.fp4_utils")
import flashinfer  # noqa: E402  (installed with SGLang's pin)

from sm120_fp4 import demo  # noqa: E402

SIM = dict(simulate="12.0", backends="emulated")
SIM_ENV = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated"}
HYPOTHESIS = dict(derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TIMEOUT = 240


# ---- the case table ----------------------------------------------------------------------

def case(area: str, what: str, expected: str):
    """Describe a test for RELIABILITY.md; `{name}` fields are filled from the test's parameters."""

    def mark(fn):
        fn.reliability_case = (area, what, expected)
        return fn

    return mark


def _plain(value: object) -> str:
    """A parameter as the table shows it: bare when that is unambiguous, else its repr."""
    if isinstance(value, str) and value and value == value.strip() and value.isprintable():
        return value
    return repr(value) if not callable(value) else value.__name__


@pytest.fixture(autouse=True)
def _record_case(request):
    described = getattr(request.function, "reliability_case", None)
    assert described is not None, f"{request.node.name} has no @case(...) for RELIABILITY.md"
    params = {k: _plain(v) for k, v in getattr(getattr(request.node, "callspec", None), "params", {}).items()}
    for key, text in zip(("area", "case", "expected"), described):
        request.node.user_properties.append((key, text.format(**params) if params else text))
    yield


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched (see conftest.sglang_unpatched)."""


def assert_not_patched():
    assert mq.flashinfer_fp4_gemm is flashinfer.mm_fp4
    assert not hasattr(mq.ModelOptFp4LinearMethod.process_weights_after_loading, "__sm120_fp4_patch__")


def assert_patched_once():
    alias = mq.flashinfer_fp4_gemm
    assert alias.__sm120_fp4_patch__ == "flashinfer-fp4-gemm-alias" and alias.__wrapped__ is flashinfer.mm_fp4
    hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    assert hook.__sm120_fp4_patch__ == "modelopt-fp4-weights-hook"
    assert not hasattr(hook.__wrapped__, "__sm120_fp4_patch__")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SM120_FP4")}
    # One thread each: the subprocesses overlap with each other and the tests (2 CPUs in CI).
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)
    return env


def ours(text: str) -> list[str]:
    """The lines this library wrote (every message of ours starts with 'sm120_fp4')."""
    return [line for line in text.splitlines() if line.startswith("sm120_fp4")]


# ---- background subprocesses (started together, collected by their tests) ---------------

class _Job:
    def __init__(self, start):
        self._start, self._proc, self._result = start, None, None

    def begin(self):
        self._proc = self._start()

    def result(self) -> tuple[int, str, str]:
        if self._result is None:
            self._result = self._proc.wait(TIMEOUT)
        return self._result

    def stop(self):
        if self._proc is not None:
            self._proc.kill()


class _Popen:
    """A subprocess whose output goes to files (no pipe to fill up while nobody reads it)."""

    def __init__(self, args, env, cwd, folder: Path):
        self.out, self.err = folder / "stdout", folder / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=err)

    def wait(self, timeout):
        rc = self.proc.wait(timeout)
        return rc, self.out.read_text(), self.err.read_text()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Spawned:
    """A `spawn` child started the way SGLang starts its schedulers, its stderr in a file."""

    def __init__(self, env, folder: Path):
        self.err = folder / "stderr"
        ctx = multiprocessing.get_context("spawn")
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)  # the child inherits the environment at start()
        try:
            self.proc = ctx.Process(target=reliability_child.scheduler_with_broken_backend, args=(str(self.err),))
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def wait(self, timeout):
        self.proc.join(timeout)
        return self.proc.exitcode, "", self.err.read_text() if self.err.exists() else ""

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _broken_copy(root: Path, corrupt: str) -> Path:
    """A copy of the package with one module truncated mid-file (a half-written install)."""
    shutil.copytree(Path(sm120_fp4.__file__).parent, root / "sm120_fp4", ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "sm120_fp4" / corrupt
    target.write_text(target.read_text()[:300])
    return root


def _fake_sglang(root: Path) -> Path:
    """An empty `sglang` package: the bootstrap hooks the import of any `sglang` (cheap to import)."""
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    return root


MISSING_FLASHINFER = """
import json, sys
sys.modules["flashinfer"] = None  # import flashinfer -> ImportError, as when it is not installed
import sm120_fp4
installed = sm120_fp4.install(simulate="12.0", backends="emulated").installed
import sglang.srt.layers.quantization.modelopt_quant as mq
from sm120_fp4.sglang import layers
layers.build_modelopt_layer(layers.make_checkpoint(32, 64))
status = sm120_fp4.status()
print(json.dumps({"installed": installed, "sglang_has_mm_fp4": mq.enable_flashinfer_fp4_gemm,
                  "patches": {p.name: [p.state, p.reason] for p in status.patches},
                  "decision": status.decisions[0].backend}))
"""

_JOBS: dict[str, _Job] = {}


def _jobs(folder: Path) -> dict[str, _Job]:
    def folder_for(name):
        path = folder / name
        path.mkdir()
        return path

    return {
        "test_strict_worker_with_a_broken_backend_refuses_to_serve_with_a_nonzero_exit": _Job(lambda: _Spawned(
            clean_env(SM120_FP4="1", SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="zeros", SM120_FP4_SELFTEST="strict"),
            folder_for("spawn"))),
        "test_a_corrupted_package_leaves_sglang_importing_with_one_line_on_stderr": _Job(lambda: _Popen(
            [sys.executable, "-c", "import json, sglang, sm120_fp4; print(json.dumps([sglang.__file__, sm120_fp4.__file__]))"],
            clean_env(SM120_FP4="1", PYTHONPATH=os.pathsep.join([str(_broken_copy(folder_for("broken"), "api.py")), str(_fake_sglang(folder_for("sglang")))]), **SIM_ENV),
            folder / "broken", folder_for("broken-run"))),
        "test_missing_flashinfer_leaves_sglang_importing_unpatched_with_one_warning": _Job(lambda: _Popen(
            [sys.executable, "-c", MISSING_FLASHINFER], clean_env(), folder, folder_for("no-flashinfer"))),
        "test_a_bad_setting_stops_a_bootstrapped_worker_at_the_sglang_import": _Job(lambda: _Popen(
            [sys.executable, "-c", "import sglang"],
            clean_env(SM120_FP4="1", SM120_FP4_SELFTEST="bogus", PYTHONPATH=str(_fake_sglang(folder_for("fake-sglang")))),
            folder / "fake-sglang", folder_for("fake-sglang-run"))),
    }


@pytest.fixture(scope="module", autouse=True)
def _background(request, tmp_path_factory):
    """Start the heavy subprocesses of the selected tests at once (they overlap on the CPUs)."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items if item.module is sys.modules[__name__]}
    jobs = {name: job for name, job in _jobs(tmp_path_factory.mktemp("reliability")).items() if name in selected}
    for job in jobs.values():
        job.begin()
    _JOBS.update(jobs)
    yield
    for job in jobs.values():
        job.stop()
    _JOBS.clear()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm120_fp4", *args], capture_output=True, text=True, env=clean_env(**env), timeout=TIMEOUT)


def run_python(code: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(**env), cwd=cwd, timeout=TIMEOUT)


# ---- 1. configuration --------------------------------------------------------------------

# (variable, garbage value, a piece of what is accepted that the error must show)
ENV_GARBAGE = [
    ("SM120_FP4", "yes", "1, on, 0, off"),
    ("SM120_FP4", "ON", "1, on, 0, off"),
    ("SM120_FP4", "", "1, on, 0, off"),
    ("SM120_FP4_ENABLE", "On", "'auto', 'on' or 'off'"),
    ("SM120_FP4_ENABLE", " on", "'auto', 'on' or 'off'"),
    ("SM120_FP4_ENABLE", "", "'auto', 'on' or 'off'"),
    ("SM120_FP4_SELFTEST", "STRICT", "'strict', 'warn' or 'off'"),
    ("SM120_FP4_SELFTEST", "1", "'strict', 'warn' or 'off'"),
    ("SM120_FP4_FALLBACK", "cutlass", "'none' or 'emulated'"),
    ("SM120_FP4_SELECT", "fast", "'first' or 'fastest'"),
    ("SM120_FP4_BACKENDS", "", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "Cutlass", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "cutlass,,b12x", "lower-case backend names"),
    ("SM120_FP4_BACKENDS", "cutlass,cutlass", "each backend named once"),
    ("SM120_FP4_BACKENDS", "cutlas", "known: cutlass"),
    ("SM120_FP4_SIMULATE", "12", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "twelve", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "12.0.1", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "12.0\n", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "0.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "100.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "-12.0", "MAJOR.MINOR"),
    ("SM120_FP4_SIMULATE", "", "MAJOR.MINOR"),
    ("SM120_FP4_REPORT", "", "a file or directory path"),
    ("SM120_FP4_REPORT", "/nonexistent-sm120/report.json", "existing, writable directory"),
    ("SM120_FP4_SELFTES", "strict", "did you mean SM120_FP4_SELFTEST"),
    ("sm120_fp4_selftest", "off", "did you mean SM120_FP4_SELFTEST"),
    ("Sm120_Fp4", "1", "did you mean SM120_FP4"),
]


def _shown(value: str) -> str:
    return repr(value)


@case("configuration", "env {variable}={value} at install()", "ConfigError naming the variable, the value and what is accepted; nothing patched")
@pytest.mark.parametrize("variable, value, accepted", ENV_GARBAGE, ids=[f"{v}={x!r}" for v, x, _ in ENV_GARBAGE])
def test_garbage_in_an_environment_variable_is_an_error_at_install(monkeypatch, variable, value, accepted):
    monkeypatch.setenv(variable, value)
    if variable != "SM120_FP4_SIMULATE":
        for name, setting in SIM_ENV.items():
            if name != variable:
                monkeypatch.setenv(name, setting)
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install()
    message = str(err.value)
    assert variable in message and _shown(value) in message and accepted in message, message
    assert not sm120_fp4.status().installed
    assert_not_patched()


KEYWORD_GARBAGE = [
    ("simulate", 12.0, "MAJOR.MINOR"),
    ("simulate", 12, "MAJOR.MINOR"),
    ("backends", [], "comma-separated list"),
    ("backends", ("emulated", 3), "lower-case backend names"),
    ("selftest", None, "'strict', 'warn' or 'off'"),
    ("enable", True, "'auto', 'on' or 'off'"),
    ("toggle", "true", "1, on, 0, off"),
    ("report", "  ", "a file or directory path"),
    ("selftes", "strict", "did you mean 'selftest'"),
]


@case("configuration", "keyword install({keyword}={value})", "ConfigError naming the keyword, the value and what is accepted")
@pytest.mark.parametrize("keyword, value, accepted", KEYWORD_GARBAGE, ids=[f"{k}={v!r}" for k, v, _ in KEYWORD_GARBAGE])
def test_garbage_in_a_keyword_is_an_error_at_install(keyword, value, accepted):
    with pytest.raises(ConfigError) as err:
        sm120_fp4.install(**{**SIM, keyword: value})
    message = str(err.value)
    assert keyword in message and accepted in message, message
    if keyword != "selftes":
        assert f"keyword {keyword}={value!r}" in message, message
    assert_not_patched()


CLI_GARBAGE = [
    ("SM120_FP4", "true"),
    ("SM120_FP4_ENABLE", "yes"),
    ("SM120_FP4_SELFTEST", "Strict"),
    ("SM120_FP4_FALLBACK", "emulate"),
    ("SM120_FP4_SELECT", "FIRST"),
    ("SM120_FP4_BACKENDS", "cutlass;b12x"),
    ("SM120_FP4_SIMULATE", "12.0.1"),
    ("SM120_FP4_REPORT", "/nonexistent-sm120/{pid}.json"),
    ("SM120_FP4_SELFTESTS", "off"),
]


@case("configuration", "`sm120-fp4 selftest` with {variable}={value}", "exit code 2 at start, before any self-test; stderr names the variable and the value")
@pytest.mark.parametrize("variable, value", CLI_GARBAGE, ids=[f"{v}={x}" for v, x in CLI_GARBAGE])
def test_garbage_settings_stop_the_cli_at_start_with_exit_2(variable, value):
    proc = run_cli("selftest", env={**SIM_ENV, variable: value})
    assert proc.returncode == 2, proc.stderr
    assert f"{variable}={value!r}" in proc.stderr, proc.stderr
    assert "self-testing" not in proc.stderr and proc.stdout == ""


@case("configuration", "SM120_FP4={value} (not 1/on/0/off) in a new interpreter that imports SGLang", "an error naming SM120_FP4 and the value, not a silently unpatched worker")
@pytest.mark.parametrize("value", ["true", "yes", "ON"])
def test_a_garbage_toggle_in_a_worker_is_not_silently_ignored(tmp_path, value):
    proc = run_python("import sglang", {"SM120_FP4": value, "PYTHONPATH": str(_fake_sglang(tmp_path))}, cwd=tmp_path)
    assert f"SM120_FP4={value!r}" in proc.stderr, proc.stderr


# ---- 3. faults in a backend --------------------------------------------------------------

FAULTS = [
    ("raises", faults.raises, (1, 32, 64), r"raised TypeError: Expected DLTensor\* but got None"),
    ("returns zeros", faults.returns_zeros, (7, 32, 64), "output is all zeros"),
    ("writes one NaN", faults.single_nan, (7, 32, 64), r"1 non-finite element\(s\), first at row 3, column 16"),
    ("zeroes rows 64-127 (partial rows)", faults.zeroes_row_band, (129, 32, 64), r"64 row\(s\) all zero where the reference is not \(rows 64-127\)"),
    ("is off by 4x (wrong scale)", faults.scale_error_4x, (7, 32, 64), r"norm is 4x the reference's .* a scale error"),
    ("is wrong only at large M", faults.wrong_for_large_m, (1001, 8, 32), r"M=1001 .*norm is 0.04x"),
    ("leaves out unwritten", faults.leaves_out_unwritten, (7, 32, 64), "output left unwritten"),
    ("returns another tensor", faults.returns_new_tensor, (7, 32, 64), "other than `out`"),
]


@case("backend faults", "self-test of a backend that {fault}", "self-test fails and its reason names the fault")
@pytest.mark.parametrize("fault, fn, shape, reason", FAULTS, ids=[f[0] for f in FAULTS])
def test_the_selftest_names_each_fault(fault, fn, shape, reason):
    backends.register("faulty", fn)
    report = selftest.run("faulty", devices.get_device(-1, (12, 0)), shapes=[shape])
    assert not report.passed and re.search(reason, report.reason), report.reason
    assert json.loads(report.model_dump_json())["reason"] == report.reason


def _raises_at_m5(a, b, a_sf, b_sf, alpha, dtype, out):
    if a.shape[0] == 5:  # a shape the self-test never tries: the fault shows only at serve time
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


@case("backend faults", "verified backend raises at serve time (M=5, outside the self-test shapes)", "the original exception reaches SGLang's caller unchanged; no output, never zeros")
def test_a_serve_time_exception_propagates_and_is_never_turned_into_zeros():
    backends.register("flaky", _raises_at_m5)
    sm120_fp4.install(simulate="12.0", backends="flaky")
    ckpt = layers.make_checkpoint(32, 64)
    method, layer = layers.build_modelopt_layer(ckpt)
    x = (torch.randn(4, 64) * 2).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x), layers.reference_output(ckpt, x))  # M=4 serves
    with pytest.raises(RuntimeError, match="illegal memory access") as err:
        method.apply(layer, torch.randn(5, 64).to(torch.bfloat16))
    frames = [f.name for f in err.traceback]
    assert "_raises_at_m5" in frames and "flashinfer_fp4_gemm" in frames, "the backend's own frame, through our dispatch"


@case("backend faults", "serve-time exception from the decided backend", "the exception carries context: which sm120_fp4 backend on which device raised")
def test_a_serve_time_exception_names_the_backend_and_device():
    backends.register("flaky", _raises_at_m5)
    sm120_fp4.install(simulate="12.0", backends="flaky", selftest="off")  # the serve-time path is under test
    method, layer = layers.build_modelopt_layer(layers.make_checkpoint(32, 64))
    with pytest.raises(RuntimeError) as err:
        method.apply(layer, torch.randn(5, 64).to(torch.bfloat16))
    context = str(err.value) + "\n".join(getattr(err.value, "__notes__", []))
    assert "flaky" in context and "sm120_fp4" in context


# ---- 4. the library's own failures never break the host ----------------------------------

@case("own failures", "a post-import hook raises inside the patch engine (alias check)", "install() returns; the alias is left as SGLang's; ledger says 'internal error'; one warning line; layers still load")
def test_an_exception_inside_a_post_import_hook_leaves_that_target_unpatched(monkeypatch, caplog):
    def boom(original):
        raise RuntimeError("boom in a hook")

    monkeypatch.setattr(sglang_targets, "is_mm_fp4", boom)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    status = sm120_fp4.install(**SIM)  # modelopt_quant is imported already: its hooks run now
    assert mq.flashinfer_fp4_gemm is flashinfer.mm_fp4
    entry = {p.name: p for p in status.patches}["flashinfer-fp4-gemm-alias"]
    assert entry.state == "skipped" and entry.reason == "internal error: RuntimeError: boom in a hook"
    lines = [r.getMessage() for r in caplog.records if "flashinfer-fp4-gemm-alias" in r.getMessage()]
    assert lines == ["sm120_fp4: patch flashinfer-fp4-gemm-alias failed, SGLang left unpatched there: boom in a hook"]
    layers.build_modelopt_layer(layers.make_checkpoint(32, 64))  # SGLang's load path still runs


@case("own failures", "package with a truncated bootstrap.py, SM120_FP4=1, new interpreter", "the interpreter starts and runs; stderr says the bootstrap failed and why; no import hook left behind")
def test_a_corrupted_bootstrap_never_raises_at_interpreter_start(tmp_path):
    root = _broken_copy(tmp_path, "bootstrap.py")
    proc = run_python("import sys; print([type(f).__name__ for f in sys.meta_path]); print('ran')", {"SM120_FP4": "1", "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.endswith("ran\n"), proc.stderr
    assert "_AfterSGLangImport" not in proc.stdout
    lines = ours(proc.stderr)
    assert lines and all(line.startswith("sm120_fp4: start-up bootstrap failed, SGLang runs unpatched: SyntaxError") for line in lines), proc.stderr


@case("own failures", "the `.pth` bootstrap fails to import the package (truncated bootstrap.py, SM120_FP4=1)", "exactly one stderr line per interpreter, although site-packages .pth files may be processed twice")
def test_a_failing_bootstrap_reports_once_per_interpreter(tmp_path):
    root = _broken_copy(tmp_path, "bootstrap.py")
    proc = run_python("pass", {"SM120_FP4": "1", "PYTHONPATH": str(root)}, cwd=tmp_path)
    assert len(ours(proc.stderr)) == 1, proc.stderr


@case("own failures", "partially installed package (the .pth present; only __init__, _version, errors copied), SM120_FP4=1", "the interpreter starts and runs; stderr says the bootstrap failed and why")
def test_a_partially_installed_package_never_raises_at_interpreter_start(tmp_path):
    package = tmp_path / "sm120_fp4"
    package.mkdir()  # an install interrupted after the first files: no bootstrap.py, api.py, ...
    for name in ("__init__.py", "_version.py", "errors.py"):
        shutil.copy(Path(sm120_fp4.__file__).parent / name, package / name)
    proc = run_python("print('ran')", {"SM120_FP4": "1", "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "ran\n"
    lines = ours(proc.stderr)
    assert lines and all("ModuleNotFoundError" in line and "sm120_fp4.bootstrap" in line for line in lines), proc.stderr


@case("own failures", "FlashInfer not importable, FlashInfer backend asked about on a (mocked) CUDA 12.0 GPU", "not supported, with the reason 'flashinfer X does not import: ModuleNotFoundError ...'; no exception")
def test_missing_flashinfer_makes_flashinfer_backends_unsupported_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    kernels._mm_fp4.cache_clear()
    try:
        for name in backends.FLASHINFER_BACKENDS:
            ok, reason = backends.is_supported(name, Device(0, "mocked RTX PRO 6000", (12, 0)))
            assert not ok and re.search(r"does not import: (ModuleNotFound|Import)Error", reason), reason
    finally:
        kernels._mm_fp4.cache_clear()


@pytest.mark.parametrize("version, message", [
    (None, "sglang is not installed"),
    ("not-a-version", "'not-a-version' is not a version this library can read"),
    ("0.5.24rc1", "outside the supported range"),
])
@case("own failures", "SGLang version {version}", "install() changes nothing and says why in its status message, without raising")
def test_a_missing_or_unreadable_sglang_version_is_left_untouched(monkeypatch, version, message):
    monkeypatch.setattr(release, "sglang_version", lambda: version)
    status = sm120_fp4.install(**SIM)
    assert not status.installed and message in status.message
    assert_not_patched()


@case("own failures", "plugin entry point with SM120_FP4=1 when SGLang's metadata is missing", "plugin.load() returns without raising; nothing patched")
def test_the_plugin_entry_point_never_raises_without_sglang(monkeypatch):
    monkeypatch.setenv("SM120_FP4", "1")
    for name, value in SIM_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(release, "sglang_version", lambda: None)
    plugin.load()
    assert not sm120_fp4.status().installed
    assert_not_patched()


@case("own failures", "`.pth` bootstrap with SM120_FP4 {value}", "nothing imported: no torch, no pydantic, no sm120_fp4; nothing on stderr")
@pytest.mark.parametrize("value", ["unset", "0", "off", "empty"])
def test_the_pth_bootstrap_imports_nothing_when_the_toggle_is_off(value):
    env = {} if value == "unset" else {"SM120_FP4": "" if value == "empty" else value}
    site = [p for p in sys.path if p.endswith("site-packages") and Path(p, "sm120_fp4.pth").exists()]
    assert site, "the .pth is installed in this environment's site-packages"
    proc = run_python(
        "import sys; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'sm120_fp4'))))".replace("json.dumps", "__import__('json').dumps"),
        env,
    )
    assert proc.returncode == 0 and json.loads(proc.stdout) == [] and proc.stderr == "", proc.stderr


@case("own failures", "`bootstrap.activate()` twice, with SGLang already imported", "install() once; the second call is a no-op; never raises")
def test_bootstrap_activate_is_idempotent_and_never_raises(monkeypatch):
    for name, value in {"SM120_FP4": "1", **SIM_ENV}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(bootstrap, "_activated", False)
    bootstrap.activate()
    bootstrap.activate()
    assert sm120_fp4.status().installed
    assert_patched_once()


# ---- 5. concurrency ----------------------------------------------------------------------

@case("concurrency", "8 threads x 15 seeded random install/uninstall/status calls", "no exception; afterwards patched exactly once or not at all, matching status(); uninstall restores every original")
def test_install_uninstall_status_from_many_threads_stay_consistent():
    original_hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    barrier, errors = threading.Barrier(8), []

    def worker(seed):
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(15):
            try:
                op = rng.choice(("install", "uninstall", "status"))
                result = sm120_fp4.install(**SIM) if op == "install" else getattr(sm120_fp4, op)()
                json.loads(result.model_dump_json())
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

    run_concurrently(worker, [(seed,) for seed in range(8)])
    assert errors == []
    if sm120_fp4.status().installed:
        assert_patched_once()
        sm120_fp4.uninstall()
    assert_not_patched()
    assert mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"] is original_hook
    assert not any(k.startswith("SM120_FP4") for k in os.environ), "the exported environment is restored"


class _CpuGpu(Device):
    """A mocked CUDA ordinal whose tensors live on the CPU (several 'GPUs' without a GPU)."""

    @property
    def torch_device(self):
        return torch.device("cpu")


@case("concurrency", "decide() for 3 devices from 12 threads at once", "one self-test per device, one Decision per device shared by all its callers, none lost")
def test_decide_for_several_devices_at_once_tests_each_device_once():
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def counted_support(device):
        with lock:
            calls[device.index] = calls.get(device.index, 0) + 1
        return True, None

    backends.register("counted", emulated_mm_fp4, counted_support)
    gpus = [_CpuGpu(i, f"mocked GPU {i}", (12, 0)) for i in range(3)]
    barrier, results, errors = threading.Barrier(12), {}, []
    settings = Settings(backends="counted")

    def worker(n):
        barrier.wait()
        try:
            results[n] = selection.decide(gpus[n % 3], settings=settings)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    run_concurrently(worker, [(n,) for n in range(12)])
    assert errors == []
    assert calls == {0: 1, 1: 1, 2: 1}
    for index in range(3):
        mine = {id(results[n]) for n in range(12) if n % 3 == index}
        assert len(mine) == 1 and results[index].device_index == index and results[index].verified
    assert sorted(d.device_index for d in selection.decisions()) == [0, 1, 2]


# ---- 6. properties of the format and of the self-test metrics ----------------------------

E2M1_MAGNITUDES = sorted(set(abs(v) for v in nvfp4.E2M1_VALUES))


@case("properties", "E2M1 encode over all finite float32 incl. ties, +-6, +-inf, subnormals, -0", "decode(encode(x)) is the nearest E2M1 value of clamp(x, -6, 6), ties to the even code, sign kept")
@hsettings(max_examples=150, **HYPOTHESIS)
@given(st.lists(st.one_of(
    st.floats(width=32, allow_nan=False),
    st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 448.0, -0.0, 1e-45, float("inf"), -float("inf")]),
), min_size=1, max_size=64))
def test_e2m1_encoding_is_round_to_nearest_even_and_saturating(values):
    x = torch.tensor(values, dtype=torch.float32)
    codes = nvfp4.encode_e2m1(x)
    got = nvfp4.decode_e2m1(codes)
    for value, code, decoded in zip(values, codes.tolist(), got.tolist()):
        target = min(abs(value), 6.0)
        best = min(abs(m - target) for m in E2M1_MAGNITUDES)
        assert abs(abs(decoded) - target) == best
        ties = [i for i, m in enumerate(E2M1_MAGNITUDES) if abs(m - target) == best]
        if len(ties) == 2:
            assert (code & 7) % 2 == 0, (value, code)
        assert decoded == 0 or (decoded < 0) == (value < 0)


@case("properties", "nibble pack/unpack and 128x4 scale swizzle over shapes 1..300 rows and E4M3 extreme bytes", "exact round trips; padding is zero")
@hsettings(max_examples=60, **HYPOTHESIS)
@given(rows=st.integers(1, 300), blocks=st.integers(1, 24), seed=st.integers(0, 2**16),
       extremes=st.sampled_from([None, 0x00, 0x01, 0x7E, 0x80, 0xFE]))
def test_packing_and_swizzling_round_trip(rows, blocks, seed, extremes):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, blocks * 16), dtype=torch.uint8, generator=gen)
    assert torch.equal(nvfp4.unpack_nibbles(nvfp4.pack_nibbles(codes)), codes)
    raw = torch.randint(0, 256, (rows, blocks), dtype=torch.uint8, generator=gen)
    if extremes is not None:
        raw[::2] = extremes
    sf = raw.view(torch.float8_e4m3fn)
    swizzled = nvfp4.swizzle_scales(sf)
    assert tuple(swizzled.shape) == nvfp4.swizzled_scale_shape(rows, blocks * 16)
    assert torch.equal(nvfp4.unswizzle_scales(swizzled, rows, blocks * 16).view(torch.uint8), raw)
    assert int(swizzled.view(torch.uint8).sum()) == int(raw.sum(dtype=torch.int64))  # padding adds nothing


@case("properties", "quantize/dequantize over shapes, magnitudes 2^-30..2^30, all-zero blocks, global scale x2^-20..x2^20", "scales finite and <= 448 (never the NaN byte), all-zero blocks exact zeros, error <= one E2M1 step of the block scale")
@hsettings(max_examples=80, **HYPOTHESIS)
@given(m=st.integers(1, 40), blocks=st.integers(1, 8), seed=st.integers(0, 2**16), exponent=st.integers(-30, 30),
       zero_fraction=st.sampled_from([0.0, 0.3, 1.0]), gsf_shift=st.sampled_from([0, -20, -8, 8, 20]))
def test_quantize_is_bounded_for_any_magnitude_and_zero_blocks(m, blocks, seed, exponent, zero_fraction, gsf_shift):
    gen = torch.Generator().manual_seed(seed)
    k = blocks * 16
    x = torch.randn(m, k, generator=gen) * 2.0**exponent
    zero = torch.rand(m, blocks, generator=gen) < zero_fraction
    x = (x.view(m, blocks, 16) * ~zero.unsqueeze(-1)).view(m, k)
    if not bool(x.any()):
        with pytest.raises(InvalidArgument, match="not all zero"):
            nvfp4.global_scale(x)
        gsf = torch.tensor(1.0)
    else:
        gsf = nvfp4.global_scale(x) * 2.0**gsf_shift
    packed, swizzled = nvfp4.quantize(x, gsf)
    sf_bytes = nvfp4.unswizzle_scales(swizzled, m, k).view(torch.uint8)
    assert not bool(((sf_bytes & 0x7F) == 0x7F).any()), "no NaN scale"
    sf = sf_bytes.view(torch.float8_e4m3fn).float()
    assert bool((sf <= 448).all())
    deq = nvfp4.dequantize(packed, swizzled, gsf)
    assert bool(torch.isfinite(deq).all())
    assert bool((deq.view(m, blocks, 16)[zero] == 0).all()) and bool((sf[zero] == 0).all())
    # Within range, the error is at most one E2M1 step (2 at the top, of a scale rounded to E4M3)
    # plus what the scale's own rounding (relative 2^-4, or 2^-10 absolute below E4M3 normals) moves.
    amax = x.view(m, blocks, 16).abs().amax(-1)
    wanted = (gsf * amax / 6).clamp(max=448)
    step = (sf / gsf).unsqueeze(-1)
    slack = (amax.unsqueeze(-1) * ((gsf * amax / 6) > 448).unsqueeze(-1)) + 6 * 2.0**-10 / gsf + 6 * (wanted - sf).abs().unsqueeze(-1) / gsf
    err = (deq.view(m, blocks, 16) - x.view(m, blocks, 16)).abs()
    assert bool((err <= step + slack + 1e-30).all())


@case("properties", "reference GEMM with all-zero A, all-zero scales, zero rows, and alpha scaling", "exact zeros where the input is zero; alpha scales the float32 result exactly")
@hsettings(max_examples=30, **HYPOTHESIS)
@given(m=st.integers(1, 140), n8=st.integers(1, 6), k32=st.integers(1, 4), seed=st.integers(0, 2**16),
       alpha=st.sampled_from([1.0, 2.0**-20, 3.0, 2.0**20]))
def test_reference_gemm_of_zero_inputs_is_exactly_zero(m, n8, k32, seed, alpha):
    gen = torch.Generator().manual_seed(seed)
    n, k = 8 * n8, 32 * k32
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    zero_rows = torch.rand(m, generator=gen) < 0.3
    x[zero_rows] = 0
    qw, sw = nvfp4.quantize(w, nvfp4.global_scale(w))
    qx, sx = nvfp4.quantize(x, torch.tensor(1.0))
    one, scaled = torch.ones(1), torch.full((1,), alpha)
    out = nvfp4.reference_mm_fp4(qx, qw.T, sx, sw.T, one, torch.float32)
    assert bool((out[zero_rows] == 0).all())
    assert torch.equal(nvfp4.reference_mm_fp4(qx, qw.T, sx, sw.T, scaled, torch.float32), out * alpha)
    zeros_a = torch.zeros_like(qx)
    assert bool((nvfp4.reference_mm_fp4(zeros_a, qw.T, sx, sw.T, one, torch.float32) == 0).all())
    zero_scales = torch.zeros_like(sx)
    assert bool((nvfp4.reference_mm_fp4(qx, qw.T, zero_scales, sw.T, one, torch.bfloat16) == 0).all())


@case("properties", "global_scale of a tensor whose amax is a float32 subnormal (1e-37)", "a finite scale or an InvalidArgument naming x, never inf")
def test_global_scale_is_never_infinite():
    try:
        gsf = nvfp4.global_scale(torch.full((1, 16), 1e-37))
    except InvalidArgument:
        return
    assert bool(torch.isfinite(gsf))


def _scaled_by(factor):
    def scaled(a, b, a_sf, b_sf, alpha, dtype, out):
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha * factor, dtype, out)

    return scaled


SMALL_SHAPES = [(1, 32, 64), (7, 96, 160), (129, 16, 32), (33, 40, 96)]


@case("properties", "self-test of a backend off by a factor c in 0.5..2 over shapes", "norm_ratio == c and rel_err == |c-1| (to bf16 rounding); passes only when |c-1| <= 1%")
@hsettings(max_examples=25, **HYPOTHESIS)
@given(factor=st.floats(0.5, 2.0), shape=st.sampled_from(SMALL_SHAPES))
def test_selftest_metrics_measure_a_scale_error(factor, shape):
    assume(not 0.005 < abs(factor - 1) < 0.02)  # away from the acceptance bound, where bf16 rounding decides
    backends.register("scaled", _scaled_by(factor), replace=True)
    result = selftest.run("scaled", devices.get_device(-1, (12, 0)), shapes=[shape]).shapes[0]
    assert result.norm_ratio == pytest.approx(factor, rel=1e-2)
    assert result.rel_err == pytest.approx(abs(factor - 1), abs=5e-3)
    assert result.nonfinite == 0 and result.zero_rows == 0
    assert result.passed == (abs(factor - 1) <= 0.005)


@case("properties", "self-test of a backend that zeroes a chosen set of rows, or puts NaN at a chosen element", "zero_rows counts exactly those rows; the NaN's position is reported")
@hsettings(max_examples=25, **HYPOTHESIS)
@given(data=st.data(), shape=st.sampled_from(SMALL_SHAPES))
def test_selftest_metrics_locate_zero_rows_and_nans(data, shape):
    m, n, _ = shape
    rows = sorted(data.draw(st.sets(st.integers(0, m - 1), min_size=1, max_size=m)))
    nan_at = (data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, n - 1)))

    def zeroes(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        out[rows] = 0
        return out

    def nan(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        out[nan_at] = float("nan")
        return out

    device = devices.get_device(-1, (12, 0))
    backends.register("zero-rows", zeroes, replace=True)
    backends.register("nan-at", nan, replace=True)
    zeroed = selftest.run("zero-rows", device, shapes=[shape]).shapes[0]
    assert not zeroed.passed
    if len(rows) == m:
        assert zeroed.reason == "output is all zeros" and zeroed.zero_rows == m
    else:
        assert zeroed.zero_rows == len(rows) and zeroed.reason.startswith(f"{len(rows)} row(s) all zero"), zeroed.reason
    nanned = selftest.run("nan-at", device, shapes=[shape]).shapes[0]
    assert nanned.nonfinite == 1 and f"first at row {nan_at[0]}, column {nan_at[1]}" in nanned.reason


# ---- 7. reports --------------------------------------------------------------------------

def _decide_with_report(path) -> Path:
    # SELFTEST=off: the report, not the self-test, is under test here (and it is faster).
    selection.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(path), selftest="off"))
    return Path(str(path).replace("{pid}", str(os.getpid())))


@case("reports", "report written under umask {umask}", "mode 0644 at most; valid JSON; no temporary file left next to it")
@pytest.mark.parametrize("umask", ["000", "022", "077"])
def test_report_permissions_are_at_most_0644_whatever_the_umask(tmp_path, umask):
    previous = os.umask(int(umask, 8))
    try:
        path = _decide_with_report(tmp_path / "report-{pid}.json")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) & ~0o644 == 0
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@case("reports", "symlink planted at the report path (to a file, to a directory, dangling)", "the link itself is replaced by the report; its target is never written or created")
@pytest.mark.parametrize("target_kind", ["file", "directory", "dangling"])
def test_report_never_follows_a_planted_symlink(tmp_path, target_kind):
    victim = tmp_path / "victim"
    if target_kind == "file":
        victim.write_text("precious")
    elif target_kind == "directory":
        victim.mkdir()
    link = tmp_path / "report.json"
    link.symlink_to(victim)
    _decide_with_report(link)
    assert not link.is_symlink() and json.loads(link.read_text())["decisions"]
    if target_kind == "file":
        assert victim.read_text() == "precious"
    elif target_kind == "directory":
        assert list(victim.iterdir()) == []
    else:
        assert not victim.exists()


@case("reports", "a report write that fails half-way (unserialisable payload)", "the previous report is intact; no temporary file is left")
def test_a_failed_report_write_leaves_the_previous_report_and_no_temp_file(tmp_path):
    path = _decide_with_report(tmp_path / "report.json")
    before = path.read_text()
    with pytest.raises(TypeError):
        selection.write_report(path, {"bad": object()})
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["report.json"]


@case("reports", "secrets in the environment (HF_TOKEN, AWS_SECRET_ACCESS_KEY, any other variable)", "the report holds no environment value except the library's own settings")
def test_report_contains_no_environment_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-456")
    text = _decide_with_report(tmp_path / "report.json").read_text()
    leaked = [k for k, v in os.environ.items() if not k.startswith("SM120_FP4") and len(v) >= 8 and v in text]
    assert leaked == []


@case("reports", "report directory removed after install(), then the first layer loads", "the decision stands (one warning says the report was not written); the worker does not crash")
def test_an_unwritable_report_does_not_stop_a_worker(tmp_path, caplog):
    folder = tmp_path / "reports"
    folder.mkdir()
    settings = Settings(simulate="12.0", report=str(folder / "r.json"), selftest="off")
    folder.rmdir()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert selection.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert any("report" in r.getMessage() for r in caplog.records)


@case("reports", "two decisions finish at once in one process, writers interleave", "the report lists both decisions (the last writer writes the latest state)")
def test_concurrent_report_writes_never_lose_a_decision(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    first_dumping, second_done = threading.Event(), threading.Event()
    real_dump = json.dump

    def ordered_dump(payload, handle, **kwargs):
        if len(payload["decisions"]) == 1:  # the first decision's writer waits for the second's
            first_dumping.set()
            second_done.wait(10)
        return real_dump(payload, handle, **kwargs)

    monkeypatch.setattr(selection.json, "dump", ordered_dump)
    first = threading.Thread(target=selection.decide, args=(_CpuGpu(0, "a", (12, 0)), ["emulated"]), kwargs={"settings": settings})
    first.start()
    first_dumping.wait(10)
    selection.decide(_CpuGpu(1, "b", (12, 0)), ["emulated"], settings=settings)
    second_done.set()
    first.join()
    assert len(json.loads(path.read_text())["decisions"]) == 2


# ---- results of the background subprocesses (last: they ran while the tests above did) ------

@case("configuration", "worker started with SM120_FP4=1 and SM120_FP4_SELFTEST=bogus imports SGLang", "the import raises ConfigError naming SM120_FP4_SELFTEST='bogus' (the worker stops before serving)")
def test_a_bad_setting_stops_a_bootstrapped_worker_at_the_sglang_import():
    rc, _, stderr = _JOBS["test_a_bad_setting_stops_a_bootstrapped_worker_at_the_sglang_import"].result()
    assert rc != 0
    assert "ConfigError" in stderr and "SM120_FP4_SELFTEST='bogus' is not accepted" in stderr, stderr


@case("backend faults", "spawned scheduler (SM120_FP4=1, SIMULATE=12.0, SELFTEST=strict, BACKENDS=zeros) loads an NVFP4 layer", "RefusedToServe: the child exits non-zero and its stderr names the backend and the fault")
def test_strict_worker_with_a_broken_backend_refuses_to_serve_with_a_nonzero_exit():
    exitcode, _, stderr = _JOBS["test_strict_worker_with_a_broken_backend_refuses_to_serve_with_a_nonzero_exit"].result()
    assert exitcode not in (0, None), stderr
    assert "RefusedToServe" in stderr and "refusing to serve NVFP4 on cpu" in stderr, stderr
    assert "zeros: self-test failed: M=1 N=96 K=1056: output is all zeros" in stderr
    assert "the layer loaded" not in stderr


@case("own failures", "package copy with a truncated api.py, SM120_FP4=1, `.pth` bootstrap, `import sglang` (a stand-in package: the hook fires on the name)", "`import sglang` succeeds; exactly one stderr line says activation failed and why")
def test_a_corrupted_package_leaves_sglang_importing_with_one_line_on_stderr():
    rc, stdout, stderr = _JOBS["test_a_corrupted_package_leaves_sglang_importing_with_one_line_on_stderr"].result()
    assert rc == 0, stderr
    sglang_file, package = json.loads(stdout)
    assert sglang_file.endswith("/sglang/sglang/__init__.py") and "/broken/sm120_fp4/" in package, "the corrupted copy is what the bootstrap loaded"
    lines = ours(stderr)
    assert len(lines) == 1 and lines[0].startswith("sm120_fp4: activation failed, SGLang runs unpatched: SyntaxError"), stderr


@case("own failures", "FlashInfer not importable, real SGLang import after install()", "install() and SGLang's import succeed; the alias is skipped with one warning line; the layer still loads and is self-tested")
def test_missing_flashinfer_leaves_sglang_importing_unpatched_with_one_warning():
    rc, stdout, stderr = _JOBS["test_missing_flashinfer_leaves_sglang_importing_unpatched_with_one_warning"].result()
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    data = json.loads(stdout)
    assert data["installed"] and data["sglang_has_mm_fp4"] is False and data["decision"] == "emulated"
    state, reason = data["patches"]["flashinfer-fp4-gemm-alias"]
    assert state == "skipped" and "flashinfer_fp4_gemm not found" in reason
    assert len([line for line in ours(stderr) if "flashinfer-fp4-gemm-alias" in line]) == 1, stderr
