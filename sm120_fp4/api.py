"""The public entry points: ``install()``, ``uninstall()``, ``status()`` and ``decide()``.

``install()`` is idempotent and thread-safe, works before or after the engine is imported, and exports
``SM120_FP4=1`` (with any keyword overrides) so that spawned processes activate themselves."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from pydantic import BaseModel

from . import __version__, canary, deciding, devices, locks, serving, verify
from . import sglang as sglang_home
from . import vllm as vllm_home
from .canary import CanaryStatus
from .config import Settings, check_flashinfer_env, env_name, flashinfer_overrides, load_settings, sources
from .dispatch import Router
from .engines import OPT_OUT, OPT_OUT_SAYS, Engine
from .errors import ConfigError, say_once
from .patching import LedgerEntry, Patcher

__all__ = ["install", "uninstall", "status", "decide", "Status"]

_LOG = logging.getLogger("sm120_fp4")
# The engine homes install() wires into, in this order; the CLI and doctor reach each through its name.
ENGINES: tuple[Engine, ...] = (sglang_home.ENGINE, vllm_home.ENGINE)
_lock = locks.rlock()


class Status(BaseModel):
    """What the library is doing in this process (``status().model_dump_json()``)."""

    version: str
    installed: bool
    message: str
    settings: dict[str, Any]
    setting_sources: dict[str, str]
    sglang_version: str | None
    sglang_supported: bool
    devices: list[str]
    patches: list[LedgerEntry]
    routes: dict[int, str]
    moe_routes: dict[int, str]
    decisions: list[deciding.Decision]
    refusals: list[deciding.Refusal]
    canary: CanaryStatus
    rank: dict[str, int] = {}  # this process's ranks in its engine's parallel groups (tp_rank, tp_size, ...)
    unverified: list[serving.Unverified] = []  # what SM120_FP4_SELFTEST=warn lets serve that nothing verifies, and why
    engines: dict[str, dict[str, Any]] = {}  # each engine home: its installed version, supported or not, and why
    flashinfer_overrides: dict[str, str] = {}  # FLASHINFER_NVFP4_* set here: install() refuses while any is


@dataclass
class _Install:
    settings: Settings
    kwargs: dict[str, Any]
    router: Router
    patcher: Patcher
    undo: list[Callable[[], None]] = field(default_factory=list)


_state: _Install | None = None
_message = "not installed"


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return ",".join(value)
    return str(value)


def _export_env(kwargs: dict[str, Any]) -> Callable[[], None]:
    """Export SM120_FP4=1 and the keyword overrides, so spawned workers use the same settings; return the undo."""
    wanted = {env_name(k): _env_value(v) for k, v in kwargs.items() if v is not None}
    wanted.setdefault(env_name("toggle"), "1")
    previous = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)

    def undo() -> None:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo


def _log_precedence(settings: Settings) -> None:
    """Say once which wins where SELFTEST=warn meets FALLBACK=emulated (the verified emulation)."""
    if settings.selftest != "warn":
        return
    for var, value in (("SM120_FP4_FALLBACK", settings.fallback), ("SM120_FP4_MOE_FALLBACK", settings.moe_fallback)):
        if value == "emulated":
            says = "sm120_fp4: %s=emulated and SM120_FP4_SELFTEST=warn are both set: where no candidate verifies, "
            says += "%s=emulated wins (the slow, verified emulation serves; nothing is served unverified)"
            say_once(logging.WARNING, says, var, var)


def engine(name: str) -> Engine:
    """Return the engine home `name` (ValueError naming the homes for any other)."""
    found = next((home for home in ENGINES if home.name == name), None)
    if found is None:
        raise ValueError(f"engine={name!r}: accepted: {', '.join(home.name for home in ENGINES)}")
    return found


def _supported_engines() -> list[Engine]:
    """Return the engine homes whose installed release this library knows how to patch."""
    return [engine for engine in ENGINES if engine.release.support()[0]]


def _nothing_to_fix(settings: Settings) -> str | None:
    if not settings.active:
        return "disabled (SM120_FP4=0 or SM120_FP4_ENABLE=off): SGLang left untouched"
    if not _supported_engines():
        installed = [engine for engine in ENGINES if engine.release.version() is not None]
        why = "; ".join(engine.release.support()[1] for engine in installed or ENGINES)
        unverified = next((u for u in (e.release.unverified() for e in installed) if u is not None), None)
        no_gpu = _no_12x_gpu(settings)
        if unverified is None or no_gpu is not None:
            return why if no_gpu is None else f"{why}; {no_gpu}"
        means, remedy = unverified
        if settings.unsupported_release == "serve-unverified":
            return f"{means} ({OPT_OUT}: as asked)"
        return f"{means}. To verify them: {remedy}; or {OPT_OUT_SAYS}"
    return _no_12x_gpu(settings)


def _no_12x_gpu(settings: Settings) -> str | None:
    """Return why there is nothing to fix for want of a 12.x GPU (SM120_FP4_ENABLE=auto), or None."""
    if settings.enable == "auto":
        try:
            found = devices.list_devices(settings.simulated_capability)
        except devices.DeviceMappingError as exc:
            # Which ordinal is which GPU is known once CUDA is initialised (each device is mapped when
            # its first layer loads, or refused there); whether any 12.x GPU may be visible is known now.
            simulate = settings.simulated_capability
            found = [replace(d, capability=simulate, simulated=True) if simulate else d for d in exc.candidates]
            goes_on = "%s (install() goes on: each GPU is mapped through CUDA when its first layer loads)"
            say_once(logging.INFO, goes_on, exc)
        if not any(devices.is_sm12x(d.capability) for d in found):
            seen = ", ".join(d.label() for d in found) or "no GPU"
            return f"no compute-capability 12.x GPU visible ({seen}): nothing to fix, SGLang left untouched (SM120_FP4_ENABLE=on forces it)"
    return None


def _install(settings: Settings, kwargs: dict[str, Any]) -> _Install:
    check_flashinfer_env()  # FlashInfer's own FP4 recipe knobs: nothing it computes could be verified
    engines = _supported_engines()
    problem = canary.settings_problem(settings) or next(
        (p for p in (engine.idle_point_problem(settings) for engine in engines) if p is not None), None
    )
    if problem is not None:  # the serving canary asked for, and it could not run: refused, never silently off
        raise ConfigError(f"invalid sm120_fp4 settings:\n  {problem}")
    state = _Install(settings, kwargs, Router(settings), Patcher())
    for engine in engines:
        state.undo += engine.attach(state.patcher, state.router, settings, canary)
    state.undo.append(_export_env(kwargs))
    return state


def _wire_process() -> None:
    """Wire serving's report sections and the watchdog's hang hook (idempotent; never at import)."""
    serving.STATE.rank = rank
    serving.STATE.report.sections.update(serving.report_sections())
    if serving.on_hang not in verify.hang_hooks:
        verify.hang_hooks.append(serving.on_hang)


def rank() -> dict[str, int]:
    """Return this process's ranks in its engine's parallel groups (``tp_rank``, ``tp_size``, ...), or {}."""
    return next((r for r in (engine.rank() for engine in ENGINES) if r), {})


@functools.wraps(serving.decide)
def decide(*args: Any, **kwargs: Any) -> deciding.Decision:
    _wire_process()
    try:
        return serving.decide(*args, **kwargs)
    finally:
        serving.STATE.report.flush()  # the caller's report file holds this decision (bounded; a refusal flushed already)


def install(**overrides: Any) -> Status:
    """Patch the engine's FP4 GEMMs and NVFP4 MoE (now or at its import); keywords beat SM120_FP4_* env."""
    global _state, _message
    with _lock:
        _wire_process()
        settings = load_settings(**overrides)
        if settings.toggle is not False:  # off means off: nothing else is looked at
            # Unknown backend names (after the entry points): ConfigError now, not at serve time.
            deciding.candidate_names(settings)
            deciding.candidate_names(settings, family=deciding.MOE)
            _log_precedence(settings)
        if _state is not None:
            # install() itself exports SM120_FP4=1, so a toggle that became "on" is not a change.
            before, after = _state.settings.model_dump(), settings.model_dump()
            changed = {k: (before[k], after[k]) for k in before if k != "toggle" and before[k] != after[k]}
            if not changed:
                _LOG.warning("sm120_fp4: install() called while already installed with these settings; nothing changed")
                return status()
            _reinstall_or_refuse(_state, changed, overrides)
        reason = _nothing_to_fix(settings)
        if reason is not None:
            _message = reason
            say_once(logging.INFO if not settings.active else logging.WARNING, "sm120_fp4: %s", reason)
            return status()
        _state = _install(settings, dict(overrides))
        engines = _supported_engines()
        carried = next((c for c in (engine.carried_fix() for engine in engines) if c), None)
        served = ", ".join(f"{engine.name} {engine.release.version()}" for engine in engines)
        _message = f"installed ({served})" + (f"; {carried}" if carried else "")
        _LOG.info("sm120_fp4 %s: %s; settings %s", __version__, _message, settings.model_dump())
        return status()


def _reinstall_or_refuse(state: _Install, changed: dict[str, tuple[Any, Any]], overrides: dict[str, Any]) -> None:
    """Uninstall for other settings while nothing is decided, else raise ConfigError (never ignore them)."""
    shown = "; ".join(f"{k}: {old!r} in force, {new!r} asked" for k, (old, new) in changed.items())
    by = (
        f"install({', '.join(f'{k}={v!r}' for k, v in state.kwargs.items())})"
        if state.kwargs
        else "the environment (SM120_FP4=1: the start-up hook or SGLang's plugin installed it)"
    )
    decided = serving.decisions() or serving.refusals() or serving.routes("dense") or serving.routes("moe")
    if decided:
        raise ConfigError(
            f"sm120_fp4: install({', '.join(f'{k}={v!r}' for k, v in overrides.items())}) asks for other settings than the "
            f"ones in force, installed by {by} ({shown}); this process has already decided ({len(serving.decisions())} "
            "decision(s), layers verified with them), so they cannot change now. Set them before SGLang loads the model "
            f"(the environment: {', '.join(env_name(k) for k in changed)}), or call sm120_fp4.uninstall() first"
        )
    again = "sm120_fp4: install() with other settings than the ones in force, installed by %s (%s): nothing was "
    _LOG.warning(again + "decided yet, so re-installing with them", by, shown)
    _uninstall_locked()


def installed() -> bool:
    """Return whether install() is in force in this process."""
    return _state is not None


def uninstall() -> Status:
    """Undo install(): original objects and enum value restored, hooks disarmed, env restored."""
    with _lock:
        if _state is None:
            _LOG.warning("sm120_fp4: uninstall() called while not installed; nothing changed")
            return status()
        _uninstall_locked()
        return status()


def _uninstall_locked() -> None:
    global _state, _message
    state, _state = _state, None
    state.patcher.remove_all()  # also disarms the hooks of steps not yet run
    for step in reversed(state.undo):
        step()
    serving.STATE.reset()  # every store of this process's serving, the canary and the report sections
    _message = "uninstalled"


def status() -> Status:
    """Return the settings in force, each patch target and its state, and the decisions."""
    with _lock:
        state = _state
        if state is not None:
            settings, kwargs = state.settings, state.kwargs
        else:
            try:
                settings, kwargs = load_settings(), {}
            except Exception:  # status() must answer even with a broken environment
                settings, kwargs = Settings.model_construct(), {}
        try:
            found = [d.label() for d in devices.list_devices(settings.simulated_capability)]
        except Exception as exc:
            found = [f"device probe failed: {exc}"]
        return Status(
            version=__version__,
            installed=state is not None,
            message=_message,
            settings=settings.model_dump(mode="json"),
            setting_sources=sources(kwargs),
            sglang_version=sglang_home.ENGINE.release.version(),
            sglang_supported=sglang_home.ENGINE.release.support()[0],
            devices=found,
            patches=state.patcher.ledger() if state else [],
            routes=serving.routes("dense") if state else {},
            moe_routes=serving.routes("moe") if state else {},
            decisions=serving.decisions(),
            refusals=serving.refusals(),
            canary=canary.status(settings),
            engines={engine.name: _engine_status(engine) for engine in ENGINES},
            rank=rank(),
            unverified=serving.unverified(),
            flashinfer_overrides=flashinfer_overrides(),
        )


def _engine_status(engine: Engine) -> dict[str, Any]:
    supported, reason = engine.release.support()
    return {"version": engine.release.version(), "supported": supported, "reason": reason}
