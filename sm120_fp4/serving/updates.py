"""After verification: the re-check after warm-up, SGLang's weight updates (the changed layers
verified again), the fingerprints of the verified layers, and what the serving canary
(:mod:`sm120_fp4.canary`) reads of the served configurations.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import backends, verify
from ..config import Settings
from ..deciding import Refusal
from ..devices import Device
from ..errors import RefusedToServe, capped
from .layers import _fail_if_written, _fingerprint, _layer_check, _record_layer, _run_check
from .records import LayerCheck, _Layer, _layer_key, _lock, _process, _records, _refuse, _served, _Serving

_LOG = logging.getLogger("sm120_fp4")


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
        except Exception as exc:
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
    message = (
        f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: the weights of {len(names)} verified "
        f"layer(s) changed after they were verified, and not through SGLang's weight-update path "
        f"(update_weights_from_disk / _from_tensor / _from_distributed / _from_ipc): {capped(names)}.\n"
        "Something wrote into them since (a kernel writing out of bounds?); serving them would compute with "
        f"weights nobody loaded. Backend in use: {serving.decision.backend}."
    )
    _refuse(
        Refusal(
            device=serving.device.label(),
            config=names[0],
            family=serving.family.name,
            message=message,
            rejected={serving.decision.backend: f"a verified layer's weights changed: {names[0]}"},
        ),
        settings,
    )
    raise RefusedToServe(message)


def recheck(settings: Settings, captured: Sequence[int] = ()) -> list[verify.SelfTestReport]:
    """After SGLang's warm-up and CUDA-graph capture, when autotuners have picked their tactics:
    first every verified layer's weights against their fingerprint (a change outside SGLang's
    weight-update path refuses, naming the layer), then every verified layer configuration once
    more, eagerly, at its re-check batch sizes and at every M of `captured` (the token counts of the
    CUDA graphs SGLang just captured: the batch sizes graphs will serve); a failure refuses
    (RefusedToServe) with the configuration and batch size."""
    verify.refuse_inside_capture("re-check", "after")
    if _process.updating:
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
                message = (
                    f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: {serving.decision.backend} "
                    f"passed at start-up but fails after warm-up and CUDA-graph capture.\n"
                    f"  {report.config}: {report.reason}\n"
                    "The kernel changed behaviour after warm-up (autotuned tactics, captured graphs); "
                    "try another backend (SM120_FP4_BACKENDS) or SM120_FP4_FALLBACK=emulated."
                )
                _refuse(
                    Refusal(
                        device=serving.device.label(),
                        config=report.config,
                        family=serving.family.name,
                        message=message,
                        rejected={serving.decision.backend: f"failed the re-check after warm-up: {report.reason}"},
                        reports=[report],
                    ),
                    settings,
                )
                raise RefusedToServe(message)
    _LOG.info(
        "sm120_fp4: re-checked %d layer configuration(s) after warm-up at %d captured graph size(s): all pass",
        len(done),
        len(set(captured)),
    )
    return done


def weights_update_begin() -> None:
    """SGLang starts writing weights (a weight-update call, or a weight-update session): caches of
    dequantized weights are dropped, and fingerprint changes are expected until the matching end."""
    backends.invalidate_caches()
    with _lock:
        if not _process.updating:
            _process.updating_since = time.monotonic()
        _process.updating += 1


def weights_update_end(settings: Settings) -> list[verify.SelfTestReport]:
    """SGLang is done writing weights: when no other update is open, every layer whose weights
    changed is verified again (reverify) before anything else is served."""
    with _lock:
        _process.updating = max(0, _process.updating - 1)
        last = _process.updating == 0
        if last:
            _process.updating_since = None
    backends.invalidate_caches()
    return reverify(settings) if last else []


def weights_update_open_s() -> float | None:
    """How long SGLang's weight update (a call, or a session begun and not ended) has been open, or
    None when none is: meanwhile weight fingerprints are not compared (changes are expected)."""
    with _lock:
        return None if _process.updating_since is None else time.monotonic() - _process.updating_since


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
            if changed and serving.converter is not None and serving.converter.in_place:
                names = [record.label for _, record, _ in changed]
                message = (
                    f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: SGLang updated the weights of "
                    f"{len(names)} layer(s) ({capped(names)}), but {serving.decision.backend} converted every "
                    "served layer to its own layout in place at load, and the new weights cannot be verified "
                    "or served in that layout in this process; restart the server with the new weights"
                )
                _refuse(
                    Refusal(
                        device=serving.device.label(),
                        config=names[0],
                        family=serving.family.name,
                        message=message,
                        rejected={serving.decision.backend: "weights updated in place"},
                    ),
                    settings,
                )
                raise RefusedToServe(message)
            for key, record, check in changed:
                config = next(
                    (
                        k
                        for k, c in serving.checks.items()
                        if (c.owner is not None and id(c.owner) == key) or id(c) == key
                    ),
                    None,
                )
                if check is None:  # no longer an NVFP4 layer in a layout this library serves
                    serving.layers.pop(key, None)
                    continue
                report, fingerprint = _layer_check(serving, check, config is not None)
                report.config = f"{check.named()} (after a weight update)"
                done.append(report)
                if not report.passed:
                    message = (
                        f"sm120_fp4: refusing to serve NVFP4 on {serving.device.label()}: after SGLang's weight "
                        f"update, {report.config} fails with {serving.decision.backend}: {report.reason}"
                    )
                    _refuse(
                        Refusal(
                            device=serving.device.label(),
                            config=report.config,
                            family=serving.family.name,
                            message=message,
                            rejected={serving.decision.backend: report.reason or ""},
                            reports=[report],
                        ),
                        settings,
                    )
                    raise RefusedToServe(message)
                if config is not None:
                    serving.checks[config] = check
                _record_layer(serving, check, fingerprint)
    if done:
        _LOG.info("sm120_fp4: re-verified %d layer(s) after SGLang's weight update: all pass", len(done))
    return done


def on_hang(message: str) -> None:
    """The self-test's watchdog is about to end the process: record the refusal in the report first
    (a hook of :data:`sm120_fp4.verify.hang_hooks`)."""
    settings = _process.last_settings
    if settings is not None:
        _refuse(Refusal(device="?", message=message), settings)


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
        if serving.converter is not None and serving.converter.in_place:
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
    if serving is None or _process.updating:
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
        if record is not None and not _process.updating:
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
            if record is None or record.fingerprint is None or _process.updating:
                continue
            [(_, why)] = _compare_fingerprints([(record, check)])
            if why is not None:
                return f"{check.named()}: {why}"
    return None
