"""Choose the FP4 GEMM backend for a device: ordered candidates, a self-test each, a cached Decision.

Walk the candidates in order, skip unsupported ones with their reason, self-test the rest, and
take the first that passes (or, with ``SM120_FP4_SELECT=fastest``, the fastest that passes).
When none passes: ``FALLBACK=emulated`` serves with the emulation (logged loudly), otherwise
:class:`~sm120_fp4.errors.RefusedToServe`. ``SELFTEST=warn`` logs the refusal and serves with the
first supported candidate; ``SELFTEST=off`` skips the test. A candidate the preflight recorded as
crashing its self-test process (:mod:`sm120_fp4.verdicts`) is skipped, with that reason.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, computed_field

from . import backends, devices, kernels, locks, report, selftest, verdicts
from .config import AUTO, Settings, load_settings
from .devices import Device
from .errors import ConfigError, RefusedToServe, capped

__all__ = ["Decision", "Refusal", "LayerCheck", "verify_layer", "recheck", "refusals", "decide", "decisions", "clear", "refusal_message", "candidate_names", "route", "route_table", "routes", "Family", "DENSE", "MOE"]

_LOG = logging.getLogger("sm120_fp4")


class Decision(BaseModel):
    """The backend chosen for one device in this process, and how it was chosen."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    device: str
    device_index: int
    capability: str
    simulated: bool
    backend: str
    verified: bool
    reason: str
    candidates: list[str]
    rejected: dict[str, str] = Field(default_factory=dict)
    reports: list[selftest.SelfTestReport] = Field(default_factory=list)
    timings_ms: dict[str, float] = Field(default_factory=dict)
    flashinfer_version: str | None = None
    duration_s: float = 0.0
    layers: list[selftest.SelfTestReport] = Field(default_factory=list)
    family: str = "dense"
    mode: str = "w4a4"  # what serves: "w4a4" (activations quantized, as the checkpoint) or "w4a16"
    fn: Callable = Field(exclude=True, repr=False)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def backend_info(self) -> dict | None:
        """What the serving backend says about itself now (humming: its mode, JIT time per kernel
        configuration, cache, memory of the converted layers); None for backends that say nothing."""
        names = backends.moe_names() if self.family == "moe" else backends.names()
        if self.backend not in names:
            return None  # unregistered since (a test's backend)
        try:
            describe = backends.backend_of(self.family, self.backend).describe
            return describe() if describe is not None else None
        except Exception as exc:  # noqa: BLE001 - status must answer
            return {"error": f"{type(exc).__name__}: {exc}"}


class Refusal(BaseModel):
    """A refusal to serve in this process: where, for which configuration, why (kept for status and the report)."""

    device: str
    config: str | None = None
    family: str = "dense"
    message: str
    rejected: dict[str, str] = Field(default_factory=dict)  # candidate -> why it was not served
    reports: list[selftest.SelfTestReport] = Field(default_factory=list)


@dataclass
class LayerCheck:
    """One layer configuration to verify on one device through the call that will serve it.

    `key` identifies the configuration (layers that share it are verified once); `label` names it
    in reports; `cases(ms)` builds the served calls for the batch sizes `ms` (with the layer's own
    weights, checked against the oracle); `recheck_ms` are the batch sizes re-run after warm-up.
    """

    device_index: int
    key: tuple
    label: str
    family: str
    cases: Callable[[list[int]], list[selftest.Case]]
    ms: list[int]
    recheck_ms: list[int]
    # The layer's own tensors, for a backend that converts each served layer at load (humming):
    # dense {"weight", "weight_sf", "dtype"}; MoE reference_moe_fp4's names and "dtype".
    tensors: dict | None = None


@dataclass(frozen=True)
class Family:
    """One kind of kernel this library verifies and routes: the dense FP4 GEMM or the NVFP4 fused MoE."""

    name: str  # "dense" | "moe"
    what: str
    backends_var: str
    fallback_var: str
    names: Callable[[], tuple[str, ...]]
    is_supported: Callable[[str, Device], tuple[bool, str | None]]
    resolve: Callable[[str], Callable]
    candidates: Callable[[Settings, Device | None], tuple[str, ...]]
    fallback: Callable[[Settings], str]
    self_test: Callable[[str, Device, Settings], selftest.SelfTestReport]


def _dense_self_test(name: str, device: Device, settings: Settings) -> selftest.SelfTestReport:
    bounds = selftest.Bounds(timeout_s=settings.selftest_timeout)
    return selftest.run(name, device, bounds=bounds, quantizer=backends.quantizer_for(name, device))


def _moe_self_test(name: str, device: Device, settings: Settings) -> selftest.SelfTestReport:
    # A simulated CPU device runs the pure-PyTorch oracle against itself: the reduced configuration
    # proves the wiring; every real GPU runs the full default configuration.
    config = selftest.SIMULATION_MOE_CONFIG if device.simulated and not device.is_cuda else None
    bounds = selftest.MOE_BOUNDS.model_copy(update={"timeout_s": settings.selftest_timeout})
    return selftest.run_moe(name, device, config, bounds=bounds)


def _dense_candidates(settings: Settings, device: Device | None) -> tuple[str, ...]:
    """SM120_FP4_BACKENDS, where `auto` is the order for the device's capability (kernels.default_order)."""
    if settings.backends != AUTO:
        return settings.backends
    return kernels.default_order(device.capability) if device is not None else kernels.DEFAULT_ORDER


DENSE = Family("dense", "FP4 GEMM", "SM120_FP4_BACKENDS", "SM120_FP4_FALLBACK", backends.names, backends.is_supported,
               backends.resolve, _dense_candidates, lambda s: s.fallback, _dense_self_test)
def _moe_candidates(settings: Settings, device: Device | None) -> tuple[str, ...]:
    """SM120_FP4_MOE_BACKENDS, where `auto` is the order for the device's capability (kernels.default_moe_order)."""
    if settings.moe_backends != AUTO:
        return settings.moe_backends
    return kernels.default_moe_order(device.capability) if device is not None else kernels.DEFAULT_MOE_ORDER


MOE = Family("moe", "NVFP4 fused-MoE", "SM120_FP4_MOE_BACKENDS", "SM120_FP4_MOE_FALLBACK", backends.moe_names,
             backends.is_moe_supported, backends.resolve_moe, _moe_candidates, lambda s: s.moe_fallback,
             _moe_self_test)
FAMILIES = {"dense": DENSE, "moe": MOE}

# Called as hook(event, family, device, backend) right before a candidate runs on a device (event
# "self-test" or "timing"): the preflight worker prints it, flushed, so that when a candidate
# crashes the process its parent knows which one did. None: nothing is announced.
candidate_hook: Callable[[str, str, Device, str], None] | None = None


def _announce(event: str, family: Family, device: Device, name: str) -> None:
    hook = candidate_hook
    if hook is not None:
        hook(event, family.name, device, name)


_lock = locks.lock()
_decisions: dict[tuple, Decision] = {}
_key_locks: dict[tuple, threading.Lock] = {}
_report_lock = locks.lock()
# The serving view of the decisions: CUDA ordinal (-1: CPU in simulation) -> the decided backend's
# callable, or None for a device this library does not serve (the original runs there). Read on
# every forward pass (one dict lookup); written only by route(); emptied with the decisions.
_route_tables: dict[str, dict[int, Callable | None]] = {"dense": {}, "moe": {}}
_route_names: dict[tuple[str, int], str] = {}
_refusals: list[Refusal] = []


@dataclass
class _Serving:
    """What serves one device: its decision, every layer configuration verified on it, what failed."""

    device: Device
    decision: Decision
    settings: Settings
    family: Family
    checks: dict[tuple, LayerCheck] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # backend -> why it failed a layer configuration
    # Every served layer's tensors seen so far (SGLang's own objects: no copy), so that a backend that
    # converts layers at load (humming) and takes over later converts the earlier ones too.
    seen: list[dict] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=locks.rlock)


_serving: dict[tuple[str, int], _Serving] = {}


def _operator_advice(device: Device, candidates: list[str], family: Family) -> list[str]:
    others = [n for n in family.names() if n not in candidates and family.is_supported(n, device)[0]]
    version = backends.flashinfer_version() or "not installed"
    tip = f"{family.backends_var}={','.join(others)} (supported here, not yet tried)" if others else "another backend"
    return [
        f"try {tip}; known backends: {', '.join(family.names())}",
        f"serve slowly but correctly with the emulation: {family.fallback_var}=emulated",
        f"install a FlashInfer release whose kernel verifies (installed: {version}), then run `sm120-fp4 selftest`",
        "turn this library off (SGLang then runs unpatched and unverified): SM120_FP4=0",
    ]


def refusal_message(device: Device, candidates: list[str], rejected: dict[str, str], config: str | None = None,
                    family: Family | None = None) -> str:
    """The text of RefusedToServe: the device, each candidate and why, what the operator can do."""
    family = family or DENSE
    what = f" for {config}" if config else ""
    lines = [
        f"sm120_fp4: refusing to serve NVFP4 on {device.label()}: no {family.what} backend passed verification{what}.",
        f"Candidates ({family.backends_var}):",
    ]
    lines += [f"  - {name}: {rejected.get(name, 'not tried')}" for name in candidates]
    lines.append("What you can do:")
    lines += [f"  - {tip}" for tip in _operator_advice(device, candidates, family)]
    return "\n".join(lines)


def _time_backend(fn: Callable, device: Device, shapes: tuple, repeats: int = 5) -> float:
    """Median milliseconds of one pass over the self-test shapes (for SELECT=fastest)."""
    tdev = device.torch_device
    prepared = []
    for i, shape in enumerate(shapes):
        _, _, args = selftest.quantized_inputs(shape, tdev, 1000 + i)
        prepared.append((args, torch.empty(shape[0], shape[1], dtype=torch.bfloat16, device=tdev)))
    times = []
    for _ in range(repeats + 1):
        if tdev.type == "cuda":
            torch.cuda.synchronize(tdev)
        start = time.perf_counter()
        for args, out in prepared:
            fn(*args, torch.bfloat16, out)
        if tdev.type == "cuda":
            torch.cuda.synchronize(tdev)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first pass warms up (JIT, caches)


def _choose(device: Device, candidates: list[str], settings: Settings, family: Family | None = None) -> Decision:
    family = family or DENSE
    start = time.perf_counter()
    rejected: dict[str, str] = {}
    supported: list[str] = []
    for name in candidates:
        ok, why = family.is_supported(name, device)
        crash = verdicts.crash_of(settings.verdicts_path, device, family.name, name) if ok else None
        if crash is not None:
            rejected[name] = crash
        elif ok:
            supported.append(name)
        else:
            rejected[name] = f"not supported: {why}"
    reports: list[selftest.SelfTestReport] = []
    passed: list[str] = []
    if settings.selftest != "off":
        for name in supported:
            _announce("self-test", family, device, name)
            report = family.self_test(name, device, settings)
            reports.append(report)
            if report.passed:
                passed.append(name)
                if settings.select == "first":
                    break
            else:
                rejected[name] = f"self-test failed: {report.reason}"
    common = dict(
        device=device.label(),
        device_index=device.index,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        simulated=device.simulated,
        candidates=candidates,
        rejected=rejected,
        reports=reports,
        flashinfer_version=backends.flashinfer_version(),
    )
    timings: dict[str, float] = {}
    if passed:
        choice, verified = passed[0], True
        reason = "first candidate to pass its self-test"
        if settings.select == "fastest" and len(passed) > 1 and family is DENSE:
            for n in passed:
                _announce("timing", family, device, n)
                timings[n] = _time_backend(backends.resolve(n), device, selftest.DEFAULT_SHAPES)
            choice = min(passed, key=timings.__getitem__)
            reason = f"fastest of {len(passed)} verified candidates ({timings[choice]:.3g} ms over the self-test shapes)"
    elif settings.selftest == "off" and supported:
        choice, verified, reason = supported[0], False, "SM120_FP4_SELFTEST=off: first supported candidate, NOT verified"
    elif family.fallback(settings) == "emulated":
        # FALLBACK=emulated wins over SELFTEST=warn: a verified slow answer beats an unverified one.
        also = " (it takes precedence over SM120_FP4_SELFTEST=warn)" if settings.selftest == "warn" else ""
        _LOG.warning(
            "%s\n%s=emulated%s: serving with the slow pure-PyTorch emulation instead",
            refusal_message(device, candidates, rejected, family=family), family.fallback_var, also,
        )
        choice, verified, reason = backends.EMULATED, True, f"fallback: no candidate verified ({family.fallback_var}=emulated)"
    elif settings.selftest == "warn" and supported:
        _LOG.warning("%s\nSM120_FP4_SELFTEST=warn: serving anyway with %s", refusal_message(device, candidates, rejected, family=family), supported[0])
        choice, verified, reason = supported[0], False, "SM120_FP4_SELFTEST=warn: self-test failed, serving UNVERIFIED"
    else:
        refused = RefusedToServe(refusal_message(device, candidates, rejected, family=family))
        refused.rejected, refused.reports = dict(rejected), list(reports)
        raise refused
    return Decision(
        backend=choice,
        mode=backends.backend_of(family.name, choice).mode,
        verified=verified,
        reason=reason,
        timings_ms=timings,
        fn=family.resolve(choice),
        family=family.name,
        duration_s=time.perf_counter() - start,
        **common,
    )


def _log_decision(decision: Decision) -> None:
    errs = [r.max_rel_err for r in decision.reports if r.backend == decision.backend and r.max_rel_err is not None]
    tested = f"self-test max rel error {errs[0]:.2e}" if errs else "no self-test of the chosen backend"
    level = logging.INFO if decision.verified else logging.WARNING
    _LOG.log(
        level,
        "sm120_fp4: %s, FlashInfer %s: using %s (%s); %s, decided in %.2f s",
        decision.device,
        decision.flashinfer_version or "not installed",
        decision.backend,
        decision.reason,
        tested,
        decision.duration_s,
    )


def candidate_names(settings: Settings, candidates: list[str] | tuple[str, ...] | None = None,
                    family: Family | None = None, device: Device | None = None, source: str | None = None) -> list[str]:
    """The ordered candidate names (`candidates`, else the family's setting for `device`: `auto`
    is the order for its capability); ConfigError for unknown ones, naming `source` (what supplied
    the names: default the family's variable). An unknown name is first looked up among the
    installed entry points (backends.ENTRY_POINT_GROUPS)."""
    family = family or DENSE
    source = source or family.backends_var
    names = list(candidates if candidates is not None else family.candidates(settings, device))
    unknown = [n for n in names if n not in family.names()]
    if unknown:
        backends.load_entry_points(unknown, family.name)
        known = family.names()
        unknown = [n for n in names if n not in known]
    if unknown:
        register = "register" if family is DENSE else "register_moe"
        group = backends.ENTRY_POINT_GROUPS[family.what]
        raise ConfigError(
            f"{source} names unknown backend(s) {capped(unknown)}; known: {', '.join(family.names())} "
            f"(register custom ones with sm120_fp4.backends.{register} before install, or as entry points of group "
            f"{group} so that spawned workers have them too)"
        )
    if not names:
        raise ConfigError(f"{source} is empty; name at least one backend")
    return names


def decide(
    device: Device | int | None = None,
    candidates: list[str] | tuple[str, ...] | None = None,
    *,
    settings: Settings | None = None,
    refresh: bool = False,
    family: Family | str = "dense",
) -> Decision:
    """The verified backend for `device` (a Device, a CUDA ordinal, or None for the current one).

    Cached per device and process; concurrent callers for one device wait for one self-test.
    """
    settings = settings or load_settings()
    if not isinstance(device, Device):
        if device is None and torch.cuda.is_available() and not settings.simulate:
            device = torch.cuda.current_device()
        device = devices.get_device(device, settings.simulated_capability)
    family = FAMILIES[family] if isinstance(family, str) else family
    names = candidate_names(settings, candidates, family, device)
    key = (family.name, device.key, tuple(names), settings.selftest, family.fallback(settings), settings.select)
    with _lock:
        key_lock = _key_locks.setdefault(key, locks.lock())
    with key_lock:
        if not refresh and key in _decisions:
            return _decisions[key]
        try:
            decision = _choose(device, names, settings, family)
        except RefusedToServe as exc:
            _refuse(Refusal(device=device.label(), family=family.name, message=str(exc),
                            rejected=getattr(exc, "rejected", {}), reports=getattr(exc, "reports", [])), settings)
            raise
        with _lock:
            _decisions[key] = decision
    _log_decision(decision)
    _write_report(settings)
    return decision


# More sections of the report file: name -> a function returning its JSON-serialisable value (the
# serving canary adds "canary"), called whenever the report is written.
report_sections: dict[str, Callable[[], object]] = {}


def _write_report(settings: Settings) -> None:
    """The newest report holds every decision and refusal, whichever device finished last."""
    if settings.report is None:
        return
    with _report_lock:
        payload = {"decisions": [d.model_dump(mode="json") for d in decisions()],
                   "refusals": [r.model_dump(mode="json") for r in refusals()]}
        payload.update({name: section() for name, section in list(report_sections.items())})
        try:
            write_report(settings.report, payload, directory=settings.report_is_dir)
        except OSError as exc:  # a report is evidence, not a reason to stop a verified worker
            _LOG.warning("sm120_fp4: could not write the report to %s: %s", settings.report, exc)


def _refuse(refusal: Refusal, settings: Settings) -> None:
    with _lock:
        _refusals.append(refusal)
    _write_report(settings)  # before the process exits: the record of why it refused


def refusals() -> list[Refusal]:
    """Every refusal to serve in this process so far."""
    with _lock:
        return list(_refusals)


def decisions() -> list[Decision]:
    """Every decision made in this process so far."""
    with _lock:
        return list(_decisions.values())


def clear() -> None:
    """Forget every decision and route (uninstall; tests; a FlashInfer upgrade in a long-lived process),
    and undo what a backend converted at load where it can (humming: the layers whose original bytes
    it kept); a layer it cannot restore is named in a warning (only that backend can serve it)."""
    with _lock:
        serving = list(_serving.values())
        _decisions.clear()
        _key_locks.clear()
        for table in _route_tables.values():
            table.clear()
        _route_names.clear()
        _refusals.clear()
        _serving.clear()
    for record in serving:
        stuck = _release(record, record.decision.backend)
        if stuck is not None:
            _LOG.warning("sm120_fp4: %s: %s", record.device.label(), stuck)


def serves(device: Device, settings: Settings) -> bool:
    """Whether this library serves `device`: a 12.x GPU, or any GPU with SM120_FP4_ENABLE=on."""
    return settings.enable == "on" or devices.is_sm12x(device.capability)


def route(index: int, settings: Settings, family: str = "dense") -> Callable | None:
    """The backend callable serving CUDA ordinal `index` (-1: CPU tensors in simulation) for kernel
    `family` ("dense" or "moe"), deciding (self-testing) on first use; None where this library does
    not serve the device."""
    table = _route_tables[family]
    if index in table:
        return table[index]
    simulate = settings.simulated_capability
    if index < 0 and simulate is None:
        fn, name = None, "original"  # a CPU tensor outside simulation: not a GPU we fix
    else:
        device = devices.get_device(index, simulate)
        if serves(device, settings):
            decision = decide(device, settings=settings, family=family)
            fn, name = decision.fn, decision.backend
            with _lock:
                _serving.setdefault((family, index), _Serving(device, decision, settings, FAMILIES[family]))
        else:
            fn, name = None, "original"
    with _lock:
        _route_names[(family, index)] = name
        return table.setdefault(index, fn)


def _set_route(serving: _Serving, decision: Decision) -> None:
    """Serve the device with `decision` from now on (it takes the replaced decision's place)."""
    index, family = serving.device.index, serving.family.name
    with _lock:
        for key, known in list(_decisions.items()):
            if known is serving.decision:
                _decisions[key] = decision
        serving.decision = decision
        _route_tables[family][index] = decision.fn
        _route_names[(family, index)] = decision.backend


def _run_check(serving: _Serving, check: LayerCheck, ms: list[int]) -> selftest.SelfTestReport:
    device = serving.device
    report = selftest.report_for(serving.decision.backend, device, config=check.label)
    start = time.perf_counter()
    try:
        cases = check.cases(ms)
    except Exception as exc:  # building the served calls failed: that is a finding, not a crash
        report.reason = f"could not build the served calls: {type(exc).__name__}: {exc}"
        report.duration_s = time.perf_counter() - start
        return report
    return selftest.finish(report, selftest.sweep(cases, selftest.Bounds(timeout_s=serving.settings.selftest_timeout), device.torch_device), start)


def verify_layer(index: int, check: LayerCheck, settings: Settings) -> selftest.SelfTestReport | None:
    """Verify one layer configuration on CUDA ordinal `index` (-1: CPU in simulation) through the
    call that will serve it, once per configuration and process; None where nothing is verified
    (a device this library does not serve, or SM120_FP4_SELFTEST=off).

    A failure rejects the backend for this device: the next candidate that passes the self-test and
    every configuration verified so far takes over; with none left, FALLBACK=emulated serves (after
    the same checks), SELFTEST=warn serves unverified, and otherwise RefusedToServe names the
    configuration, the batch size and what was wrong.
    """
    if route(index, settings, check.family) is None:
        return None
    serving = _serving[(check.family, index)]
    with serving.lock:
        first = check.key not in serving.checks
        problem = _prepare(serving, check.tensors, keep_original=first and settings.selftest != "off")
        if check.tensors is not None:
            serving.seen.append(check.tensors)
        if settings.selftest == "off":
            return None
        if not first:
            return next((r for r in serving.decision.layers if r.config == check.label), None)
        serving.checks[check.key] = check
        if problem is None:
            report = _run_check(serving, check, check.ms)
        else:
            report = selftest.report_for(serving.decision.backend, serving.device, config=check.label)
            report.reason = problem
        if report.passed:
            serving.decision.layers.append(report)
            _LOG.info("sm120_fp4: %s verified with %s on %s (%d batch sizes, max rel error %.2e)", check.label,
                      serving.decision.backend, serving.device.label(), len(check.ms), report.max_rel_err or 0.0)
            _write_report(settings)
            return report
        return _replace_backend(serving, report, settings)


def _prepare(serving: _Serving, tensors: dict | None, keep_original: bool) -> str | None:
    """Let the serving backend convert one layer at load (humming); None, or why it could not."""
    backend = backends.backend_of(serving.family.name, serving.decision.backend)
    if backend.prepare is None or tensors is None:
        return None
    try:
        backend.prepare(tensors, keep_original)
    except Exception as exc:  # a finding about this backend, like a failed check
        return f"could not convert the layer's weights for {backend.name}: {type(exc).__name__}: {exc}"
    return None


def _release(serving: _Serving, name: str) -> str | None:
    """Undo what backend `name` converted on this device; None, or why no other backend can take over."""
    try:
        backend = backends.backend_of(serving.family.name, name)
    except ConfigError:  # unregistered since (a test's backend): it converted nothing of ours
        return None
    if backend.restore is None or backend.restore():
        return None
    return (f"{name} converted served layers' weights to its own layout in place at load and kept the original bytes "
            "of the checked layers only, so no other backend can serve them in this process; restart with "
            f"{serving.family.backends_var} naming a backend that verifies")


def _replace_backend(serving: _Serving, report: selftest.SelfTestReport, settings: Settings) -> selftest.SelfTestReport:
    """The served backend failed `report`'s configuration: find one that passes everything, or refuse."""
    failures = [report]
    serving.failed[report.backend] = f"{report.config}: {report.reason}"
    stuck = _release(serving, report.backend)
    if stuck is not None:
        serving.failed[report.backend] += f" ({stuck})"
    while stuck is None:
        remaining = [n for n in candidate_names(settings, family=serving.family, device=serving.device) if n not in serving.failed]
        decision = _next_decision(serving, remaining, settings)
        if decision is None:
            break
        _set_route(serving, decision)
        problems = [p for p in (_prepare(serving, t, any(t is c.tensors for c in serving.checks.values())) for t in serving.seen) if p]
        reports = [_run_check(serving, c, c.ms) for c in serving.checks.values()]
        if problems:
            reports[0].passed, reports[0].reason = False, problems[0]
        bad = next((r for r in reports if not r.passed), None)
        if bad is None:
            decision.layers = reports
            _LOG.warning("sm120_fp4: %s: %s failed %s; serving with %s, which passes every layer configuration",
                         serving.device.label(), report.backend, report.config, decision.backend)
            _write_report(settings)
            return next(r for r in reports if r.config == report.config)
        failures.append(bad)
        serving.failed[decision.backend] = f"{bad.config}: {bad.reason}"
        stuck = _release(serving, decision.backend)
        if stuck is not None:
            serving.failed[decision.backend] += f" ({stuck})"
    rejected = {n: f"failed the served-layer check: {why}" for n, why in serving.failed.items()}
    message = refusal_message(serving.device, candidate_names(settings, family=serving.family, device=serving.device),
                              rejected, config=report.config, family=serving.family)
    if settings.selftest == "warn":
        _LOG.warning("%s\nSM120_FP4_SELFTEST=warn: serving UNVERIFIED with %s", message, serving.decision.backend)
        serving.decision.verified = False
        return report
    _refuse(Refusal(device=serving.device.label(), config=report.config, family=serving.family.name, message=message,
                    rejected=rejected, reports=failures), settings)
    raise RefusedToServe(message)


def _next_decision(serving: _Serving, remaining: list[str], settings: Settings) -> Decision | None:
    """The first of `remaining` that passes its self-test, else the verified emulation where
    FALLBACK=emulated allows it (and it has not failed too), else None."""
    family = serving.family
    strict = settings.model_copy(update={"selftest": "strict", "fallback": "none", "moe_fallback": "none"})
    if remaining:
        with contextlib.suppress(RefusedToServe):
            return _choose(serving.device, remaining, strict, family)
    if family.fallback(settings) != "emulated" or backends.EMULATED in serving.failed:
        return None
    try:
        decision = _choose(serving.device, [backends.EMULATED], strict, family)
    except RefusedToServe:
        return None
    decision.reason = f"fallback: no candidate verified on every layer configuration ({family.fallback_var}=emulated)"
    _LOG.warning("sm120_fp4: %s: no %s candidate passed every layer configuration; %s=emulated: "
                 "serving with the slow pure-PyTorch emulation", serving.device.label(), family.what, family.fallback_var)
    return decision


def recheck(settings: Settings, captured: Sequence[int] = ()) -> list[selftest.SelfTestReport]:
    """Re-run every verified layer configuration once, eagerly, at its re-check batch sizes and at
    every M of `captured` (the token counts of the CUDA graphs SGLang just captured: the batch
    sizes graphs will serve), after SGLang's warm-up and capture, when autotuners have picked their
    tactics; a failure refuses (RefusedToServe) with the configuration and batch size."""
    selftest.refuse_inside_capture("re-check", "after")
    done = []
    for serving in list(_serving.values()):
        with serving.lock:
            for check in list(serving.checks.values()):
                report = _run_check(serving, check, sorted(set(check.recheck_ms) | set(captured)))
                report.config = f"{check.label} (re-check after warm-up)"
                done.append(report)
                if report.passed:
                    continue
                message = (f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: {serving.decision.backend} "
                           f"passed at start-up but fails after warm-up and CUDA-graph capture.\n"
                           f"  {report.config}: {report.reason}\n"
                           "The kernel changed behaviour after warm-up (autotuned tactics, captured graphs); "
                           "try another backend (SM120_FP4_BACKENDS) or SM120_FP4_FALLBACK=emulated.")
                _refuse(Refusal(device=serving.device.label(), config=report.config, family=serving.family.name, message=message,
                                rejected={serving.decision.backend: f"failed the re-check after warm-up: {report.reason}"},
                                reports=[report]), settings)
                raise RefusedToServe(message)
    _LOG.info("sm120_fp4: re-checked %d layer configuration(s) after warm-up at %d captured graph size(s): all pass",
              len(done), len(set(captured)))
    return done


# ---- for the serving canary (sm120_fp4.canary) --------------------------------------------------

__all__ += ["Served", "served_configurations", "check_served", "record_refusal", "report_sections", "update_report"]


@dataclass(frozen=True)
class Served:
    """One layer configuration verified in this process, on the device and kernel family that serve it."""

    family: str
    device: Device
    check: LayerCheck

    @property
    def backend(self) -> str:
        """The backend serving this configuration now."""
        return _serving[(self.family, self.device.index)].decision.backend


def served_configurations() -> list[Served]:
    """Every layer configuration verified in this process (passed, with the backend serving it now;
    not one served unverified under SELFTEST=warn), per family and device in the order verified."""
    with _lock:
        servings = list(_serving.values())
    served = []
    for s in servings:
        with s.lock:
            passed = {r.config for r in s.decision.layers if r.passed}
            served += [Served(s.family.name, s.device, c) for c in s.checks.values() if c.label in passed]
    return served


def check_served(served: Served, ms: Sequence[int]) -> selftest.SelfTestReport:
    """Run one verified configuration once more through the call that serves it, at batch sizes
    `ms`: the re-check's check (two passes, every call against the oracle), for the serving canary.
    Never raises for a bad kernel: the report says what was wrong."""
    serving = _serving[(served.family, served.device.index)]
    with serving.lock:
        return _run_check(serving, served.check, list(ms))


def record_refusal(refusal: Refusal, settings: Settings) -> None:
    """Record a refusal decided outside this module (the serving canary's): status and the report file."""
    _refuse(refusal, settings)


def update_report(settings: Settings) -> None:
    """Write the report file now (SM120_FP4_REPORT), with every section of `report_sections`."""
    _write_report(settings)


def route_table(family: str = "dense") -> dict[int, Callable | None]:
    """The live route table of `family` (the hot path's lookup); never replace it, only read it."""
    return _route_tables[family]


def routes(family: str = "dense") -> dict[int, str]:
    """Device index -> the backend it is routed to, or "original" (a device this library does not serve)."""
    with _lock:
        return {index: name for (fam, index), name in _route_names.items() if fam == family}


def write_report(path: Path, payload: dict, directory: bool | None = None) -> Path:
    """Merge `payload` (this process's ``decisions`` and ``refusals``) into the report at `path`
    (sm120_fp4.report: one file for every process of the run, 0600, never over a link or a special
    file; a directory, or a link to one, gets one file per process) and return the file written."""
    return report.write(path, payload, directory)
