"""How one install is wired into SGLang: :func:`attach` (post-import hooks for the installed
release's patch targets), and whether the serving canary has an idle point in this release.

Nothing here imports SGLang at import time: every step runs from a post-import hook when (or if)
SGLang imports the module it concerns.
"""

from __future__ import annotations

import logging
from typing import Callable

from .release import sglang_version

__all__ = ["attach", "idle_point_problem"]

_LOG = logging.getLogger("sm120_fp4")


def attach(patcher, router, settings, canary=None) -> list[Callable[[], None]]:
    """Register this install's SGLang patches (and, in simulation, the simulation stand-ins).

    `router` (a dispatch.Router) builds the FP4 GEMM alias replacement and decides per device: its
    ``ensure(index)`` may raise RefusedToServe and returns None for a device this library does not
    serve (the runner enum then stays as is, and nothing is verified there). `canary` (the module
    sm120_fp4.canary, passed in so that nothing here imports it) runs at the scheduler's idle point
    when SM120_FP4_CANARY is on. Returns the undo steps that are not patches (the patcher undoes its own).
    """
    from .. import checkpoints, serving
    from ..errors import ConfigError, RefusedToServe, say_once
    from ..versions import version_in
    from . import hooks, moe, simulation, targets

    undo: list[Callable[[], None]] = []
    simulate = settings.simulated_capability
    sim = simulation.Simulation(simulate, patcher) if simulate is not None else None

    def refuse(what: str, problem: str | None) -> None:
        """A layer or call this library cannot verify: RefusedToServe (SELFTEST=strict), logged once (warn),
        or nothing (off, or no problem)."""
        if problem is None or settings.selftest == "off":
            return
        message = f"sm120_fp4: refusing to serve {what}: {problem}"
        if settings.selftest == "strict":
            raise RefusedToServe(message)
        say_once(logging.WARNING, "%s (SM120_FP4_SELFTEST=warn: serving it UNVERIFIED)", message)

    def layer_what(kind: str, layer, family: str = "") -> str:
        name = hooks.layer_name(layer)
        return f"the NVFP4 {family}layer {name + ' ' if name else ''}({kind})"

    def before(kind: str, method, layer) -> None:
        index = hooks.layer_device_index(layer)
        if router.ensure(index) is None:
            return  # a device this library does not serve
        refuse(f"NVFP4 dense layers on device {index}", targets.runner_backend_problem())
        targets.pin_runner_backend(patcher)
        check_scales(kind, method, layer)
        refuse(layer_what(kind, layer), hooks.layer_scales_problem(kind, method, layer))

    def unknown_backend(index: int, name: str, value: object) -> None:
        problem = (
            targets.unknown_backend_problem(index, value)
            if name == "backend"
            else targets.unverified_argument_problem(index, name, value)
        )
        refuse(f"an FP4 GEMM on device {index}", problem)

    def make_dispatch(original):
        return router.make_dispatch(original, unknown_backend)

    declined_on: set[int] = set()

    def declined(index: int) -> None:
        if index not in declined_on:  # once per device: this runs at every FP4 GEMM call
            declined_on.add(index)
            _LOG.info(
                "sm120_fp4: SGLang's KDA NVFP4 GEMM fast path (%s.try_qwen3x_nvfp4_gemm) is not used on device %d: "
                "that kernel is not verified here; its calls go to the routed, verified FP4 GEMM",
                targets.KERNEL_OPS_GEMM,
                index,
            )

    def make_decline(original):
        return router.make_decline(original, declined)

    def verify(check) -> None:
        if check is not None:
            serving.verify_layer(check.device_index, check, settings)

    def weights_scope():
        return simulation.cuda_moves_stay_on_cpu(sim is not None)

    def check_scales(kind: str, method, layer, family: str = "dense") -> None:
        """A layer whose quant mode or checkpoint scales cannot serve is refused naming them, before any kernel is blamed."""
        if settings.selftest == "off" or serving.route(hooks.layer_device_index(layer), settings, family) is None:
            return
        problem = hooks.quant_mode_problem(kind, method) or hooks.checkpoint_scale_problem(kind, method, layer)
        refuse(layer_what(kind, layer, "MoE " if family == "moe" else ""), problem)

    def before_moe(kind: str, method, layer) -> None:
        if serving.route(hooks.layer_device_index(layer), settings, "moe") is None:
            return  # a device this library does not serve
        check_scales(kind, method, layer, "moe")
        if not version_in(sglang_version(), moe.SEAM_VERSIONS):
            moe.refuse_unverifiable(kind, settings)
            return
        refuse(f"the NVFP4 MoE layer ({kind})", moe.runner_problem(kind, method) or moe.gate_up_problem(layer))

    def pin_moe_runner(model_path: str | None) -> None:
        if not _serves_current_device(settings):
            return
        try:
            quant = checkpoints.read_quantization(model_path) if model_path else None
        except ConfigError as exc:
            _LOG.warning(
                "sm120_fp4: cannot read the checkpoint's quantization (%s); SGLang's MoE runner is left as "
                "it is, and each NVFP4 MoE layer's runner is checked when it loads",
                exc,
            )
            return
        if quant is not None and quant.nvfp4:
            moe.pin_auto_runner(patcher)

    def moe_seam(original):
        return moe.make_seam(original, router.make_moe_front, sim is not None)

    idle = targets.idle_spec(canary.idle) if canary is not None and settings.canary_period is not None else None
    if settings.canary_period is not None and idle is None:
        raise ConfigError(
            f"invalid sm120_fp4 settings:\n  {idle_point_problem(settings) or 'the serving canary is not wired'}"
        )

    def recheck(captured: list[int]) -> object:
        done = serving.recheck(settings, captured)
        if idle is not None:  # the serving canary: its idle hook must be in place, or nothing would run it
            _require_idle_hook(patcher, idle, settings)
            canary.on_warmup(captured)
        return done

    def tuned_families() -> list[str]:
        """The NVFP4 families served on this process's device with a backend FlashInfer's autotuner tunes."""
        from .autotune import tunable_backends

        return tunable_backends({f: serving.routes(f) for f in ("dense", "moe")}, _current_index(settings))

    wiring = targets.Wiring(
        make_dispatch,
        before,
        weights_scope,
        verify,
        recheck,
        moe_seam,
        before_moe,
        pin_moe_runner,
        serving.weights_update_begin,
        lambda: serving.weights_update_end(settings),
        make_decline=make_decline,
        tuned_families=tuned_families,
    )
    specs = targets.specs(wiring)
    if idle is not None:
        canary.configure(settings, f"{idle.module}.{idle.attribute}")
        undo.append(canary.stop)
        specs.append(idle)
    if sim is not None:
        _LOG.warning("sm120_fp4: SIMULATION of sm_%d%d: results prove the wiring, not an SM120 kernel", *simulate)
        specs += simulation.specs(simulate)
        sim.arm()
        undo.append(sim.undo)
    undo.append(targets.apply_env_knobs(patcher))
    patcher.add(specs)
    return undo


def idle_point_problem(settings) -> str | None:
    """Why the serving canary these settings ask for cannot run with the installed SGLang: its
    scheduler loop has no idle point this library can use (None: it has one, or the canary is off)."""
    from . import targets

    if settings.canary_period is None or targets.idle_spec(lambda stream: None) is not None:
        return None
    known = ", ".join(f"{s.attribute} ({s.versions})" for s in targets.idle_specs(lambda stream: None))
    return (
        f"SM120_FP4_CANARY={settings.canary_period:g} is not available with SGLang {sglang_version()}: its "
        f"scheduler loop has no idle point sm120_fp4 can run the canary at (known: {known}); "
        "set SM120_FP4_CANARY=off to serve without the serving canary, or use a release listed"
    )


def _require_idle_hook(patcher, spec, settings) -> None:
    """After warm-up in a scheduler: the canary's idle hook is applied here, else RefusedToServe
    (the canary is on, and silently off is never what was asked for)."""
    from ..errors import RefusedToServe

    entry = next((e for e in patcher.ledger() if e.name == spec.name), None)
    if entry is not None and entry.state == "applied":
        return
    state = f"{entry.state}: {entry.reason}" if entry is not None else f"{spec.module} was never imported"
    raise RefusedToServe(
        f"sm120_fp4: refusing to serve: SM120_FP4_CANARY={settings.canary_period:g} is on, but the serving canary's idle "
        f"hook ({spec.module}.{spec.attribute}, patch {spec.name}) is not in place in this scheduler process ({state}); "
        "nothing would run the canary. Set SM120_FP4_CANARY=off to serve without it, or report this SGLang release."
    )


def _current_index(settings) -> int:
    """The CUDA ordinal this process computes on (-1: CPU tensors, in simulation)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def _serves_current_device(settings) -> bool:
    """Whether this library serves the device this process computes on (CPU tensors: only in simulation)."""
    from .. import deciding, devices

    index = _current_index(settings)
    if index < 0 and settings.simulated_capability is None:
        return False
    return deciding.serves(devices.get_device(index, settings.simulated_capability), settings)
