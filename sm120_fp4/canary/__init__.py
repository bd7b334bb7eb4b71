"""The serving canary (``SM120_FP4_CANARY``): while the server runs, re-verify the kernels it serves.

The start-up verification and the re-check after warm-up say nothing about a kernel that goes wrong
later: a tactic re-chosen, a driver or firmware fault, a degrading card. With the canary on, every
period each serving process re-verifies, for each kernel family it serves (the dense FP4 GEMM, the
NVFP4 fused MoE) on each device, one of that family's verified layer configurations, in rotation:
through the exact routed call with one of its layers' own weights (rotating through every verified
layer of the configuration: a kernel wrong with one layer's weights only is reached too), at one
decode batch size and one larger batch size (both rotating through the batch sizes verified at load,
the re-check's and the captured graph sizes: see :meth:`Canary._batch_sizes`), against the oracle.
A run is the re-check's own light check (two passes, every call checked,
:func:`serving.check_served`), after comparing that layer's weight fingerprint and SWEEP more
layers' in rotation (:func:`serving.fingerprint_sweep`), so a weight changed in memory is found on
any layer.

Engine-neutral: the engine integration calls :func:`idle` where its serving loop is between forward
passes (for SGLang: the scheduler loop's idle point, on the serving thread, with the stream the
forward passes use made current). A run never runs inside CUDA-graph capture. One idle point runs
one whole run (a slice), a family's at most: the runs of one period take one idle point each.

The bound (``SM120_FP4_CANARY_SLICE_MS``, the budget of one slice): a run's time is measured on the
serving thread, with the serving stream synchronised at its end (so it is the GPU time it held the
forward passes back, from above). A run that took longer than the budget caps its configuration's
larger batch sizes below the one it checked: from then on that size and every larger one are not
re-checked while serving (verified at load and after warm-up; :func:`status` lists them), so every
later run of the configuration checks sizes whose run fitted. The sizes climb one at a time, so the
one run that finds the cap is over the budget by about one size step. The smallest decode size and
the smallest larger size are always checked (a canary that checks nothing guarantees nothing): where
even that run is over the budget, it still runs, and status says so with its measured time.
A saturated loop has no idle point: the run waits for the next one, each period it missed is counted
as skipped, and :func:`status` says so.

On a failure, ``SM120_FP4_CANARY_ACTION=exit`` (the default) records the refusal ("while serving:
...", the configuration, the numbers) in status and the report file, logs it and raises
RefusedToServe out of the idle point: the engine's loop stops the process non-zero (SGLang then
kills its server), so that an orchestrator restarts it and the start-up verification runs again.
``log`` logs the first failure of each configuration, counts every one, and keeps serving.

A run never captures a CUDA graph of the checks' own (:func:`graphs.no_capture`): it replays the
graphs the start-up checks captured and runs anything else eagerly, since a capture costs several
eager calls.
"""

from __future__ import annotations

from typing import Callable, ContextManager

from .. import report as report_file
from ..config import Settings
from .engine import SMALL_M, Canary
from .models import CanaryFailure, CanaryRun, CanaryStatus

__all__ = [
    "CanaryRun",
    "CanaryFailure",
    "CanaryStatus",
    "Canary",
    "configure",
    "stop",
    "active",
    "idle",
    "on_warmup",
    "status",
    "settings_problem",
    "SMALL_M",
]


def settings_problem(settings: Settings) -> str | None:
    """Why the canary cannot do what these settings ask (None: it can), independent of the engine."""
    if settings.canary_period is not None and settings.selftest == "off":
        return (
            f"SM120_FP4_CANARY={settings.canary_period:g} re-verifies the verified layer configurations while "
            "serving, but SM120_FP4_SELFTEST=off verifies none; set SM120_FP4_SELFTEST=strict (or warn), "
            "or SM120_FP4_CANARY=off"
        )
    return None


# ---- the process's canary -----------------------------------------------------------------------

_active: Canary | None = None


def configure(settings: Settings, idle_point: str | None = None) -> Canary | None:
    """Start this process's canary (install): None, and nothing runs, with SM120_FP4_CANARY=off."""
    global _active
    if settings.canary_period is None:
        return None
    _active = Canary(settings, idle_point)
    report_file.sections["canary"] = lambda: status(settings).model_dump(mode="json")
    return _active


def stop() -> None:
    """Forget this process's canary (uninstall)."""
    global _active
    _active = None
    report_file.sections.pop("canary", None)


def active() -> Canary | None:
    return _active


def idle(serving_stream: Callable[[], ContextManager] | None = None) -> None:
    """The engine's serving loop is between forward passes (see Canary.idle); nothing when off."""
    canary = _active
    if canary is not None:
        canary.idle(serving_stream)


def on_warmup(captured: list[int]) -> None:
    canary = _active
    if canary is not None:
        canary.on_warmup(captured)


def status(settings: Settings | None = None) -> CanaryStatus:
    """This process's canary, or what the settings say where none runs here."""
    canary = _active
    if canary is not None:
        return canary.status()
    period = settings.canary_period if settings is not None else None
    action = settings.canary_action if settings is not None else "exit"
    slice_ms = settings.canary_slice_ms if settings is not None else 5.0
    state = (
        "off (SM120_FP4_CANARY=off)" if period is None else "not running: sm120_fp4 is not installed in this process"
    )
    return CanaryStatus(
        enabled=False,
        period_s=period,
        action=action,
        slice_ms=slice_ms,
        state=state,
        fingerprints="not compared: the canary is off",
    )
