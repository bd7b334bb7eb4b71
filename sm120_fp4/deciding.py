"""Deciding which FP4 backend one device serves with, and why (or why none can): the candidates in
order, each self-tested; the first (or with SELECT=fastest the fastest) that passes, else FALLBACK,
SELFTEST=warn or a refusal. Caching and routing the decisions is :mod:`sm120_fp4.serving`'s job."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from pydantic import BaseModel, Field, computed_field

from . import backends, devices, verify
from .backends import flashinfer
from .config import AUTO, Settings, env_name
from .devices import Device
from .errors import ConfigError, RefusedToServe, capped, say_once

_LOG = logging.getLogger("sm120_fp4")


class Decision(BaseModel):
    """The backend chosen for one device in this process, and how it was chosen."""

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
    reports: list[verify.SelfTestReport] = Field(default_factory=list)
    timings_ms: dict[str, float] = Field(default_factory=dict)
    flashinfer_version: str | None = None
    duration_s: float = 0.0
    layers: list[verify.SelfTestReport] = Field(default_factory=list)
    family: str = "dense"
    mode: str = "w4a4"  # what serves: "w4a4" (activations quantized, as the checkpoint) or "w4a16"
    # SELECT=fastest split by batch size: (largest M, backend) per range, the last (None) unbounded.
    ranges: list[tuple[int | None, str]] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def backend_info(self) -> dict | None:
        """Return what the serving backend says about itself now (humming), or None; a route split by batch size:
        what each of its backends says, by name (a converting one's memory: its layout next to the checkpoint's)."""
        if len(self.ranges) < 2:
            return _describe(self.family, self.backend)
        found = {name: _describe(self.family, name) for name in dict.fromkeys(n for _, n in self.ranges)}
        return {name: info for name, info in found.items() if info is not None} or None


def _describe(family: str, name: str) -> dict | None:
    if name not in (backends.moe_names() if family == "moe" else backends.names()):
        return None  # unregistered since (a test's backend)
    try:
        describe = backends.backend_of(family, name).describe
        return describe() if describe is not None else None
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


class Refusal(BaseModel):
    """A refusal to serve in this process: where, for which configuration, why (kept for status and the report)."""

    device: str
    config: str | None = None
    family: str = "dense"
    message: str
    rank: dict[str, int] = Field(default_factory=dict)  # the engine's ranks of this process (tp_rank, tp_size, ...)
    rejected: dict[str, str] = Field(default_factory=dict)  # candidate -> why it was not served
    reports: list[verify.SelfTestReport] = Field(default_factory=list)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: the report model and the callable that was tested (what serves)."""

    decision: Decision
    fn: Callable = field(repr=False)


@dataclass(frozen=True)
class Family:
    """One kind of kernel this library verifies and routes: the dense FP4 GEMM or the NVFP4 fused MoE."""

    name: str  # "dense" | "moe"
    names: Callable[[], tuple[str, ...]]
    is_supported: Callable[[str, Device], tuple[bool, str | None]]
    resolve: Callable[[str], Callable]
    candidates: Callable[[Settings, Device | None], tuple[str, ...]]
    self_test: Callable[[str, Device, Settings], verify.SelfTestReport]

    @property
    def what(self) -> str:
        return backends.FAMILY_LABELS[self.name]

    @property
    def backends_var(self) -> str:
        return env_name("backends" if self.name == "dense" else "moe_backends")

    @property
    def fallback_var(self) -> str:
        return env_name("fallback" if self.name == "dense" else "moe_fallback")

    def fallback(self, settings: Settings) -> str:
        return settings.fallback if self.name == "dense" else settings.moe_fallback


def _dense_self_test(name: str, device: Device, settings: Settings) -> verify.SelfTestReport:
    bounds = verify.Bounds(timeout_s=settings.selftest_timeout)
    return verify.run(name, device, bounds=bounds, quantizer=backends.quantizer_for(name, device))


def _moe_self_test(name: str, device: Device, settings: Settings) -> verify.SelfTestReport:
    # A simulated CPU device runs the pure-PyTorch oracle against itself: the reduced configuration
    # proves the wiring; every real GPU runs the full default configuration.
    config = verify.SIMULATION_MOE_CONFIG if device.simulated and not device.is_cuda else None
    bounds = verify.MOE_BOUNDS.model_copy(update={"timeout_s": settings.selftest_timeout})
    return verify.run_moe(name, device, config, bounds=bounds)


def _dense_candidates(settings: Settings, device: Device | None) -> tuple[str, ...]:
    """Return SM120_FP4_BACKENDS, `auto` being the order for the device's capability."""
    if settings.backends != AUTO:
        return settings.backends
    return flashinfer.default_order(device.capability) if device is not None else flashinfer.DEFAULT_ORDER


DENSE = Family("dense", backends.names, backends.is_supported, backends.resolve, _dense_candidates, _dense_self_test)


def _moe_candidates(settings: Settings, device: Device | None) -> tuple[str, ...]:
    """Return SM120_FP4_MOE_BACKENDS, `auto` being the order for the device's capability."""
    if settings.moe_backends != AUTO:
        return settings.moe_backends
    if device is None:
        return flashinfer.DEFAULT_MOE_ORDER
    return flashinfer.default_moe_order(device.capability, settings.select == "fastest")


MOE = Family(
    "moe", backends.moe_names, backends.is_moe_supported, backends.resolve_moe, _moe_candidates, _moe_self_test
)
FAMILIES = {"dense": DENSE, "moe": MOE}

# hook(event, family, device, backend) right before a candidate runs ("self-test" or "timing"): the
# preflight worker prints it, so that its parent knows which candidate crashed the process.
candidate_hook: Callable[[str, str, Device, str], None] | None = None


def _announce(event: str, family: Family, device: Device, name: str) -> None:
    hook = candidate_hook
    if hook is not None:
        hook(event, family.name, device, name)


def refusal_message(
    device: Device, candidates: list, rejected: dict[str, str], family: Family, config: str | None = None
) -> str:
    """Return the text of RefusedToServe: the device, each candidate and why, what the operator can do."""
    what = f" for {config}" if config else ""
    lines = [
        f"sm120_fp4: refusing to serve NVFP4 on {device.label()}: no {family.what} backend passed verification{what}.",
        f"Candidates ({family.backends_var}):",
    ]
    lines += [f"  - {name}: {rejected.get(name, 'not tried')}" for name in candidates]
    others = [n for n in family.names() if n not in candidates and family.is_supported(n, device)[0]]
    version = backends.flashinfer_version() or "not installed"
    tip = f"{family.backends_var}={','.join(others)} (supported here, not yet tried)" if others else "another backend"
    lines += [
        "What you can do:",
        f"  - try {tip}; known backends: {', '.join(family.names())}",
        f"  - serve slowly but correctly with the emulation: {family.fallback_var}=emulated",
        f"  - install a FlashInfer release whose kernel verifies (installed: {version}), then run `sm120-fp4 selftest`",
        "  - turn this library off (SGLang then runs unpatched and unverified): SM120_FP4=0",
    ]
    return "\n".join(lines)


_FLUSH_MIN_BYTES = 256 << 20


def time_call(call: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Return the median seconds of `call`: a CUDA-graph replay with a cold L2 on CUDA, else eager."""
    return timed(call, device, repeats)[0]


def timed(call: Callable[[], object], device: torch.device, repeats: int = 5) -> tuple[float, str]:
    """Return (the median seconds of `call`, how: "graph", "eager: <why not captured>", or "cpu")."""
    call()  # JIT, autotuner caches, workspaces
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples), "cpu"
    step, how = _replay(call, device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    flush = torch.empty(max(_FLUSH_MIN_BYTES, 2 * l2), dtype=torch.uint8, device=device)
    samples = []
    for _ in range(repeats):
        flush.zero_()  # cold L2: a server's many layers leave none of this one's weights cached
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(samples), how


def _replay(call: Callable[[], object], device: torch.device) -> tuple[Callable[[], object], str]:
    """Return (the replay of `call` captured in a CUDA graph, "graph"), or (`call`, "eager: <why>") where it cannot be."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    try:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            call()  # warm on a side stream, as torch's capture recipe asks
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph):
            call()
    except Exception as exc:  # not capturable: timed eagerly
        torch.cuda.synchronize(device)
        why = str(exc).splitlines()[0] if str(exc) else ""
        return call, f"eager: {type(exc).__name__}: {why}"[:120]
    return graph.replay, "graph"


def _supported(device: Device, candidates: list[str], family: Family, crashed: Mapping[str, str]) -> tuple[list, dict]:
    """Return the candidates that may run (supported, not `crashed` a preflight process) and why each other may not."""
    supported: list[str] = []
    rejected: dict[str, str] = {}
    for name in candidates:
        ok, why = family.is_supported(name, device)
        crash = crashed.get(name) if ok else None
        if ok and crash is None:
            supported.append(name)
        else:
            rejected[name] = crash or f"not supported: {why}"
    return supported, rejected


def _self_tests(device: Device, names: list[str], settings: Settings, family: Family, rejected: dict) -> tuple:
    """Self-test `names` in order (until the first pass with SELECT=first): (the passed names, every report)."""
    passed, reports = [], []
    for name in names if settings.selftest != "off" else ():
        _announce("self-test", family, device, name)
        report = family.self_test(name, device, settings)
        reports.append(report)
        if not report.passed:
            rejected[name] = f"self-test failed: {report.reason}"
            continue
        passed.append(name)
        if settings.select == "first":
            break
    return passed, reports


def _fastest(device: Device, passed: list[str], family: Family, rejected: dict, gather: Callable | None) -> tuple:
    """Return (the candidates that passed on every rank, the fastest first, each one's milliseconds): dense ones timed
    over the self-test shapes, summed over the ranks; a candidate that failed on another rank is `rejected` here."""
    tdev, timings = device.torch_device, {}
    for name in passed if family is DENSE and len(passed) > 1 else ():
        _announce("timing", family, device, name)
        fn, total = backends.resolve(name), 0.0
        for i, shape in enumerate(verify.DEFAULT_SHAPES):  # one call at each self-test shape, summed
            _, _, args = verify.quantized_inputs(shape, tdev, 1000 + i)
            out = torch.empty(shape[0], shape[1], dtype=torch.bfloat16, device=tdev)
            total += time_call(lambda: fn(*args, torch.bfloat16, out), tdev)
        timings[name] = total * 1e3
    # `gather`: every rank the same choice from the same numbers.
    every = gather(f"the {family.what} self-tests", (passed, timings)) if gather else [(passed, timings)]
    for rank, (theirs, _) in enumerate(every):
        for name in (n for n in passed if n not in theirs):
            rejected.setdefault(name, f"passed its self-test here, but not on rank {rank}")
    common = [n for n in passed if n not in rejected]
    timed = len(common) > 1 and all(set(common) <= set(t) for _, t in every)
    summed = {n: sum(t[n] for _, t in every) for n in common} if timed else {}
    return sorted(common, key=lambda n: summed.get(n, 0.0)), summed


def refuse(settings: Settings, message: str, serving: str = "serving it UNVERIFIED", refused=None) -> None:
    """Apply SM120_FP4_SELFTEST to what cannot serve verified: strict raises `refused` (else RefusedToServe(message));
    warn logs `message` once with what serves instead; off passes. The decision, a failed layer check and each
    engine home's unverifiable paths all go through here."""
    if settings.selftest == "strict":
        raise refused or RefusedToServe(message)
    if settings.selftest == "warn":
        say_once(logging.WARNING, "%s\nSM120_FP4_SELFTEST=warn: %s", message, serving)


def _unverified(device: Device, candidates: list, settings: Settings, family: Family, supported, rejected, reports):
    """Return (backend, verified, why) where no candidate passed (SELFTEST=off, FALLBACK, SELFTEST=warn), else refuse."""
    if settings.selftest == "off" and supported:
        return supported[0], False, "SM120_FP4_SELFTEST=off: first supported candidate, NOT verified"
    message = refusal_message(device, candidates, rejected, family=family)
    if family.fallback(settings) == "emulated":
        # FALLBACK=emulated wins over SELFTEST=warn: a verified slow answer beats an unverified one.
        var = family.fallback_var
        also = " (it takes precedence over SM120_FP4_SELFTEST=warn)" if settings.selftest == "warn" else ""
        _LOG.warning("%s\n%s=emulated%s: serving with the slow pure-PyTorch emulation instead", message, var, also)
        return backends.EMULATED, True, f"fallback: no candidate verified ({var}=emulated)"
    refused = RefusedToServe(message)
    refused.rejected, refused.reports = dict(rejected), list(reports)
    if supported:  # SELFTEST=warn serves the first supported candidate; strict raises
        refuse(settings, message, f"serving anyway with {supported[0]}", refused)
        return supported[0], False, "SM120_FP4_SELFTEST=warn: self-test failed, serving UNVERIFIED"
    raise refused


def choose(
    device: Device,
    candidates: list[str],
    settings: Settings,
    family: Family,
    crashed: Mapping[str, str] | None = None,
    gather: Callable | None = None,
) -> Choice:
    """Self-test `candidates` in order on `device` and choose one; RefusedToServe (with its reasons) when none may serve.

    `crashed`: the candidates that crashed a preflight process on this device, and why (the caller reads the
    verdict store: nothing here reads a file). `gather(point, facts)` (a choice every rank makes): every rank's
    facts, so that SELECT=fastest chooses alike."""
    start = time.perf_counter()
    supported, rejected = _supported(device, candidates, family, crashed or {})
    passed, reports = _self_tests(device, supported, settings, family, rejected)
    timings: dict[str, float] = {}
    if settings.select == "fastest" and (gather or len(passed) > 1):
        passed, timings = _fastest(device, passed, family, rejected, gather)
    if timings:
        choice, verified = passed[0], True
        reason = f"fastest of {len(passed)} verified candidates ({timings[choice]:.3g} ms over the self-test shapes)"
    elif passed:
        choice, verified, reason = passed[0], True, "first candidate to pass its self-test"
    else:
        choice, verified, reason = _unverified(device, candidates, settings, family, supported, rejected, reports)
    decision = Decision(
        device=device.label(),
        device_index=device.index,
        device_uuid=device.uuid,
        device_pci_bus_id=device.pci_bus_id,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        simulated=device.simulated,
        candidates=candidates,
        rejected=rejected,
        reports=reports,
        timings_ms=timings,
        flashinfer_version=backends.flashinfer_version(),
        backend=choice,
        mode=backends.backend_of(family.name, choice).mode,
        verified=verified,
        reason=reason,
        family=family.name,
        duration_s=time.perf_counter() - start,
    )
    return Choice(decision, family.resolve(choice))


def log_decision(decision: Decision) -> None:
    """Log `decision` once: device, FlashInfer version, backend, why, its self-test error, how long it took."""
    errs = [r.max_rel_err for r in decision.reports if r.backend == decision.backend and r.max_rel_err is not None]
    tested = f"self-test max rel error {errs[0]:.2e}" if errs else "no self-test of the chosen backend"
    d, msg = decision, "sm120_fp4: %s, FlashInfer %s: using %s (%s); %s, decided in %.2f s"
    args = (d.device, d.flashinfer_version or "not installed", d.backend, d.reason, tested, d.duration_s)
    _LOG.log(logging.INFO if d.verified else logging.WARNING, msg, *args)


def candidate_names(
    settings: Settings,
    candidates: list[str] | tuple[str, ...] | None = None,
    family: Family | None = None,
    device: Device | None = None,
    source: str | None = None,
) -> list[str]:
    """Return the ordered candidate names (`candidates`, else the family's setting); ConfigError names unknown ones."""
    family = family or DENSE
    source = source or family.backends_var
    names = list(candidates if candidates is not None else family.candidates(settings, device))
    backends.load_entry_points(names, family.name)  # those not registered yet, each looked up once per process
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


def serves(device: Device, settings: Settings) -> bool:
    """Return whether this library serves `device`: a 12.x GPU, or any GPU with SM120_FP4_ENABLE=on."""
    return settings.enable == "on" or devices.is_sm12x(device.capability)
