#!/usr/bin/env python3
"""The SGLang release matrix: every patch target of sm120_fp4 checked against every release.

    .venv/bin/python scripts/sglang_matrix.py [--cache DIR] [--versions 0.5.3,0.5.8] [--json OUT]
    .venv/bin/python scripts/sglang_matrix.py --import-check 0.5.22

Source check (default): downloads each release's wheel once (``pip download --no-deps``), extracts
the few files the targets live in, and checks with ``ast`` (SGLang is never imported) that every
spec of ``sm120_fp4.sglang.targets.ledger_rows()`` whose version range contains the release finds
its target there with the expected shape, and that every spec whose range excludes the release
does *not* find it (a range that is too narrow would leave a release unpatched). Prints a table
and exits 1 on any FAIL.

Import check (``--import-check VERSION``): builds a CPU venv for that release under
``.cache/venvs/sglang-VERSION`` (its own torch/flashinfer/transformers pins, read from the wheel),
imports the real SGLang modules after ``sm120_fp4.install(simulate=...)`` and checks that the
patches are applied, then that ``uninstall()`` restores the originals. Dependencies: the lists of
``scripts/setup_env.sh`` with the release's pins, plus (found by trial, as the import fails) any
module the release needs that its METADATA lists. ``--torch`` replaces the torch pin (0.5.18-0.5.21
pin torch 2.13.0, whose only local build is CPU-only and has no matching torchvision);
``--run-tests`` also runs tests/test_sglang_integration.py there. The venv is ~6 GB: delete it.

Needs ``packaging`` and an importable ``sm120_fp4`` (wrapt, pydantic): run it with the repo's
``.venv/bin/python`` (``bash scripts/setup_env.sh`` builds it).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

try:
    from sm120_fp4.kernels import MM_FP4_HEAD
    from sm120_fp4.sglang import release as R
    from sm120_fp4.sglang import targets as T
except ImportError as exc:  # pragma: no cover - environment problem, explained to the user
    sys.exit(f"cannot import sm120_fp4.sglang ({exc}); run this with the repo's .venv/bin/python")

# Every release on the index in the supported range (the index is not scanned: add new ones here).
RELEASES = (
    "0.5.3", "0.5.3.post1", "0.5.3.post2", "0.5.3.post3",
    "0.5.4", "0.5.4.post1", "0.5.4.post2", "0.5.4.post3",
    "0.5.5", "0.5.5.post1", "0.5.5.post2", "0.5.5.post3",
    "0.5.6", "0.5.6.post1", "0.5.6.post2", "0.5.7",
    "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10", "0.5.10.post1",
    "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1",
    "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17",
    "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)
# Versions just outside SUPPORTED: no spec may apply to them (a specifier check, no download).
OUTSIDE_PROBES = ("0.5.2", "0.5.2.post1", "0.5.3rc0", "0.5.24", "0.6.0")
DEFAULT_CACHE = ROOT / ".cache" / "sglang-wheels"
# Where 0.5.11+ wheels exist (cp311 manylinux_2_34; older ones are py3-none-any): pinned so the
# download does not depend on the Python that runs this script.
WHEEL_TAGS = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
              "--platform", "manylinux_2_34_x86_64"]
PLUGINS = "sglang.srt.plugins"
RUNTIME_CONTEXT = "sglang.srt.runtime_context"
MM_FP4_KEYWORDS = {"backend", "out", "block_size", "use_8x4_sf_layout", "use_nvfp4"}
ENUM_MEMBERS = {"AUTO": "auto", "FLASHINFER_CUDNN": "flashinfer_cudnn", "FLASHINFER_CUTLASS": "flashinfer_cutlass"}
OK, NA, FAIL = "ok", "n/a", "FAIL"


def module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def needed_files() -> list[str]:
    """Paths inside the wheel that the checks read (every spec's module + plugins + runtime_context)."""
    modules = {spec.module for spec in T.ledger_rows()} | {RUNTIME_CONTEXT}
    return sorted({module_path(m) for m in modules} | {PLUGINS.replace(".", "/") + "/__init__.py"})


# ---------------------------------------------------------------- wheels and sources


def wheel_for(version: str, cache: Path) -> Path:
    """The cached wheel of sglang==version, downloaded on first use."""
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *WHEEL_TAGS,
           "--disable-pip-version-check", "--quiet", "-d", str(cache), f"sglang=={version}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if run.returncode != 0 or not found:
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"could not download the sglang=={version} wheel ({' '.join(cmd)}):\n{tail}")
    return found[0]


def sources(version: str, cache: Path) -> Path:
    """Directory holding the needed files of `version` (extracted from its wheel once) + METADATA."""
    dest = cache / "src" / version
    stamp = dest / ".extracted"
    wanted = needed_files()
    if stamp.exists() and stamp.read_text().split() == wanted:
        return dest
    with zipfile.ZipFile(wheel_for(version, cache)) as whl:
        names = set(whl.namelist())
        for rel in wanted + [f"sglang-{version}.dist-info/METADATA"]:
            target = dest / ("METADATA" if rel.endswith("/METADATA") else rel)
            if rel in names:  # a module missing from a release is a fact, not an error
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(whl.read(rel))
    stamp.write_text("\n".join(wanted))
    return dest


# ---------------------------------------------------------------- ast helpers


def parse(src: Path, module: str) -> ast.Module | None:
    path = src / module_path(module)
    return ast.parse(path.read_text(encoding="utf-8"), str(path)) if path.exists() else None


def top_level(body: list[ast.stmt]):
    """Module-level statements, looking into if/try/with blocks but not into functions or classes."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from top_level(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from top_level(handler.body)


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in top_level(tree.body) if isinstance(n, ast.ClassDef) and n.name == name), None)


def assigns(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


# ---------------------------------------------------------------- one check per kind of spec
# Each returns (present, problem): whether the target exists at all, and what is wrong with it.


def check_alias(tree: ast.Module, attr: str) -> tuple[bool, str | None]:
    """`from flashinfer import mm_fp4 as <attr>` at module level, called with mm_fp4's positional order."""
    bound = any(
        isinstance(n, ast.ImportFrom) and n.module == "flashinfer"
        and any(a.name == "mm_fp4" and (a.asname or a.name) == attr for a in n.names)
        for n in top_level(tree.body)
    )
    if not bound:
        return False, f"no module-level `from flashinfer import mm_fp4 as {attr}`"
    calls = [n for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == attr]
    if not calls:
        return True, f"{attr} is bound but never called (the GEMM call site moved?)"
    for call in calls:
        where = f"{attr}(...) at line {call.lineno}"
        if len(call.args) != 6 or any(isinstance(a, ast.Starred) for a in call.args):
            head = ", ".join(MM_FP4_HEAD)
            return True, f"{where} passes {len(call.args)} positional args; mm_fp4's convention is 6 ({head})"
        alpha, dtype = ast.unparse(call.args[4]), ast.unparse(call.args[5])
        if "alpha" not in alpha or "dtype" not in dtype:
            return True, f"{where}: 5th/6th positional args are {alpha!r}/{dtype!r}, expected alpha/out_dtype"
        unknown = {k.arg for k in call.keywords if k.arg is not None} - MM_FP4_KEYWORDS
        if unknown:
            return True, f"{where} passes keywords mm_fp4 does not take: {sorted(unknown)}"
    return True, None


def check_method(tree: ast.Module, dotted: str) -> tuple[bool, str | None]:
    """`class C: def method(self, layer)`."""
    cls_name, method = dotted.split(".")
    cls = find_class(tree, cls_name)
    if cls is None:
        return False, f"no class {cls_name}"
    fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    if fn is None:
        return False, f"{cls_name} defines no {method}"
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if names != ["self", "layer"] or a.vararg or a.kwarg or a.kwonlyargs:
        return True, f"{dotted} signature is ({ast.unparse(a)}), expected (self, layer)"
    return True, None


def check_enum(tree: ast.Module, attr: str) -> tuple[bool, str | None]:
    """Fp4GemmRunnerBackend has AUTO/FLASHINFER_CUDNN/FLASHINFER_CUTLASS and the module global exists."""
    cls = find_class(tree, "Fp4GemmRunnerBackend")
    if cls is None:
        return False, "no enum Fp4GemmRunnerBackend"
    values = {name: stmt.value.value for stmt in cls.body for name in assigns(stmt)
              if isinstance(getattr(stmt, "value", None), ast.Constant)}
    wrong = {k: values.get(k) for k, v in ENUM_MEMBERS.items() if values.get(k) != v}
    if wrong:
        return True, f"Fp4GemmRunnerBackend members differ: {wrong} (expected {ENUM_MEMBERS})"
    if not any(attr in assigns(n) for n in top_level(tree.body)):
        return True, f"no module global {attr}"
    return True, None


def check_knob(tree: ast.Module, attr: str) -> tuple[bool, str | None]:
    """`<attr> = get_bool_env_var("SGLANG_USE_CUTLASS_BACKEND_FOR_FP4_GEMM", ...)` at module level."""
    reads = any(isinstance(n, ast.Constant) and n.value == T.LEGACY_KNOB for n in ast.walk(tree))
    node = next((n for n in top_level(tree.body) if attr in assigns(n)), None)
    if node is None:
        return reads, f"no module global {attr}" + (f" (but {T.LEGACY_KNOB} is read elsewhere)" if reads else "")
    args = [a.value for a in getattr(node.value, "args", []) if isinstance(a, ast.Constant)]
    if T.LEGACY_KNOB not in args:
        return True, f"{attr} is assigned at line {node.lineno} but not from env {T.LEGACY_KNOB}"
    return True, None


def kind(spec) -> str:
    if spec is T.ENUM_PIN:
        return "enum"
    if spec is T.LEGACY_KNOB_SPEC:
        return "knob"
    if "." in spec.attribute:
        return "method"
    if spec.check is not None and getattr(spec.check, "__name__", "") == "is_mm_fp4":
        return "alias"
    return "unknown"


CHECKS = {"alias": check_alias, "method": check_method, "enum": check_enum, "knob": check_knob}


def check_spec(spec, version: str, src: Path) -> tuple[str, str]:
    applies = Version(version) in SpecifierSet(spec.versions or R.SUPPORTED)
    how = CHECKS.get(kind(spec))
    if how is None:
        return FAIL, f"no check for {spec.name} ({spec.module}.{spec.attribute}): extend CHECKS in this script"
    tree = parse(src, spec.module)
    present, problem = (False, f"no module {spec.module}") if tree is None else how(tree, spec.attribute)
    if applies:
        return (OK, "") if problem is None else (FAIL, problem)
    if present and problem is None:
        return FAIL, f"{spec.attribute} is there, but the range {spec.versions} excludes {version} (range too narrow?)"
    return NA, ""


def function(tree: ast.Module | None, name: str) -> ast.FunctionDef | None:
    body = [] if tree is None else tree.body
    return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def check_extras(src: Path) -> dict[str, tuple[str, str]]:
    """Facts the library relies on outside the ledger: the plugin entry-point group, override_platform."""
    out = {"plugins": (NA, ""), "override_platform": (NA, "")}  # n/a: the release does not have it
    tree = parse(src, PLUGINS + ".__init__")
    if tree is not None:
        group = any(isinstance(n, ast.Constant) and n.value == PLUGINS for n in ast.walk(tree))
        out["plugins"] = (OK, "") if group and function(tree, "load_plugins") else (
            FAIL, f"plugins/__init__.py lacks load_plugins() or the entry-point group {PLUGINS!r}")
    fn = function(parse(src, RUNTIME_CONTEXT), "override_platform")
    if fn is not None:
        out["override_platform"] = (OK, "") if fn.args.kwarg and not fn.args.args else (
            FAIL, f"override_platform({ast.unparse(fn.args)}) is not (**facts)")
    return out


def check_version(version: str, cache: Path = DEFAULT_CACHE) -> dict[str, tuple[str, str]]:
    """{column: (ok | n/a | FAIL, reason)} for one release; columns are spec names + coverage + extras."""
    src = sources(version, cache)
    rows = T.ledger_rows()
    result = {spec.name: check_spec(spec, version, src) for spec in rows}
    aliases = [s.name for s in rows if kind(s) == "alias" and Version(version) in SpecifierSet(s.versions)]
    supported, why = T.release_support(version)
    if not supported:
        result["coverage"] = (FAIL, why)
    elif not aliases:
        result["coverage"] = (FAIL, "no mm_fp4 alias spec covers this release: the GEMM would run unpatched")
    else:
        result["coverage"] = (OK, "")
    result.update(check_extras(src))
    return result


def check_outside(version: str) -> str | None:
    """None when nothing applies to `version` (a release outside SUPPORTED), else what does."""
    applying = [s.name for s in T.ledger_rows() if Version(version) in SpecifierSet(s.versions or R.SUPPORTED)]
    if T.release_support(version)[0] or applying:
        return f"{version} is outside {R.SUPPORTED} but is supported/covered by {applying}"
    return None


# ---------------------------------------------------------------- import check (real SGLang in a venv)

SNIPPET = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
modules = json.loads(sys.argv[1])
import flashinfer
original = flashinfer.mm_fp4
import sm120_fp4
sm120_fp4.install(simulate="12.0", backends="emulated", enable="on")
for name in modules:
    importlib.import_module(name)
mq = sys.modules["sglang.srt.layers.quantization.modelopt_quant"]
states = {p.name: (p.state, p.reason) for p in sm120_fp4.status().patches}
alias = next(n for n in ("flashinfer_fp4_gemm", "fp4_gemm") if getattr(mq, n, None) is not None)
patched = getattr(mq, alias) is not original and getattr(getattr(mq, alias), "__wrapped__", None) is original
sm120_fp4.uninstall()
hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
print("MATRIX-RESULT " + json.dumps({
    "states": states,
    "alias": alias,
    "alias_patched": patched,
    "alias_restored": getattr(mq, alias) is original,
    "hook_restored": not hasattr(hook, "__wrapped__"),
    "left_after_uninstall": [p.name for p in sm120_fp4.status().patches],
}))
"""


MAX_ADDED_DEPS = 20
IMPORT_NAMES = {"zmq": "pyzmq", "yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python-headless"}


def bash_array(script: str, name: str) -> list[str]:
    """The items of `NAME=( ... )` in setup_env.sh (comments and quotes stripped)."""
    match = re.search(rf"^{name}=\((.*?)^\)", script, re.S | re.M)
    if match is None:
        raise RuntimeError(f"scripts/setup_env.sh has no {name}=( ... ) array; update bash_array() here")
    return [item.strip("\"'") for line in match.group(1).splitlines() for item in line.split("#")[0].split()]


def release_pins(src: Path) -> dict[str, str]:
    """{canonical name: specifier} from the wheel's unconditional Requires-Dist lines."""
    meta = Parser().parsestr((src / "METADATA").read_text(encoding="utf-8"))
    pins = {}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            pins.setdefault(canonicalize_name(req.name), str(req.specifier))
    return pins


def import_check(version: str, cache: Path, run_tests: bool = False, torch_pin: str | None = None) -> int:
    src = sources(version, cache)
    pins = release_pins(src)
    if torch_pin:  # e.g. only the CPU build of the pinned torch exists here, and no matching torchvision
        pins["torch"] = "==" + torch_pin
    if "torch" not in pins or "flashinfer-python" not in pins:
        print(f"sglang {version}: METADATA pins no torch/flashinfer-python ({pins})")
        return 1
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    deps = []  # setup_env.sh's list, with this release's pins where it has them (else unpinned)
    for item in bash_array(setup, "FLASHINFER_DEPS") + bash_array(setup, "SGLANG_DEPS") + bash_array(setup, "PROJECT_DEPS"):
        name = canonicalize_name(Requirement(item).name)
        deps.append(name + pins.get(name, ""))
    torch = "torch" + pins["torch"]  # passed to every pip call so that pip never swaps torch
    venv = ROOT / ".cache" / "venvs" / f"sglang-{version}"
    logs = venv / ".logs"
    py = venv / "bin" / "python"

    def pip(step: str, *args: str) -> None:
        print(f"[{version}] pip install {' '.join(args)}", flush=True)
        logs.mkdir(parents=True, exist_ok=True)
        run = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", *args],
                             capture_output=True, text=True)
        (logs / f"{step}.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"pip install failed at step {step} (full log {logs / step}.log):\n{tail}")

    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip("pip", "--upgrade", "pip")
    # sglang imports torchvision (pip takes the one matching the torch pin) and triton (which the
    # CUDA torch build brings, the CPU build does not).
    pip("torch", torch, "torchvision", "triton")
    pip("flashinfer", "--no-deps", "flashinfer-python" + pins["flashinfer-python"])
    pip("sglang", "--no-deps", str(wheel_for(version, cache)))
    pip("deps", torch, "torchvision", "triton", *deps)
    pip("project", "--no-deps", "-e", str(ROOT))

    v = Version(version)
    runtime = [s for s in T.ledger_rows() if s.make is not None and v in SpecifierSet(s.versions)]
    expected = sorted(s.name for s in runtime)
    modules = sorted({s.module for s in runtime})
    added = []  # older releases import more than setup_env.sh's list: add their own pins, by trial
    for _ in range(MAX_ADDED_DEPS + 1):
        run = subprocess.run([str(py), "-c", SNIPPET, json.dumps(modules)],
                             capture_output=True, text=True, cwd=venv)
        missing = re.search(r"ModuleNotFoundError: No module named '([\w]+)", run.stderr)
        name = missing and canonicalize_name(IMPORT_NAMES.get(missing.group(1), missing.group(1)))
        if run.returncode == 0 or not missing or name not in pins or len(added) == MAX_ADDED_DEPS:
            break
        added.append(name + pins[name])
        pip(f"added-{name}", torch, "torchvision", "triton", added[-1])
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("MATRIX-RESULT ")), None)
    if run.returncode != 0 or line is None:
        print(f"sglang {version}: import-and-patch snippet failed (rc {run.returncode}):\n{run.stderr[-3000:]}")
        return 1
    got = json.loads(line.removeprefix("MATRIX-RESULT "))
    problems = [f"{name}: {got['states'].get(name, ('missing', None))}" for name in expected
                if got["states"].get(name, ("missing",))[0] != "applied"]
    for key in ("alias_patched", "alias_restored", "hook_restored"):
        if not got[key]:
            problems.append(f"{key} is false")
    if got["left_after_uninstall"]:
        problems.append(f"patches left after uninstall: {got['left_after_uninstall']}")
    print(f"sglang {version} (torch{pins['torch']}, flashinfer-python{pins['flashinfer-python']}): "
          f"expected applied {expected}; states {got['states']}; alias {got['alias']}; "
          f"deps added beyond setup_env.sh: {added or 'none'}")
    print(f"import check {version}: " + ("OK" if not problems else "FAIL\n  " + "\n  ".join(problems)))
    if run_tests:  # the repo's end-to-end tests (simulated SM120 on CPU) against this release
        tests = subprocess.run([str(py), "-m", "pytest", "-q", str(ROOT / "tests" / "test_sglang_integration.py")], cwd=ROOT)
        print(f"integration tests on {version}: " + ("OK" if tests.returncode == 0 else f"FAIL (pytest rc {tests.returncode})"))
        problems += [] if tests.returncode == 0 else ["integration tests failed"]
    print(f"venv kept at {venv} ({'remove with: rm -rf ' + str(venv)})")
    return 1 if problems else 0


# ---------------------------------------------------------------- CLI


def print_table(results: dict[str, dict[str, tuple[str, str]]]) -> None:
    columns = list(next(iter(results.values())))
    tags = {c: f"[{i}]" for i, c in enumerate(columns, 1)}
    for c in columns:
        print(f"{tags[c]:>5} {c}")
    width = max(len(v) for v in results) + 2
    print("version".ljust(width) + "".join(tags[c].ljust(6) for c in columns))
    for version, row in results.items():
        print(version.ljust(width) + "".join(row[c][0].ljust(6) for c in columns))
    fails = [(v, c, r) for v, row in results.items() for c, (s, r) in row.items() if s == FAIL]
    for v, c, r in fails:
        print(f"FAIL {v} {c}: {r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel/source cache (default {DEFAULT_CACHE})")
    parser.add_argument("--versions", help="comma-separated subset of the matrix (default: all releases)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--import-check", metavar="VERSION", help="build a venv for VERSION and import-and-patch the real SGLang")
    parser.add_argument("--torch", metavar="VERSION", help="with --import-check: install this torch instead of the release's pin")
    parser.add_argument("--run-tests", action="store_true", help="with --import-check: also run tests/test_sglang_integration.py in that venv")
    args = parser.parse_args(argv)

    if args.import_check:
        try:
            return import_check(args.import_check, args.cache, args.run_tests, args.torch)
        except RuntimeError as exc:
            print(f"import check {args.import_check}: {exc}")
            return 2
    versions = args.versions.split(",") if args.versions else list(RELEASES)
    unknown = [v for v in versions if v not in RELEASES]
    if unknown:
        parser.error(f"not in the matrix: {unknown} (known: {', '.join(RELEASES)})")

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:  # downloads dominate; the checks are cheap
            list(pool.map(lambda v: sources(v, args.cache), versions))
    except RuntimeError as exc:
        print(exc)
        return 2
    results = {v: check_version(v, args.cache) for v in versions}
    outside = {v: check_outside(v) for v in OUTSIDE_PROBES}
    print_table(results)
    for v, problem in outside.items():
        print(f"outside {R.SUPPORTED}: {v}: " + (f"FAIL {problem}" if problem else "nothing applies (ok)"))
    if args.json:
        args.json.write_text(json.dumps({"releases": results, "outside": outside}, indent=2))
    failed = any(s == FAIL for row in results.values() for s, _ in row.values()) or any(outside.values())
    print(f"{len(versions)} releases: " + ("FAIL" if failed else "all ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
