"""The serving canary (SM120_FP4_CANARY): verified configurations re-checked at idle points (docs/operations.md)."""

from __future__ import annotations

from typing import Callable, ContextManager

from ..config import Settings
from ..serving import STATE
from .engine import SMALL_M, Canary
from .models import CanaryFailure, CanaryRun, CanaryStatus

__all__ = [
    "CanaryRun",
    "CanaryFailure",
    "CanaryStatus",
    "Canary",
    "configure",
    "stop",
    "idle",
    "on_warmup",
    "status",
    "settings_problem",
    "SMALL_M",
]


def settings_problem(settings: Settings) -> str | None:
    """Return why the canary cannot do what these settings ask, or None."""
    if settings.canary_period is not None and settings.selftest == "off":
        return (
            f"SM120_FP4_CANARY={settings.canary_period:g} re-verifies the verified layer configurations while "
            "serving, but SM120_FP4_SELFTEST=off verifies none; set SM120_FP4_SELFTEST=strict (or warn), "
            "or SM120_FP4_CANARY=off"
        )
    return None


def configure(settings: Settings, idle_point: str | None = None) -> Canary | None:
    """Start this process's canary (install; serving.STATE holds it): None, and nothing runs, with SM120_FP4_CANARY=off."""
    if settings.canary_period is None:
        return None
    STATE.canary = Canary(settings, idle_point)
    STATE.report.sections["canary"] = lambda: status(settings).model_dump(mode="json")
    return STATE.canary


def stop() -> None:
    """Forget this process's canary (uninstall)."""
    STATE.canary = None
    STATE.report.sections.pop("canary", None)


def idle(serving_stream: Callable[[], ContextManager] | None = None) -> None:
    """Run the canary's due run: the engine's serving loop is between forward passes; nothing when off."""
    if STATE.canary is not None:
        STATE.canary.idle(serving_stream)


def on_warmup(captured: list[int]) -> None:
    """Add the captured graphs' batch sizes to the rotation; nothing when off."""
    if STATE.canary is not None:
        STATE.canary.on_warmup(captured)


def status(settings: Settings) -> CanaryStatus:
    """Return this process's canary status, or what the settings in force say where none runs here."""
    if STATE.canary is not None:
        return STATE.canary.status()
    state, off = "not running: sm120_fp4 is not installed in this process", "not compared: the canary is off"
    state = "off (SM120_FP4_CANARY=off)" if settings.canary_period is None else state
    return CanaryStatus(
        enabled=False,
        period_s=settings.canary_period,
        action=settings.canary_action,
        slice_ms=settings.canary_slice_ms,
        state=state,
        fingerprints=off,
    )
