"""Verifying a served layer, and replacing the backend that fails one: the next candidate that
passes everything so far, FALLBACK=emulated, SELFTEST=warn, or a refusal; SELECT=fastest is settled
on the served calls.
"""

from __future__ import annotations

import contextlib
import logging

from .. import backends, verify
from .. import report as report_file
from ..config import Settings
from ..deciding import Choice, Refusal, candidate_names, choose, refusal_message
from ..errors import RefusedToServe
from .fastest import route_fastest
from .layers import (
    _convert,
    _convert_seen,
    _fingerprint,
    _layer_check,
    _record_layer,
    _refingerprint,
    _representative,
    _seen_key,
    _settle,
    _settle_seen,
    _verify_everything,
)
from .records import LayerCheck, _process, _records, _refuse, _release, _Serving, route

_LOG = logging.getLogger("sm120_fp4")


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
    _process.last_settings = settings
    if route(index, settings, check.family) is None:
        return None
    serving = _records[(check.family, index)]
    with serving.lock:
        checking = settings.selftest != "off"
        # A backend that serves converted weights converts this layer now (keeping its original
        # bytes while it is checked: the oracle reads them); every later backend switch converts it too.
        problem = _convert(serving, check.tensors, keep_original=checking)
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
            _LOG.info(
                "sm120_fp4: %s verified with %s on %s (%d batch sizes, max rel error %.2e)",
                check.label,
                serving.decision.backend,
                serving.device.label(),
                len(check.ms),
                report.max_rel_err or 0.0,
            )
            if settings.select == "fastest":
                route_fastest(serving, check)
            report_file.update(settings)
        elif check.owner is not None and known.owner is check.owner:
            serving.checks[check.key] = check  # the same layer again (its weights reloaded): re-checks use these
        return report


def _back_to(serving: _Serving, original: Choice) -> None:
    """Route the device to `original` again (a refusal or an interruption while replacing it),
    converting the layers again where that backend serves converted weights."""
    serving.serve(original)
    if serving.converter is not None:
        for tensors in serving.seen.values():
            _convert(serving, tensors, _representative(serving, tensors))
        _refingerprint(serving)


def _replace_backend(
    serving: _Serving, check: LayerCheck, report: verify.SelfTestReport, settings: Settings
) -> verify.SelfTestReport:
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
            remaining = [
                n
                for n in candidate_names(settings, family=serving.family, device=serving.device)
                if n not in serving.failed
            ]
            choice = _next_choice(serving, remaining, settings)
            if choice is None:
                break
            serving.serve(choice)
            decision = choice.decision
            problem = _convert_seen(serving)
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
                _LOG.warning(
                    "sm120_fp4: %s: %s failed %s; serving with %s, which passes every layer configuration and layer",
                    serving.device.label(),
                    report.backend,
                    report.config,
                    decision.backend,
                )
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
    message = refusal_message(
        serving.device,
        candidate_names(settings, family=serving.family, device=serving.device),
        rejected,
        config=report.config,
        family=serving.family,
    )
    if settings.selftest == "warn":
        _LOG.warning("%s\nSM120_FP4_SELFTEST=warn: serving UNVERIFIED with %s", message, serving.decision.backend)
        serving.decision.verified = False
        serving.unverified[check.key] = report
        return report
    _refuse(
        Refusal(
            device=serving.device.label(),
            config=report.config,
            family=serving.family.name,
            message=message,
            rejected=rejected,
            reports=failures,
        ),
        settings,
    )
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
    choice.decision.reason = (
        f"fallback: no candidate verified on every layer configuration ({family.fallback_var}=emulated)"
    )
    _LOG.warning(
        "sm120_fp4: %s: no %s candidate passed every layer configuration; %s=emulated: "
        "serving with the slow pure-PyTorch emulation",
        serving.device.label(),
        family.what,
        family.fallback_var,
    )
    return choice
