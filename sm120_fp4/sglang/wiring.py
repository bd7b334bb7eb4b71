"""Wire one install into SGLang (:func:`attach`), and say whether the serving canary has an idle point here.

Nothing here imports SGLang: every step runs from a post-import hook when (or if) SGLang imports its module.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from .. import engines, serving
from ..backends import b12x_moe
from ..checkpoints import read_quantization
from ..deciding import serves
from ..devices import get_device
from ..errors import ConfigError, RefusedToServe
from ..serving import policy
from ..serving.policy import layer_device_index, layer_name
from ..versions import version_in
from .autotune import tunable_backends
from .moe import (
    SEAM_VERSIONS,
    b12x_problem,
    call_problem,
    make_seam,
    moe_check,
    pin_auto_runner,
    refuse_unverifiable,
    runner_problem,
)
from .release import KERNEL_OPS_GEMM, PARALLEL_STATE, sglang_version
from .scales import checkpoint_scale_problem, quant_mode_problem
from .simulation import Simulation
from .simulation import specs as simulation_specs
from .targets import (
    idle_spec,
    idle_specs,
    pin_runner_backend,
    runner_backend_problem,
    unknown_backend_problem,
    unverified_argument_problem,
)
from .targets import specs as target_specs

_LOG = logging.getLogger("sm120_fp4")


class _Install:
    """Hold one install's decisions: what each patch calls into (what targets.specs reads)."""

    def __init__(self, patcher, router, settings, sim) -> None:
        self.patcher, self.router, self.settings, self.sim = patcher, router, settings, sim
        self.declined_on: set[int] = set()
        self.idle = None  # the canary's idle spec, when the canary is on
        self.canary = None
        self.make_dispatch = functools.partial(router.make_dispatch, unknown=self.unknown_backend)
        self.make_decline = functools.partial(router.make_decline, declined=self.declined)
        front = functools.partial(router.make_moe_front, unknown=self.unmodeled_moe)
        self.make_moe_seam = functools.partial(make_seam, make_front=front, simulated=sim is not None)
        self.weights_update_begin = serving.weights_update_begin
        self.weights_update_end = lambda: serving.weights_update_end(settings)
        self.weights_scope = functools.partial(engines.cuda_moves_stay_on_cpu, sim is not None)
        # After FlashInfer's autotune, before graph capture: SELECT=fastest times the tuned candidates again.
        self.retime = lambda: serving.retime(settings)

    def refuse(self, what: str, problem: str | None) -> None:
        """Refuse to serve `what` for `problem` as SM120_FP4_SELFTEST says (policy.refuse_unverifiable)."""
        policy.refuse_unverifiable(self.settings, what, problem)

    def before_dense(self, kind: str, method, layer) -> None:
        index = layer_device_index(layer)
        if self.router.ensure(index) is None:
            return  # a device this library does not serve
        self.refuse(f"NVFP4 dense layers on device {index}", runner_backend_problem())
        pin_runner_backend(self.patcher)
        self.check_scales(kind, method, layer)

    def check_scales(self, kind: str, method, layer, family: str = "dense") -> None:
        """Refuse a layer whose quant mode or checkpoint scales cannot serve, before any kernel is blamed."""
        if self.settings.selftest == "off" or serving.route(layer_device_index(layer), self.settings, family) is None:
            return
        problem = quant_mode_problem(kind, method) or checkpoint_scale_problem(kind, method, layer)
        self.refuse(_layer_what(kind, layer, "MoE " if family == "moe" else ""), problem)

    def before_moe(self, kind: str, method, layer) -> None:
        if serving.route(layer_device_index(layer), self.settings, "moe") is None:
            return  # a device this library does not serve
        self.check_scales(kind, method, layer, "moe")
        if not version_in(sglang_version(), SEAM_VERSIONS):
            refuse_unverifiable(kind, self.settings)
            return
        self.refuse(f"the NVFP4 MoE layer ({kind})", runner_problem(kind, method))

    def moe_check(self, kind: str, layer):
        """Return the layer's MoE check, or None after refusing (warn: serving UNVERIFIED) a call the oracle cannot model."""
        if serving.route(layer_device_index(layer), self.settings, "moe") is None:
            return None
        problem = call_problem(layer)
        self.refuse(_layer_what(kind, layer, "MoE "), problem)
        return moe_check(kind, layer) if problem is None else None

    def before_w4a16(self, kind: str, method, layer) -> None:
        """Refuse (strict) or serve UNVERIFIED (warn) a weight-only NVFP4 layer: FP4 Marlin, called directly, serves it."""
        family = "moe" if "MoE" in kind else "dense"
        if serving.route(layer_device_index(layer), self.settings, family) is None:
            return  # a device this library does not serve
        problem = (
            f"SGLang serves {kind} weight-only (W4A16) with FP4 Marlin (or FlashInfer's mm_bf16_fp4), called directly: "
            "no W4A16 NVFP4 kernel is routed or verified by sm120_fp4 on this GPU. Serve a W4A4 NVFP4 checkpoint "
            f"(without --fp4-gemm-backend marlin), or set SM120_FP4_SELFTEST=warn to serve it unverified"
        )
        self.refuse(_layer_what(kind, layer, "MoE " if family == "moe" else ""), problem)

    def unmodeled_moe(self, index: int, problem: str) -> None:
        self.refuse(f"an NVFP4 fused-MoE call on device {index}", problem)

    def unknown_backend(self, index: int, name: str, value: object) -> None:
        backend = name == "backend"
        problem = unknown_backend_problem(index, value) if backend else unverified_argument_problem(index, name, value)
        self.refuse(f"an FP4 GEMM on device {index}", problem)

    def declined(self, index: int) -> None:
        if index not in self.declined_on:  # once per device: this runs at every FP4 GEMM call
            self.declined_on.add(index)
            _LOG.info(
                "sm120_fp4: SGLang's KDA NVFP4 GEMM fast path (%s.try_qwen3x_nvfp4_gemm) is not used on device %d: "
                "that kernel is not verified here; its calls go to the routed, verified FP4 GEMM",
                KERNEL_OPS_GEMM,
                index,
            )

    def verify(self, check) -> None:
        if check is not None:
            serving.verify_layer(check.device_index, check, self.settings)

    def pin_moe_runner(self, model_path: str | None) -> None:
        if not _serves_current_device(self.settings):
            return
        try:
            quant = read_quantization(model_path) if model_path else None
        except ConfigError as exc:
            _LOG.warning(
                "sm120_fp4: cannot read the checkpoint's quantization (%s); SGLang's MoE runner is left as "
                "it is, and each NVFP4 MoE layer's runner is checked when it loads",
                exc,
            )
            return
        if quant is not None and quant.nvfp4:
            pin_auto_runner(self.patcher)

    def recheck(self, captured: list[int]) -> object:
        done = serving.recheck(self.settings, captured)
        if self.idle is not None:  # the serving canary: its idle hook must be in place, or nothing would run it
            _require_idle_hook(self.patcher, self.idle, self.settings)
            self.canary.on_warmup(captured)
        return done

    def tuned_families(self) -> list[str]:
        """Return the NVFP4 families served on this process's device with a backend FlashInfer's autotuner tunes."""
        return tunable_backends({f: serving.routes(f) for f in ("dense", "moe")}, _current_index())


def attach(patcher, router, settings, canary=None) -> list[Callable[[], None]]:
    """Register this install's SGLang patches (and simulation stand-ins); return the undo steps that are not patches."""
    # `router.ensure(index)` may raise RefusedToServe (None: a device not served); `canary` is passed in, not imported.
    undo: list[Callable[[], None]] = []
    simulate = settings.simulated_capability
    sim = Simulation(simulate, patcher) if simulate is not None else None
    wired = _Install(patcher, router, settings, sim)
    if canary is not None and settings.canary_period is not None:
        wired.idle, wired.canary = idle_spec(canary.idle), canary
    if settings.canary_period is not None and wired.idle is None:
        raise ConfigError(
            f"invalid sm120_fp4 settings:\n  {idle_point_problem(settings) or 'the serving canary is not wired'}"
        )
    specs = target_specs(wired)
    if wired.idle is not None:
        canary.configure(settings, f"{wired.idle.module}.{wired.idle.attribute}")
        undo.append(canary.stop)
        specs.append(wired.idle)
    if sim is not None:
        _LOG.warning("sm120_fp4: SIMULATION of sm_%d%d: results prove the wiring, not an SM120 kernel", *simulate)
        specs += simulation_specs(simulate)
        sim.arm()
        undo.append(sim.undo)
    undo.append(b12x_moe.engine_check(b12x_problem))  # SGLang's server settings under which b12x cannot serve
    undo.append(serving.use_group(functools.partial(engines.tp_cpu_group, PARALLEL_STATE)))
    patcher.add(specs)
    return undo


def _layer_what(kind: str, layer, family: str = "") -> str:
    name = layer_name(layer)
    return f"the NVFP4 {family}layer {name + ' ' if name else ''}({kind})"


def idle_point_problem(settings) -> str | None:
    """Return why the serving canary these settings ask for has no idle point in the installed SGLang, or None."""
    if settings.canary_period is None or idle_spec(lambda stream: None) is not None:
        return None
    known = ", ".join(f"{s.attribute} ({s.versions})" for s in idle_specs(lambda stream: None))
    return (
        f"SM120_FP4_CANARY={settings.canary_period:g} is not available with SGLang {sglang_version()}: its "
        f"scheduler loop has no idle point sm120_fp4 can run the canary at (known: {known}); "
        "set SM120_FP4_CANARY=off to serve without the serving canary, or use a release listed"
    )


def _require_idle_hook(patcher, spec, settings) -> None:
    """Raise RefusedToServe unless the canary's idle hook is applied in this scheduler (checked after warm-up)."""
    entry = next((e for e in patcher.ledger() if e.name == spec.name), None)
    if entry is not None and entry.state == "applied":
        return
    state = f"{entry.state}: {entry.reason}" if entry is not None else f"{spec.module} was never imported"
    raise RefusedToServe(
        f"sm120_fp4: refusing to serve: SM120_FP4_CANARY={settings.canary_period:g} is on, but the serving canary's idle "
        f"hook ({spec.module}.{spec.attribute}, patch {spec.name}) is not in place in this scheduler process ({state}); "
        "nothing would run the canary. Set SM120_FP4_CANARY=off to serve without it, or report this SGLang release."
    )


def _current_index() -> int:
    """Return the CUDA ordinal this process computes on (-1: CPU tensors, in simulation)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def _serves_current_device(settings) -> bool:
    """Return whether this library serves the device this process computes on (CPU: only in simulation)."""
    index, simulated = _current_index(), settings.simulated_capability
    return (index >= 0 or simulated is not None) and serves(get_device(index, simulated), settings)
