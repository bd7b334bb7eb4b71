"""``sm120-fp4 doctor``: everything an issue report needs, as Markdown or ``--json``; every probe guarded."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import site
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


def _backends(settings) -> list[dict]:
    """Return whether each backend of each family can run on each device, and why not."""
    from . import devices
    from .deciding import FAMILIES

    return [
        dict(device=device.label(), family=family.name, backend=name, supported=ok, reason=reason)
        for device in devices.list_devices(settings.simulated_capability if settings else None)
        for family in FAMILIES.values()
        for name, (ok, reason) in ((n, family.is_supported(n, device)) for n in family.names())
    ]


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
    from .api import ENGINES
    from .canary import settings_problem
    from .report import read_all
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
    for path, data in read_all(settings.report)[:64] if settings.report is not None else ():
        for proc in data.get("processes", []):  # a section per process (report.py), each with its canary's counters
            section = proc.get("canary") or {}
            if section.get("enabled"):
                out["processes"].append(
                    {"pid": proc.get("pid"), "report": path, **{k: section.get(k) for k in _CANARY_KEYS}}
                )
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
    probes = {"torch": _torch, "toolchain": _toolchain, "flashinfer_env": _flashinfer_env}
    probes |= {"humming": _humming, "devices": lambda: _devices(settings), "activation": _activation}
    report.update({key: _probe(probe) for key, probe in {**probes, "sglang": _targets, "engines": _engines}.items()})
    report["backends"] = _probe(lambda: _backends(settings))
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
    problems = [e for section, value in report.items() for e in _errors(value, section)]
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
    nvcc = str(report.get("toolchain", {}).get("cuda_source", "")).startswith("nvcc")  # the toolkit's, found
    if sm12x and not any(d["simulated"] for d in sm12x) and not nvcc:
        problems.append(
            "nvcc not found: FlashInfer JIT-compiles its SM12x kernels with it on first use; install the CUDA toolkit "
            "(>= 12.9 for sm_120f)"
        )
    problems += report["settings"].get("refused", [])  # the settings' section, or their probe's error
    for section, key, what in _SECTION_PROBLEMS:
        if report.get(section, {}).get(key):
            problems.append(f"{what}: {report[section][key]}")
    for row in (row for row in report.get("import_check", {}).get("targets", []) if row["state"] == "fails"):
        if row["simulation"]:
            problems.append(f"simulation cannot run on this SGLang release: {row['name']}: {row['reason']}")
        elif row["name"] in _ESSENTIAL:
            problems.append(f"runtime patch {row['name']} does not apply: {row['reason']}")
    return problems


# The Markdown section of each probe (another engine's section is titled by the engine).
_TITLES = {
    "settings": "Settings",
    "torch": "torch",
    "toolchain": "Toolchain of JIT builds (cuda_source: the nvcc FlashInfer's JIT compiles with, where found)",
    "flashinfer_env": "FlashInfer NVFP4 variables (FLASHINFER_NVFP4_*)",
    "humming": "humming-kernels",
    "devices": "GPUs",
    "activation": "Activation",
    "sglang": "SGLang patch targets",
    "backends": "Backends",
    "import_check": "SGLang import check (each target of this release: would it apply, or is it applied here)",
    "canary": "Serving canary (SM120_FP4_CANARY)",
}


def _shown(value: Any) -> list[str]:
    """Return a probe's value as Markdown: rows as a table, a dict's items as a list (its rows as a table), else JSON."""
    if isinstance(value, list) and all(isinstance(row, dict) for row in value):
        header = list(value[0]) if value else []
        return markdown_table(header, [[row.get(k) for k in header] for row in value]) if value else ["- none"]
    if not isinstance(value, dict):
        return ["```", json.dumps(value, indent=2, default=str), "```"]
    lines: list[str] = []
    for key, item in value.items():
        rows = isinstance(item, list) and item and all(isinstance(row, dict) for row in item)
        lines += ["", *_shown(item)] if rows else [f"- {key}: {item}"]
    return lines


def _markdown(report: dict) -> str:
    """Return the report as Markdown: the versions, then a section per probe, the problems last."""
    lines = [f"## sm120-fp4 doctor ({report['sm120_fp4']})", "", f"- Python {report['python']} on {report['platform']}"]
    lines += [f"- {k}: {v or 'not installed'}" for k, v in report["versions"].items()]
    sections = {k: v for k, v in report.items() if k not in ("sm120_fp4", "python", "platform", "versions", "problems")}
    settings = sections["settings"]
    if "values" in settings:  # a row per setting: its value and where it came from
        rows = [{"setting": k, "value": v, "from": settings["sources"][k]} for k, v in settings["values"].items()]
        sections["settings"] = {"settings": rows, "refused": settings["refused"]}
    engines = sections.pop("engines")
    for name, section in engines.items():  # each other engine's release and patch targets
        title = section.get("engine", name) if isinstance(section, dict) else name
        sections[f"{title} patch targets"] = section
    for key, value in sections.items():
        lines += ["", f"### {_TITLES.get(key, key)}", *_shown(value)]
    lines += ["", "### Problems"] + ([f"- {p}" for p in report["problems"]] or ["- none found"])
    return "\n".join(lines)


def run(as_json: bool = False, strict: bool = False, deep: bool = True) -> int:
    report = collect(deep)
    print(json.dumps(report, indent=2, default=str) if as_json else _markdown(report))
    return 1 if strict and report["problems"] else 0
