"""The layer checks: served calls against the oracle, weight fingerprints, layer records, conversion at load.

Each function works on one :class:`~.records.Record` (a family on a device); .replace, .updates and .fastest call
them."""

from __future__ import annotations

import time
import weakref
from itertools import chain
from typing import Callable

import torch

from .. import verify
from ..deciding import Decision
from ..devices import CHECK_MEMORY_BYTES
from .records import LayerCheck, LayerRecord, Record


def run_check(serving: Record, check: LayerCheck, ms: list[int], light=False, passes=2, config=None, guard=False):
    """Run `check`'s calls at `ms`; return the report and (`guard`: fail where they wrote it) the weights' fingerprint."""
    # A check that cannot get its memory (the engine filled the GPU) frees what it held and runs once more; then
    # its report says it was skipped (a failure at load, named; the canary retries it later), never an OOM raised.
    args = (serving, check, ms, light, passes, config, guard)
    try:
        return _run_check_once(*args)
    except torch.OutOfMemoryError:
        verify.free_memory(serving.device.torch_device)
    try:
        return _run_check_once(*args)
    except torch.OutOfMemoryError as exc:
        verify.free_memory(serving.device.torch_device)
        report = verify.report_for(serving.decision.backend, serving.device, config=config or check.label)
        report.skipped = f"out of GPU memory for the check ({str(exc).splitlines()[0][:200]})"
        report.reason = (
            f"{check.named()}: the check was skipped: {report.skipped}; freed and retried once. It takes at most "
            f"{CHECK_MEMORY_BYTES >> 20} MiB beyond the served call's own: leave that much of the GPU outside the "
            "engine's KV pool (SGLang's --mem-fraction-static, vLLM's --gpu-memory-utilization)"
        )
        return report, None


def _run_check_once(serving: Record, check: LayerCheck, ms, light, passes, config, guard):
    device = serving.device
    start = time.perf_counter()
    report = verify.report_for(serving.decision.backend, device, config=config or check.label)
    ms = sorted(set(ms) | edges(serving.decision))  # a split route: every range and boundary, through its backend
    try:
        cases = check.cases(ms)  # first: the oracle's GPU work is queued, and the host's work below overlaps it
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # building the served calls failed: that is a finding, not a crash
        report.reason = f"could not build the served calls: {type(exc).__name__}: {exc}"
        report.duration_s = time.perf_counter() - start
        return report, None
    where = f" of {serving.route_name!r} on {device.label()} for {check.named()}"
    if light and check.weights is not None:
        # The fingerprint after the calls covers the weights (no copies); other inputs are compared bit for bit.
        weights = {t.untyped_storage().data_ptr() for t in check.weights() if isinstance(t, torch.Tensor)}
        for case in cases:
            case.inputs = tuple(t for t in case.inputs if t.untyped_storage().data_ptr() not in weights)
    # A light check calls each M once: its configuration's sweep already called each M twice in a row.
    bounds = verify.Bounds(timeout_s=serving.settings.selftest_timeout)
    sweep = verify.Sweep(cases, bounds, device.torch_device, where, repeat=not light)
    # After the oracle's work is queued, before the first served call: its launches overlap the oracle's.
    before = fingerprint(check) if guard else None
    report = _blame(serving.decision, verify.finish(report, sweep.run(passes), start))
    fail_if_written(report, check, before)
    return report, before


def edges(decision: Decision) -> set[int]:
    """Return each boundary of `decision`'s M ranges and the size above it (none for one backend)."""
    return {m for bound, _ in decision.ranges[:-1] for m in (bound, bound + 1)}


def backend_at(decision: Decision, m: int) -> str:
    """Return the backend `decision` serves batch size `m` with."""
    return next((name for bound, name in decision.ranges if bound is None or m <= bound), decision.backend)


def _blame(decision: Decision, report: verify.SelfTestReport) -> verify.SelfTestReport:
    """Name in a failed `report` the backend serving the first failing batch size."""
    failing = next((r.m for r in report.shapes if not r.passed), None)
    if not report.passed and failing is not None:
        report.backend = backend_at(decision, failing)
    return report


def fingerprint(check: LayerCheck) -> torch.Tensor | None:
    """Return the fingerprint of the weights `check`'s layer serves with now (None: it names none)."""
    return verify.fingerprint(check.weights()) if check.weights is not None else None


def _owner_ref(check: LayerCheck) -> Callable[[], object] | None:
    try:
        return weakref.ref(check.owner)
    except TypeError:  # not weak-referenceable: kept
        owner = check.owner
        return lambda: owner


def check_layer(serving: Record, check: LayerCheck, full: bool) -> tuple[verify.SelfTestReport, torch.Tensor | None]:
    """Run `check`'s full sweep or light check; return its report and the weights' fingerprint when checked."""
    if full:
        return run_check(serving, check, check.ms, guard=True)
    return run_check(serving, check, check.light_ms, True, 1, f"{check.label} (layer check)", guard=True)


def fail_if_written(report: verify.SelfTestReport, check: LayerCheck, before: torch.Tensor | None) -> None:
    """Fail a passing `report` whose calls wrote into the layer's weights (fingerprint no longer `before`)."""
    if report.passed and before is not None and not torch.equal(before, fingerprint(check)):
        report.passed = False
        report.reason = f"{check.named()}: the checked calls changed this layer's own weights in place"


def record_layer(serving: Record, check: LayerCheck, fingerprint: torch.Tensor | None) -> None:
    """Keep `check`'s layer in `serving`'s layers with its `fingerprint` (a weak reference where it can be rebuilt)."""
    if len(serving.layers) >= serving.prune_at:  # amortised: a model's hundreds of layers cost no quadratic walk
        serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
        serving.prune_at = max(64, 2 * len(serving.layers))
    owner = _owner_ref(check) if check.owner is not None else None
    kept = None if isinstance(owner, weakref.ref) and check.rebuild is not None else check  # else rebuilt when read
    serving.layers[check.layer_key()] = LayerRecord(check.named(), fingerprint, owner, check.rebuild, kept, check.key)


def convert(serving: Record, tensors: dict | None, keep_original: bool) -> str | None:
    """Let the serving backend convert one layer at load (humming); return None, or why it could not."""
    converter = serving.converter
    if converter is None or tensors is None:
        return None
    try:
        converter.convert(tensors, keep_original)
    except Exception as exc:  # a finding about this backend, like a failed check
        return f"could not convert the layer's weights for {serving.decision.backend}: {type(exc).__name__}: {exc}"
    return None


def seen_key(tensors: dict) -> tuple:
    """Return what identifies the layer `tensors` describe: its packed weight's storage, else the dict."""
    weight = tensors.get("weight", tensors.get("w13"))
    return ("storage", weight.data_ptr()) if isinstance(weight, torch.Tensor) else ("dict", id(tensors))


def representative(serving: Record, tensors: dict) -> bool:
    """Return whether `tensors` are a configuration's first layer (the one the re-checks compare)."""
    key = seen_key(tensors)
    return any(
        c.tensors is tensors or (c.tensors is not None and seen_key(c.tensors) == key) for c in serving.checks.values()
    )


def settle(serving: Record, tensors: dict | None) -> None:
    """End a layer's check: the backend drops what it kept for it (a configuration's first layer: keeps it)."""
    converter = serving.converter
    if converter is not None and tensors is not None:
        converter.settle(tensors, representative(serving, tensors))


def refingerprint(serving: Record) -> None:
    """Take every layer's fingerprint anew (after a switch that converted or restored weights)."""
    for record in serving.layers.values():
        current = record.current() if record.alive() else None
        if current is not None:
            record.fingerprint = fingerprint(current)


def verify_everything(serving: Record, extra: LayerCheck | None, extra_full: bool, configurations=True) -> tuple:
    """Check every configuration (unless `configurations` is False), every layer and `extra` as routed now."""
    reports, representatives = [], {c.layer_key() for c in serving.checks.values()}
    layers = (
        (r.current() if r.alive() and k not in representatives else None) for k, r in list(serving.layers.items())
    )
    checks = chain(((c, True) for c in serving.checks.values() if configurations), ((c, False) for c in layers))
    for check, full in chain(checks, [(extra, extra_full)]):
        if check is None:
            continue
        report, _ = check_layer(serving, check, full)
        if not report.passed:
            return reports, report
        if full:  # the full sweeps' reports: every configuration's, and `extra`'s
            reports.append(report)
    return reports, None
