"""Everything this library knows about SGLang, in one package.

* :mod:`.release`: the installed release, the supported range, whether it already carries the fix;
* :mod:`.targets`: what to patch in which release (the ledger), the runner-enum pin, env knobs;
* :mod:`.simulation`: the stand-ins that let SGLang's real FP4 path run without an SM120 GPU;
* :mod:`.plugin`: the ``sglang.srt.plugins`` entry point; :mod:`.layers`: real layers for the demo.

:func:`attach` wires one install into SGLang. Nothing here imports SGLang at import time: every
step runs from a post-import hook when (or if) SGLang imports the module it concerns.
"""

from __future__ import annotations

import logging
from typing import Callable

from .release import release_support, runtime_patch_needed, sglang_version

__all__ = ["attach", "release_support", "runtime_patch_needed", "sglang_version"]

_LOG = logging.getLogger("sm120_fp4")


def attach(patcher, router, settings) -> list[Callable[[], None]]:
    """Register this install's SGLang patches (and, in simulation, the simulation stand-ins).

    `router` (a dispatch.Router) builds the FP4 GEMM alias replacement and decides per device: its
    ``ensure(index)`` may raise RefusedToServe and returns None for a device this library does not
    serve (the runner enum then stays as is, and nothing is verified there). Returns the undo steps
    that are not patches (the patcher undoes its own).
    """
    from .. import selection
    from ..errors import RefusedToServe
    from ..versions import version_in
    from . import hooks, moe, simulation, targets

    undo: list[Callable[[], None]] = []
    simulate = settings.simulated_capability
    sim = simulation.Simulation(simulate, patcher) if simulate is not None else None

    def before(index: int) -> None:
        if router.ensure(index) is not None:
            targets.pin_runner_backend(patcher)

    def verify(check) -> None:
        if check is not None:
            selection.verify_layer(check.device_index, check, settings)

    def weights_scope():
        return simulation.cuda_moves_stay_on_cpu(sim is not None)

    def before_moe(kind: str, layer) -> None:
        if selection.route(hooks.layer_device_index(layer), settings, "moe") is None:
            return  # a device this library does not serve
        if not version_in(sglang_version(), moe.SEAM_VERSIONS):
            moe.refuse_unverifiable(kind, settings)
            return
        problem = moe.gate_up_problem(layer)
        if problem is not None and settings.selftest != "off":
            message = f"sm120_fp4: refusing to serve the NVFP4 MoE layer ({kind}): {problem}"
            if settings.selftest == "strict":
                raise RefusedToServe(message)
            _LOG.warning("%s (SM120_FP4_SELFTEST=warn: serving anyway)", message)

    def moe_seam(original):
        return moe.make_seam(original, lambda index: selection.route(index, settings, "moe"), sim is not None)

    wiring = targets.Wiring(router.make_dispatch, before, weights_scope, verify, lambda captured: selection.recheck(settings, captured),
                            moe_seam, before_moe, selection.weights_update_begin, lambda: selection.weights_update_end(settings))
    specs = targets.specs(wiring)
    if sim is not None:
        _LOG.warning("sm120_fp4: SIMULATION of sm_%d%d: results prove the wiring, not an SM120 kernel", *simulate)
        specs += simulation.specs()
        sim.arm()
        undo.append(sim.undo)
    undo.append(targets.apply_env_knobs(patcher))
    patcher.add(specs)
    return undo
