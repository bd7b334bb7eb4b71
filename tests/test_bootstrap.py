"""Start-up activation: the `.pth` line, the toggle parser, the one-shot SGLang import hook, and what
happens when the package is broken. New interpreters run as background jobs (see conftest.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers.cases import case
from helpers.common import SIM_ENV, assert_patched_once
from helpers.procs import (
    PACKAGE,
    REPO,
    Popen,
    background,
    broken_copy,
    clean_env,
    fake_sglang,
    ours,
    python,
    with_repo_pth,
)

import sm120_fp4
from sm120_fp4 import bootstrap

PTH = (PACKAGE / "_pth" / "sm120_fp4.pth").read_text()


# ---- the toggle ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, parsed",
    [(None, None), ("1", True), ("on", True), ("0", False), ("off", False), (1, True), (0, False), (True, True)],
)
def test_parse_toggle_accepts_1_on_0_off(value, parsed):
    assert bootstrap.parse_toggle(value) is parsed


@pytest.mark.parametrize("value", ["", "true", "ON", " 1", 2, 1.0])
def test_parse_toggle_rejects_anything_else_and_says_what_is_accepted(value):
    with pytest.raises(ValueError, match="accepted: 1, on, 0, off"):
        bootstrap.parse_toggle(value)


@pytest.mark.parametrize(
    "environ, on",
    [
        ({}, False),
        ({"SM120_FP4": ""}, False),
        ({"SM120_FP4": "0"}, False),
        ({"SM120_FP4": "off"}, False),
        ({"SM120_FP4": "1"}, True),
        ({"SM120_FP4": "garbage"}, True),
    ],
)
def test_enabled_lets_garbage_through_to_install_which_rejects_it(environ, on):
    assert bootstrap.enabled(environ) is on


def test_the_pth_line_repeats_the_off_values_of_the_toggle():
    assert repr(bootstrap.TOGGLE_OFF) in PTH and "from sm120_fp4.bootstrap import activate; activate()" in PTH


# ---- activate() in this process -----------------------------------------------------------------


@case(
    "own failures",
    "`bootstrap.activate()` twice, with SGLang already imported",
    "install() once; the second call is a no-op; never raises",
)
def test_bootstrap_activate_is_idempotent_and_never_raises(monkeypatch, sglang_unpatched):
    for name, value in {"SM120_FP4": "1", **SIM_ENV}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(bootstrap, "_activated", False)
    bootstrap.activate()
    bootstrap.activate()
    assert sm120_fp4.status().installed
    assert_patched_once()


def test_activate_before_sglang_puts_one_finder_that_removes_itself_after_install(monkeypatch):
    monkeypatch.setattr(bootstrap, "_activated", False)
    monkeypatch.delitem(sys.modules, "sglang")  # as if SGLang were not imported yet
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    bootstrap.activate()
    bootstrap.activate()
    assert sys.meta_path.count(bootstrap._finder) == 1 and sys.meta_path[0] is bootstrap._finder
    assert bootstrap._finder.find_spec("json") is None and bootstrap._finder in sys.meta_path
    calls = []
    monkeypatch.setattr(bootstrap, "_install_once", lambda: calls.append("install"))
    spec = bootstrap._finder.find_spec("sglang")
    assert bootstrap._finder in sys.meta_path, "in place until install() has run"
    module = type(sys)("sglang")
    spec.loader.exec_module(module)  # SGLang's own __init__ runs, then the hook
    assert calls == ["install"] and bootstrap._finder not in sys.meta_path


# ---- new interpreters ---------------------------------------------------------------------------

SHOW_IMPORTS = "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'sm120_fp4'))))"
TOGGLE_VALUES = {"unset": None, "0": "0", "off": "off", "empty": ""}


@case(
    "own failures",
    "`.pth` bootstrap with SM120_FP4 {value}",
    "nothing imported: no torch, no pydantic, no sm120_fp4; nothing on stderr",
)
@pytest.mark.parametrize("value", list(TOGGLE_VALUES))
@background(
    lambda folder, value: python(
        SHOW_IMPORTS, folder, **({} if TOGGLE_VALUES[value] is None else {"SM120_FP4": TOGGLE_VALUES[value]})
    )
)
def test_the_pth_bootstrap_imports_nothing_when_the_toggle_is_off(background, value):
    site = [p for p in sys.path if p.endswith("site-packages") and Path(p, "sm120_fp4.pth").exists()]
    assert site, "the .pth is installed in this environment's site-packages"
    rc, stdout, stderr = background
    assert rc == 0 and json.loads(stdout) == [] and stderr == "", stderr


# the worker's settings (the toggle on, or one setting bad) -> what the error must name
BAD_WORKER = {
    "SM120_FP4=true": ({"SM120_FP4": "true"}, "SM120_FP4='true'"),
    "SM120_FP4=1 SM120_FP4_SELFTEST=bogus": (
        {"SM120_FP4": "1", "SM120_FP4_SELFTEST": "bogus"},
        "SM120_FP4_SELFTEST='bogus' is not accepted",
    ),
}


@case(
    "configuration",
    "worker started with {setting} (the `.pth` bootstrap active) imports SGLang",
    "the import raises ConfigError naming the variable and the value: the worker stops before serving, never silently unpatched",
)
@pytest.mark.parametrize("setting", list(BAD_WORKER))
@background(
    lambda folder, setting: python(
        "import sglang",
        folder,
        cwd=folder,
        PYTHONPATH=f"{fake_sglang(folder / 'site')}:{REPO}",
        **BAD_WORKER[setting][0],
    )
)
def test_a_bad_setting_stops_a_bootstrapped_worker_at_the_sglang_import(background, setting):
    rc, _, stderr = background
    assert rc != 0
    assert "ConfigError" in stderr and BAD_WORKER[setting][1] in stderr, stderr


@case(
    "own failures",
    "package with a truncated bootstrap.py, SM120_FP4=1, new interpreter (this repository's `.pth` line)",
    "the interpreter starts and runs; one stderr line says the bootstrap failed and why; only a finder that refuses `sglang` is left behind",
)
@background(
    lambda folder: with_repo_pth(
        "import sys; print([type(f).__name__ for f in sys.meta_path]); print('ran')",
        folder,
        cwd=folder,
        SM120_FP4="1",
        PYTHONPATH=str(broken_copy(folder / "site", "bootstrap.py")),
    )
)
def test_a_corrupted_bootstrap_never_raises_at_interpreter_start(background):
    rc, stdout, stderr = background
    assert rc == 0 and stdout.endswith("ran\n"), stderr
    assert "_AfterSGLangImport" not in stdout and "_Sm120Fp4Refuse" in stdout
    lines = ours(stderr)
    assert (
        len(lines) == 1 and lines[0].startswith("sm120_fp4: start-up bootstrap failed") and "SyntaxError" in lines[0]
    ), stderr


@case(
    "own failures",
    "package that cannot be imported (truncated bootstrap.py), SM120_FP4=1, `.pth` line, then `import sglang`",
    "`import sglang` raises ImportError saying the bootstrap failed, why, and how to turn the library off: SGLang never runs unpatched",
)
@background(
    lambda folder: with_repo_pth(
        "import sglang",
        folder,
        cwd=folder,
        SM120_FP4="1",
        PYTHONPATH=f"{broken_copy(folder / 'site', 'bootstrap.py')}:{fake_sglang(folder / 'fake')}",
    )
)
def test_a_package_that_cannot_import_makes_import_sglang_fail(background):
    rc, _, stderr = background
    assert rc != 0
    last = stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ImportError: sm120_fp4: start-up bootstrap failed")
        and "SyntaxError" in last
        and "SM120_FP4=0" in last
    ), stderr


@case(
    "own failures",
    "`.pth` line with SM120_FP4 unset, 0 or off (this repository's copy)",
    "nothing imported, no finder inserted",
)
@pytest.mark.parametrize("value", ["unset", "0", "off"])
@background(
    lambda folder, value: with_repo_pth(
        "import sys, json; print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', 'sm120_fp4')), [type(f).__name__ for f in sys.meta_path if 'Sm120' in type(f).__name__ or 'SGLang' in type(f).__name__]]))",
        folder,
        **({} if value == "unset" else {"SM120_FP4": value}),
    )
)
def test_the_repository_pth_line_is_free_when_off(background, value):
    rc, stdout, stderr = background
    assert rc == 0 and json.loads(stdout) == [[], []], stderr


def _partial_install(folder: Path) -> Path:
    package = folder / "site" / "sm120_fp4"
    package.mkdir(parents=True)  # an install interrupted after the first files: no bootstrap.py, api.py, ...
    for name in ("__init__.py", "_version.py", "errors.py"):
        shutil.copy(PACKAGE / name, package / name)
    return package.parent


@case(
    "own failures",
    "partially installed package (the .pth present; only __init__, _version, errors copied), SM120_FP4=1",
    "the interpreter starts and runs; stderr says the bootstrap failed and why",
)
@background(
    lambda folder: python("print('ran')", folder, cwd=folder, SM120_FP4="1", PYTHONPATH=str(_partial_install(folder)))
)
def test_a_partially_installed_package_never_raises_at_interpreter_start(background):
    rc, stdout, stderr = background
    assert rc == 0 and stdout == "ran\n"
    lines = ours(stderr)
    assert lines and all("ModuleNotFoundError" in line and "sm120_fp4.bootstrap" in line for line in lines), stderr


@case(
    "own failures",
    "package copy with a truncated api.py, SM120_FP4=1, `.pth` bootstrap, `import sglang` (a stand-in package: the hook fires on the name)",
    "`import sglang` fails: the last stderr line says activation failed, why, and how to turn the library off; never SGLang unpatched",
)
@background(
    lambda folder: python(
        "import json, sglang, sm120_fp4; print(json.dumps([sglang.__file__, sm120_fp4.__file__]))",
        folder,
        cwd=broken_copy(folder / "broken", "api.py"),
        SM120_FP4="1",
        **SIM_ENV,
        PYTHONPATH=f"{folder / 'broken'}:{fake_sglang(folder / 'fake')}",
    )
)
def test_a_corrupted_package_stops_import_sglang_with_one_clear_line(background):
    rc, stdout, stderr = background
    assert rc != 0 and stdout == "", stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        "sm120_fp4.bootstrap.ActivationFailed: sm120_fp4: activation failed with SM120_FP4 on (SyntaxError"
    ), stderr
    assert "SM120_FP4=0" in last
    assert stderr.count("activation failed") == 1, "one clear line, not one per retried import"


LONG = "/tmp/" + "x" * 300 + "/report.json"


@case(
    "configuration",
    "worker (SM120_FP4=1, `.pth` bootstrap) with SM120_FP4_REPORT={what} imports SGLang",
    "the import raises ConfigError naming SM120_FP4_REPORT and the filesystem error; the worker stops, never unpatched",
)
@pytest.mark.parametrize("what", ["an over-long path component"])
@background(
    lambda folder, what: python(
        "import sglang",
        folder,
        cwd=folder,
        PYTHONPATH=f"{fake_sglang(folder / 'site')}:{REPO}",
        SM120_FP4="1",
        SM120_FP4_REPORT=LONG,
        **SIM_ENV,
    )
)
def test_a_filesystem_error_in_a_setting_stops_a_worker_as_a_config_error(background, what):
    rc, _, stderr = background
    assert rc != 0
    assert "ConfigError" in stderr and "SM120_FP4_REPORT=" in stderr and "ENAMETOOLONG" in stderr, stderr
    assert "ConfigError" in stderr[stderr.rindex("Traceback") :], "the import raised it: the interpreter ended with it"


# ---- SGLang found by another finder than the path finder --------------------------------------


def _editable_sglang_site(folder: Path) -> Path:
    """This environment's site-packages without the `sglang` package itself (its dist-info stays),
    plus the `.pth` and the finder setuptools writes for `pip install -e` of SGLang, mapping
    `sglang` to the real package: SGLang is found only by that editable finder."""
    import site

    import sglang
    from setuptools.command.editable_wheel import _finder_template

    real = Path(sglang.__file__).parent
    farm = folder / "site"
    farm.mkdir(parents=True)
    skip = {"sglang", "sm120_fp4.pth", "_editable_impl_sm120_fp4.pth", "__pycache__"}
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if entry.name not in skip and not entry.name.startswith("__editable__"):
            (farm / entry.name).symlink_to(entry)
    name = "__editable___sglang_0_5_23_finder"
    (farm / f"{name}.py").write_text(_finder_template(name, {"sglang": str(real)}, {}))
    (farm / "__editable__.sglang-0.5.23.pth").write_text(f"import {name}; {name}.install()\n")
    shutil.copy(PACKAGE / "_pth" / "sm120_fp4.pth", farm / "sm120_fp4.pth")  # this repository's line
    return farm


EDITABLE_CHECK = """
import json, sys
import sglang
import sglang.srt.layers.quantization.modelopt_quant as mq
import sm120_fp4
finders = [getattr(f, '__name__', type(f).__name__) for f in sys.meta_path]
patched = getattr(getattr(mq, 'flashinfer_fp4_gemm', None), '__sm120_fp4_patch__', None)
print(json.dumps([sglang.__file__, finders, sm120_fp4.status().installed, patched]))
"""


@case(
    "own failures",
    "SGLang installed editable (`pip install -e`: found only by setuptools' `__editable___*_finder` on sys.meta_path), SM120_FP4=1, a new interpreter imports it",
    "the start-up hook finds SGLang as the import system does: install() runs and SGLang's FP4 alias is patched",
)
@background(
    lambda folder: Popen(
        [
            sys.executable,
            "-S",
            "-c",
            f"import site; site.addsitedir({str(_editable_sglang_site(folder))!r})\n" + EDITABLE_CHECK,
        ],
        clean_env(SM120_FP4="1", PYTHONPATH=str(REPO), **SIM_ENV),
        folder,
        cwd=folder,
    )
)
def test_an_editable_sglang_is_hooked_by_the_start_up_finder(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    where, finders, installed, patched = json.loads(stdout.strip().splitlines()[-1])
    assert (
        "site-packages/sglang/__init__.py" in where and "/site/sglang" not in where
    )  # the real package, not a farm link
    assert "_EditableFinder" in finders and "_AfterSGLangImport" not in finders
    assert installed and patched == "flashinfer-fp4-gemm-alias", stderr


FINDER = """
import importlib.util, json, sys
from importlib.machinery import ModuleSpec, PathFinder
class LegacyLoader:  # only the pre-3.4 load_module protocol: nothing can run after the module
    def load_module(self, name):
        raise AssertionError('never reached')
class Finder:
    busy = False
    def find_spec(self, name, path=None, target=None):
        if name != 'sglang' or self.busy:
            return None
        if WHERE == 'before':  # finds SGLang itself, never asking the finders after it
            return PathFinder.find_spec(name, path)
        self.busy = True
        try:  # re-enters the import system while it looks, as wrapt's finder does
            importlib.util.find_spec('sglang')
        finally:
            self.busy = False
        return ModuleSpec('sglang', LegacyLoader())
if WHERE == 'after':  # right after the start-up hook's finder: before the path finder
    sys.meta_path.insert([type(f).__name__ for f in sys.meta_path].index('_AfterSGLangImport') + 1, Finder())
else:
    sys.meta_path.insert(0, Finder())
try:
    import sglang
    import sglang.srt
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    import sm120_fp4
    print(json.dumps(sm120_fp4.status().installed))
"""
FINDERS = {
    "after": (
        "a finder after the start-up hook's whose loader has only the legacy load_module (the finder re-enters the import system while it looks)",
        "`import sglang` fails with ActivationFailed saying why and how to turn the library off",
    ),
    "before": (
        "a finder put before the start-up hook's that finds SGLang itself (the path finder, asked directly)",
        "install() runs when SGLang's first submodule is imported, before it loads",
    ),
}


@case("own failures", "SGLang found by {where_}, SM120_FP4=1", "{outcome}: never SGLang running without install()")
@pytest.mark.parametrize("where_, outcome", list(FINDERS.values()), ids=list(FINDERS))
@background(
    lambda folder, where_, outcome: with_repo_pth(
        f"WHERE = {'after' if 'after' in where_ else 'before'!r}\n" + FINDER,
        folder,
        cwd=folder,
        SM120_FP4="1",
        **SIM_ENV,
    )
)
def test_sglang_found_by_any_other_finder_never_runs_without_install(background, where_, outcome):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    if "after" in where_:
        assert stdout.startswith("ActivationFailed") and "LegacyLoader" in stdout and "SM120_FP4=0" in stdout, stdout
    else:
        assert stdout.strip() == "true", stdout + stderr


FLAKY_SGLANG = """
import json, sys
try:
    import sglang  # its __init__ fails the first time (a missing optional dependency, say)
except RuntimeError as exc:
    print('first import failed:', exc)
import sglang
import sm120_fp4
print(json.dumps(sm120_fp4.status().installed))
"""


def _flaky_sglang(root: Path) -> Path:
    fake_sglang(root)
    (root / "sglang" / "__init__.py").write_text(
        "import os\nif not os.path.exists('tried'):\n    open('tried', 'w').close()\n    raise RuntimeError('first try')\n"
    )
    return root


@case(
    "own failures",
    "SM120_FP4=1 and the first `import sglang` fails in SGLang's own __init__, the second succeeds",
    "install() runs after the second import: the hook stays in place until install() has run",
)
@background(
    lambda folder: with_repo_pth(
        FLAKY_SGLANG,
        folder,
        cwd=folder,
        SM120_FP4="1",
        **SIM_ENV,
        PYTHONPATH=f"{_flaky_sglang(folder / 'fake')}:{REPO}",
    )
)
def test_a_failed_first_import_of_sglang_is_hooked_again(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    assert "first import failed: first try" in stdout and stdout.strip().endswith("true"), stdout + stderr


def test_every_engine_entry_point_goes_through_the_one_activation_module():
    """The .pth line, SGLang's plugin and vLLM's plugin all call into sm120_fp4.bootstrap (none into an engine home)."""
    import tomllib

    from sm120_fp4 import api, engines

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    groups = project["entry-points"]
    values = [groups["sglang.srt.plugins"]["sm120_fp4"], groups["vllm.general_plugins"]["sm120_fp4"]]
    assert values == ["sm120_fp4.bootstrap:load_plugin", "sm120_fp4.bootstrap:load_vllm_plugin"]
    pth = (Path(__file__).parents[1] / "sm120_fp4" / "_pth" / "sm120_fp4.pth").read_text()
    assert "sm120_fp4.bootstrap" in pth
    # Each home is an Engine: every member the CLI, doctor and install() use is there, none looked up by hasattr.
    assert [home.name for home in api.ENGINES] == ["sglang", "vllm"]
    assert all(isinstance(home, engines.Engine) and isinstance(home.release, engines.Release) for home in api.ENGINES)
    assert api.engine("vllm").launches(["vllm", "serve", "m"]) and not api.engine("sglang").launches(["vllm", "serve"])
    assert api.engine("sglang").launches(["python", "-m", "sglang.launch_server"])
    with pytest.raises(ValueError, match=r"engine='trt': accepted: sglang, vllm"):
        api.engine("trt")
