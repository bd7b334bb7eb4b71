"""Serving: one record per (kernel family, device) -- what was decided for it, what serves it, the
layers verified on it -- and everything done with the layers.

:func:`route` decides (:mod:`sm120_fp4.deciding`) on first use and routes the device;
:func:`verify_layer` checks each served layer through the call that will serve it (the full sweep
per configuration, a light check and a fingerprint per layer), converts it for a backend that
serves converted weights, and replaces a backend that fails a layer (the next candidate that passes
everything so far, FALLBACK=emulated, SELFTEST=warn, or a refusal); SELECT=fastest is settled on the
served calls; :func:`recheck` runs after warm-up, :func:`reverify` after SGLang's weight updates; the
serving canary reads :func:`served_configurations` and :func:`check_served`.

The records are the one store of this state. The route table the hot path reads
(:func:`route_table`, one dict lookup per call in :mod:`sm120_fp4.dispatch`) is derived from them:
every change of what serves a record (``_Serving.serve`` / ``route_to`` / ``store``, and clear()
dropping it) rebuilds that device's entry from the store through ``_publish``, the one writer of
the table. A refresh (``decide(refresh=True)``) of the decision a device is served with serves the
refreshed one while no layer was verified with it; after that it is refused (ConfigError): the
refreshed backend would serve layers never checked with it.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import backends, devices, graphs, locks, verify
from . import report as report_file
from .config import Settings, check_flashinfer_env, load_settings
from .deciding import FAMILIES, Choice, Decision, Family, Refusal, candidate_names, choose, log_decision, refusal_message, serves
from .devices import Device
from .errors import ConfigError, RefusedToServe, capped

__all__ = ["LayerCheck", "verify_layer", "recheck", "reverify", "weights_updating", "weights_update_begin", "weights_update_end",
           "weights_update_open_s",
           "refusals", "record_refusal", "decide", "decisions", "clear", "route", "route_table", "routes",
           "Served", "served_configurations", "served_layer", "check_served",
           "fingerprint_problem", "fingerprint_sweep"]

_LOG = logging.getLogger("sm120_fp4")


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
    cases: Callable[[list[int]], list[verify.Case]]
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
    key: tuple | None = None  # its configuration's (LayerCheck.key)

    def alive(self) -> bool:
        return self.owner is None or self.owner() is not None

    def current(self) -> LayerCheck | None:
        if self.check is not None:
            return self.check
        owner = self.owner() if self.owner is not None else None
        return self.rebuild(owner) if owner is not None else None


@dataclass
class _Serving:
    """Everything about one kernel family on one device index in this process: decide()'s decisions
    for it, whether and with what it is routed, every layer configuration and every layer verified
    on it, what failed.

    `decided` caches decide() (the rest of its key -> the choice); `serving` names which of them
    serves the device (None: not routed to a backend). `routed` says whether route() has answered
    for this device (with `serving` None: the original kernel runs there). Change what serves only
    through :meth:`serve` and :meth:`route_to`: they keep the route table in step."""

    family: Family
    index: int
    device: Device | None = None
    settings: Settings | None = None
    decided: dict[tuple, Choice] = field(default_factory=dict)
    deciding: dict[tuple, threading.Lock] = field(default_factory=dict)  # one lock per decide() key: one self-test each
    serving: tuple | None = None
    routed: bool = False
    checks: dict[tuple, LayerCheck] = field(default_factory=dict)  # one per configuration: its full sweep
    layers: dict[int, _Layer] = field(default_factory=dict)  # id(layer) -> its record (light checks, fingerprints)
    failed: dict[str, str] = field(default_factory=dict)  # backend -> why it failed a layer configuration
    timings: dict[str, dict[tuple, float]] = field(default_factory=dict)  # SELECT=fastest: backend -> configuration -> ms
    candidate_layers: dict[str, list] = field(default_factory=dict)  # SELECT=fastest: each candidate's configuration reports
    unverified: dict[tuple, verify.SelfTestReport] = field(default_factory=dict)  # SELFTEST=warn: failed, served anyway
    # Every served layer's tensors seen so far (SGLang's own objects: no copy), so that a backend that
    # converts layers at load (humming) and takes over later converts the earlier ones too.
    # Keyed by the layer's packed weight storage (_seen_key): finding a layer among hundreds costs one lookup.
    seen: dict[tuple, dict] = field(default_factory=dict)
    prune_at: int = 64  # _record_layer drops dropped layers' records when this many are kept
    lock: threading.RLock = field(default_factory=locks.rlock)

    @property
    def choice(self) -> Choice:
        """What serves the device (only where `serving` is set)."""
        return self.decided[self.serving]

    @property
    def decision(self) -> Decision:
        return self.choice.decision

    @property
    def route_name(self) -> str:
        """The backend the device is routed to, or "original" (a device this library does not serve)."""
        return self.decision.backend if self.serving is not None else "original"

    @property
    def fn(self) -> Callable | None:
        """The callable the hot path calls for this device, or None (the original kernel runs)."""
        return self.choice.fn if self.routed and self.serving is not None else None

    def store(self, key: tuple, choice: Choice) -> None:
        """decide()'s result for `key` (a refresh of the key that serves routes the device to it)."""
        with _lock:
            self.decided[key] = choice
            if key == self.serving:
                _publish(self)

    def route_to(self, device: Device | None, key: tuple | None, settings: Settings | None) -> Callable | None:
        """route()'s answer for this device, once: served with decide()'s choice for `key` (None: not
        served, the original runs); the callable the hot path calls (the first answer stands)."""
        with _lock:
            if not self.routed:
                self.routed, self.serving = True, key
                if key is not None:
                    self.device, self.settings = device, settings
                _publish(self)
            return self.fn

    def serve(self, choice: Choice) -> None:
        """Serve the device with `choice` from now on (it takes the replaced decision's place)."""
        with _lock:
            self.decided[self.serving] = choice
            _publish(self)


_lock = locks.lock()
_records: dict[tuple[str, int], _Serving] = {}  # (family, device index) -> its record: the one store
# Derived from _records by _publish alone: CUDA ordinal (-1: CPU in simulation) -> the callable
# serving it, or None for a device this library does not serve (the original runs there). Read on
# every forward pass (one dict lookup); emptied, never replaced, by clear().
_route_tables: dict[str, dict[int, Callable | None]] = {"dense": {}, "moe": {}}
_refusals: list[Refusal] = []


def _publish(record: _Serving) -> None:
    """Make the route table entry of `record`'s family and device say what the store says now (under
    _lock): the callable of the record kept for them, where it is routed; no entry where none is (a
    record dropped by clear(), or one not routed yet). The one writer of the route tables."""
    table = _route_tables[record.family.name]
    current = _records.get((record.family.name, record.index))
    if current is not None and current.routed:
        table[record.index] = current.fn
    else:
        table.pop(record.index, None)


def _record(family: Family, index: int, device: Device | None = None) -> _Serving:
    with _lock:
        return _records.setdefault((family.name, index), _Serving(family, index, device))


def _served() -> list[_Serving]:
    """Every record routed to a backend of ours, in the order they were made."""
    with _lock:
        return [r for r in _records.values() if r.serving is not None]


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
    return _decide(device, candidates, settings, refresh, family)[2].decision


def _decide(device: Device | int | None, candidates: list[str] | tuple[str, ...] | None, settings: Settings | None,
            refresh: bool, family: Family | str) -> tuple[_Serving, tuple, Choice]:
    """decide(): the device's record, the key its choice is cached under, the choice."""
    global _last_settings
    settings = settings or load_settings()
    _last_settings = settings
    if not isinstance(device, Device):
        if device is None and torch.cuda.is_available() and not settings.simulate:
            device = torch.cuda.current_device()
        device = devices.get_device(device, settings.simulated_capability)
    family = FAMILIES[family] if isinstance(family, str) else family
    names = candidate_names(settings, candidates, family, device)
    # FlashInfer's own FP4 knobs, set since install() (or where decide() is called without it): every
    # candidate would fail against the oracle and be blamed; name the variable instead.
    check_flashinfer_env()
    key = (device.capability, device.simulated, tuple(names), settings.selftest, family.fallback(settings), settings.select)
    record = _record(family, device.index, device)
    with _lock:
        key_lock = record.deciding.setdefault(key, locks.lock())
    with key_lock:
        if not refresh and key in record.decided:
            return record, key, record.decided[key]
        if refresh and key == record.serving and record.checks:
            raise ConfigError(
                f"decide(refresh=True): {device.label()} already serves {len(record.checks)} verified layer "
                f"configuration(s) with {record.decision.backend}; a refreshed decision would serve them unchecked. "
                "Accepted: refresh before the first layer loads, or uninstall() (or a new process) first")
        try:
            choice = choose(device, names, settings, family)
        except RefusedToServe as exc:
            _refuse(Refusal(device=device.label(), family=family.name, message=str(exc),
                            rejected=getattr(exc, "rejected", {}), reports=getattr(exc, "reports", [])), settings)
            raise
        record.store(key, choice)
    log_decision(choice.decision)
    report_file.update(settings)
    return record, key, choice


def _refuse(refusal: Refusal, settings: Settings) -> None:
    with _lock:
        _refusals.append(refusal)
    report_file.update(settings)  # before the process exits: the record of why it refused


def record_refusal(refusal: Refusal, settings: Settings) -> None:
    """Record a refusal decided outside this module (the serving canary's): status and the report file."""
    _refuse(refusal, settings)


def refusals() -> list[Refusal]:
    """Every refusal to serve in this process so far."""
    with _lock:
        return list(_refusals)


def decisions() -> list[Decision]:
    """Every decision made in this process so far (a replaced backend's in the place of the one it replaced)."""
    with _lock:
        return [choice.decision for record in _records.values() for choice in record.decided.values()]


report_file.sections["decisions"] = lambda: [d.model_dump(mode="json") for d in decisions()]
report_file.sections["refusals"] = lambda: [r.model_dump(mode="json") for r in refusals()]


def clear() -> None:
    """Forget every decision and route (uninstall; tests; a FlashInfer upgrade in a long-lived process),
    and undo what a backend converted at load where it can (humming: the layers whose original bytes
    it kept); a layer it cannot restore is named in a warning (only that backend can serve it)."""
    global _updating, _updating_since
    with _lock:
        _updating, _updating_since = 0, None
        dropped = list(_records.values())
        _records.clear()
        _refusals.clear()
        for record in dropped:
            _publish(record)  # its entry goes with it
        served = [(record, record.decision.backend) for record in dropped if record.serving is not None]
    graphs.clear()  # the checks' graphs (their memory) go with the layers they checked
    for record, backend in served:
        stuck = _release(record, backend)
        if stuck is not None:
            _LOG.warning("sm120_fp4: %s: %s", record.device.label(), stuck)


def route(index: int, settings: Settings, family: str = "dense") -> Callable | None:
    """The backend callable serving CUDA ordinal `index` (-1: CPU tensors in simulation) for kernel
    `family` ("dense" or "moe"), deciding (self-testing) on first use; None where this library does
    not serve the device."""
    table = _route_tables[family]
    if index in table:
        return table[index]
    kind = FAMILIES[family]
    simulate = settings.simulated_capability
    if index < 0 and simulate is None:
        return _record(kind, index).route_to(None, None, None)  # a CPU tensor outside simulation: not a GPU we fix
    device = devices.get_device(index, simulate)
    if not serves(device, settings):
        return _record(kind, index, device).route_to(device, None, None)
    record, key, _ = _decide(device, None, settings, False, kind)
    return record.route_to(device, key, settings)


def route_table(family: str = "dense") -> dict[int, Callable | None]:
    """The live route table of `family` (the hot path's lookup, derived from the records); never
    replace or write it, only read it."""
    return _route_tables[family]


def routes(family: str = "dense") -> dict[int, str]:
    """Device index -> the backend it is routed to, or "original" (a device this library does not serve)."""
    with _lock:
        return {r.index: r.route_name for (fam, _), r in _records.items() if fam == family and r.routed}


def _start_check(serving: _Serving, check: LayerCheck, ms: list[int], config: str | None = None,
                 light: bool = False) -> tuple[verify.SelfTestReport, verify.Sweep | None, float]:
    """The served calls of `check` at batch sizes `ms`, ready to be called pass by pass: (the report
    to fill, the sweep or None where building the calls failed (the report says why), the start)."""
    device = serving.device
    start = time.perf_counter()
    try:
        cases = check.cases(ms)  # first: the oracle's GPU work is queued, and the host's work below overlaps it
    except Exception as exc:  # building the served calls failed: that is a finding, not a crash
        report = verify.report_for(serving.decision.backend, device, config=config or check.label)
        report.reason = f"could not build the served calls: {type(exc).__name__}: {exc}"
        report.duration_s = time.perf_counter() - start
        return report, None, start
    report = verify.report_for(serving.decision.backend, device, config=config or check.label)
    where = f" of {serving.decision.backend!r} on {device.label()} for {check.named()}"
    if light and check.weights is not None:
        # The layer's fingerprint after the calls covers its weights: no copies of them. The call's
        # other inputs (an MoE layer's activations and routing) are still compared bit for bit.
        weights = _weight_storages(check)
        for case in cases:
            case.inputs = tuple(t for t in case.inputs if t.untyped_storage().data_ptr() not in weights)
    # A light check (any other layer of a verified configuration, the canary's) calls each M once: its
    # configuration's sweep already called each M twice in a row.
    sweep = verify.Sweep(cases, verify.Bounds(timeout_s=serving.settings.selftest_timeout), device.torch_device, where,
                           repeat=not light)
    return report, sweep, start


def _run_check(serving: _Serving, check: LayerCheck, ms: list[int], passes: int = 2,
               config: str | None = None, light: bool = False) -> verify.SelfTestReport:
    report, run, start = _start_check(serving, check, ms, config, light)
    if run is None:
        return report
    return verify.finish(report, run.run(passes), start)


def _weight_storages(check: LayerCheck) -> frozenset[int]:
    """The storages of the tensors the layer of `check` serves with (its weights)."""
    if check.weights is None:
        return frozenset()
    return frozenset(t.untyped_storage().data_ptr() for t in check.weights() if isinstance(t, torch.Tensor))


def _fingerprint(check: LayerCheck) -> torch.Tensor | None:
    return verify.fingerprint(check.weights()) if check.weights is not None else None


def _owner_ref(check: LayerCheck) -> Callable[[], object] | None:
    try:
        return weakref.ref(check.owner)
    except TypeError:  # not weak-referenceable: kept
        owner = check.owner
        return lambda: owner


def _layer_check(serving: _Serving, check: LayerCheck, full: bool) -> tuple[verify.SelfTestReport, torch.Tensor | None]:
    """The full sweep (a configuration's first layer) or the light check (any other layer) of
    `check`, then its fingerprint: a call that wrote into the layer's own weights fails the check.
    Returns the report and the fingerprint the layer's weights had when they were checked."""
    if full:
        report, run, start = _start_check(serving, check, check.ms)
    else:
        report, run, start = _start_check(serving, check, check.light_ms, f"{check.label} (layer check)", light=True)
    if run is None:
        return report, None
    # Taken after the oracle's work is queued (it reads the weights and writes none) and before
    # the first served call: on a GPU its launches overlap the oracle's dequantization.
    before = _fingerprint(check)
    report = verify.finish(report, run.run(2 if full else 1), start)
    _fail_if_written(report, check, before)
    return report, before


def _fail_if_written(report: verify.SelfTestReport, check: LayerCheck, before: torch.Tensor | None) -> None:
    """A passing check fails when the layer's weights no longer have the fingerprint `before` they
    had: its calls wrote into them."""
    if report.passed and before is not None and not torch.equal(before, _fingerprint(check)):
        report.passed = False
        report.reason = f"{check.named()}: the checked calls changed this layer's own weights in place"


def _record_layer(serving: _Serving, check: LayerCheck, fingerprint: torch.Tensor | None) -> None:
    if len(serving.layers) >= serving.prune_at:  # amortised: a model's hundreds of layers cost no quadratic walk
        serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
        serving.prune_at = max(64, 2 * len(serving.layers))
    if check.owner is None:
        serving.layers[id(check)] = _Layer(check.named(), fingerprint, None, None, check, check.key)
        return
    owner = _owner_ref(check)
    weak = isinstance(owner, weakref.ref) and check.rebuild is not None
    serving.layers[id(check.owner)] = _Layer(check.named(), fingerprint, owner, check.rebuild, None if weak else check, check.key)


def verify_layer(index: int, check: LayerCheck, settings: Settings) -> verify.SelfTestReport | None:
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
    serving = _records[(check.family, index)]
    with serving.lock:
        checking = settings.selftest != "off"
        # A backend that serves converted weights converts this layer now (keeping its original
        # bytes while it is checked: the oracle reads them); every later backend switch converts it too.
        problem = _prepare(serving, check.tensors, keep_original=checking)
        if check.tensors is not None:
            serving.seen.setdefault(_seen_key(check.tensors), check.tensors)
        if not checking:
            return None
        if check.key in serving.unverified:  # SELFTEST=warn has already said so for this configuration
            return serving.unverified[check.key]
        known = serving.checks.get(check.key)
        full = known is None
        if problem is None:
            report, fingerprint = _layer_check(serving, check, full)
        else:
            report, fingerprint = verify.report_for(serving.decision.backend, serving.device, config=check.label), None
            report.reason = problem
        if not report.passed:
            return _replace_backend(serving, check, report, settings)
        _record_layer(serving, check, fingerprint)
        if full:
            serving.checks[check.key] = check
        _settle(serving, check.tensors)  # after the line above: a configuration's first layer keeps its kept bytes
        if full:
            serving.decision.layers.append(report)
            _LOG.info("sm120_fp4: %s verified with %s on %s (%d batch sizes, max rel error %.2e)", check.label,
                      serving.decision.backend, serving.device.label(), len(check.ms), report.max_rel_err or 0.0)
            if settings.select == "fastest":
                _route_fastest(serving, check, settings)
            report_file.update(settings)
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


def _seen_key(tensors: dict) -> tuple:
    """What identifies the served layer `tensors` describe: its packed weight's storage (two dicts
    of the same layer share it), else the dict itself."""
    weight = tensors.get("weight", tensors.get("w13"))
    return ("storage", weight.data_ptr()) if isinstance(weight, torch.Tensor) else ("dict", id(tensors))


def _same_layer(a: dict | None, b: dict | None) -> bool:
    """Whether two `tensors` dicts describe the same served layer (the same packed weight storage)."""
    if a is None or b is None:
        return False
    return a is b or _seen_key(a) == _seen_key(b)


def _representative(serving: _Serving, tensors: dict) -> bool:
    """Whether `tensors` are a configuration's first layer: the one the re-checks compare."""
    return any(_same_layer(c.tensors, tensors) for c in serving.checks.values())


def _settle(serving: _Serving, tensors: dict | None) -> None:
    """A layer's check is over: the backend drops what it kept for the check, or, for its
    configuration's first layer (the one the re-checks compare), keeps it its long-term way."""
    backend = backends.backend_of(serving.family.name, serving.decision.backend)
    if backend.settle is not None and tensors is not None:
        backend.settle(tensors, _representative(serving, tensors))


def _prepare_seen(serving: _Serving) -> str | None:
    """Let the backend now routed convert every layer served so far (originals kept while checked)."""
    return next((p for p in (_prepare(serving, t, True) for t in serving.seen.values()) if p), None)


def _settle_seen(serving: _Serving) -> None:
    for tensors in serving.seen.values():
        _settle(serving, tensors)


def _refingerprint(serving: _Serving) -> None:
    """After a backend switch that converted or restored weights: every layer's fingerprint anew."""
    for record in serving.layers.values():
        current = record.current() if record.alive() else None
        if current is not None:
            record.fingerprint = _fingerprint(current)


def _back_to(serving: _Serving, original: Choice) -> None:
    """Route the device to `original` again (a refusal or an interruption while replacing it),
    converting the layers again where that backend serves converted weights."""
    serving.serve(original)
    backend = backends.backend_of(serving.family.name, original.decision.backend)
    if backend.prepare is not None:
        for tensors in serving.seen.values():
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
    chosen_first = serving.choice
    original = chosen_first.decision
    names = [r.backend for r in original.reports if r.passed] or [original.backend]
    names = [n for n in dict.fromkeys([original.backend, *names]) if n not in serving.failed]
    if len(names) < 2:
        return
    choices = {original.backend: chosen_first}
    try:
        for name in names:
            if name != original.backend:
                copy = original.model_copy(update={"backend": name, "mode": backends.mode_of(serving.family.name, name),
                                                   "layers": [], "timings_ms": {}})
                choices[name] = Choice(copy, serving.family.resolve(name))
                serving.serve(choices[name])
                report, _ = _layer_check(serving, check, True)
                if not report.passed:
                    serving.failed[name] = f"{report.config}: {report.reason}"
                    continue
                serving.candidate_layers.setdefault(name, []).append(report)
            else:
                serving.serve(chosen_first)
            serving.timings.setdefault(name, {})[check.key] = _time_served(serving, check)
        keys = list(serving.checks)
        eligible = [n for n in names if n not in serving.failed and all(k in serving.timings.get(n, {}) for k in keys)]
        totals = {n: sum(serving.timings[n][k] for k in keys) for n in eligible}
        best = min(eligible, key=totals.__getitem__)
        serving.serve(choices[best])
        chosen = choices[best].decision
        if best != original.backend:
            _, bad = _verify_everything(serving, check, False, configurations=False)  # every layer so far, its own weights
            if bad is not None:
                serving.failed[best] = f"{bad.config}: {bad.reason}"
                serving.serve(chosen_first)
                return
            serving.candidate_layers[original.backend] = list(original.layers)
            chosen.layers = list(serving.candidate_layers.get(best, []))
        chosen.timings_ms = totals
        chosen.reason = (f"fastest of {len(eligible)} verified candidates on the served layer configurations at their "
                         f"serving batch sizes ({totals[best]:.3g} ms over {len(keys)} configuration(s))")
    except BaseException:
        serving.serve(chosen_first)
        raise


def _verify_everything(serving: _Serving, extra: LayerCheck, extra_full: bool,
                       configurations: bool = True) -> tuple[list, verify.SelfTestReport | None]:
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


def _replace_backend(serving: _Serving, check: LayerCheck, report: verify.SelfTestReport,
                     settings: Settings) -> verify.SelfTestReport:
    """The served backend failed `check` (`report`): find one that passes everything, or refuse.

    Until one passes every configuration and every layer, nothing new is recorded; on a refusal or
    an interruption the device goes back to the backend it had (which still serves what it passed)."""
    original = serving.choice
    full = check.key not in serving.checks
    failures = [report]
    serving.failed[report.backend] = f"{report.config}: {report.reason}"
    stuck = _release(serving, report.backend)
    if stuck is not None:
        serving.failed[report.backend] += f" ({stuck})"
    try:
        while stuck is None:
            remaining = [n for n in candidate_names(settings, family=serving.family, device=serving.device) if n not in serving.failed]
            choice = _next_choice(serving, remaining, settings)
            if choice is None:
                break
            serving.serve(choice)
            decision = choice.decision
            problem = _prepare_seen(serving)
            if problem is None:
                reports, bad = _verify_everything(serving, check, full)
            else:
                reports, bad = [], verify.report_for(decision.backend, serving.device, config=check.label)
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
                report_file.update(settings)
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


def _next_choice(serving: _Serving, remaining: list[str], settings: Settings) -> Choice | None:
    """The first of `remaining` that passes its self-test, else the verified emulation where
    FALLBACK=emulated allows it (and it has not failed too), else None."""
    family = serving.family
    strict = settings.model_copy(update={"selftest": "strict", "fallback": "none", "moe_fallback": "none"})
    if remaining:
        with contextlib.suppress(RefusedToServe):
            return choose(serving.device, remaining, strict, family)
    if family.fallback(settings) != "emulated" or backends.EMULATED in serving.failed:
        return None
    try:
        choice = choose(serving.device, [backends.EMULATED], strict, family)
    except RefusedToServe:
        return None
    choice.decision.reason = f"fallback: no candidate verified on every layer configuration ({family.fallback_var}=emulated)"
    _LOG.warning("sm120_fp4: %s: no %s candidate passed every layer configuration; %s=emulated: "
                 "serving with the slow pure-PyTorch emulation", serving.device.label(), family.what, family.fallback_var)
    return choice


_updating = 0  # SGLang weight updates in progress (weights_updating)
_updating_since: float | None = None  # time.monotonic() when the open weight updates began (None: none open)
_last_settings: Settings | None = None


def _layer_key(check: LayerCheck) -> int:
    """The key of `check`'s layer in _Serving.layers."""
    return id(check.owner) if check.owner is not None else id(check)


_CHANGED = "the layer's weights changed after they were verified, and not through SGLang's weight-update path"


def _compare_fingerprints(layers: list[tuple[_Layer, LayerCheck | None]]) -> list[tuple[LayerCheck | None, str | None]]:
    """For each (record, its check or None: rebuilt from the record) of one device: the check, and
    why its weights are not the ones fingerprinted when verified (None: they are). The comparisons
    run on the device and are read back at once."""
    results: list[tuple[LayerCheck | None, str | None]] = []
    pending: list[tuple[int, torch.Tensor]] = []
    for record, check in layers:
        try:
            check = check if check is not None else record.current()
            now = _fingerprint(check) if check is not None else None
        except Exception as exc:  # noqa: BLE001 - a weight the layer no longer has: changed
            results.append((None, f"its weights can no longer be read ({type(exc).__name__}: {exc})"))
            continue
        if now is None or now.shape != record.fingerprint.shape:
            results.append((check, _CHANGED))
            continue
        pending.append((len(results), (now == record.fingerprint).all()))
        results.append((check, None))
    same = torch.stack([eq for _, eq in pending]).tolist() if pending else []
    for (i, _), ok in zip(pending, same):
        if not ok:
            results[i] = (results[i][0], _CHANGED)
    return results


def _changed_layers(serving: _Serving) -> list[tuple[int, _Layer, LayerCheck | None]]:
    """(key, record, its check now) of the recorded layers whose weights differ from their
    fingerprint now (or can no longer be read)."""
    serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
    kept = [(key, record) for key, record in serving.layers.items() if record.fingerprint is not None]
    compared = _compare_fingerprints([(record, None) for _, record in kept])
    return [(key, record, check) for (key, record), (check, why) in zip(kept, compared) if why is not None]


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


def recheck(settings: Settings, captured: Sequence[int] = ()) -> list[verify.SelfTestReport]:
    """After SGLang's warm-up and CUDA-graph capture, when autotuners have picked their tactics:
    first every verified layer's weights against their fingerprint (a change outside SGLang's
    weight-update path refuses, naming the layer), then every verified layer configuration once
    more, eagerly, at its re-check batch sizes and at every M of `captured` (the token counts of the
    CUDA graphs SGLang just captured: the batch sizes graphs will serve); a failure refuses
    (RefusedToServe) with the configuration and batch size."""
    verify.refuse_inside_capture("re-check", "after")
    if _updating:
        reverify(settings)  # a capture inside a weight update: the new weights are verified first
    done = []
    for serving in _served():
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
    global _updating, _updating_since
    backends.invalidate_caches()
    with _lock:
        if not _updating:
            _updating_since = time.monotonic()
        _updating += 1


def weights_update_end(settings: Settings) -> list[verify.SelfTestReport]:
    """SGLang is done writing weights: when no other update is open, every layer whose weights
    changed is verified again (reverify) before anything else is served."""
    global _updating, _updating_since
    with _lock:
        _updating = max(0, _updating - 1)
        last = _updating == 0
        if last:
            _updating_since = None
    backends.invalidate_caches()
    return reverify(settings) if last else []


def weights_update_open_s() -> float | None:
    """How long SGLang's weight update (a call, or a session begun and not ended) has been open, or
    None when none is: meanwhile weight fingerprints are not compared (changes are expected)."""
    with _lock:
        return None if _updating_since is None else time.monotonic() - _updating_since


@contextlib.contextmanager
def weights_updating(settings: Settings):
    """weights_update_begin() ... weights_update_end(settings) around one of SGLang's weight updates."""
    weights_update_begin()
    try:
        yield
    finally:
        weights_update_end(settings)


def reverify(settings: Settings) -> list[verify.SelfTestReport]:
    """Verify again every recorded layer whose weights changed (a weight update): each is rebuilt
    from the layer's current state and checked (a configuration's representative layer with the full
    sweep, any other with its light check), its fingerprint renewed; a failure refuses
    (RefusedToServe) naming the layer."""
    done = []
    for serving in _served():
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


verify.hang_hooks.append(_on_hang)


# ---- for the serving canary (sm120_fp4.canary) --------------------------------------------------

@dataclass(frozen=True)
class Served:
    """One layer configuration verified in this process, on the device and kernel family that serve it."""

    family: str
    device: Device
    check: LayerCheck

    @property
    def backend(self) -> str:
        """The backend serving this configuration now."""
        return _records[(self.family, self.device.index)].decision.backend


def served_configurations() -> list[Served]:
    """Every layer configuration verified in this process (passed, with the backend serving it now;
    not one served unverified under SELFTEST=warn), per family and device in the order verified."""
    servings = _served()
    served = []
    for s in servings:
        with s.lock:
            passed = {r.config for r in s.decision.layers if r.passed}
            served += [Served(s.family.name, s.device, c) for c in s.checks.values() if c.label in passed]
    return served


def served_layer(served: Served, turn: int) -> Served:
    """The `turn`-th (in rotation) verified layer of `served`'s configuration, as a Served whose
    check uses that layer's own weights (the serving canary walks every layer this way, so that a
    kernel wrong with one layer's weights only, or one layer's weights changed, is reached); the
    configuration's first layer where no other is alive or it cannot be rebuilt, and where the
    serving backend converted the layers in place (humming: the oracle has the checkpoint's bytes of
    the first layer only; the fingerprint sweep still covers the others)."""
    serving = _records[(served.family, served.device.index)]
    with serving.lock:
        if backends.backend_of(served.family, serving.decision.backend).settle is not None:
            return served  # a backend that converts layers in place keeps the checkpoint's bytes of the first one only
        layers = [r for r in serving.layers.values() if r.key == served.check.key and r.alive()]
        if not layers:
            return served
        check = layers[turn % len(layers)].current()
    return Served(served.family, served.device, check) if check is not None else served


def fingerprint_sweep(family: str, index: int, start: int, count: int) -> tuple[str | None, int]:
    """Compare the fingerprints of `count` verified layers of `family` on device `index`, from the
    `start`-th on (in rotation; one host read for all of them): (the first changed layer's problem
    or None, where the next sweep starts). None during SGLang's weight updates."""
    serving = _records.get((family, index))
    if serving is None or _updating:
        return None, start
    with serving.lock:
        records = [r for r in serving.layers.values() if r.fingerprint is not None and r.alive()]
        if not records:
            return None, 0
        chosen = [records[(start + i) % len(records)] for i in range(min(count, len(records)))]
        compared = _compare_fingerprints([(record, None) for record in chosen])
    problem = next((f"{record.label}: {why}" for record, (_, why) in zip(chosen, compared) if why is not None), None)
    return problem, (start + len(chosen)) % len(records)


def check_served(served: Served, m: int) -> verify.SelfTestReport:
    """The re-check's light check of `served` at batch size `m`, through the call that serves it
    (two passes, every call against the oracle), for the serving canary: its report, including a
    call that wrote into the layer's weights (their fingerprint after the calls must still be the one
    they were verified with)."""
    serving = _records[(served.family, served.device.index)]
    with serving.lock:
        report = _run_check(serving, served.check, [m], light=True)
        record = serving.layers.get(_layer_key(served.check))
        if record is not None and not _updating:
            _fail_if_written(report, served.check, record.fingerprint)
        return report


def fingerprint_problem(check: LayerCheck) -> str | None:
    """Whether the verified layer of `check` still has the weights it was verified with: None, or
    why not (the serving canary asks at the first step of every run; a weight corrupted in memory is
    invisible to the oracle, which reads the same corrupted weight). During SGLang's weight updates
    changes are expected: None."""
    key = _layer_key(check)
    for serving in _served():
        with serving.lock:
            record = serving.layers.get(key)
            if record is None or record.fingerprint is None or _updating:
                continue
            [(_, why)] = _compare_fingerprints([(record, check)])
            if why is not None:
                return f"{check.named()}: {why}"
    return None

