"""The serving records per (kernel family, device), and the route table the hot path reads (written by _publish)."""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel

from .. import backends, devices, graphs, locks, verdicts, verify
from .. import report as report_file
from ..config import Settings, check_flashinfer_env, load_settings
from ..deciding import FAMILIES, Choice, Decision, Family, Refusal, candidate_names, choose, log_decision, serves
from ..devices import Device
from ..errors import ConfigError, RefusedToServe
from .collective import gather

_LOG = logging.getLogger("sm120_fp4")


class Unverified(BaseModel):
    """Something served UNVERIFIED (SM120_FP4_SELFTEST=warn): which layer or call, and why nothing verifies it."""

    what: str
    reason: str


@dataclass
class LayerCheck:
    """One NVFP4 layer to verify on one device through the call that will serve it."""

    device_index: int
    key: tuple  # the layer configuration: its first layer gets the full sweep, every other a light check
    label: str  # the configuration's name in reports
    family: str
    cases: Callable[[list[int]], list[verify.Case]]  # the served calls at these batch sizes, with their oracle
    ms: list[int]  # the full sweep's batch sizes
    recheck_ms: list[int]  # the batch sizes run again after warm-up (and timed by SELECT=fastest)
    layer: str = ""  # this layer's name
    light_ms: list[int] = field(default_factory=lambda: [8])
    weights: Callable[[], tuple] | None = None  # the tensors the layer serves with now (fingerprinted)
    rebuild: Callable[[object], "LayerCheck | None"] | None = None  # the check again from the layer's state
    owner: object = None  # the layer itself, kept by a weak reference
    # The layer's own tensors, for a backend that converts each served layer at load (humming):
    # dense {"weight", "weight_sf", "dtype"}; MoE reference_moe_fp4's names and "dtype".
    tensors: dict | None = None

    def named(self) -> str:
        return f"{self.label} [{self.layer}]" if self.layer else self.label


@dataclass
class _Layer:
    """One verified layer: its fingerprint when verified and how to check it again (rebuilt where it can be)."""

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
    """One kernel family on one device: decisions, what serves (changed only by serve/route_to), layers, failures."""

    family: Family
    index: int
    device: Device | None = None
    settings: Settings | None = None
    decided: dict[tuple, Choice] = field(default_factory=dict)  # decide()'s key -> its choice
    deciding: dict[tuple, threading.Lock] = field(default_factory=dict)  # one lock per decide() key: one self-test each
    serving: tuple | None = None  # the key of the choice that serves (None: the original kernel runs)
    routed: bool = False  # whether route() has answered for this device
    checks: dict[tuple, LayerCheck] = field(default_factory=dict)  # one per configuration: its full sweep
    layers: dict[int, _Layer] = field(default_factory=dict)  # id(layer) -> its record (light checks, fingerprints)
    failed: dict[str, str] = field(default_factory=dict)  # backend -> why it failed a layer configuration
    timings: dict[str, dict[tuple, dict[int, float]]] = field(default_factory=dict)  # backend -> config -> M -> ms
    candidate_layers: dict[str, list] = field(default_factory=dict)  # SELECT=fastest: each candidate's reports
    unverified: dict[tuple, verify.SelfTestReport] = field(default_factory=dict)  # SELFTEST=warn: failed, served anyway
    # Every served layer's tensors (no copy) by weight storage: a converting backend taking over converts them.
    seen: dict[tuple, dict] = field(default_factory=dict)
    prune_at: int = 64  # _record_layer drops dropped layers' records when this many are kept
    lock: threading.RLock = field(default_factory=locks.rlock)

    @property
    def choice(self) -> Choice:
        """Return what serves the device (only where `serving` is set)."""
        return self.decided[self.serving]

    @property
    def decision(self) -> Decision:
        return self.choice.decision

    @property
    def route_name(self) -> str:
        """Return the backend(s) the device is routed to, or "original"."""
        return route_text(self.decision) if self.serving is not None else "original"

    @property
    def candidates(self) -> list[str]:
        """Return the backends SELECT=fastest may move this device to: every verified candidate of its decision."""
        base = self.decision
        names = [r.backend for r in base.reports if r.passed and r.backend not in base.rejected]
        return list(dict.fromkeys([base.backend, *names]))

    @property
    def beside(self) -> bool:
        """Return whether a converting backend keeps its own layout next to each layer's (which keeps the
        checkpoint's bytes): SELECT=fastest with several verified candidates, any of which may serve any range."""
        return self.settings is not None and self.settings.select == "fastest" and len(self.candidates) > 1

    @property
    def converter(self) -> backends.Converter | None:
        """Return how the serving backend converts each layer's weights at load (humming), or None (also: beside)."""
        converter = backends.backend_of(self.family.name, self.decision.backend).converter
        return None if converter is not None and converter.in_place and self.beside else converter

    @property
    def fn(self) -> Callable | None:
        """Return the callable the hot path calls for this device, or None (the original kernel runs)."""
        return self.choice.fn if self.routed and self.serving is not None else None

    def store(self, key: tuple, choice: Choice) -> None:
        """Keep decide()'s choice for `key` (a refresh of the serving key routes to it)."""
        with _lock:
            self.decided[key] = choice
            if key == self.serving:
                _publish(self)

    def route_to(self, device: Device | None, key: tuple | None, settings: Settings | None) -> Callable | None:
        """Route the device once to the choice for `key` (None: the original) and return its callable."""
        with _lock:
            if not self.routed:
                self.routed, self.serving = True, key
                if key is not None:
                    self.device, self.settings = device, settings
                _publish(self)
            return self.fn

    def serve(self, choice: Choice) -> None:
        """Serve the device with `choice` from now on, in the replaced decision's place."""
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

# CUDA ordinal (-1: CPU in simulation) -> the callable serving it (None: the original); read on every
# forward pass, written by _publish alone, emptied (never replaced) by clear().
_route_tables: dict[str, dict[int, Callable | None]] = {"dense": {}, "moe": {}}
_refusals: list[Refusal] = []
_unverified: list[Unverified] = []


@dataclass
class _Process:
    """This process's serving state outside the records."""

    updating: int = 0  # SGLang weight updates in progress (weights_updating)
    updating_since: float | None = None  # time.monotonic() when the open weight updates began (None: none open)
    last_settings: Settings | None = None  # the settings of the last decide() / verify_layer() (the watchdog's refusal)
    rank: Callable[[], dict[str, int]] = dict  # the engine's ranks of this process (api wires the engine homes')
    verifying: dict[object, str] = field(default_factory=dict)  # what it self-tests now (the report), by check


_process = _Process()


def _publish(record: _Serving) -> None:
    """Make `record`'s route table entry say what the store says now (under _lock)."""
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
    """Return every record routed to a backend of ours, in the order made."""
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
    """Return the verified backend for `device` (a Device, a CUDA ordinal, or None: the current one), cached."""
    return _decide(device, candidates, settings, refresh, family)[2].decision


def _decide(device, candidates, settings, refresh, family) -> tuple[_Serving, tuple, Choice]:
    """Return decide()'s record, cache key and choice (the arguments as decide()'s)."""
    settings = settings or load_settings()
    _process.last_settings = settings
    if not isinstance(device, Device):
        if device is None and torch.cuda.is_available() and not settings.simulate:
            device = torch.cuda.current_device()
        device = devices.get_device(device, settings.simulated_capability)
    family = FAMILIES[family] if isinstance(family, str) else family
    names = candidate_names(settings, candidates, family, device)
    # FlashInfer's own FP4 knobs would fail every candidate against the oracle: name the variable instead.
    check_flashinfer_env()
    fallback = family.fallback(settings)
    key = (device.capability, device.simulated, tuple(names), settings.selftest, fallback, settings.select)
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
        mark = (family.name, device.index, key)
        _process.verifying[mark] = f"{family.what} on {device.label()}"
        report_file.write_now(settings)  # before the first check: a rank the engine stops meanwhile says so
        try:
            # Every rank decides here (its first layer): SELECT=fastest chooses alike on every rank.
            choice = choose(
                device,
                names,
                settings,
                family,
                crashed=verdicts.crashed(settings.verdicts_path, device, family.name),
                gather=functools.partial(gather, timeout_s=settings.selftest_timeout),
            )
        except RefusedToServe as exc:
            _process.verifying.pop(mark, None)
            exc.args = (_with_rank(str(exc), _process.rank()), *exc.args[1:])  # the engine's log names the rank
            refusal = Refusal(device=device.label(), family=family.name, message=str(exc))
            refusal.rejected, refusal.reports = getattr(exc, "rejected", {}), getattr(exc, "reports", [])
            record_refusal(refusal, settings)
            raise
        finally:
            _process.verifying.pop(mark, None)
        record.store(key, choice)
    log_decision(choice.decision)
    report_file.request(settings)
    return record, key, choice


def record_refusal(refusal: Refusal, settings: Settings) -> None:
    """Record a refusal (ours or the serving canary's) for status and the report file, with this process's ranks."""
    refusal.rank = refusal.rank or _process.rank()
    refusal.message = _with_rank(refusal.message, refusal.rank)
    with _lock:
        _refusals.append(refusal)
    report_file.write_now(settings)  # before the process exits: the record of why it refused (bounded)


def _with_rank(message: str, rank: dict[str, int]) -> str:
    """Return `message` with its first line ending in the rank of several that refused ("... (TP rank 1/2)")."""
    where = devices.rank_text(rank)
    if not where or f"({where})" in message:
        return message
    first, *rest = message.split("\n", 1)
    return "\n".join([f"{first} ({where})", *rest])


def use_rank(source: Callable[[], dict[str, int]]) -> None:
    """Read this process's engine ranks from `source` from now on (api: the engine homes' ``rank()``)."""
    _process.rank = source


def record_unverified(what: str, reason: str) -> None:
    """Record something served UNVERIFIED because SM120_FP4_SELFTEST=warn allowed it (status and the report show it)."""
    with _lock:
        if not any(u.what == what and u.reason == reason for u in _unverified):
            _unverified.append(Unverified(what=what, reason=reason))


def unverified() -> list[Unverified]:
    """Return everything served UNVERIFIED in this process so far (SELFTEST=warn), with why."""
    with _lock:
        return list(_unverified)


def refusals() -> list[Refusal]:
    """Return every refusal to serve in this process so far."""
    with _lock:
        return list(_refusals)


def decisions() -> list[Decision]:
    """Return every decision made in this process so far."""
    with _lock:
        return [choice.decision for record in _records.values() for choice in record.decided.values()]


def report_sections() -> dict[str, Callable[[], object]]:
    """Return this process's report-file sections: its ranks, what it verifies now, its decisions and refusals, and
    what it serves unverified."""
    return {
        "rank": lambda: _process.rank(),
        "verifying": lambda: sorted(_process.verifying.copy().values()),  # a copy: other threads' decides change it
        "decisions": lambda: [d.model_dump(mode="json") for d in decisions()],
        "refusals": lambda: [r.model_dump(mode="json") for r in refusals()],
        "unverified": lambda: [u.model_dump(mode="json") for u in unverified()],
    }


def clear() -> None:
    """Forget every decision and route, undoing what a backend converted at load where it can."""
    with _lock:
        _process.updating, _process.updating_since = 0, None
        dropped = list(_records.values())
        _records.clear()
        _refusals.clear()
        _unverified.clear()
        for record in dropped:
            _publish(record)  # its entry goes with it
        served = [(record, record.decision.backend) for record in dropped if record.serving is not None]
    graphs.clear()  # the checks' graphs (their memory) go with the layers they checked
    for record, backend in served:
        stuck = _release(record, backend)
        if stuck is not None:
            _LOG.warning("sm120_fp4: %s: %s", record.device.label(), stuck)


def _release(serving: _Serving, name: str) -> str | None:
    """Undo what backend `name` converted on this device; return None, or why no other backend can take over."""
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
    """Return the callable serving CUDA ordinal `index` (-1: CPU in simulation), deciding on first use; None: not ours."""
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
    """Return the live route table of `family` (read it, never write it)."""
    return _route_tables[family]


def routes(family: str = "dense") -> dict[int, str]:
    """Return device index -> the backend(s) it is routed to, or "original"."""
    with _lock:
        return {r.index: r.route_name for (fam, _), r in _records.items() if fam == family and r.routed}


def _layer_key(check: LayerCheck) -> int:
    """Return the key of `check`'s layer in _Serving.layers."""
    return id(check.owner) if check.owner is not None else id(check)
