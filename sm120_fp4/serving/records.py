"""The serving records per (kernel family, device) in :data:`STATE`, and the route table the hot path reads."""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import torch

from .. import backends, devices, locks, verdicts, verify
from ..config import Settings, check_flashinfer_env, load_settings
from ..deciding import FAMILIES, Choice, Decision, Family, Refusal, candidate_names, choose, log_decision, serves
from ..devices import Device
from ..errors import ConfigError, RefusedToServe
from .collective import gather
from .state import STATE, Unverified

_LOG = logging.getLogger("sm120_fp4")


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

    def layer_key(self) -> int:
        """Return the key of this check's layer in :attr:`Record.layers`."""
        return id(self.owner) if self.owner is not None else id(self)


@dataclass
class LayerRecord:
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
class Record:
    """One kernel family on one device: decisions, what serves (changed only by serve/route_to), layers, failures;
    the object every serving module works on."""

    family: Family
    index: int
    device: Device | None = None
    settings: Settings | None = None
    decided: dict[tuple, Choice] = field(default_factory=dict)  # decide()'s key -> its choice
    deciding: dict[tuple, threading.Lock] = field(default_factory=dict)  # one lock per decide() key: one self-test each
    serving: tuple | None = None  # the key of the choice that serves (None: the original kernel runs)
    routed: bool = False  # whether route() has answered for this device
    checks: dict[tuple, LayerCheck] = field(default_factory=dict)  # one per configuration: its full sweep
    layers: dict[int, LayerRecord] = field(default_factory=dict)  # LayerCheck.layer_key() -> its record
    failed: dict[str, str] = field(default_factory=dict)  # backend -> why it failed a layer configuration
    timings: dict[str, dict[tuple, dict[int, float]]] = field(default_factory=dict)  # backend -> config -> M -> ms
    candidate_layers: dict[str, list] = field(default_factory=dict)  # SELECT=fastest: each candidate's reports
    unverified: dict[tuple, verify.SelfTestReport] = field(default_factory=dict)  # SELFTEST=warn: failed, served anyway
    # Every served layer's tensors (no copy) by weight storage: a converting backend taking over converts them.
    seen: dict[tuple, dict] = field(default_factory=dict)
    prune_at: int = 64  # layers.record_layer drops dropped layers' records when this many are kept
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
    def route_backends(self) -> list[str]:
        """Return the backend(s) serving the device, in the order of their M ranges."""
        return [name for _, name in self.decision.ranges] or [self.decision.backend]

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

    def route_to(self, device: Device | None, key: tuple | None, settings: Settings | None) -> Callable | None:
        """Route the device once to the choice for `key` (None: the original) and return its callable."""
        with STATE.lock:
            if not self.routed:
                self.routed, self.serving = True, key
                if key is not None:
                    self.device, self.settings = device, settings
                STATE.publish(self)
            return self.fn

    def serve(self, choice: Choice) -> None:
        """Serve the device with `choice` from now on, in the replaced decision's place."""
        with STATE.lock:
            self.decided[self.serving] = choice
            STATE.publish(self)

    def release(self, name: str) -> str | None:
        """Undo what backend `name` converted on this device; return None, or why no other backend can take over."""
        try:
            backend = backends.backend_of(self.family.name, name)
        except ConfigError:  # unregistered since (a test's backend): it converted nothing of ours
            return None
        if backend.converter is None or backend.converter.restore():
            return None
        return (
            f"{name} converted served layers' weights to its own layout in place at load and kept the original bytes "
            "of the checked layers only, so no other backend can serve them in this process; restart with "
            f"{self.family.backends_var} naming a backend that verifies"
        )


def route_text(decision: Decision) -> str:
    """Return the backend of `decision`, or each backend with its M range ("a (M<=64), b (M>64)")."""
    ranges = decision.ranges
    if len(ranges) < 2:
        return decision.backend
    labels = [f"M<={bound}" if bound is not None else f"M>{ranges[-2][0]}" for bound, _ in ranges]
    return ", ".join(f"{name} ({label})" for (_, name), label in zip(ranges, labels))


def _record(family: Family, index: int, device: Device | None = None) -> Record:
    with STATE.lock:
        return STATE.records.setdefault((family.name, index), Record(family, index, device))


def decide(
    device: Device | int | None = None,
    candidates: list[str] | tuple[str, ...] | None = None,
    *,
    settings: Settings | None = None,
    family: Family | str = "dense",
) -> Decision:
    """Return the verified backend for `device` (a Device, a CUDA ordinal, or None: the current one), cached."""
    return _decide(device, candidates, settings, family)[2].decision


def _decide(device, candidates, settings, family) -> tuple[Record, tuple, Choice]:
    """Return decide()'s record, cache key and choice (the arguments as decide()'s)."""
    settings = settings or load_settings()
    STATE.last_settings = settings
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
    with STATE.lock:
        key_lock = record.deciding.setdefault(key, locks.lock())
    with key_lock:
        if key in record.decided:
            return record, key, record.decided[key]
        mark = (family.name, device.index, key)
        STATE.verifying[mark] = f"{family.what} on {device.label()}"
        STATE.report.write_now(settings)  # before the first check: a rank the engine stops meanwhile says so
        try:
            # Every rank decides here (its first layer): SELECT=fastest chooses alike on every rank.
            choice = choose(
                device,
                names,
                settings,
                family,
                crashed=crashed(settings, device, family.name),
                gather=functools.partial(gather, timeout_s=settings.selftest_timeout),
            )
        except RefusedToServe as exc:
            STATE.verifying.pop(mark, None)
            found = {"rejected": getattr(exc, "rejected", {}), "reports": getattr(exc, "reports", [])}
            refuse_now(settings, str(exc), device=device.label(), family=family.name, **found)
        finally:
            STATE.verifying.pop(mark, None)
        with STATE.lock:
            record.decided[key] = choice
    log_decision(choice.decision)
    STATE.report.request(settings)
    return record, key, choice


def record_refusal(refusal: Refusal, settings: Settings) -> None:
    """Record a refusal (ours or the serving canary's) for status and the report file, with this process's ranks."""
    refusal.rank = refusal.rank or STATE.rank()
    refusal.message = _with_rank(refusal.message, refusal.rank)
    with STATE.lock:
        STATE.refusals.append(refusal)
    STATE.report.write_now(settings)  # before the process exits: the record of why it refused (bounded)


def crashed(settings: Settings, device: Device, family: str) -> dict[str, str]:
    """Return each candidate of `family` to skip on `device`, and why: it crashed a preflight worker, as this process
    was told (``STATE.crashes``) or the verdict store (SM120_FP4_VERDICTS) says."""
    with STATE.lock:
        told = [(b, why) for (f, b), why in STATE.crashes.items() if f == family]
    found = {b: f"skipped: it crashed the preflight self-test process ({why})" for b, why in told}
    return verdicts.crashed(settings.verdicts_path, device, family) | found


def refuse_now(settings: Settings, message: str, serving: Record | None = None, **found) -> NoReturn:
    """Record the refusal `message` on `serving`'s device (None: none named; `found`: more of Refusal's fields) for
    status and the report file, then raise RefusedToServe with it (naming the rank where the engine has several;
    carrying `rejected` and `reports` as the preflight worker reads them)."""
    where = (
        {"device": serving.device.label(), "family": serving.family.name} if serving is not None else {"device": "?"}
    )
    refusal = Refusal(**(where | found), message=message)
    record_refusal(refusal, settings)
    refused = RefusedToServe(refusal.message)  # the engine's log names the rank
    refused.rejected, refused.reports = refusal.rejected, refusal.reports
    raise refused from None  # its message says why: no second traceback in the engine's log


def _with_rank(message: str, rank: dict[str, int]) -> str:
    """Return `message` with its first line ending in the rank of several that refused ("... (TP rank 1/2)")."""
    where = devices.rank_text(rank)
    if not where or f"({where})" in message:
        return message
    first, *rest = message.split("\n", 1)
    return "\n".join([f"{first} ({where})", *rest])


def record_unverified(what: str, reason: str) -> None:
    """Record something served UNVERIFIED because SM120_FP4_SELFTEST=warn allowed it (status and the report show it)."""
    with STATE.lock:
        if not any(u.what == what and u.reason == reason for u in STATE.unverified):
            STATE.unverified.append(Unverified(what=what, reason=reason))


def unverified() -> list[Unverified]:
    """Return everything served UNVERIFIED in this process so far (SELFTEST=warn), with why."""
    with STATE.lock:
        return list(STATE.unverified)


def refusals() -> list[Refusal]:
    """Return every refusal to serve in this process so far."""
    with STATE.lock:
        return list(STATE.refusals)


def decisions() -> list[Decision]:
    """Return every decision made in this process so far."""
    with STATE.lock:
        return [choice.decision for record in STATE.records.values() for choice in record.decided.values()]


def report_sections() -> dict[str, Callable[[], object]]:
    """Return this process's report-file sections: its ranks, what it verifies now, its decisions and refusals, and
    what it serves unverified."""
    return {
        "rank": lambda: STATE.rank(),
        "verifying": lambda: sorted(STATE.verifying.copy().values()),  # a copy: other threads' decides change it
        "decisions": lambda: [d.model_dump(mode="json") for d in decisions()],
        "refusals": lambda: [r.model_dump(mode="json") for r in refusals()],
        "unverified": lambda: [u.model_dump(mode="json") for u in unverified()],
    }


def route(index: int, settings: Settings, family: str = "dense") -> Callable | None:
    """Return the callable serving CUDA ordinal `index` (-1: CPU in simulation), deciding on first use; None: not ours."""
    table = STATE.route_tables[family]
    if index in table:
        return table[index]
    kind = FAMILIES[family]
    simulate = settings.simulated_capability
    if index < 0 and simulate is None:
        return _record(kind, index).route_to(None, None, None)  # a CPU tensor outside simulation: not a GPU we fix
    device = devices.get_device(index, simulate)
    if not serves(device, settings):
        return _record(kind, index, device).route_to(device, None, None)
    record, key, _ = _decide(device, None, settings, kind)
    return record.route_to(device, key, settings)


def route_table(family: str = "dense") -> dict[int, Callable | None]:
    """Return the live route table of `family` (read it, never write it)."""
    return STATE.route_tables[family]


def routes(family: str = "dense") -> dict[int, str]:
    """Return device index -> the backend(s) it is routed to, or "original"."""
    with STATE.lock:
        return {r.index: r.route_name for (fam, _), r in STATE.records.items() if fam == family and r.routed}
