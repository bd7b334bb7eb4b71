"""After verification: the warm-up re-check, SGLang's weight updates, the fingerprints, and what the canary reads."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import backends, verify
from ..config import Settings
from ..deciding import Refusal
from ..devices import Device
from ..errors import capped
from .layers import check_layer, fail_if_written, fingerprint, record_layer, run_check
from .records import LayerCheck, LayerRecord, Record, record_refusal, refuse_now
from .state import STATE

_LOG = logging.getLogger("sm120_fp4")
_CHANGED = "the layer's weights changed after they were verified, and not through SGLang's weight-update path"


def _compare_fingerprints(
    layers: list[tuple[LayerRecord, LayerCheck | None]],
) -> list[tuple[LayerCheck | None, str | None]]:
    """Return per (record, check or None) the check and why its weights changed (None: unchanged), in one read."""
    results, pending = [], {}  # pending: the index in results -> whether the fingerprints are equal (read at once)
    for record, check in layers:
        try:
            check = check if check is not None else record.current()
            now = fingerprint(check) if check is not None else None
        except Exception as exc:
            results.append((None, f"its weights can no longer be read ({type(exc).__name__}: {exc})"))
            continue
        comparable = now is not None and now.shape == record.fingerprint.shape
        if comparable:
            pending[len(results)] = (now == record.fingerprint).all()
        results.append((check, None if comparable else _CHANGED))
    same = dict(zip(pending, torch.stack(list(pending.values())).tolist())) if pending else {}
    return [(check, _CHANGED if same.get(i) is False else why) for i, (check, why) in enumerate(results)]


def _changed_layers(serving: Record) -> list[tuple[int, LayerRecord, LayerCheck | None]]:
    """Return (key, record, check now) of each recorded layer whose weights no longer match its fingerprint."""
    serving.layers = {k: v for k, v in serving.layers.items() if v.alive()}
    kept = [(key, record) for key, record in serving.layers.items() if record.fingerprint is not None]
    compared = _compare_fingerprints([(record, None) for _, record in kept])
    return [(key, record, check) for (key, record), (check, why) in zip(kept, compared) if why is not None]


def _refuse_now(serving: Record, config: str, why: str, message: str, settings: Settings, reports=(), backend=None):
    """Record the refusal of `serving`'s device (`backend` rejected for `why`) and raise RefusedToServe."""
    message = f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: {message}"
    rejected = {backend or serving.route_name: why}
    refuse_now(settings, message, serving, config=config, rejected=rejected, reports=list(reports))


def _refuse_changed(serving: Record, changed: list, settings: Settings) -> None:
    names = [record.label for _, record, _ in changed]
    message = (
        f"the weights of {len(names)} verified layer(s) changed after they were verified, and not through SGLang's "
        f"weight-update path (update_weights_from_disk / _from_tensor / _from_distributed / _from_ipc): "
        f"{capped(names)}.\nSomething wrote into them since (a kernel writing out of bounds?); serving them would "
        f"compute with weights nobody loaded. Backend in use: {serving.route_name}."
    )
    _refuse_now(serving, names[0], f"a verified layer's weights changed: {names[0]}", message, settings)


def recheck(settings: Settings, captured: Sequence[int] = ()) -> list[verify.SelfTestReport]:
    """Compare every verified layer's fingerprint, then check every configuration at its re-check and `captured` sizes."""
    verify.refuse_inside_capture("re-check", "after")
    if STATE.updating:
        reverify(settings)  # a capture inside a weight update: the new weights are verified first
    done = []
    for serving in STATE.served():
        with serving.lock:
            changed = _changed_layers(serving)
            if changed:
                _refuse_changed(serving, changed, settings)
            for check in list(serving.checks.values()):
                report, _ = run_check(serving, check, sorted(set(check.recheck_ms) | set(captured)))
                report.config = f"{check.label} (re-check after warm-up)"
                done.append(report)
                if not report.passed:
                    message = (
                        f"{report.backend} passed at start-up but fails after warm-up and CUDA-graph capture.\n"
                        f"  {report.config}: {report.reason}\n"
                        "The kernel changed behaviour after warm-up (autotuned tactics, captured graphs); "
                        "try another backend (SM120_FP4_BACKENDS) or SM120_FP4_FALLBACK=emulated."
                    )
                    why = f"failed the re-check after warm-up: {report.reason}"
                    _refuse_now(serving, report.config, why, message, settings, [report], report.backend)
    _LOG.info(
        "sm120_fp4: re-checked %d layer configuration(s) after warm-up at %d captured graph size(s): all pass",
        len(done),
        len(set(captured)),
    )
    return done


def weights_update_begin() -> None:
    """Drop dequantized-weight caches and expect fingerprint changes until the matching end (SGLang writes weights)."""
    backends.invalidate_caches()
    with STATE.lock:
        if not STATE.updating:
            STATE.updating_since = time.monotonic()
        STATE.updating += 1


def weights_update_end(settings: Settings) -> list[verify.SelfTestReport]:
    """Re-verify every changed layer when the last open weight update ends."""
    with STATE.lock:
        STATE.updating = max(0, STATE.updating - 1)
        last = STATE.updating == 0
        STATE.updating_since = None if last else STATE.updating_since
    backends.invalidate_caches()
    return reverify(settings) if last else []


def weights_update_open_s() -> float | None:
    """Return how long SGLang's open weight update has been open, or None when none is."""
    with STATE.lock:
        return None if STATE.updating_since is None else time.monotonic() - STATE.updating_since


def reverify(settings: Settings) -> list[verify.SelfTestReport]:
    """Check again every recorded layer whose weights changed (a weight update) and renew its fingerprint."""
    done = []
    for serving in STATE.served():
        with serving.lock:
            changed = _changed_layers(serving)
            converting = [
                n
                for n in serving.route_backends
                if getattr(backends.backend_of(serving.family.name, n).converter, "in_place", False)
            ]
            if changed and converting:
                names = [record.label for _, record, _ in changed]
                message = (
                    f"SGLang updated the weights of {len(names)} layer(s) ({capped(names)}), but {converting[0]} "
                    "serves every layer from its own layout made at load (in place, or next to the checkpoint's bytes "
                    "with SELECT=fastest), and the new weights cannot be verified or served in that layout in this "
                    "process; restart the server with the new weights"
                )
                _refuse_now(serving, names[0], "weights updated in place", message, settings)
            for key, record, check in changed:
                config = next((k for k, c in serving.checks.items() if c.layer_key() == key), None)
                if check is None:  # no longer an NVFP4 layer in a layout this library serves
                    serving.layers.pop(key, None)
                    continue
                report, fingerprint = check_layer(serving, check, config is not None)
                report.config = f"{check.named()} (after a weight update)"
                done.append(report)
                if not report.passed:
                    why = f"after SGLang's weight update, {report.config} fails with {report.backend}: {report.reason}"
                    _refuse_now(serving, report.config, report.reason or "", why, settings, [report], report.backend)
                if config is not None:
                    serving.checks[config] = check
                record_layer(serving, check, fingerprint)
    if done:
        _LOG.info("sm120_fp4: re-verified %d layer(s) after SGLang's weight update: all pass", len(done))
    return done


def on_hang(message: str) -> None:
    """Record the watchdog's refusal in the report before it ends the process (a verify.hang_hooks hook)."""
    settings = STATE.last_settings
    if settings is not None:
        record_refusal(Refusal(device="?", message=message), settings)


@dataclass(frozen=True)
class Served:
    """One layer configuration verified in this process, with its device and kernel family."""

    family: str
    device: Device
    check: LayerCheck

    @property
    def backend(self) -> str:
        """Return the backend(s) serving this configuration now."""
        return STATE.records[(self.family, self.device.index)].route_name


def served_configurations() -> list[Served]:
    """Return every layer configuration verified (passed) in this process, in the order verified."""
    # Read from copies, not under the record's lock: a layer check holds that lock for its whole run (seconds, a
    # first compile minutes), and the report's writer reads this (the canary's section) while the checking thread
    # waits for its write (the record that it verifies, on disk before the check).
    served = []
    for s in STATE.served():
        passed = {r.config for r in list(s.decision.layers) if r.passed}
        served += [Served(s.family.name, s.device, c) for c in list(s.checks.values()) if c.label in passed]
    return served


def served_layer(served: Served, turn: int) -> Served:
    """Return the `turn`-th verified layer of `served`'s configuration (in rotation), else `served` itself."""
    serving = STATE.records[(served.family, served.device.index)]
    with serving.lock:
        if serving.converter is not None and serving.converter.in_place:
            return served  # a backend that converts layers in place keeps the checkpoint's bytes of the first one only
        layers = [r for r in serving.layers.values() if r.key == served.check.key and r.alive()]
        if not layers:
            return served
        check = layers[turn % len(layers)].current()
    return Served(served.family, served.device, check) if check is not None else served


def fingerprints(served: Served, start: int, count: int) -> tuple[str | None, int]:
    """Compare the fingerprints of `served`'s layer and of `count` more layers of its family and device from the
    `start`-th on, in one read: (the first that no longer has its verified weights and why, or None; the next start).
    Nothing is compared while a weight update is open."""
    serving = STATE.records.get((served.family, served.device.index))
    if serving is None or STATE.updating:
        return None, start
    with serving.lock:
        records = [r for r in serving.layers.values() if r.fingerprint is not None and r.alive()]
        if not records:
            return None, 0
        chosen = [records[(start + i) % len(records)] for i in range(min(count, len(records)))]
        own = serving.layers.get(served.check.layer_key())
        pairs = [(record, None) for record in chosen]
        if own is not None and own.fingerprint is not None:
            pairs.insert(0, (own, served.check))
        compared = _compare_fingerprints(pairs)
    problem = next(
        (f"{record.label}: {why}" for (record, _), (_, why) in zip(pairs, compared) if why is not None), None
    )
    return problem, (start + len(chosen)) % len(records)


def check_served(served: Served, m: int) -> verify.SelfTestReport:
    """Return the canary's light check of `served` at batch size `m` (and every range boundary), two passes."""
    serving = STATE.records[(served.family, served.device.index)]
    with serving.lock:
        report, _ = run_check(serving, served.check, [m], light=True)
        record = serving.layers.get(served.check.layer_key())
        if record is not None and not STATE.updating:
            fail_if_written(report, served.check, record.fingerprint)
        return report
