"""How one install is wired into vLLM (:func:`attach`), and why the serving canary cannot run with it yet."""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from .. import checkpoints, engines, serving
from ..checkpoints import scales
from ..errors import ConfigError
from ..serving import policy
from ..serving.policy import layer_device_index, layer_name
from . import hooks, moe, simulation, targets
from .release import PARALLEL_STATE, RELEASE

_LOG = logging.getLogger("sm120_fp4")


class _Wired:
    """What the patches of one install call back into: its settings, its router, the simulation if any."""

    def __init__(self, router, settings, simulated: bool) -> None:
        self.router, self.settings, self.simulated = router, settings, simulated

    def refuse(self, what: str, problem: str | None) -> None:
        """Refuse to serve `what` for `problem` as SM120_FP4_SELFTEST says (policy.refuse_unverifiable)."""
        policy.refuse_unverifiable(self.settings, what, problem)

    def before_dense(self, kind: str, method, layer) -> None:
        refuse_canary(self.settings)
        if hooks.nvfp4_kernel(method) is None:
            return  # not an NVFP4 layer (ModelOptLinearMethod serves FP8 and MXFP8 too): nothing of ours to decide
        if self.router.ensure(layer_device_index(layer)) is None:
            return  # a device this library does not serve
        self.refuse(_what(kind, layer), hooks.kernel_problem(kind, method))
        # The checkpoint's scales, each shard's still apart (vLLM's processing serves the largest): as SGLang refuses.
        self.refuse(_what(kind, layer), scales.layer_problem(_format(kind), layer))

    def unknown(self, index: int, name: str, value: object) -> None:
        self.refuse(
            f"an FP4 GEMM on device {index}",
            f"vLLM called its FlashInfer FP4 GEMM wrapper with {name}={value!r}, which the backend verified on this GPU "
            f"was not verified for; start vLLM with {hooks.LINEAR_FLAG}, or upgrade sm120_fp4",
        )

    def make_alias(self, original: Callable) -> Callable:
        """vLLM's ``flashinfer_scaled_fp4_mm`` over the library's dense front (mm_fp4's convention)."""

        def in_vllm_convention(a, b_t, scale_a, scale_b_t, alpha, out_dtype, out=None, block_size=16, **kwargs):
            kwargs.pop("use_8x4_sf_layout", None)  # mm_fp4's keyword, not the wrapper's
            backend = kwargs.pop("backend", "cutlass")
            return original(
                a, b_t.t(), scale_a, scale_b_t.t(), alpha, out_dtype, backend, block_size=block_size, **kwargs
            )

        front = self.router.make_dispatch(in_vllm_convention, self.unknown)

        def flashinfer_scaled_fp4_mm(a, b, scale_a, scale_b, alpha, out_dtype, backend, block_size=16, use_nvfp4=True):
            if backend in ("cutlass", "cudnn"):  # as vLLM's wrapper: the kernels read the E4M3 scales as bytes
                scale_a, scale_b = scale_a.view(torch.uint8), scale_b.view(torch.uint8)
            options = {"backend": backend, "block_size": block_size, "use_nvfp4": use_nvfp4}
            return front(a, b.t(), scale_a, scale_b.t(), alpha, out_dtype, **options)

        flashinfer_scaled_fp4_mm.__wrapped__ = original
        flashinfer_scaled_fp4_mm.__qualname__ = "sm120_fp4.vllm.flashinfer_scaled_fp4_mm"
        return flashinfer_scaled_fp4_mm

    def verify(self, check) -> None:
        if check is not None:
            serving.verify_layer(check.device_index, check, self.settings)

    def weights_scope(self):
        return engines.cuda_moves_stay_on_cpu(self.simulated)

    def recheck(self, sizes: list[int]) -> object:
        # kernel_warmup has just run FlashInfer's autotune; graph capture comes next: with SELECT=fastest the
        # verified candidates are timed again on the tuned tactics first, so the captured route is the fastest.
        serving.retime(self.settings)
        return serving.recheck(self.settings, sizes)

    @staticmethod
    def moe_served(index: int) -> bool:
        return serving.route_table("moe").get(index) is not None

    def before_moe(self, kind: str, method, layer) -> None:
        refuse_canary(self.settings)
        if self.router.ensure(layer_device_index(layer), "moe") is None:
            return  # a device this library does not serve
        self.refuse(_what(kind, layer, "MoE "), moe.backend_problem(kind, method))
        self.refuse(_what(kind, layer, "MoE "), scales.layer_problem(_format(kind), layer, moe=True))

    def verify_moe(self, kind: str, method, layer) -> None:
        if not self.moe_served(layer_device_index(layer)) or moe.backend_problem(kind, method) is not None:
            return
        problem = moe.layer_problem(kind, method, layer)
        self.refuse(_what(kind, layer, "MoE "), problem)
        if problem is None:
            self.verify(moe.moe_check(kind, method, layer))

    def unmodeled_moe(self, index: int, problem: str) -> None:
        self.refuse(f"an NVFP4 fused-MoE call on device {index}", problem)


def _what(kind: str, layer, family: str = "") -> str:
    name = layer_name(layer)
    return f"the vLLM NVFP4 {family}layer {name + ' ' if name else ''}({kind})"


def _format(kind: str) -> str:
    """Return the checkpoint format of a hooked layer kind (ModelOpt's, else compressed-tensors')."""
    return checkpoints.MODELOPT if kind.startswith("ModelOpt") else checkpoints.COMPRESSED_TENSORS


def attach(patcher, router, settings, canary=None) -> list[Callable[[], None]]:
    """Register this install's vLLM patches (and, in simulation, the stand-ins); return the non-patch undo steps."""
    simulate = settings.simulated_capability
    specs = targets.specs(_Wired(router, settings, simulate is not None))
    undo: list[Callable[[], None]] = []
    if simulate is not None:
        _LOG.warning(
            "sm120_fp4: SIMULATION of sm_%d%d in vLLM: results prove the wiring, not an SM120 kernel", *simulate
        )
        sim = simulation.Simulation(simulate, patcher)
        specs += simulation.specs()
        sim.arm()
        undo.append(sim.undo)
    undo.append(serving.use_group(functools.partial(engines.tp_cpu_group, PARALLEL_STATE)))
    patcher.add(specs)
    return undo


def canary_problem(settings) -> str | None:
    """Why the serving canary cannot run with vLLM (no idle point is wired), or None when it is off."""
    if settings.canary_period is None:
        return None
    return (
        f"SM120_FP4_CANARY={settings.canary_period:g} is not available with vLLM {RELEASE.version()}: sm120_fp4 wires "
        "no idle point in vLLM's engine loop yet; set SM120_FP4_CANARY=off to serve without the serving canary"
    )


def refuse_canary(settings) -> None:
    """vLLM serves here: the serving canary, asked for, cannot run (refused, never silently off)."""
    problem = canary_problem(settings)
    if problem is not None:
        raise ConfigError(f"invalid sm120_fp4 settings:\n  {problem}")
