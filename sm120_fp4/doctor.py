"""``sm120-fp4 doctor``: everything an issue report needs, as Markdown or ``--json``; every probe guarded."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
from typing import Any, Callable

from .tables import markdown_table
from .versions import KERNEL_DISTRIBUTIONS, installed_version, kernel_mismatches, kernel_versions

__all__ = ["collect", "run"]


def _probe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _torch() -> dict:
    import torch

    return {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}


def _nvcc() -> dict:
    home = os.environ.get("CUDA_HOME")
    path = shutil.which("nvcc") or (os.path.join(home, "bin", "nvcc") if home else None)
    if not path or not os.path.exists(path):
        note = "FlashInfer JIT-compiles SM12x kernels with nvcc on first use: install the CUDA toolkit (>= 12.9 for sm_120f)"
        return {"found": False, "note": note}
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return {"found": True, "path": path, "version": match.group(1) if match else out.strip()[-80:]}


def _flashinfer_env() -> dict:
    from .config import flashinfer_overrides, flashinfer_problem

    return {"variables": flashinfer_overrides(), "problem": flashinfer_problem()}


def _toolchain() -> dict:
    from .backends import flashinfer

    tc = flashinfer.toolchain()
    shown = lambda v: None if v is None else f"{v[0]}.{v[1]}"  # noqa: E731
    found = dict(cuda=shown(tc.cuda), cuda_source=tc.cuda_source, glibc=shown(tc.glibc))
    found["cute_dsl"] = tc.cute_dsl_problem or "importable"
    return {**found, "jit_problem": flashinfer.jit_problem(tc), "b12x_problem": flashinfer.b12x_problem(tc)}


def _humming() -> dict:
    from .backends import humming

    return humming.doctor_info()


def _devices(settings) -> list[dict]:
    from . import devices

    found = devices.list_devices(settings.simulated_capability if settings else None)
    keys = ("index", "name", "capability", "simulated", "source")
    return [{k: "%d.%d" % d.capability if k == "capability" else getattr(d, k) for k in keys} for d in found]


def _activation() -> dict:
    from .sglang.release import PLUGIN_GROUP
    from .toggle import enabled
    from .vllm.allowlist import plugin_problem

    eps = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    ours = [f"{ep.name} -> {ep.value}" for ep in eps if ep.value.startswith("sm120_fp4")]
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    pth = [os.path.join(d, "sm120_fp4.pth") for d in dirs if os.path.exists(os.path.join(d, "sm120_fp4.pth"))]
    allow = os.environ.get("SGLANG_PLUGINS")
    allowed = any(o.split(" ")[0] in allow.split(",") for o in ours) if allow else None
    note = "both activate when SM120_FP4 is set (1 or on; any other value but 0/off is rejected loudly at install); the plugin needs SGLang >= 0.5.11, the .pth works for all releases"
    found = {"toggle": os.environ.get("SM120_FP4"), "active": enabled(), "plugin_entry_point": ours or None}
    found |= {"vllm_plugin_problem": plugin_problem()}  # what launch refuses for vLLM (cli/launch.py)
    return {**found, "plugin_allowed_by_SGLANG_PLUGINS": allowed, "pth_bootstrap": pth or None, "note": note}


def _settings() -> tuple[Any, dict]:
    from .config import load_settings, sources

    settings = load_settings()
    found = {"values": settings.model_dump(mode="json"), "sources": sources({})}
    return settings, {**found, "refused": _refused(settings)}


def _refused(settings) -> list[str]:
    """Return why install(), selftest and launch refuse these settings' backend names, by their own check."""
    from .deciding import FAMILIES, candidate_names
    from .errors import ConfigError

    problems = []
    for family in FAMILIES.values():
        try:
            candidate_names(settings, family=family)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def _engines() -> dict:
    """Return each engine's own rows but SGLang's (doctor's "sglang" section)."""
    from .api import ENGINES

    return {engine.name: _probe(engine.doctor_rows) for engine in ENGINES if engine.name != "sglang"}


def _targets() -> dict:
    from .api import engine

    return engine("sglang").doctor_rows()


def _backends(devs: list[dict]) -> list[dict]:
    from . import backends
    from .devices import Device

    out = []
    kinds = {"dense": (backends.names, backends.is_supported), "moe": (backends.moe_names, backends.is_moe_supported)}
    for d in devs:
        capability = tuple(int(p) for p in d["capability"].split("."))
        device = Device(d["index"], d["name"], capability, d["simulated"], d["source"])
        for family, (names, check) in kinds.items():
            for name, (ok, reason) in ((n, check(n, device)) for n in names()):
                out.append(dict(device=device.label(), family=family, backend=name, supported=ok, reason=reason))
    return out


# Targets whose failure means the runtime patch (or the simulation) cannot do its job here; the
# model runner's post-warm-up seam is reported, but its module imports only on a GPU server.
_ESSENTIAL = frozenset(
    "flashinfer-fp4-gemm-alias modelopt-fp4-weights-hook compressed-tensors-w4a4-weights-hook "
    "fused-moe-kernel-seam modelopt-nvfp4-moe-weights-hook".split()
)


def _import_check(settings=None) -> dict:
    """Return whether each patch target of this SGLang (simulation stand-ins included) would apply, unpatched."""
    # Simulating without CUDA: a kernel package that cannot load (0.5.8-0.5.10) gets a stand-in, reported as a row.
    import torch

    from .patching import dry_run
    from .sglang import release, simulation, targets

    if not release.RELEASE.support()[0]:
        return {"skipped": "no supported SGLang installed"}
    rows = []
    simulating = getattr(settings, "simulated_capability", None) is not None and not torch.cuda.is_available()
    used: list[str] = []
    remove = simulation.kernel_package_stand_in(used.append) if simulating else None
    try:
        for spec in targets.ledger_rows() + simulation.specs():
            if spec.make is None:
                continue  # pins and env knobs: decided at run time
            rows.append(_row(spec.name, *dry_run(spec), spec.name.startswith("sim-")))
    finally:
        if remove is not None:
            remove()
    if used:
        why = f"{simulation.KERNEL_PACKAGE} cannot load here ({used[0]}): the simulation imports a stand-in"
        rows.append(_row(simulation.KERNEL_PACKAGE_STAND_IN.name, "applies", why, True))
    return {"targets": rows}


def _row(name: str, state: str, reason: str | None, simulation: bool) -> dict:
    return {"name": name, "state": state, "reason": reason, "simulation": simulation}


_CANARY_KEYS = ("state", "runs", "failures", "last_run", "busy_s", "share", "longest_slice_ms", "skipped_saturated")


def _canary(settings) -> dict:
    """Return the canary's settings, this SGLang's idle point, and each serving process's last reported counters."""
    import glob

    from .api import ENGINES
    from .canary import settings_problem
    from .sglang import targets

    idle = targets.idle_spec(lambda stream: None)
    point = f"{idle.module}.{idle.attribute} ({idle.versions})" if idle else None
    # What launch refuses for each engine it may start (cli/launch.py's _canary_problem): every supported one here.
    homes = [home for home in ENGINES if home.release.support()[0]]
    problem = settings_problem(settings) or next(
        (p for p in (home.canary_problem(settings) for home in homes) if p), None
    )
    out = dict(
        enabled=settings.canary_period is not None, period_s=settings.canary_period, action=settings.canary_action
    )
    out |= dict(slice_ms=settings.canary_slice_ms, idle_point=point, problem=problem, processes=[])
    if settings.report is not None:
        report = str(settings.report)
        pattern = os.path.join(report, "*.json") if os.path.isdir(report) else report.replace("{pid}", "*")
        for path in sorted(glob.glob(pattern))[:64]:
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            # A report holds one section per process (report.py); each may carry its canary's counters.
            procs = data.get("processes") if isinstance(data, dict) else None
            for proc in procs if isinstance(procs, list) else [data]:
                section = proc.get("canary") if isinstance(proc, dict) else None
                if isinstance(section, dict) and section.get("enabled"):
                    counters = {k: section.get(k) for k in _CANARY_KEYS}
                    out["processes"].append({"pid": proc.get("pid"), "report": path, **counters})
    return out


def collect(deep: bool = True) -> dict:
    """Return every probe's result ({'error': ...} where one failed); `deep` also imports SGLang to check targets."""
    from . import __version__

    names = ("torch", "flashinfer-python", *KERNEL_DISTRIBUTIONS, "sglang", "humming-kernels", "nvidia-ml-py")
    report: dict[str, Any] = {"sm120_fp4": __version__, "python": sys.version.split()[0]}
    versions = {d: installed_version(d) for d in (*names, "pydantic", "wrapt")} | kernel_versions()
    report |= {"platform": platform.platform(), "versions": versions}
    result = _probe(_settings)  # (settings, their section), or the probe's error
    settings, report["settings"] = result if isinstance(result, tuple) else (None, result)
    probes = {"torch": _torch, "nvcc": _nvcc, "toolchain": _toolchain, "flashinfer_env": _flashinfer_env}
    probes |= {"humming": _humming, "devices": lambda: _devices(settings), "activation": _activation}
    report.update({key: _probe(probe) for key, probe in {**probes, "sglang": _targets, "engines": _engines}.items()})
    devs = report["devices"] if isinstance(report["devices"], list) else []
    report["backends"] = _probe(lambda: _backends(devs))
    report["import_check"] = _probe(lambda: _import_check(settings)) if deep else {"skipped": "--quick"}
    report["canary"] = _probe(lambda: _canary(settings)) if settings is not None else {"skipped": "no valid settings"}
    report["problems"] = _problems(report)
    return report


def _errors(value: Any, where: str) -> list[str]:
    """Return every probe error shown anywhere in `value`, each with where it is shown."""
    if isinstance(value, dict):
        if isinstance(value.get("error"), str):
            return [f"{where}: {value['error']}"]
        return [e for key, item in value.items() for e in _errors(item, f"{where}.{key}")]
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _errors(item, f"{where}[{i}]")]
    return []


_SECTION_PROBLEMS = (
    ("flashinfer_env", "problem", "FlashInfer NVFP4 environment"),
    ("toolchain", "jit_problem", "JIT builds will fail"),
    ("canary", "problem", "serving canary"),
    ("activation", "vllm_plugin_problem", "vLLM plugin not loaded"),
)


def _problems(report: dict) -> list[str]:
    # Every error doctor shows, in any section (a probe that failed: the GPUs' numbering, NVML,
    # SGLang's import), is a problem: what the report shows and what --strict judges never differ.
    problems = [e for section, value in report.items() if section != "import_check" for e in _errors(value, section)]
    versions = report["versions"]
    problems += kernel_mismatches(versions["flashinfer-python"], {k: v for k, v in versions.items() if v})
    sg = report.get("sglang", {})
    if isinstance(sg, dict) and sg.get("sglang") and not sg.get("supported"):
        problems.append(sg.get("reason", "unsupported SGLang"))
    devs = report.get("devices")
    sm12x = [d for d in devs if d["capability"].startswith("12.")] if isinstance(devs, list) else []
    if isinstance(devs, list) and not sm12x:
        problems.append(
            "no compute-capability 12.x GPU visible: the library does nothing here (SM120_FP4_SIMULATE=12.0 to simulate)"
        )
    if sm12x and not any(d["simulated"] for d in sm12x) and not report.get("nvcc", {}).get("found"):
        problems.append("nvcc not found: FlashInfer cannot JIT-compile its SM12x kernels")
    settings = report.get("settings")
    problems += settings.get("refused", []) if isinstance(settings, dict) else []
    for section, key, what in _SECTION_PROBLEMS:
        if report.get(section, {}).get(key):
            problems.append(f"{what}: {report[section][key]}")
    check = report.get("import_check", {})
    if isinstance(check.get("error"), str):
        problems.append(f"SGLang import check failed: {check['error']}")
    for row in (row for row in check.get("targets", []) if row["state"] == "fails"):
        if row["simulation"]:
            problems.append(f"simulation cannot run on this SGLang release: {row['name']}: {row['reason']}")
        elif row["name"] in _ESSENTIAL:
            problems.append(f"runtime patch {row['name']} does not apply: {row['reason']}")
    return problems


_TARGET_COLUMNS = ("patch", "target", "releases", "applies here")


def _block(value: Any) -> str:
    return "```\n" + json.dumps(value, indent=2, default=str) + "\n```"


def _section(title: str, value: Any, headers: tuple, rows: list | None, intro: tuple = ()) -> list[str]:
    """Return a Markdown section: `intro` and a table of `rows`, or `value` as JSON where rows is None."""
    return ["", f"### {title}", *([_block(value)] if rows is None else [*intro, *markdown_table(headers, rows)])]


def _target_rows(section: dict) -> list | None:
    if "targets" not in section:
        return None
    return [(t["name"], f"`{t['target']}`", t["versions"], t["applies"]) for t in section["targets"]]


def _summary(report: dict) -> list[str]:
    """Return the report's opening lines: versions, torch, nvcc, toolchain, FlashInfer variables, humming."""
    lines = [f"## sm120-fp4 doctor ({report['sm120_fp4']})", "", f"- Python {report['python']} on {report['platform']}"]
    lines += [f"- {k}: {v or 'not installed'}" for k, v in report["versions"].items()]
    torch_info, nvcc, tc = report["torch"], report["nvcc"], report.get("toolchain", {})
    if "error" not in torch_info:
        lines.append(f"- torch CUDA build {torch_info['cuda_build']}, CUDA available: {torch_info['cuda_available']}")
    lines.append(f"- nvcc: {nvcc.get('version', 'not found')} {nvcc.get('path', '')}".rstrip())
    if "error" not in tc:
        lines.append(
            f"- toolchain: CUDA {tc.get('cuda') or 'unknown'} ({tc.get('cuda_source')}), glibc {tc.get('glibc') or 'unknown'}, "
            f"CuTe DSL: {tc.get('cute_dsl')}; b12x: {tc.get('b12x_problem') or 'can run'}"
        )
    shown = ", ".join(f"{k}={v!r}" for k, v in report.get("flashinfer_env", {}).get("variables", {}).items())
    lines.append(f"- FlashInfer NVFP4 variables (FLASHINFER_NVFP4_*): {shown or 'none set'}")
    hum = report.get("humming", {})
    if "error" in hum:
        return [*lines, f"- humming-kernels: probe failed: {hum['error']}"]
    compiles = f"cannot compile here: {hum.get('compiler_detail')}"
    if hum.get("can_compile"):
        compiles = f"can compile here ({hum['compiler']}: {hum['compiler_detail']})"
    version = hum.get("version") or "not installed"
    return [*lines, f"- humming-kernels: {version}; {compiles}; kernel cache {hum.get('cache_dir')}"]


def _canary_lines(canary: dict) -> list[str]:
    lines = ["", "### Serving canary (SM120_FP4_CANARY)"]
    if "enabled" not in canary:
        return [*lines, _block(canary)]
    on = "off"
    if canary["enabled"]:
        on = f"on, every {canary['period_s']:g} s, action {canary['action']}, slice {canary['slice_ms']:g} ms"
    lines.append(f"- {on}; idle point here: {canary['idle_point'] or 'none (the canary cannot run on this SGLang)'}")
    for p in canary["processes"]:
        last = p.get("last_run") or {}
        share = f"{p['share']:.3%}" if isinstance(p.get("share"), (int, float)) else "-"
        lines.append(
            f"- pid {p['pid']}: {p['state']}; runs {p['runs']}, failures {p['failures']}, last run "
            f"{last.get('config', '-')} {'passed' if last.get('passed') else 'FAILED' if last else ''}, "
            f"serving-thread time {p['busy_s']:.3f} s ({share}), longest slice {p['longest_slice_ms']:.1f} ms, "
            f"skipped (saturated) {p['skipped_saturated']}"
        )
    if canary["enabled"] and not canary["processes"]:
        lines.append(
            "- no serving process has reported yet (set SM120_FP4_REPORT for the servers to see their counters here)"
        )
    return lines


def _markdown(report: dict) -> str:
    lines = [*_summary(report), "", "### GPUs"]
    devs = report["devices"]
    if isinstance(devs, list):
        lines += [
            f"- {d['index']}: {d['name']} (sm_{d['capability'].replace('.', '')}{', simulated' if d['simulated'] else ''}, via {d['source']})"
            for d in devs
        ] or ["- none visible"]
    else:
        lines.append(_block(devs))
    lines += ["", "### Activation", _block(report["activation"])]
    settings, sg = report["settings"], report["sglang"]
    values = settings.get("values") if "values" in settings else None
    rows = None if values is None else [(k, v, settings["sources"][k]) for k, v in values.items()]
    lines += _section("Settings", settings, ("setting", "value", "from"), rows)
    lines += _section("SGLang patch targets", sg, _TARGET_COLUMNS, _target_rows(sg), (f"{sg.get('reason')}", ""))
    for section in (report.get("engines") or {}).values():
        if not isinstance(section, dict) or "targets" not in section:
            lines += _section("Engine", section, (), None)
            continue
        version, entry = section["version"] or "not installed", ", ".join(section["plugin_entry_point"] or ["none"])
        intro = (f"{section['engine']} {version}: {section['reason']}; plugin entry point: {entry}", "")
        lines += _section(f"{section['engine']} patch targets", section, _TARGET_COLUMNS, _target_rows(section), intro)
    bk, check = report["backends"], report["import_check"]
    shown = bk if isinstance(bk, list) else []
    rows = [(b["device"], b["family"], b["backend"], b["supported"], b["reason"] or "") for b in shown]
    rows = rows if isinstance(bk, list) else None
    lines += _section("Backends", bk, ("device", "family", "backend", "supported", "reason"), rows)
    lines += _canary_lines(report.get("canary", {}))
    rows = [(t["name"], t["state"], t["reason"] or "") for t in check["targets"]] if "targets" in check else None
    title = "SGLang import check (each target of this release: would it apply, or is it applied here)"
    lines += _section(title, check, ("target", "here", "reason"), rows)
    lines += ["", "### Problems"] + ([f"- {p}" for p in report["problems"]] or ["- none found"])
    return "\n".join(lines)


def run(as_json: bool = False, strict: bool = False, deep: bool = True) -> int:
    report = collect(deep)
    print(json.dumps(report, indent=2, default=str) if as_json else _markdown(report))
    return 1 if strict and report["problems"] else 0
