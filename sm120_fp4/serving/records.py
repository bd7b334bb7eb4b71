"""The serving records: one per (kernel family, device) -- what was decided for it, what serves it,
the layers verified on it -- and the route table derived from them.

:func:`route` decides (:mod:`sm120_fp4.deciding`) on first use and routes the device. The records
are the one store of this state. The route table the hot path reads (:func:`route_table`, one dict
lookup per call in :mod:`sm120_fp4.dispatch`) is derived from them: every change of what serves a
record (``_Serving.serve`` / ``route_to`` / ``store``, and clear() dropping it) rebuilds that
device's entry from the store through ``_publish``, the one writer of the table. A refresh
(``decide(refresh=True)``) of the decision a device is served with serves the refreshed one while no
layer was verified with it; after that it is refused (ConfigError): the refreshed backend would
serve layers never checked with it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import backends, devices, graphs, locks, verify
from .. import report as report_file
from ..config import Settings, check_flashinfer_env, load_settings
from ..deciding import FAMILIES, Choice, Decision, Family, Refusal, candidate_names, choose, log_decision, serves
from ..devices import Device
from ..errors import ConfigError, RefusedToServe

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
    timings: dict[str, dict[tuple, float]] = field(
        default_factory=dict
    )  # SELECT=fastest: backend -> configuration -> ms
    candidate_layers: dict[str, list] = field(
        default_factory=dict
    )  # SELECT=fastest: each candidate's configuration reports
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
        return route_text(self.decision) if self.serving is not None else "original"

    @property
    def converter(self) -> backends.Converter | None:
        """How the serving backend converts each layer's weights (humming), or None: it serves them as they are."""
        return backends.backend_of(self.family.name, self.decision.backend).converter

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


def route_text(decision: Decision) -> str:
    """Return the backend of `decision`, or each backend with its M range ("a (M<=64), b (M>64)")."""
    ranges = decision.ranges
    if len(ranges) < 2:
        return decision.backend
    labels = [f"M<={bound}" if bound is not None else f"M>{ranges[-2][0]}" for bound, _ in ranges]
    return ", ".join(f"{name} ({label})" for (_, name), label in zip(ranges, labels))


_lock = locks.lock()

_records: dict[tuple[str, int], _Serving] = {}  # (family, device index) -> its record: the one store

# Derived from _records by _publish alone: CUDA ordinal (-1: CPU in simulation) -> the callable
# serving it, or None for a device this library does not serve (the original runs there). Read on
# every forward pass (one dict lookup); emptied, never replaced, by clear().
_route_tables: dict[str, dict[int, Callable | None]] = {"dense": {}, "moe": {}}

_refusals: list[Refusal] = []


@dataclass
class _Process:
    """This process's serving state outside the records."""

    updating: int = 0  # SGLang weight updates in progress (weights_updating)
    updating_since: float | None = None  # time.monotonic() when the open weight updates began (None: none open)
    last_settings: Settings | None = None  # the settings of the last decide() / verify_layer() (the watchdog's refusal)


_process = _Process()


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


def _decide(
    device: Device | int | None,
    candidates: list[str] | tuple[str, ...] | None,
    settings: Settings | None,
    refresh: bool,
    family: Family | str,
) -> tuple[_Serving, tuple, Choice]:
    """decide(): the device's record, the key its choice is cached under, the choice."""
    settings = settings or load_settings()
    _process.last_settings = settings
    if not isinstance(device, Device):
        if device is None and torch.cuda.is_available() and not settings.simulate:
            device = torch.cuda.current_device()
        device = devices.get_device(device, settings.simulated_capability)
    family = FAMILIES[family] if isinstance(family, str) else family
    names = candidate_names(settings, candidates, family, device)
    # FlashInfer's own FP4 knobs, set since install() (or where decide() is called without it): every
    # candidate would fail against the oracle and be blamed; name the variable instead.
    check_flashinfer_env()
    key = (
        device.capability,
        device.simulated,
        tuple(names),
        settings.selftest,
        family.fallback(settings),
        settings.select,
    )
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
                "Accepted: refresh before the first layer loads, or uninstall() (or a new process) first"
            )
        try:
            choice = choose(device, names, settings, family)
        except RefusedToServe as exc:
            _refuse(
                Refusal(
                    device=device.label(),
                    family=family.name,
                    message=str(exc),
                    rejected=getattr(exc, "rejected", {}),
                    reports=getattr(exc, "reports", []),
                ),
                settings,
            )
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


def report_sections() -> dict[str, Callable[[], object]]:
    """This process's sections of the report file (:mod:`sm120_fp4.report`): its decisions and refusals."""
    return {
        "decisions": lambda: [d.model_dump(mode="json") for d in decisions()],
        "refusals": lambda: [r.model_dump(mode="json") for r in refusals()],
    }


def clear() -> None:
    """Forget every decision and route (uninstall; tests; a FlashInfer upgrade in a long-lived process),
    and undo what a backend converted at load where it can (humming: the layers whose original bytes
    it kept); a layer it cannot restore is named in a warning (only that backend can serve it)."""
    with _lock:
        _process.updating, _process.updating_since = 0, None
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


def _release(serving: _Serving, name: str) -> str | None:
    """Undo what backend `name` converted on this device; None, or why no other backend can take over."""
    try:
        backend = backends.backend_of(serving.family.name, name)
    except ConfigError:  # unregistered since (a test's backend): it converted nothing of ours
        return None
    if backend.converter is None or backend.converter.restore():
        return None
    return (
        f"{name} converted served layers' weights to its own layout in place at load and kept the original bytes "
        "of the checked layers only, so no other backend can serve them in this process; restart with "
        f"{serving.family.backends_var} naming a backend that verifies"
    )


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


def _layer_key(check: LayerCheck) -> int:
    """The key of `check`'s layer in _Serving.layers."""
    return id(check.owner) if check.owner is not None else id(check)
