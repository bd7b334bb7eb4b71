"""Verifying served layers; a failing backend replaced (next candidate, FALLBACK=emulated, SELFTEST=warn) or refused."""

from __future__ import annotations

import contextlib
import logging

from .. import backends, verify
from ..config import Settings
from ..deciding import Choice, candidate_names, choose, refusal_message, refuse
from ..errors import RefusedToServe
from . import layers
from .fastest import measure
from .records import LayerCheck, Record, crashed, refuse_now, route
from .state import STATE

_LOG = logging.getLogger("sm120_fp4")


def verify_layer(index: int, check: LayerCheck, settings: Settings) -> verify.SelfTestReport | None:
    """Verify one NVFP4 layer on CUDA ordinal `index` through the call that will serve it (None: nothing verified)."""
    # A configuration's first layer gets the full sweep, any other a light check; nothing is recorded
    # before it passes. A failure hands the device on (_replace_backend).
    STATE.last_settings = settings
    if route(index, settings, check.family) is None:
        return None
    serving = STATE.records[(check.family, index)]
    with serving.lock:
        checking = settings.selftest != "off"
        # A backend that serves converted weights converts this layer now (keeping its original
        # bytes while it is checked: the oracle reads them); every later backend switch converts it too.
        problem = layers.convert(serving, check.tensors, keep_original=checking)
        if check.tensors is not None:
            serving.seen.setdefault(layers.seen_key(check.tensors), check.tensors)
        if not checking:
            return None
        if check.key in serving.unverified:  # SELFTEST=warn has already said so for this configuration
            return serving.unverified[check.key]
        known = serving.checks.get(check.key)
        full = known is None
        if problem is None:
            if full:  # said in the report before the check: a rank the engine stops meanwhile says so
                STATE.verifying[id(check)] = f"{check.named()} on {serving.device.label()}"
                STATE.report.write_now(settings)  # on disk before a check the engine may cut short
            try:
                report, fingerprint = layers.check_layer(serving, check, full)
            finally:
                STATE.verifying.pop(id(check), None)
        else:
            report, fingerprint = verify.report_for(serving.decision.backend, serving.device, config=check.label), None
            report.reason = problem
        if not report.passed:
            return _replace_backend(serving, check, report, settings)
        layers.record_layer(serving, check, fingerprint)
        if full:
            serving.checks[check.key] = check
        # after the line above: a configuration's first layer keeps its kept bytes
        layers.settle(serving, check.tensors)
        if full:
            _verified(serving, check, report, settings)
        elif check.owner is not None and known.owner is check.owner:
            serving.checks[check.key] = check  # the same layer again (its weights reloaded): re-checks use these
        return report


def _verified(serving: Record, check: LayerCheck, report: verify.SelfTestReport, settings: Settings) -> None:
    """Record that a configuration's first layer passed its full sweep (SELECT=fastest then times the candidates)."""
    serving.decision.layers.append(report)
    where, err = f"{serving.route_name} on {serving.device.label()}", report.max_rel_err or 0.0
    _LOG.info(f"sm120_fp4: {check.label} verified with {where} ({len(check.ms)} batch sizes, max rel error {err:.2e})")
    if settings.select == "fastest":
        measure(serving, [check], new=True)  # check and time every verified candidate on it, then route
    STATE.report.request(settings)


def _back_to(serving: Record, original: Choice) -> None:
    """Route the device to `original` again, converting the layers again where that backend converts them."""
    serving.serve(original)
    if serving.converter is not None:
        for tensors in serving.seen.values():
            layers.convert(serving, tensors, layers.representative(serving, tensors))
        layers.refingerprint(serving)


def _reject(serving: Record, report: verify.SelfTestReport) -> bool:
    """Mark the backend of failed `report` as failed here; return whether another backend may still take over."""
    serving.failed[report.backend] = f"{report.config}: {report.reason}"
    stuck = serving.release(report.backend)
    if stuck is not None:
        serving.failed[report.backend] += f" ({stuck})"
    return stuck is None


def _try(serving: Record, choice: Choice, check: LayerCheck, full: bool) -> tuple[list, verify.SelfTestReport | None]:
    """Serve with `choice` and check every configuration, layer and `check`: (the reports, the first failure)."""
    serving.serve(choice)
    # every layer served so far, converted by the backend now routed (originals kept while checked)
    problem = next((p for p in (layers.convert(serving, t, True) for t in serving.seen.values()) if p), None)
    if problem is None:
        return layers.verify_everything(serving, check, full)
    bad = verify.report_for(choice.decision.backend, serving.device, config=check.label)
    bad.reason = problem
    return [], bad


def _replace_backend(serving: Record, check: LayerCheck, report, settings: Settings) -> verify.SelfTestReport:
    """Replace the backend that failed `check` with one that passes everything, or refuse (back to the original)."""
    original, full, failures = serving.choice, check.key not in serving.checks, [report]
    names = candidate_names(settings, family=serving.family, device=serving.device)
    try:
        going = _reject(serving, report)
        while going and (choice := _next_choice(serving, [n for n in names if n not in serving.failed], settings)):
            reports, bad = _try(serving, choice, check, full)
            if bad is None:
                return _replaced(serving, check, choice.decision, report, reports, settings)
            failures.append(bad)
            going = _reject(serving, bad)
    except BaseException:
        _back_to(serving, original)  # interrupted: back to what was verified
        raise
    _back_to(serving, original)
    rejected = {n: f"failed the served-layer check: {why}" for n, why in serving.failed.items()}
    message = refusal_message(serving.device, names, rejected, config=report.config, family=serving.family)
    if settings.selftest == "strict":
        refuse_now(settings, message, serving, config=report.config, rejected=rejected, reports=failures)
    refuse(settings, message, f"serving UNVERIFIED with {serving.decision.backend}")  # warn: said once; off: passes
    serving.decision.verified = False
    serving.unverified[check.key] = report
    return report


def _replaced(serving: Record, check: LayerCheck, decision, report, reports: list, settings: Settings):
    """Record the replacement `decision` that passed everything; return its report for `check`."""
    decision.layers = reports
    new = check.key not in serving.checks
    if new:
        serving.checks[check.key] = check
    for tensors in serving.seen.values():
        layers.settle(serving, tensors)
    layers.refingerprint(serving)
    layers.record_layer(serving, check, layers.fingerprint(check))
    what = f"{serving.device.label()}: {report.backend} failed {report.config}; serving with {decision.backend}"
    _LOG.warning(f"sm120_fp4: {what}, which passes every layer configuration and layer")
    if new and settings.select == "fastest":  # as after any new configuration: on every rank alike
        measure(serving, [check], new=True)
    STATE.report.request(settings)
    return next((r for r in reports if r.config == check.label), reports[-1] if reports else report)


def _next_choice(serving: Record, remaining: list[str], settings: Settings) -> Choice | None:
    """Return the first of `remaining` that passes its self-test, else the emulation where FALLBACK allows it (and it
    has not failed here), else None."""
    fallback = "none" if backends.EMULATED in serving.failed else serving.family.fallback(settings)
    strict = settings.model_copy(update={"selftest": "strict", "fallback": fallback, "moe_fallback": fallback})
    with contextlib.suppress(RefusedToServe):
        return choose(
            serving.device, remaining, strict, serving.family, crashed(settings, serving.device, serving.family.name)
        )
    return None
