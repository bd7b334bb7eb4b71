#!/usr/bin/env python3
"""The SGLang release matrix: every patch target of sm120_fp4 checked against every release.

    .venv/bin/python scripts/sglang_matrix.py [--cache DIR] [--versions 0.5.8,0.5.9] [--json OUT]
    .venv/bin/python scripts/sglang_matrix.py --import-check 0.5.22 [--demo] [--run-tests]
    .venv/bin/python scripts/sglang_matrix.py --import-check 0.5.23 --flashinfer 0.7.4 [--venv DIR] --demo --run-tests
    .venv/bin/python scripts/sglang_matrix.py --releases era --demo --run-tests --report docs/RELEASES.md

Source check (default): downloads each release's wheel once (``pip download --no-deps``), extracts
the few files the targets live in, and checks with ``ast`` (SGLang is never imported) that every
spec of the ledger (``ledger_rows()``) whose version range contains the release finds its target
there with the expected shape, and that every spec whose range excludes the release does *not*
find it (a range that is too narrow would leave a release unpatched), and that each of the
simulation's stand-ins finds its target where the simulation uses it (``check_stand_ins``: the
activation quantizer the release's ``apply()`` calls, in every release of the ledger's range). Prints a
table and exits 1 on any FAIL.

Import check (``--import-check VERSION``): builds a CPU venv for that release under
``.cache/venvs/sglang-VERSION`` from the per-release pins recorded in ``PINS`` below (torch,
torchvision, flashinfer-python, transformers, extra deps, how the CUDA-only kernel package is
handled; no flag to find by hand), imports the real SGLang modules after
``sm120_fp4.install(simulate="12.0")``, checks that the patches and the simulated activation
quantizer are applied, then that ``uninstall()`` restores the originals and leaves no import
finder. ``--demo`` also runs ``python -m sm120_fp4 demo`` there (must be bit-exact), ``--run-tests``
the test files that import the real SGLang (``TEST_FILES``). The venv (~7 GB) is kept: delete it.

Several releases (``--releases 0.5.8,0.5.9``, ``era``, ``newest`` (the newest release of every
minor) or ``table`` (both: docs/RELEASES.md's rows)): the same, one release at a time, each venv
deleted after its run (``--keep-venv`` keeps them); ``--report FILE`` writes the results as a
Markdown table (release, pins, what was run and its outcome, date), rewritten after each release,
keeping the rows of FILE's other releases as they were. ``--flashinfer VERSION`` installs that
flashinfer-python (``--no-deps``) into each release's venv instead of the release's pin (what a user
who upgrades FlashInfer gets); its rows are keyed ``RELEASE+flashinfer-VERSION``, beside the
release's own. ``--venv DIR`` (with ``--import-check``) uses an existing venv of that release
(a copy of another, say) instead of building one; it is never deleted. ``--repo DIR`` (repeatable) runs another checkout's sm120_fp4 and test file in the
same venv (on PYTHONPATH; the venv's editable install is this repo's).

Needs ``packaging`` and an importable ``sm120_fp4`` (wrapt, pydantic): run it with the repo's
``.venv/bin/python`` (``bash scripts/setup_env.sh`` builds it).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shutil
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
    from sm120_fp4.backends.flashinfer import MM_FP4_HEAD
    from sm120_fp4.sglang import release as R
    from sm120_fp4.sglang import simulation as S
    from sm120_fp4.sglang import targets as T
    from sm120_fp4.sglang.moe import MOE_RUNNER_PIN, MOE_RUNNER_PIN_LEGACY
except ImportError as exc:  # pragma: no cover - environment problem, explained to the user
    sys.exit(f"cannot import sm120_fp4.sglang ({exc}); run this with the repo's .venv/bin/python")

# Every release on the index in the supported range (the index is not scanned: add new ones here).
RELEASES = (
    "0.5.8",
    "0.5.8.post1",
    "0.5.9",
    "0.5.10",
    "0.5.10.post1",
    "0.5.11",
    "0.5.12",
    "0.5.12.post1",
    "0.5.13",
    "0.5.13.post1",
    "0.5.14",
    "0.5.15",
    "0.5.15.post1",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)
# Versions just outside SUPPORTED: no spec may apply to them (a specifier check, no download).
OUTSIDE_PROBES = ("0.5.2", "0.5.7", "0.5.7.post1", "0.5.8rc0", "0.5.24", "0.6.0")
DEFAULT_CACHE = ROOT / ".cache" / "sglang-wheels"
# Where 0.5.11+ wheels exist (cp311 manylinux_2_34; older ones are py3-none-any): pinned so the
# download does not depend on the Python that runs this script.
WHEEL_TAGS = [
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_34_x86_64",
]
PLUGINS = R.PLUGIN_GROUP
RUNTIME_CONTEXT = R.RUNTIME_CONTEXT
MM_FP4_KEYWORDS = {"backend", "out", "block_size", "use_8x4_sf_layout", "use_nvfp4"}
ENUM_MEMBERS = {"AUTO": "auto", "FLASHINFER_CUDNN": "flashinfer_cudnn", "FLASHINFER_CUTLASS": "flashinfer_cutlass"}
OK, NA, FAIL = "ok", "n/a", "FAIL"


def module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def needed_files() -> list[str]:
    """Paths inside the wheel that the checks read (every spec's module + plugins + runtime_context)."""
    modules = {spec.module for spec in T.ledger_rows() + S.ledger_rows() if spec.module.startswith("sglang.")} | {
        RUNTIME_CONTEXT
    }
    return sorted({module_path(m) for m in modules} | {PLUGINS.replace(".", "/") + "/__init__.py"})


# ---------------------------------------------------------------- wheels and sources


def wheel_for(version: str, cache: Path) -> Path:
    """The cached wheel of sglang==version, downloaded on first use."""
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        *WHEEL_TAGS,
        "--disable-pip-version-check",
        "--quiet",
        "-d",
        str(cache),
        f"sglang=={version}",
    ]
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
        isinstance(n, ast.ImportFrom)
        and n.module == "flashinfer"
        and any(a.name == "mm_fp4" and (a.asname or a.name) == attr for a in n.names)
        for n in top_level(tree.body)
    )
    if not bound:
        return False, f"no module-level `from flashinfer import mm_fp4 as {attr}`"
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == attr
    ]
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


def _method(tree: ast.Module, dotted: str) -> tuple[ast.FunctionDef | None, str | None]:
    cls_name, method = dotted.split(".")
    cls = find_class(tree, cls_name)
    if cls is None:
        return None, f"no class {cls_name}"
    fn = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    return fn, None if fn is not None else f"{cls_name} defines no {method}"


def check_method(tree: ast.Module, dotted: str) -> tuple[bool, str | None]:
    """`class C: def method(self, layer)` (a weights hook: SGLang calls it with the layer only)."""
    fn, problem = _method(tree, dotted)
    if fn is None:
        return False, problem
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if names != ["self", "layer"] or a.vararg or a.kwarg or a.kwonlyargs:
        return True, f"{dotted} signature is ({ast.unparse(a)}), expected (self, layer)"
    return True, None


def check_warmup(tree: ast.Module, dotted: str) -> tuple[bool, str | None]:
    """`class ModelRunner: def init_cuda_graphs(self, ...)`: the hook passes every argument through,
    so only a method (first parameter self) is required."""
    fn, problem = _method(tree, dotted)
    if fn is None:
        return False, problem
    names = [p.arg for p in fn.args.posonlyargs + fn.args.args]
    if names[:1] != ["self"] or any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return True, f"{dotted} is not an instance method ({ast.unparse(fn.args)})"
    return True, None


def check_idle(tree: ast.Module, dotted: str) -> tuple[bool, str | None]:
    """`class Scheduler: def on_idle(self)` (or the mixin's): the scheduler loop calls it with no argument."""
    fn, problem = _method(tree, dotted)
    if fn is None:
        return False, problem
    a = fn.args
    if [p.arg for p in a.posonlyargs + a.args] != ["self"] or a.kwonlyargs:
        return True, f"{dotted} signature is ({ast.unparse(a)}), expected (self)"
    return True, None


def check_function(tree: ast.Module, name: str) -> tuple[bool, str | None]:
    """A module-level `def name(...)` (the fused-MoE seam; the seam passes every argument through)."""
    fn = next((n for n in top_level(tree.body) if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        bound = any(name in assigns(n) for n in top_level(tree.body))
        return bound, f"{name} is bound at module level but not by a def" if bound else f"no function {name}"
    return True, None


def check_imported(tree: ast.Module, name: str) -> tuple[bool, str | None]:
    """`name` bound at module level by a `from ... import name` (a caller's by-name binding of a function
    patched at its home too: SGLang's base runner's import of the autotune gate)."""
    bound = any(
        isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name for a in n.names)
        for n in top_level(tree.body)
    )
    return bound, None if bound else f"no module-level `from ... import {name}`"


def check_enum(tree: ast.Module, attr: str) -> tuple[bool, str | None]:
    """Fp4GemmRunnerBackend has AUTO/FLASHINFER_CUDNN/FLASHINFER_CUTLASS and the module global exists."""
    cls = find_class(tree, "Fp4GemmRunnerBackend")
    if cls is None:
        return False, "no enum Fp4GemmRunnerBackend"
    values = {
        name: stmt.value.value
        for stmt in cls.body
        for name in assigns(stmt)
        if isinstance(getattr(stmt, "value", None), ast.Constant)
    }
    wrong = {k: values.get(k) for k, v in ENUM_MEMBERS.items() if values.get(k) != v}
    if wrong:
        return True, f"Fp4GemmRunnerBackend members differ: {wrong} (expected {ENUM_MEMBERS})"
    if not any(attr in assigns(n) for n in top_level(tree.body)):
        return True, f"no module global {attr}"
    return True, None


def check_moe_config(tree: ast.Module, name: str) -> tuple[bool, str | None]:
    """`def initialize_moe_config(...)` at module level that sets the MoE runner backend (the module
    global MOE_RUNNER_BACKEND or `<flags>.runner_backend`): the hook pins 'auto' right after it."""
    present, problem = check_function(tree, name)
    if problem is not None:
        return present, problem
    fn = next(n for n in top_level(tree.body) if isinstance(n, ast.FunctionDef) and n.name == name)
    sets = any(
        isinstance(t, ast.Name)
        and t.id == "MOE_RUNNER_BACKEND"
        or isinstance(t, ast.Attribute)
        and t.attr == "runner_backend"
        for n in ast.walk(fn)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    )
    return (
        True,
        None
        if sets
        else f"{name} sets neither MOE_RUNNER_BACKEND nor <flags>.runner_backend: pinning after it pins nothing",
    )


def _moe_enum_problem(utils: ast.Module | None) -> str | None:
    """What the MoE runner pins need of moe/utils.py: enum MoeRunnerBackend with AUTO and FLASHINFER_CUTLASS."""
    cls = None if utils is None else find_class(utils, "MoeRunnerBackend")
    if cls is None:
        return "no enum MoeRunnerBackend in " + R.MOE_UTILS
    members = {name for stmt in cls.body for name in assigns(stmt)}
    missing = sorted({"AUTO", "FLASHINFER_CUTLASS"} - members)
    return f"MoeRunnerBackend lacks {missing}" if missing else None


def check_moe_global(tree: ast.Module, attr: str) -> tuple[bool, str | None]:
    """moe-runner-backend-pin-legacy: the module global MOE_RUNNER_BACKEND of moe/utils.py (pinned there)."""
    if not any(attr in assigns(n) for n in top_level(tree.body)):
        return False, f"no module global {attr}"
    return True, _moe_enum_problem(tree)


def check_moe_flags(tree: ast.Module, attr: str, src: Path) -> tuple[bool, str | None]:
    """moe-runner-backend-pin: runtime_context's MoeFlags has `runner_backend` (pinned on get_flags().moe),
    and moe/utils.py keeps no module global MOE_RUNNER_BACKEND (the pin takes the global where there is one)."""
    cls = find_class(tree, "MoeFlags")
    fields = set() if cls is None else {name for stmt in cls.body for name in assigns(stmt)}
    if attr not in fields:
        return False, f"runtime_context has no MoeFlags.{attr}"
    utils = parse(src, R.MOE_UTILS)
    if utils is not None and any("MOE_RUNNER_BACKEND" in assigns(n) for n in top_level(utils.body)):
        return True, "moe/utils.py still has the module global MOE_RUNNER_BACKEND, which the pin takes instead"
    if utils is None or not _binds(utils, "get_flags"):
        return True, f"{R.MOE_UTILS} does not bind get_flags (the pin reads get_flags().moe there)"
    return True, _moe_enum_problem(utils)


# What replaces each declared target (targets.TARGETS: (replacement kind, spec)): the FP4 GEMM alias is
# the one the "dispatch" replacement swaps, whatever check function guards it.
_REPLACED_BY = {spec.name: makes for makes, spec in T.TARGETS}


def kind(spec) -> str:
    if spec is T.ENUM_PIN:
        return "enum"
    if spec is MOE_RUNNER_PIN:
        return "moe-flags"
    if spec is MOE_RUNNER_PIN_LEGACY:
        return "moe-global"
    if spec.module == R.MOE_UTILS and spec.attribute == "initialize_moe_config":
        return "moe-config"
    if spec.name.startswith("scheduler-idle-canary"):
        return "idle"
    if spec.attribute.startswith(("ModelRunner.", "Scheduler.", "WeightUpdater.")):
        return "warmup"  # a pass-through wrapper (capture, weight updates): any instance method
    if "." in spec.attribute:
        return "method"
    if spec.module.endswith(".flashinfer_cutlass"):
        return "function"
    if _REPLACED_BY.get(spec.name) == "dispatch":
        return "alias"
    if _REPLACED_BY.get(spec.name) in (
        "decline",
        "autotune-gate",
    ):  # a module's function, or a caller's by-name import of it
        return "imported" if spec.module == R.BASE_RUNNER else "function"
    return "unknown"


def alias_spec(version: str):
    """The FP4 GEMM alias spec that covers `version` (exactly one for every supported release); a
    RuntimeError naming the release otherwise."""
    found = [s for s in T.ledger_rows() if kind(s) == "alias" and Version(version) in SpecifierSet(s.versions)]
    if len(found) != 1:
        raise RuntimeError(
            f"sglang {version}: {len(found)} FP4 GEMM alias specs cover it ({[s.name for s in found]}); "
            "exactly one must (sm120_fp4/sglang/targets.py)"
        )
    return found[0]


# Specs whose target also exists outside their range, deliberately unpatched there (why).
_NO_SEAM = "before 0.5.15 there is no fused-MoE seam to verify: NVFP4 MoE layers are refused there, nothing to pin"
NARROW_ON_PURPOSE = {
    "post-capture-recheck-model-workers": "from 0.5.14 graphs are captured later, in init_all_cuda_graphs (patched instead)",
    "moe-runner-config-hook": _NO_SEAM,
    "moe-runner-backend-pin-legacy": _NO_SEAM,
}

CHECKS = {
    "alias": check_alias,
    "method": check_method,
    "warmup": check_warmup,
    "idle": check_idle,
    "function": check_function,
    "imported": check_imported,
    "enum": check_enum,
    "moe-config": check_moe_config,
    "moe-global": check_moe_global,
    "moe-flags": check_moe_flags,
}
NEEDS_SOURCES = {"moe-flags"}  # checks that read a second module of the release


def check_spec(spec, version: str, src: Path) -> tuple[str, str]:
    applies = Version(version) in SpecifierSet(spec.versions or R.SUPPORTED)
    how = CHECKS.get(kind(spec))
    if how is None:
        return FAIL, f"no check for {spec.name} ({spec.module}.{spec.attribute}): extend CHECKS in this script"
    tree = parse(src, spec.module)
    extra = (src,) if kind(spec) in NEEDS_SOURCES else ()
    present, problem = (False, f"no module {spec.module}") if tree is None else how(tree, spec.attribute, *extra)
    if applies:
        return (OK, "") if problem is None else (FAIL, problem)
    if present and problem is None and spec.name not in NARROW_ON_PURPOSE:
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
        out["plugins"] = (
            (OK, "")
            if group and function(tree, "load_plugins")
            else (FAIL, f"plugins/__init__.py lacks load_plugins() or the entry-point group {PLUGINS!r}")
        )
    fn = function(parse(src, RUNTIME_CONTEXT), "override_platform")
    if fn is not None:
        out["override_platform"] = (
            (OK, "")
            if fn.args.kwarg and not fn.args.args
            else (FAIL, f"override_platform({ast.unparse(fn.args)}) is not (**facts)")
        )
    return out


# ---------------------------------------------------------------- the simulation's stand-ins
# Where the simulation expects to use each stand-in, it must find its target; the quantizers (taken
# by what SGLang's code calls, not by version) and the Blackwell check must be called exactly in
# their ledger range, so that the ledger's "Releases" stays true.

STAND_IN_CALLERS = {
    **{spec.name: S.QUANTIZER_CALLERS[spec.module] for spec in S.QUANTIZERS},
    "sim-blackwell-check": "ModelOptFp4LinearMethod.process_weights_after_loading",
}


def _loads(fn: ast.FunctionDef, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(fn))


def _binds(tree: ast.Module, name: str) -> bool:
    """A module-level binding of `name` (an import under that name or an assignment)."""
    for node in top_level(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
        if name in assigns(node):
            return True
    return False


def check_stand_in(spec, version: str, src: Path) -> tuple[str, str]:
    """A caller-decided stand-in: called by its caller in its range (and, where it replaces a module
    global, that global bound), not called outside it."""
    caller = STAND_IN_CALLERS[spec.name]
    applies = Version(version) in SpecifierSet(spec.versions or R.SUPPORTED)
    tree = parse(src, spec.module)
    fn, problem = (None, f"no module {spec.module}") if tree is None else _method(tree, caller)
    called = fn is not None and _loads(fn, spec.attribute)
    if not applies:
        return (
            (
                FAIL,
                f"{caller} calls {spec.attribute}, but the range {spec.versions} excludes {version}: the ledger "
                "would be wrong (range too narrow?)",
            )
            if called
            else (NA, "")
        )
    if fn is None:
        return FAIL, f"the simulation reads {caller}: {problem}"
    if not called:
        return FAIL, f"{caller} does not call {spec.attribute}: the stand-in cannot take effect (range too wide?)"
    if not _binds(tree, spec.attribute):
        return (
            FAIL,
            f"{caller} calls {spec.attribute}, but {spec.module} binds no module global of that name to replace",
        )
    return OK, ""


def _op_registrations(tree: ast.Module) -> list[tuple[ast.FunctionDef, ast.expr]]:
    """The module-level functions registered as the op sglang::fp4_gemm, with their decorator:
    SGLang's ``register_custom_op`` (op name = function name; it registers a GPU kernel only) or
    ``torch.library.custom_op("sglang::fp4_gemm", ...)``."""
    found = []
    for fn in (n for n in top_level(tree.body) if isinstance(n, ast.FunctionDef)):
        for d in fn.decorator_list:
            call = d.func if isinstance(d, ast.Call) else d
            name = ast.unparse(call)
            if name.endswith("register_custom_op") and fn.name == "fp4_gemm":
                found.append((fn, d))
            elif (
                name.endswith("custom_op")
                and isinstance(d, ast.Call)
                and d.args
                and isinstance(d.args[0], ast.Constant)
                and d.args[0].value == S.OP_NAME
            ):
                found.append((fn, d))
    return found


def _device_specific(decorator: ast.expr) -> bool:
    """Whether the registration gives the op a kernel for some devices only (no CPU kernel on a CPU):
    SGLang's register_custom_op (CUDA/XPU/NPU/MUSA, never CPU), or custom_op(..., device_types=...)."""
    call = decorator.func if isinstance(decorator, ast.Call) else decorator
    if ast.unparse(call).endswith("register_custom_op"):
        return True
    return any(
        k.arg == "device_types" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
        for k in getattr(decorator, "keywords", [])
    )


def check_cpu_kernel(version: str, src: Path) -> tuple[str, str]:
    """sim-fp4-gemm-cpu-kernel, exactly in its ledger range: where modelopt_quant registers
    sglang::fp4_gemm for the GPU only, the simulation registers the op's Python body for CPU (a
    body that calls flashinfer_fp4_gemm, the patched alias); where the op is registered for every
    device (torch.library.custom_op without device_types) or absent, nothing is needed."""
    spec = S.FP4_GEMM_CPU_KERNEL
    applies = Version(version) in SpecifierSet(spec.versions or R.SUPPORTED)
    tree = parse(src, R.MQ)
    registered = [] if tree is None else _op_registrations(tree)
    needs = [(fn, d) for fn, d in registered if _device_specific(d)]
    if not applies:
        if needs:
            return FAIL, (
                f"{S.OP_NAME} is registered for the GPU only ({ast.unparse(needs[0][1])} at line "
                f"{needs[0][0].lineno}), but the range {spec.versions} excludes {version}: no CPU kernel (range too narrow?)"
            )
        return NA, ""
    if not needs:
        how = f"registered for every device ({ast.unparse(registered[0][1])})" if registered else "absent"
        return FAIL, f"{S.OP_NAME} is {how} in {version}: no CPU kernel needed, the range {spec.versions} is too wide"
    fn = needs[0][0]
    if _loads(fn, "flashinfer_fp4_gemm") or _binds(tree, "flashinfer_fp4_gemm"):
        return OK, ""
    return (
        FAIL,
        f"the {S.OP_NAME} op body neither calls nor has flashinfer_fp4_gemm: no Python body to register for CPU",
    )


def check_kernel_package(version: str, src: Path) -> tuple[str, str]:
    """sim-kernel-package: where the import check installs the release's kernel package (PINS
    kernel "pinned"), the release's METADATA requires one (the package the stand-in replaces)."""
    if pins_for(version)["kernel"] != "pinned":
        return NA, ""
    meta = release_pins(src)
    return (OK, "") if any(d in meta for d in KERNEL_DISTS) else (FAIL, f"METADATA requires none of {KERNEL_DISTS}")


def check_stand_ins(version: str, src: Path) -> dict[str, tuple[str, str]]:
    """{stand-in name: (state, reason)} for the simulation's stand-ins that have a target in SGLang's source."""
    rows = {spec.name: check_stand_in(spec, version, src) for spec in S.ledger_rows() if spec.name in STAND_IN_CALLERS}
    rows[S.FP4_GEMM_CPU_KERNEL.name] = check_cpu_kernel(version, src)
    rows[S.KERNEL_PACKAGE_STAND_IN.name] = check_kernel_package(version, src)
    return rows


def check_version(version: str, cache: Path = DEFAULT_CACHE) -> dict[str, tuple[str, str]]:
    """{column: (ok | n/a | FAIL, reason)} for one release; columns are spec names + coverage + extras
    + the simulation's stand-ins (sim-*; sim-platform-facts is the override_platform column)."""
    src = sources(version, cache)
    rows = T.ledger_rows()
    result = {spec.name: check_spec(spec, version, src) for spec in rows}
    aliases = [s.name for s in rows if kind(s) == "alias" and Version(version) in SpecifierSet(s.versions)]
    supported, why = R.RELEASE.support(version)
    if not supported:
        result["coverage"] = (FAIL, why)
    elif not aliases:
        result["coverage"] = (FAIL, "no mm_fp4 alias spec covers this release: the GEMM would run unpatched")
    else:
        result["coverage"] = (OK, "")
    result.update(check_extras(src))
    result.update(check_stand_ins(version, src))
    return result


def check_outside(version: str) -> str | None:
    """None when nothing applies to `version` (a release outside SUPPORTED), else what does."""
    applying = [s.name for s in T.ledger_rows() if Version(version) in SpecifierSet(s.versions or R.SUPPORTED)]
    if R.RELEASE.support(version)[0] or applying:
        return f"{version} is outside {R.SUPPORTED} but is supported/covered by {applying}"
    return None


# ---------------------------------------------------------------- import check (real SGLang in a venv)

# What each release's CPU venv gets, recorded here so that an import check needs no hand-found flag.
# Rows are applied in order; a later row overrides the fields it names for the releases it matches.
#   torch / torchvision: installed instead of the release's own pin. torch 2.14.1 (CUDA 13.0 build,
#     runs on a CPU) and torchvision 0.29.1 are the only builds on this machine's disk (a local
#     index); any other torch is a ~3-6 GB download with its own nvidia-* set. Every release below
#     was run with them (import, patches, demo, integration tests: docs/RELEASES.md): SGLang's FP4
#     linear path and the modules it imports use no torch API that 2.14 removed. (0.5.18-0.5.21 pin
#     torch 2.13.0, whose only local build is CPU-only with no matching torchvision: that was the
#     old --torch 2.14.1 flag; 0.5.8-0.5.17 pin 2.9.1/2.11.0, none of them on disk.)
#   flashinfer / transformers: None = the release's own pin, read from its wheel's METADATA.
#   extra: distributions the release's import of modelopt_quant needs beyond setup_env.sh's lists
#     (found by trial once, recorded here); each is installed at the release's own pin when its
#     METADATA has one, unpinned otherwise.
#   kernel: the CUDA-only kernel package (sgl-kernel <= 0.5.10.post1, sglang-kernel from 0.5.11).
#     "pinned": the release's own pin, --no-deps, as `pip install sglang==X` would bring it; on a
#     CPU its import fails (libnvrtc.so.12/libcuda.so.1), which is the case the simulation's
#     kernel stand-in must handle. "absent": not installed (SGLang's FP4 modules import without it).
TORCH_LOCAL = {"torch": "2.14.1", "torchvision": "0.29.1"}
PINS: tuple[tuple[str, dict], ...] = (
    (
        ">=0.5.8,<0.5.24",
        dict(
            **TORCH_LOCAL,
            flashinfer=None,
            transformers=None,
            extra=(),
            kernel="absent",
            why="torch 2.14.1: the local CUDA build; SGLang's FP4 path imports and runs with it",
        ),
    ),
    # 0.5.8-0.5.10.post1 import sgl_kernel on the way to modelopt_quant (unguarded, in
    # moe_runner/deep_gemm.py): install the pinned one so the run sees what a user's CPU sees.
    (">=0.5.8,<0.5.11", dict(kernel="pinned")),
    # Beyond setup_env.sh's lists, each era's modelopt_quant import reaches (found by the trial loop
    # below on 0.5.8-0.5.10, 0.5.12, 0.5.13, 0.5.15; releases in between take their era's row):
    (">=0.5.8,<0.5.11", dict(extra=("openai", "partial-json-parser"))),
    (">=0.5.11,<0.5.18", dict(extra=("openai", "partial-json-parser", "einops"))),
)
KERNEL_DISTS = ("sgl-kernel", "sglang-kernel")


def pins_for(version: str) -> dict:
    """The PINS rows that match `version`, merged in order (fields of later rows win)."""
    merged: dict = {}
    for spec, fields in PINS:
        if Version(version) in SpecifierSet(spec):
            merged.update(fields)
    if not merged:
        raise RuntimeError(f"no PINS row covers sglang {version}: add one to scripts/sglang_matrix.py")
    return merged


SNIPPET = r"""
import importlib, json, sys, traceback, warnings
warnings.simplefilter("ignore")
args = json.loads(sys.argv[1])
out = {"stage": "import flashinfer"}
try:
    import flashinfer
    original = flashinfer.mm_fp4
    import sm120_fp4
    out["stage"] = "install(simulate='12.0')"
    # The serving canary on: its idle hook (patched only then) is checked with the others.
    sm120_fp4.install(simulate="12.0", backends="emulated", enable="on", canary="60")
    out["stage"] = "import SGLang"
    out["not_importable"] = {}
    for name in args["modules"]:
        out["stage"] = "import " + name
        try:
            importlib.import_module(name)
        except Exception as exc:
            if name not in args["optional"]:
                raise
            out["not_importable"][name] = (type(exc).__name__ + ": " + str(exc).strip().splitlines()[0])[:200]
    mq = sys.modules[args["mq"]]
    out["stage"] = "check patches"
    out["states"] = {p.name: [p.state, p.reason] for p in sm120_fp4.status().patches}
    alias = args["alias"]
    out["alias_patched"] = getattr(getattr(mq, alias, None), "__wrapped__", None) is original
    fp4_utils = sys.modules.get(args["fp4_utils"])
    enum = getattr(fp4_utils, "Fp4GemmRunnerBackend", None)
    out["enum_members"] = None if enum is None else [m.name for m in enum]
    out["targets_present"] = {}
    missing = object()
    for name, (module, attribute) in args["targets"].items():
        owner = sys.modules.get(module, missing)
        for part in attribute.split("."):
            owner = getattr(owner, part, missing) if owner is not missing else missing
        out["targets_present"][name] = owner is not missing  # the name exists (its value may be None)
    out["stage"] = "uninstall()"
    sm120_fp4.uninstall()
    hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    out["alias_restored"] = getattr(mq, alias, None) is original
    out["hook_restored"] = not hasattr(hook, "__wrapped__")
    out["left_after_uninstall"] = [p.name for p in sm120_fp4.status().patches]
    out["finders_left"] = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path
                           if type(f).__module__.startswith("sm120_fp4")]
    out["stage"] = "done"
except BaseException as exc:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = next((ln for ln in lines if "cannot open shared object" in ln), None)  # sgl_kernel's real reason
    out["error"] = (type(exc).__name__ + ": " + " ".join(lines[:1] + ([cause] if cause and cause not in lines[:1] else [])))[:400]
    out["traceback"] = traceback.format_exc().splitlines()[-14:]
print("MATRIX-RESULT " + json.dumps(out, default=str))
sys.exit(1 if "error" in out else 0)
"""


MAX_ADDED_DEPS = 20
IMPORT_NAMES = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "cv2": "opencv-python-headless",
    "partial_json_parser": "partial-json-parser",
}
STEPS = ("import", "demo", "tests")
TEST_FILES = tuple(
    Path("tests") / f
    for f in ("test_sglang.py", "test_sglang_verify.py", "test_sglang_moe.py", "test_sglang_moe_layers.py")
)


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


def exact(specifier: str | None) -> str | None:
    """'==1.2' -> '1.2' (None for anything looser)."""
    match = re.fullmatch(r"==\s*([\w.+!-]+)", specifier or "")
    return match.group(1) if match else None


def resolve(version: str, cache: Path, flashinfer: str | None = None) -> dict:
    """The install plan of one release: PINS merged with what its METADATA pins; `flashinfer`, when
    given, replaces the release's flashinfer-python pin (the FlashInfer axis)."""
    meta = release_pins(sources(version, cache))
    plan = pins_for(version)
    for field, dist in (("flashinfer", "flashinfer-python"), ("transformers", "transformers")):
        if plan[field] is None:
            plan[field] = exact(meta.get(dist))
            if plan[field] is None:
                raise RuntimeError(
                    f"sglang {version}: METADATA pins no exact {dist} ({meta.get(dist)!r}); set it in PINS"
                )
    plan["kernel_req"] = None
    if plan["kernel"] == "pinned":
        dist = next((d for d in KERNEL_DISTS if d in meta), None)
        if dist is None or exact(meta[dist]) is None:
            raise RuntimeError(f"sglang {version}: kernel 'pinned' but METADATA pins none of {KERNEL_DISTS}")
        plan["kernel_req"] = f"{dist}=={exact(meta[dist])}"
    plan["meta"] = meta
    plan["flashinfer_axis"] = flashinfer
    if flashinfer is not None:
        plan["flashinfer"] = flashinfer
    plan["deviations"] = [
        f"{name} {plan[field]} (release pins {meta.get(name)})"
        for field, name in (("torch", "torch"), ("torchvision", "torchvision"), ("flashinfer", "flashinfer-python"))
        if exact(meta.get(name)) not in (None, plan[field])
    ]
    return plan


def row_key(version: str, flashinfer: str | None) -> str:
    """A results row's release cell: the release, or RELEASE+flashinfer-VERSION on the FlashInfer axis."""
    return version if flashinfer is None else f"{version}+flashinfer-{flashinfer}"


def release_of(key: str) -> str:
    return key.split("+flashinfer-", 1)[0]


def pins_summary(plan: dict) -> str:
    kernel = plan["kernel_req"] or "no kernel pkg"
    extra = f", +{'/'.join(plan['extra'])}" if plan["extra"] else ""
    return (
        f"torch {plan['torch']}, flashinfer {plan['flashinfer']}, transformers {plan['transformers']}, {kernel}{extra}"
    )


def venv_dir(version: str, flashinfer: str | None = None) -> Path:
    return ROOT / ".cache" / "venvs" / f"sglang-{row_key(version, flashinfer)}"


def build_venv(version: str, cache: Path, plan: dict) -> Path:
    """Create (or top up) the release's CPU venv as `plan` says; returns its python."""
    venv = venv_dir(version, plan["flashinfer_axis"])
    logs = venv / ".logs"
    py = venv / "bin" / "python"
    pinned = [
        f"torch=={plan['torch']}",
        f"torchvision=={plan['torchvision']}",
        "triton",
    ]  # in every call: pip never swaps torch

    def pip(step: str, *args: str) -> None:
        print(f"[{version}] pip install {' '.join(args)}", flush=True)
        logs.mkdir(parents=True, exist_ok=True)
        run = subprocess.run(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", *args], capture_output=True, text=True
        )
        (logs / f"{step}.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"pip install failed at step {step} (full log {logs / step}.log):\n{tail}")

    meta = plan["meta"]
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    deps = []  # setup_env.sh's lists with this release's pins where it has them (else unpinned)
    for item in (
        bash_array(setup, "FLASHINFER_DEPS") + bash_array(setup, "SGLANG_DEPS") + bash_array(setup, "PROJECT_DEPS")
    ):
        name = canonicalize_name(Requirement(item).name)
        deps.append(f"transformers=={plan['transformers']}" if name == "transformers" else name + meta.get(name, ""))
    deps += [canonicalize_name(e) + meta.get(canonicalize_name(e), "") for e in plan["extra"]]
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip("pip", "--upgrade", "pip")
    pip("torch", *pinned)
    pip("flashinfer", "--no-deps", f"flashinfer-python=={plan['flashinfer']}")
    pip("sglang", "--no-deps", str(wheel_for(version, cache)))
    if plan["kernel_req"]:
        pip("kernel", "--no-deps", plan["kernel_req"])
    pip("deps", *pinned, *deps)
    pip("project", "--no-deps", "-e", str(ROOT))  # also puts sm120_fp4.pth in site-packages (spawned workers)
    return py


def _env(repo: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    env["PYTHONPATH"] = str(repo)  # before site-packages: `repo` is the sm120_fp4 that runs
    return env


def run_import(version: str, py: Path, repo: Path, plan: dict) -> dict:
    """install(simulate) + import SGLang's modules + patches checked + uninstall() restores."""
    v = Version(version)
    rows = T.ledger_rows()
    runtime = [s for s in rows if s.make is not None and v in SpecifierSet(s.versions)]
    alias = alias_spec(version).attribute
    args = {
        "modules": sorted({s.module for s in runtime}),
        "mq": R.MQ,
        "fp4_utils": R.FP4_UTILS,
        "alias": alias,
        "targets": {s.name: (s.module, s.attribute) for s in rows},
        # the model runner and the scheduler are the GPU server's modules: some releases import
        # server-only packages there. Their hooks are then source-checked only, and the
        # row says so.
        "optional": [R.MODEL_RUNNER, R.SCHEDULER, R.SCHEDULER_CHECKER],
    }
    added, run = [], None
    for _ in range(MAX_ADDED_DEPS + 1):  # a release that needs more than PINS says: add by trial, report it
        run = subprocess.run(
            [str(py), "-c", SNIPPET, json.dumps(args)],
            capture_output=True,
            text=True,
            cwd=py.parent.parent,
            env=_env(repo),
            timeout=900,
        )
        missing = re.search(r"No module named '([\w]+)", run.stdout + run.stderr)
        name = missing and canonicalize_name(IMPORT_NAMES.get(missing.group(1), missing.group(1)))
        if run.returncode == 0 or not missing or name not in plan["meta"] or len(added) == MAX_ADDED_DEPS:
            break
        added.append(name + plan["meta"][name])
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                f"torch=={plan['torch']}",
                f"torchvision=={plan['torchvision']}",
                added[-1],
            ],
            capture_output=True,
            text=True,
        )
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("MATRIX-RESULT ")), None)
    got = (
        json.loads(line.removeprefix("MATRIX-RESULT "))
        if line
        else {"error": f"snippet died (rc {run.returncode})", "traceback": run.stderr.splitlines()[-14:]}
    )
    problems = []
    if "error" in got:
        problems.append(f"{got['stage']}: {got['error']}")
    else:
        states = got["states"]
        skipped_modules = got.get("not_importable", {})
        expected = sorted(s.name for s in runtime if s.module not in skipped_modules)
        problems += [
            f"{n}: {states.get(n, ['missing', None])}" for n in expected if states.get(n, ["missing"])[0] != "applied"
        ]
        quantizers = {n: st for n, st in states.items() if n.startswith("sim-activation-quantizer")}
        if not any(st[0] == "applied" for st in quantizers.values()):
            problems.append(f"simulated activation quantizer not applied: {quantizers}")
        problems += [f"{key} is false" for key in ("alias_patched", "alias_restored", "hook_restored") if not got[key]]
        if got["left_after_uninstall"]:
            problems.append(f"patches left after uninstall: {got['left_after_uninstall']}")
        if got["finders_left"]:
            problems.append(f"import finders left after uninstall: {got['finders_left']}")
    got.update(ok=not problems, problems=problems, deps_added=added, alias=alias)
    return got


def run_demo(py: Path, repo: Path) -> dict:
    """`python -m sm120_fp4 demo`: must exit 0 and print a bit-exact forward pass."""
    run = subprocess.run(
        [str(py), "-m", "sm120_fp4", "demo"],
        capture_output=True,
        text=True,
        cwd=py.parent.parent,
        env=_env(repo),
        timeout=900,
    )
    text = run.stdout + run.stderr
    exact_line = next((ln.strip() for ln in text.splitlines() if "bit-exact:" in ln), None)
    ok = run.returncode == 0 and exact_line is not None and "bit-exact: True" in exact_line
    error = (
        None if ok else next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), f"rc {run.returncode}")
    )
    return {"ok": ok, "rc": run.returncode, "bit_exact": exact_line, "error": error, "tail": text.splitlines()[-30:]}


def run_tests(py: Path, repo: Path) -> dict:
    """The repo's integration test file against this release; its pytest summary and failures."""
    run = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *(str(repo / f) for f in TEST_FILES)],
        capture_output=True,
        text=True,
        cwd=repo,
        env=_env(repo),
        timeout=1800,
    )
    lines = run.stdout.splitlines()
    summary = next(
        (ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)),
        f"rc {run.returncode}",
    )
    failed = [ln.removeprefix("FAILED ").removeprefix("ERROR ") for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    skipped_all = run.returncode == 0 and "passed" not in summary
    skipped = sorted(
        {re.sub(r"^SKIPPED \[(\d+)\] [^:]+:\d+: ", r"(\1) ", ln) for ln in lines if ln.startswith("SKIPPED [")}
    )
    return {
        "ok": run.returncode == 0 and not skipped_all,
        "rc": run.returncode,
        "summary": summary,
        "failed": failed,
        "skipped": skipped,
        "tail": lines[-40:],
    }


def use_venv(venv: Path, version: str, plan: dict) -> Path:
    """An existing venv of `version` (--venv): its SGLang checked, the FlashInfer axis's release installed."""
    py = venv / "bin" / "python"
    run = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('sglang'))"], capture_output=True, text=True
    )
    if run.returncode != 0 or run.stdout.strip() != version:
        raise RuntimeError(
            f"--venv {venv}: holds sglang {run.stdout.strip() or '(none: ' + run.stderr.strip()[-200:] + ')'}, not {version}"
        )
    if plan["flashinfer_axis"] is not None:
        print(f"[{version}] pip install --no-deps flashinfer-python=={plan['flashinfer']} into {venv}", flush=True)
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                f"flashinfer-python=={plan['flashinfer']}",
            ],
            check=True,
        )
    return py


def check_release(
    version: str,
    cache: Path,
    steps: tuple[str, ...],
    repos: list[Path],
    keep_venv: bool,
    flashinfer: str | None = None,
    venv: Path | None = None,
) -> list[dict]:
    """Build the release's venv (or use `venv`), run `steps` with each repo's sm120_fp4, delete the venv unless kept."""
    plan = resolve(version, cache, flashinfer)
    results = []
    base = {
        "release": row_key(version, flashinfer),
        "pins": pins_summary(plan),
        "deviations": plan["deviations"],
        "date": datetime.date.today().isoformat(),
    }
    labels = {repo: repo_label(repo) for repo in repos}
    keep_venv = keep_venv or venv is not None
    built = venv or venv_dir(version, flashinfer)
    try:
        py = use_venv(venv, version, plan) if venv is not None else build_venv(version, cache, plan)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        return [dict(base, repo=str(r), code=labels[r], build_error=str(exc), ok=False) for r in repos]
    try:
        for repo in repos:
            row = dict(base, repo=str(repo), code=labels[repo])
            if "import" in steps:
                row["import"] = run_import(version, py, repo, plan)
                print(
                    f"[{version}] import+patches ({repo}): "
                    + ("OK" if row["import"]["ok"] else "FAIL: " + "; ".join(row["import"]["problems"])),
                    flush=True,
                )
            if "demo" in steps:
                row["demo"] = run_demo(py, repo)
                print(
                    f"[{version}] demo ({repo}): "
                    + ("OK " + row["demo"]["bit_exact"] if row["demo"]["ok"] else f"FAIL: {row['demo']['error']}"),
                    flush=True,
                )
            if "tests" in steps:
                row["tests"] = run_tests(py, repo)
                print(
                    f"[{version}] SGLang test files ({repo}): {row['tests']['summary']}"
                    + "".join(f"\n    FAILED {f}" for f in row["tests"]["failed"]),
                    flush=True,
                )
            row["ok"] = all(row[s]["ok"] for s in steps if s in row)
            results.append(row)
    finally:
        if keep_venv:
            print(f"[{version}] venv kept at {built} (remove with: rm -rf {built})")
        else:
            shutil.rmtree(built, ignore_errors=True)
            print(f"[{version}] venv deleted", flush=True)
    return results


def cell(row: dict, step: str) -> str:
    got = row.get(step)
    if got is None:
        return "not run"
    if step == "import":
        if got["ok"]:
            missing = "; ".join(
                f"{m.rsplit('.', 1)[-1]} not importable on this CPU venv ({e}): its hook source-checked only"
                for m, e in got.get("not_importable", {}).items()
            )
            states = got.get("states", {})
            quantizer = "activation quantizer stand-in for " + (
                ", ".join(
                    f"{spec.module.rsplit('.', 1)[-1]}.{spec.attribute}"
                    for spec in S.QUANTIZERS
                    if states.get(spec.name, [None])[0] == "applied"
                )
                or "nothing"
            )
            kernel = (
                "; the CUDA-only sgl_kernel cannot load here: its stand-in imported"
                if states.get(S.KERNEL_PACKAGE_STAND_IN.name, [None])[0] == "applied"
                else ""
            )
            notes = "; ".join(n for n in (missing,) if n)
            return f"ok: patched ({quantizer}{kernel}), restored by uninstall()" + (f" ({notes})" if notes else "")
        return "FAIL: " + "; ".join(got["problems"])[:300]
    if step == "demo":
        return ("ok: " + got["bit_exact"]) if got["ok"] else f"FAIL (rc {got['rc']}): {got['error']}"[:300]
    text = got["summary"]
    if got["failed"]:
        text += ": " + "; ".join(f.split(" - ")[0].split("::")[-1] for f in got["failed"])
    if got.get("skipped"):
        text += "; skipped: " + "; ".join(got["skipped"])
    return text[:700]


def repo_label(repo: Path) -> str:
    """`name@shorthash` (+ `+changes` when the work tree differs from it) of the checkout that ran."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    top = git("rev-parse", "--show-toplevel")
    head = git("rev-parse", "--short", "HEAD")
    if not head or Path(top).resolve() != repo.resolve():  # a folder inside another checkout (an exported snapshot)
        return repo.name
    return f"{repo.name}@{head}" + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def earlier_rows(path: Path | None, run: set[str]) -> dict[str, str]:
    """The table lines of an earlier report at `path` for the releases not in `run` (kept as they
    are: each names the commit and date that ran it)."""
    if path is None or not path.is_file():
        return {}
    found = (re.match(r"\| (\S+) \| ", line) for line in path.read_text().splitlines())
    return {m.group(1): m.string for m in found if m and release_of(m.group(1)) in RELEASES and m.group(1) not in run}


def row_order(key: str) -> tuple[int, str]:
    """Rows by release, the release's own row before its FlashInfer-axis rows."""
    order = {v: i for i, v in enumerate(RELEASES)}
    return order.get(release_of(key), len(order)), key


def markdown(rows: list[dict], kept: dict[str, str] | None = None) -> str:
    head = [
        "release",
        "sm120_fp4 commit",
        "pins (what the venv got)",
        "import + patches + uninstall",
        "demo",
        "integration tests",
        "outcome",
        "date",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines = dict(kept or {})
    for row in rows:
        code = row.get("code", row["repo"]).split("@", 1)[-1]  # the commit (a checkout's folder name says nothing)
        if "build_error" in row:
            cells = [
                row["release"],
                code,
                row["pins"],
                "venv build failed: " + row["build_error"].splitlines()[0],
                "not run",
                "not run",
                "FAIL",
                row["date"],
            ]
        else:
            cells = [
                row["release"],
                code,
                row["pins"],
                cell(row, "import"),
                cell(row, "demo"),
                cell(row, "tests"),
                "ok" if row["ok"] else "FAIL",
                row["date"],
            ]
        lines[row["release"]] = "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"
    out += [lines[v] for v in sorted(lines, key=row_order)]
    return "\n".join(out) + "\n"


REPORT_HEAD = """# SGLang releases: what was run, and the outcome

Generated by `scripts/sglang_matrix.py` (do not edit by hand). The rows: one release per era of
SGLang's FP4 path and the newest release (last post release) of every minor, the one
`pip install "sglang~=0.5.N.0"` gets (`--releases table`). For each, one CPU venv with the
release's own wheel and the pins recorded in the script's `PINS` (the table's "pins" column), then, with
`sm120_fp4.install(simulate="12.0")`:

- **import + patches + uninstall**: SGLang's real FP4 modules imported; every runtime patch of the
  release applied (the ledger's rows for it), the simulated activation quantizer in place (in
  parentheses: which one took effect, by what the release's `apply()` calls, and whether the
  CUDA-only `sgl_kernel` needed its stand-in); then `uninstall()` restored every original and left
  no import finder;
- **demo**: `python -m sm120_fp4 demo` (a real `ModelOptFp4LinearMethod` layer through the patched
  path, bit-exact with the oracle; the MoE part and the refusals);
- **integration tests**: the four test files that import the real SGLang (`tests/test_sglang.py`,
  `test_sglang_verify.py`, `test_sglang_moe.py`, `test_sglang_moe_layers.py`) with that release; the
  skipped ones and why are listed (expectations are read from the release: no fused-MoE seam
  before 0.5.15, so its NVFP4 MoE layers are refused there; a simulated
  FusedMoE layer needs SGLang's scoped runtime seams, which 0.5.22+ have, so on 0.5.15-0.5.21 the
  MoE seam and hooks are checked by the import step, not at a running layer). SGLang is installed
  `--no-deps` with what its FP4 modules import, not its server packages: where the scheduler or
  model runner module needs one (setproctitle, xgrammar, uvicorn), the import step checks their
  hooks in the source (the row says so) and a test that needs the module is skipped, naming it.

Each row names the commit of sm120_fp4 that ran it (a release re-run after a fix shows the later
commit).

A row `RELEASE+flashinfer-VERSION` is the FlashInfer axis: the same release with another
flashinfer-python installed (`--flashinfer VERSION`, `--no-deps`) in place of its pin, what a user who
upgrades FlashInfer gets; its "pins" column names the FlashInfer that ran.

This is a simulation on a CPU: it proves the wiring on each release, not an SM120 kernel.
Re-run: `.venv/bin/python scripts/sglang_matrix.py --releases table --demo --run-tests --report docs/RELEASES.md --json R.json`
(one venv at a time, ~7 GB, deleted after each; about 10 minutes per release, the venv's build included, on 2 idle cores;
a subset, `--releases A,B`, rewrites its rows and keeps the others as they were).
"""


def source_section(source: dict) -> str:
    """The source check's summary (every release's wheel, read with ast) for the report."""
    releases = source.get("releases", {})
    failing = {v: [k for k, (st, _) in r.items() if st == FAIL] for v, r in releases.items()}
    bad = {v: f for v, f in failing.items() if f}
    lines = [
        "",
        SOURCE_TITLE,
        "",
        f"`scripts/sglang_matrix.py` (default mode) read the {len(releases)} releases' wheels "
        f"({', '.join(releases)}): every patch target is where its version range says, and absent where "
        "the range excludes it; releases outside the supported range are left alone. The simulation's "
        "stand-ins too: each activation quantizer and the Blackwell check is called by the method the "
        "simulation reads exactly in its ledger range; the CPU op body and the kernel package are where "
        "the simulation uses them.",
        "",
    ]
    lines.append(
        f"Outcome ({source.get('date', 'date not recorded')}): "
        + ("all ok." if not bad else "FAIL: " + "; ".join(f"{v}: {', '.join(f)}" for v, f in bad.items()))
    )
    return "\n".join(lines) + "\n"


TABLE_TITLE = "## One release per era and the newest of every minor, run"
SOURCE_TITLE = "## Source check of every release"


def write_report(path: Path, rows: list[dict], source: dict | None = None) -> None:
    """The report: `rows` plus the rows of the releases an earlier report at `path` has and `rows`
    lack (kept as they were), and the source check's section (`source`, else the earlier one)."""
    earlier = path.read_text() if path.is_file() else ""
    kept = earlier_rows(path, {row["release"] for row in rows})
    section = (
        source_section(source)
        if source
        else ("\n" + earlier[earlier.index(SOURCE_TITLE) :] if SOURCE_TITLE in earlier else "")
    )
    have = set(kept) | {row["release"] for row in rows}
    missing = [v for v in TABLE_RELEASES if v not in have]
    todo = f"\nNot run yet (of `--releases table`): {', '.join(missing)}.\n" if missing else ""
    path.write_text(REPORT_HEAD + f"\n{TABLE_TITLE}\n\n" + markdown(rows, kept) + todo + section)


def check_releases(
    versions: list[str],
    cache: Path,
    steps: tuple[str, ...],
    repos: list[Path],
    keep_venv: bool,
    report: Path | None,
    json_out: Path | None,
    flashinfer: str | None = None,
    venv: Path | None = None,
) -> int:
    """One release at a time (venv built, run, deleted): the disk holds one venv (~7 GB) at most."""
    rows: list[dict] = []
    for version in versions:
        rows += check_release(version, cache, steps, repos, keep_venv, flashinfer, venv)
        if report:  # rewritten after each release: an interrupted run keeps what it did
            write_report(report, rows)
        if json_out:
            json_out.write_text(json.dumps(rows, indent=2, default=str))
    print(markdown(rows))
    return 0 if all(r["ok"] for r in rows) else 1


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


# One release per era of SGLang's FP4 path: op wrapper, enum members, platform checks and kernel
# package each change somewhere along it.
ERA_RELEASES = (
    "0.5.8",
    "0.5.9",
    "0.5.10",
    "0.5.12",
    "0.5.13",
    "0.5.15",
    "0.5.18",
    "0.5.20",
    "0.5.22",
    "0.5.23",
)


def newest_of_each_minor(releases=RELEASES) -> tuple[str, ...]:
    """The newest release (its last post release, if any) of every minor version in `releases`."""
    newest: dict[tuple[int, ...], str] = {}
    for v in releases:
        key = Version(v).release[:3]
        if key not in newest or Version(v) > Version(newest[key]):
            newest[key] = v
    return tuple(newest[k] for k in sorted(newest))


NEWEST_RELEASES = newest_of_each_minor()
# The releases docs/RELEASES.md has a row for: one per era and the newest of every minor (what
# `pip install "sglang~=0.5.N.0"` gives), in release order.
TABLE_RELEASES = tuple(sorted(set(ERA_RELEASES) | set(NEWEST_RELEASES), key=Version))
RELEASE_SETS = {"era": ERA_RELEASES, "newest": NEWEST_RELEASES, "table": TABLE_RELEASES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel/source cache (default {DEFAULT_CACHE})"
    )
    parser.add_argument("--versions", help="source check: comma-separated subset of the matrix (default: all releases)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--import-check", metavar="VERSION", help="build a venv for VERSION (kept) and import-and-patch the real SGLang"
    )
    parser.add_argument(
        "--releases",
        metavar="LIST",
        help="like --import-check for each release of LIST (comma-separated, or 'era' for "
        f"{','.join(ERA_RELEASES)}; 'newest' for the newest of every minor, {','.join(NEWEST_RELEASES)}; 'table' for "
        "both, the rows of docs/RELEASES.md), one at a time, each venv deleted after its run",
    )
    parser.add_argument(
        "--demo", action="store_true", help="with --import-check/--releases: also run `python -m sm120_fp4 demo` there"
    )
    parser.add_argument(
        "--run-tests", action="store_true", help="with --import-check/--releases: also run the SGLang test files there"
    )
    parser.add_argument(
        "--repo",
        type=Path,
        action="append",
        help="run this checkout's sm120_fp4 and tests (PYTHONPATH); repeatable; default this repo",
    )
    parser.add_argument("--keep-venv", action="store_true", help="with --releases: keep each venv (~7 GB each)")
    parser.add_argument(
        "--flashinfer",
        metavar="VERSION",
        help="with --import-check/--releases: install this flashinfer-python "
        "(--no-deps) instead of the release's pin; rows RELEASE+flashinfer-VERSION",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        metavar="DIR",
        help="with --import-check: an existing venv of that release "
        "(a copy of another; never deleted) instead of building one",
    )
    parser.add_argument(
        "--report", type=Path, help="with --import-check/--releases: write the Markdown results table here"
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="write --report from the --json of earlier --releases runs "
        "(several files: comma-separated; a release in several: the last file's row) and, with --source-json, "
        "the source check's",
    )
    parser.add_argument("--source-json", type=Path, help="with --render: the --json of a source-check run")
    args = parser.parse_args(argv)

    if args.render:
        if not args.report:
            parser.error("--render needs --report")
        latest: dict[str, dict] = {}  # a release run again in a later file: the later run's row
        for part in str(args.render).split(","):
            for row in json.loads(Path(part).read_text()):
                latest[row["release"]] = row
        rows = sorted(latest.values(), key=lambda r: row_order(r["release"]))
        write_report(args.report, rows, json.loads(args.source_json.read_text()) if args.source_json else None)
        print(f"wrote {args.report}")
        return 0

    if args.import_check or args.releases:
        versions = (
            [args.import_check]
            if args.import_check
            else (list(RELEASE_SETS[args.releases]) if args.releases in RELEASE_SETS else args.releases.split(","))
        )
        unknown = [v for v in versions if v not in RELEASES]
        if unknown:
            parser.error(f"not in the matrix: {unknown} (known: {', '.join(RELEASES)})")
        if args.venv is not None and not args.import_check:
            parser.error("--venv needs --import-check (one release's venv)")
        if args.flashinfer is not None and not re.fullmatch(
            r"[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?(\.post[0-9]+)?", args.flashinfer, re.ASCII
        ):
            parser.error(f"--flashinfer {args.flashinfer!r}: a flashinfer-python release such as 0.7.4 or 0.7.2.post1")
        steps = ("import",) + (("demo",) if args.demo else ()) + (("tests",) if args.run_tests else ())
        repos = [r.resolve() for r in (args.repo or [ROOT])]
        try:
            return check_releases(
                versions,
                args.cache,
                steps,
                repos,
                bool(args.import_check or args.keep_venv),
                args.report,
                args.json,
                args.flashinfer,
                args.venv,
            )
        except RuntimeError as exc:
            print(f"import check: {exc}")
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
        args.json.write_text(
            json.dumps({"releases": results, "outside": outside, "date": datetime.date.today().isoformat()}, indent=2)
        )
    failed = any(s == FAIL for row in results.values() for s, _ in row.values()) or any(outside.values())
    print(f"{len(versions)} releases: " + ("FAIL" if failed else "all ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
