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
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, computed_field

from . import backends, devices, kernels, locks, report, selftest, verdicts
from .config import AUTO, Settings, load_settings
from .devices import Device
from .errors import ConfigError, RefusedToServe, capped

__all__ = ["Decision", "Refusal", "LayerCheck", "verify_layer", "recheck", "reverify", "weights_updating", "weights_update_begin", "weights_update_end", "refusals", "decide", "decisions", "clear", "refusal_message", "candidate_names", "route", "route_table", "routes", "Family", "DENSE", "MOE"]

_LOG = logging.getLogger("sm120_fp4")


class Decision(BaseModel):
    """The backend chosen for one device in this process, and how it was chosen."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    device: str
    device_index: int
    capability: str
    device_uuid: str | None = None  # the GPU this decision is for, as NVML/CUDA name it (several GPUs: which is which)
    device_pci_bus_id: str | None = None
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
    """One NVFP4 layer to verify on one device through the call that will serve it.

    `key` identifies the configuration: the first layer of a configuration gets the full sweep (its
    batch sizes `ms`, two passes), every later layer of it a light check of its own weights at
    `light_ms` (one pass); `label` names the configuration in reports, `layer` this layer; `cases(ms)`
    builds the served calls for the batch sizes `ms` (with the layer's own weights, checked against
    the oracle); `recheck_ms` are the batch sizes re-run after warm-up. `weights()` returns the tensors
    the layer serves with, read from the layer now (fingerprinted: a verified layer whose weights
    change outside SGLang's weight-update path is refused); `rebuild(owner)` the check again from
    the layer's current state (re-checks, weight updates); `owner` the layer itself (one record per
    layer, kept by a weak reference: a model that is dropped is not kept alive by its records).
    """

    device_index: int
    key: tuple
    label: str
    family: str
    cases: Callable[[list[int]], list[selftest.Case]]
    ms: list[int]
    recheck_ms: list[int]
    layer: str = ""
    light_ms: list[int] = field(default_factory=lambda: [8])
    weights: Callable[[], tuple] | None = None
    rebuild: Callable[[object], "LayerCheck | None"] | None = None
    owner: object = None
    # The layer's own tensors, for a backend that converts each served layer at load (humming):
    # dense {"weight", "weight_sf", "dtype"}; MoE reference_moe_fp4's names and "dtype".
    tensors: dict | None = None

    def named(self) -> str:
        return f"{self.label} [{self.layer}]" if self.layer else self.label


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


DENSE = Family("dense", backends.FAMILY_LABELS["dense"], "SM120_FP4_BACKENDS", "SM120_FP4_FALLBACK", backends.names, backends.is_supported,
               backends.resolve, _dense_candidates, lambda s: s.fallback, _dense_self_test)
def _moe_candidates(settings: Settings, device: Device | None) -> tuple[str, ...]:
    """SM120_FP4_MOE_BACKENDS, where `auto` is the order for the device's capability (kernels.default_moe_order)."""
    if settings.moe_backends != AUTO:
        return settings.moe_backends
    return kernels.default_moe_order(device.capability) if device is not None else kernels.DEFAULT_MOE_ORDER


MOE = Family("moe", backends.FAMILY_LABELS["moe"], "SM120_FP4_MOE_BACKENDS", "SM120_FP4_MOE_FALLBACK", backends.moe_names,
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
class _Layer:
    """One verified layer: how to check it again and the fingerprint of its weights when verified.
    With a layer to rebuild from, only a weak reference to it is kept (and the check is made again
    from it when needed); otherwise the check itself."""

    label: str
    fingerprint: torch.Tensor | None
    owner: Callable[[], object] | None
    rebuild: Callable[[object], "LayerCheck | None"] | None
    check: LayerCheck | None  # kept only where it cannot be rebuilt

    def alive(self) -> bool:
        return self.owner is None or self.owner() is not None

    def current(self) -> LayerCheck | None:
        if self.check is not None:
            return self.check
        owner = self.owner() if self.owner is not None else None
        return self.rebuild(owner) if owner is not None else None


@dataclass
class _Serving:
    """What serves one device: its decision, every layer configuration and every layer verified on
    it, what failed."""

    device: Device
    decision: Decision
    settings: Settings
    family: Family
    checks: dict[tuple, LayerCheck] = field(default_factory=dict)  # one per configuration: its full sweep
    layers: dict[int, _Layer] = field(default_factory=dict)  # id(layer) -> its record (light checks, fingerprints)
    failed: dict[str, str] = field(default_factory=dict)  # backend -> why it failed a layer configuration
    timings: dict[str, dict[tuple, float]] = field(default_factory=dict)  # SELECT=fastest: backend -> configuration -> ms
    candidate_layers: dict[str, list] = field(default_factory=dict)  # SELECT=fastest: each candidate's configuration reports
    unverified: dict[tuple, selftest.SelfTestReport] = field(default_factory=dict)  # SELFTEST=warn: failed, served anyway
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
        device_uuid=device.uuid,
        device_pci_bus_id=device.pci_bus_id,
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
        group = backends.ENTRY_POINT_GROUPS[family.name]
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
    global _last_settings
    settings = settings or load_settings()
    _last_settings = settings
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
    global _updating
    with _lock:
        _updating = 0
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


def _run_check(serving: _Serving, check: LayerCheck, ms: list[int], passes: int = 2,
               config: str | None = None, light: bool = False) -> selftest.SelfTestReport:
    device = serving.device
    report = selftest.report_for(serving.decision.backend, device, config=config or check.label)
    start = time.perf_counter()
    try:
        cases = check.cases(ms)
    except Exception as exc:  # building the served calls failed: that is a finding, not a crash
        report.reason = f"could not build the served calls: {type(exc).__name__}: {exc}"
        report.duration_s = time.perf_counter() - start
        return report
    where = f" of {serving.decision.backend!r} on {device.label()} for {check.named()}"
    if light and check.weights is not None:
        for case in cases:  # the layer's fingerprint before and after covers its weights (no copies of them)
            case.inputs = ()
    results = selftest.sweep(cases, selftest.Bounds(timeout_s=serving.settings.selftest_timeout), device.torch_device,
                             passes=passes, where=where)
    return selftest.finish(report, results, start)


def _fingerprint(check: LayerCheck) -> torch.Tensor | None:
    return selftest.fingerprint(check.weights()) if check.weights is not None else None


def _owner_ref(check: LayerCheck) -> Callable[[], object] | None:
    try:
        return weakref.ref(check.owner)
    except TypeError:  # not weak-referenceable: kept
        owner = check.owner
        return lambda: owner


def _layer_check(serving: _Serving, check: LayerCheck, full: bool) -> tuple[selftest.SelfTestReport, torch.Tensor | None]:
    """The full sweep (a configuration's first layer) or the light check (any other layer) of
    `check`, then its fingerprint: a call that wrote into the layer's own weights fails the check.
    Returns the report and the fingerprint the layer's weights had when they were checked."""
    before = _fingerprint(check)
    if full:
        report = _run_check(serving, check, check.ms)
    else:
        report = _run_check(serving, check, check.light_ms, passes=1, config=f"{check.label} (layer check)", light=True)
    if report.passed and before is not None and not torch.equal(before, _fingerprint(check)):
        report.passed = False
        report.reason = f"{check.named()}: the checked calls changed this layer's own weights in place"
    return report, before


def _record_layer(serving: _Serving, check: LayerCheck, fingerprint: torch.Tensor | None) -> None:
    serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
    if check.owner is None:
        serving.layers[id(check)] = _Layer(check.named(), fingerprint, None, None, check)
        return
    owner = _owner_ref(check)
    weak = isinstance(owner, weakref.ref) and check.rebuild is not None
    serving.layers[id(check.owner)] = _Layer(check.named(), fingerprint, owner, check.rebuild, None if weak else check)


def verify_layer(index: int, check: LayerCheck, settings: Settings) -> selftest.SelfTestReport | None:
    """Verify one NVFP4 layer on CUDA ordinal `index` (-1: CPU in simulation) through the call that
    will serve it; None where nothing is verified (a device this library does not serve, or
    SM120_FP4_SELFTEST=off).

    The first layer of each configuration gets the full sweep; every other layer a light check of
    its own weights (one decode batch), and its weights' fingerprint is kept for the re-checks.
    Nothing is recorded before it passed: an interrupted check (Ctrl-C, any BaseException) leaves no
    trace, so the next attempt checks again. A failure rejects the backend for this device: the next
    candidate that passes the self-test and every configuration and layer verified so far takes
    over; with none left, FALLBACK=emulated serves (after the same checks), SELFTEST=warn serves
    unverified, and otherwise RefusedToServe names the configuration, the batch size and what was
    wrong.
    """
    global _last_settings
    _last_settings = settings
    if route(index, settings, check.family) is None:
        return None
    serving = _serving[(check.family, index)]
    with serving.lock:
        checking = settings.selftest != "off"
        # A backend that serves converted weights converts this layer now (keeping its original
        # bytes while it is checked: the oracle reads them); every later backend switch converts it too.
        problem = _prepare(serving, check.tensors, keep_original=checking)
        if check.tensors is not None and not any(_same_layer(t, check.tensors) for t in serving.seen):
            serving.seen.append(check.tensors)
        if not checking:
            return None
        if check.key in serving.unverified:  # SELFTEST=warn has already said so for this configuration
            return serving.unverified[check.key]
        known = serving.checks.get(check.key)
        full = known is None
        if problem is None:
            report, fingerprint = _layer_check(serving, check, full)
        else:
            report, fingerprint = selftest.report_for(serving.decision.backend, serving.device, config=check.label), None
            report.reason = problem
        if not report.passed:
            return _replace_backend(serving, check, report, settings)
        if not full:
            _settle(serving, check.tensors)
        _record_layer(serving, check, fingerprint)
        if full:
            serving.checks[check.key] = check
            serving.decision.layers.append(report)
            _LOG.info("sm120_fp4: %s verified with %s on %s (%d batch sizes, max rel error %.2e)", check.label,
                      serving.decision.backend, serving.device.label(), len(check.ms), report.max_rel_err or 0.0)
            if settings.select == "fastest":
                _route_fastest(serving, check, settings)
            _write_report(settings)
        elif check.owner is not None and known.owner is check.owner:
            serving.checks[check.key] = check  # the same layer again (its weights reloaded): re-checks use these
        return report


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


def _same_layer(a: dict | None, b: dict | None) -> bool:
    """Whether two `tensors` dicts describe the same served layer (the same packed weight storage)."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    wa, wb = a.get("weight", a.get("w13")), b.get("weight", b.get("w13"))
    return isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor) and wa.data_ptr() == wb.data_ptr()


def _representative(serving: _Serving, tensors: dict) -> bool:
    """Whether `tensors` are a configuration's first layer: the one the re-checks compare."""
    return any(_same_layer(c.tensors, tensors) for c in serving.checks.values())


def _settle(serving: _Serving, tensors: dict | None) -> None:
    """A checked layer that is not its configuration's first: drop what the backend kept for its check."""
    backend = backends.backend_of(serving.family.name, serving.decision.backend)
    if backend.settle is not None and tensors is not None and not _representative(serving, tensors):
        backend.settle(tensors)


def _prepare_seen(serving: _Serving) -> str | None:
    """Let the backend now routed convert every layer served so far (originals kept while checked)."""
    return next((p for p in (_prepare(serving, t, True) for t in serving.seen) if p), None)


def _settle_seen(serving: _Serving) -> None:
    for tensors in serving.seen:
        _settle(serving, tensors)


def _refingerprint(serving: _Serving) -> None:
    """After a backend switch that converted or restored weights: every layer's fingerprint anew."""
    for record in serving.layers.values():
        current = record.current() if record.alive() else None
        if current is not None:
            record.fingerprint = _fingerprint(current)


def _back_to(serving: _Serving, original: Decision) -> None:
    """Route the device to `original` again (a refusal or an interruption while replacing it),
    converting the layers again where that backend serves converted weights."""
    _set_route(serving, original)
    backend = backends.backend_of(serving.family.name, original.backend)
    if backend.prepare is not None:
        for tensors in serving.seen:
            _prepare(serving, tensors, _representative(serving, tensors))
        _refingerprint(serving)


def _time_served(serving: _Serving, check: LayerCheck, repeats: int = 3) -> float:
    """Milliseconds of one served call of `check` at each of its serving batch sizes (decode and
    prefill: its re-check sizes), summed: the median of `repeats` after a first call."""
    tdev = serving.device.torch_device
    total = 0.0
    for case in check.cases(check.recheck_ms):
        case.invoke()  # JIT, autotuner caches, workspaces
        samples = []
        for _ in range(repeats):
            if tdev.type == "cuda":
                torch.cuda.current_stream(tdev).synchronize()
            start = time.perf_counter()
            case.invoke()
            if tdev.type == "cuda":
                torch.cuda.current_stream(tdev).synchronize()
            samples.append(time.perf_counter() - start)
        total += statistics.median(samples)
    return total * 1e3


def _route_fastest(serving: _Serving, check: LayerCheck, settings: Settings) -> None:
    """SELECT=fastest, at each new layer configuration: every candidate that passed its self-test
    and every configuration so far is checked on this one too and timed on its served calls at the
    serving batch sizes; the device is routed to the one fastest over all configurations (which
    first passes every layer's light check). Timing the self-test's shapes would rank kernels on
    calls that never serve."""
    original = serving.decision
    names = [r.backend for r in original.reports if r.passed] or [original.backend]
    names = [n for n in dict.fromkeys([original.backend, *names]) if n not in serving.failed]
    if len(names) < 2:
        return
    decisions = {original.backend: original}
    try:
        for name in names:
            if name != original.backend:
                decisions[name] = original.model_copy(update={"backend": name, "fn": serving.family.resolve(name),
                                                              "layers": [], "timings_ms": {}})
                _set_route(serving, decisions[name])
                report, _ = _layer_check(serving, check, True)
                if not report.passed:
                    serving.failed[name] = f"{report.config}: {report.reason}"
                    continue
                serving.candidate_layers.setdefault(name, []).append(report)
            else:
                _set_route(serving, original)
            serving.timings.setdefault(name, {})[check.key] = _time_served(serving, check)
        keys = list(serving.checks)
        eligible = [n for n in names if n not in serving.failed and all(k in serving.timings.get(n, {}) for k in keys)]
        totals = {n: sum(serving.timings[n][k] for k in keys) for n in eligible}
        best = min(eligible, key=totals.__getitem__)
        chosen = decisions[best]
        _set_route(serving, chosen)
        if best != original.backend:
            _, bad = _verify_everything(serving, check, False, configurations=False)  # every layer so far, its own weights
            if bad is not None:
                serving.failed[best] = f"{bad.config}: {bad.reason}"
                _set_route(serving, original)
                return
            serving.candidate_layers[original.backend] = list(original.layers)
            chosen.layers = list(serving.candidate_layers.get(best, []))
        chosen.timings_ms = totals
        chosen.reason = (f"fastest of {len(eligible)} verified candidates on the served layer configurations at their "
                         f"serving batch sizes ({totals[best]:.3g} ms over {len(keys)} configuration(s))")
    except BaseException:
        _set_route(serving, original)
        raise


def _verify_everything(serving: _Serving, extra: LayerCheck, extra_full: bool,
                       configurations: bool = True) -> tuple[list, selftest.SelfTestReport | None]:
    """Every configuration's full sweep (unless `configurations` is False: already passed), every
    recorded layer's light check, and `extra`'s, with the backend now routed: (the configurations'
    reports, the first failure or None)."""
    reports = []
    for check in serving.checks.values() if configurations else ():
        report, _ = _layer_check(serving, check, True)
        if not report.passed:
            return reports, report
        reports.append(report)
    representatives = {id(c.owner) if c.owner is not None else id(c) for c in serving.checks.values()}
    for key, record in list(serving.layers.items()):
        current = record.current() if record.alive() and key not in representatives else None
        if current is not None:
            report, _ = _layer_check(serving, current, False)
            if not report.passed:
                return reports, report
    report, _ = _layer_check(serving, extra, extra_full)
    if not report.passed:
        return reports, report
    if extra_full:
        reports.append(report)
    return reports, None


def _replace_backend(serving: _Serving, check: LayerCheck, report: selftest.SelfTestReport,
                     settings: Settings) -> selftest.SelfTestReport:
    """The served backend failed `check` (`report`): find one that passes everything, or refuse.

    Until one passes every configuration and every layer, nothing new is recorded; on a refusal or
    an interruption the device goes back to the backend it had (which still serves what it passed)."""
    original = serving.decision
    full = check.key not in serving.checks
    failures = [report]
    serving.failed[report.backend] = f"{report.config}: {report.reason}"
    stuck = _release(serving, report.backend)
    if stuck is not None:
        serving.failed[report.backend] += f" ({stuck})"
    try:
        while stuck is None:
            remaining = [n for n in candidate_names(settings, family=serving.family, device=serving.device) if n not in serving.failed]
            decision = _next_decision(serving, remaining, settings)
            if decision is None:
                break
            _set_route(serving, decision)
            problem = _prepare_seen(serving)
            if problem is None:
                reports, bad = _verify_everything(serving, check, full)
            else:
                reports, bad = [], selftest.report_for(decision.backend, serving.device, config=check.label)
                bad.reason = problem
            if bad is None:
                decision.layers = reports
                if full:
                    serving.checks[check.key] = check
                _settle_seen(serving)
                _refingerprint(serving)
                _record_layer(serving, check, _fingerprint(check))
                _LOG.warning("sm120_fp4: %s: %s failed %s; serving with %s, which passes every layer configuration and layer",
                             serving.device.label(), report.backend, report.config, decision.backend)
                _write_report(settings)
                return next((r for r in reports if r.config == check.label), reports[-1] if reports else report)
            failures.append(bad)
            serving.failed[decision.backend] = f"{bad.config}: {bad.reason}"
            stuck = _release(serving, decision.backend)
            if stuck is not None:
                serving.failed[decision.backend] += f" ({stuck})"
    except BaseException:
        _back_to(serving, original)  # interrupted: back to what was verified
        raise
    _back_to(serving, original)
    rejected = {n: f"failed the served-layer check: {why}" for n, why in serving.failed.items()}
    message = refusal_message(serving.device, candidate_names(settings, family=serving.family, device=serving.device),
                              rejected, config=report.config, family=serving.family)
    if settings.selftest == "warn":
        _LOG.warning("%s\nSM120_FP4_SELFTEST=warn: serving UNVERIFIED with %s", message, serving.decision.backend)
        serving.decision.verified = False
        serving.unverified[check.key] = report
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


_updating = 0  # SGLang weight updates in progress (weights_updating)
_last_settings: Settings | None = None


def _changed_layers(serving: _Serving) -> list[tuple[int, _Layer, LayerCheck | None]]:
    """(key, record, its check now) of the recorded layers whose weights differ from their
    fingerprint now (or can no longer be read)."""
    serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
    changed = []
    for key, record in serving.layers.items():
        if record.fingerprint is None:
            continue
        try:
            check = record.current()
            now = _fingerprint(check) if check is not None else None
        except Exception:  # noqa: BLE001 - a weight the layer no longer has: changed
            check, now = None, None
        if now is None or now.shape != record.fingerprint.shape or not torch.equal(now, record.fingerprint):
            changed.append((key, record, check))
    return changed


def _refuse_changed(serving: _Serving, changed: list, settings: Settings) -> None:
    names = [record.label for _, record, _ in changed]
    message = (f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: the weights of {len(names)} verified "
               f"layer(s) changed after they were verified, and not through SGLang's weight-update path "
               f"(update_weights_from_disk / _from_tensor / _from_distributed / _from_ipc): {capped(names)}.\n"
               "Something wrote into them since (a kernel writing out of bounds?); serving them would compute with "
               f"weights nobody loaded. Backend in use: {serving.decision.backend}.")
    _refuse(Refusal(device=serving.device.label(), config=names[0], family=serving.family.name, message=message,
                    rejected={serving.decision.backend: f"a verified layer's weights changed: {names[0]}"}), settings)
    raise RefusedToServe(message)


def recheck(settings: Settings, captured: Sequence[int] = ()) -> list[selftest.SelfTestReport]:
    """After SGLang's warm-up and CUDA-graph capture, when autotuners have picked their tactics:
    first every verified layer's weights against their fingerprint (a change outside SGLang's
    weight-update path refuses, naming the layer), then every verified layer configuration once
    more, eagerly, at its re-check batch sizes and at every M of `captured` (the token counts of the
    CUDA graphs SGLang just captured: the batch sizes graphs will serve); a failure refuses
    (RefusedToServe) with the configuration and batch size."""
    selftest.refuse_inside_capture("re-check", "after")
    if _updating:
        reverify(settings)  # a capture inside a weight update: the new weights are verified first
    done = []
    for serving in list(_serving.values()):
        with serving.lock:
            changed = _changed_layers(serving)
            if changed:
                _refuse_changed(serving, changed, settings)
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


def weights_update_begin() -> None:
    """SGLang starts writing weights (a weight-update call, or a weight-update session): caches of
    dequantized weights are dropped, and fingerprint changes are expected until the matching end."""
    global _updating
    backends.invalidate_caches()
    with _lock:
        _updating += 1


def weights_update_end(settings: Settings) -> list[selftest.SelfTestReport]:
    """SGLang is done writing weights: when no other update is open, every layer whose weights
    changed is verified again (reverify) before anything else is served."""
    global _updating
    with _lock:
        _updating = max(0, _updating - 1)
        last = _updating == 0
    backends.invalidate_caches()
    return reverify(settings) if last else []


@contextlib.contextmanager
def weights_updating(settings: Settings):
    """weights_update_begin() ... weights_update_end(settings) around one of SGLang's weight updates."""
    weights_update_begin()
    try:
        yield
    finally:
        weights_update_end(settings)


def reverify(settings: Settings) -> list[selftest.SelfTestReport]:
    """Verify again every recorded layer whose weights changed (a weight update): each is rebuilt
    from the layer's current state and checked (a configuration's representative layer with the full
    sweep, any other with its light check), its fingerprint renewed; a failure refuses
    (RefusedToServe) naming the layer."""
    done = []
    for serving in list(_serving.values()):
        with serving.lock:
            changed = _changed_layers(serving)
            if changed and backends.backend_of(serving.family.name, serving.decision.backend).prepare is not None:
                names = [record.label for _, record, _ in changed]
                message = (f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: SGLang updated the weights of "
                           f"{len(names)} layer(s) ({capped(names)}), but {serving.decision.backend} converted every "
                           "served layer to its own layout in place at load, and the new weights cannot be verified "
                           "or served in that layout in this process; restart the server with the new weights")
                _refuse(Refusal(device=serving.device.label(), config=names[0], family=serving.family.name,
                                message=message, rejected={serving.decision.backend: "weights updated in place"}), settings)
                raise RefusedToServe(message)
            for key, record, check in changed:
                config = next((k for k, c in serving.checks.items() if (c.owner is not None and id(c.owner) == key) or id(c) == key), None)
                if check is None:  # no longer an NVFP4 layer in a layout this library serves
                    serving.layers.pop(key, None)
                    continue
                report, fingerprint = _layer_check(serving, check, config is not None)
                report.config = f"{check.named()} (after a weight update)"
                done.append(report)
                if not report.passed:
                    message = (f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: after SGLang's weight "
                               f"update, {report.config} fails with {serving.decision.backend}: {report.reason}")
                    _refuse(Refusal(device=serving.device.label(), config=report.config, family=serving.family.name,
                                    message=message, rejected={serving.decision.backend: report.reason or ""},
                                    reports=[report]), settings)
                    raise RefusedToServe(message)
                if config is not None:
                    serving.checks[config] = check
                _record_layer(serving, check, fingerprint)
    if done:
        _LOG.info("sm120_fp4: re-verified %d layer(s) after SGLang's weight update: all pass", len(done))
    return done


def _on_hang(message: str) -> None:
    """selftest's watchdog is about to end the process: record the refusal in the report first."""
    settings = _last_settings
    if settings is not None:
        _refuse(Refusal(device="?", message=message), settings)


selftest.hang_hooks.append(_on_hang)


# ---- for the serving canary (sm120_fp4.canary) --------------------------------------------------

__all__ += ["Served", "served_configurations", "check_served", "fingerprint_problem", "record_refusal", "report_sections", "update_report"]


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


def fingerprint_problem(check: LayerCheck) -> str | None:
    """Whether the verified layer of `check` still has the weights it was verified with: None, or
    why not (the serving canary asks at the first step of every run; a weight corrupted in memory is
    invisible to the oracle, which reads the same corrupted weight). During SGLang's weight updates
    changes are expected: None."""
    key = id(check.owner) if check.owner is not None else id(check)
    for serving in list(_serving.values()):
        with serving.lock:
            record = serving.layers.get(key)
            if record is None or record.fingerprint is None or _updating:
                continue
            try:
                now = _fingerprint(check)
            except Exception as exc:  # noqa: BLE001 - a weight the layer no longer has: changed
                return f"{check.named()}: its weights can no longer be read ({type(exc).__name__}: {exc})"
            if now is None or now.shape != record.fingerprint.shape or not torch.equal(now, record.fingerprint):
                return (f"{check.named()}: the layer's weights changed after they were verified, and not through "
                        "SGLang's weight-update path")
    return None


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
