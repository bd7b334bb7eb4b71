"""SGLang's NVFP4 fused-MoE path: route its kernel seam (0.5.15+) to the verified backend, and verify each layer.

SGLang's runner 'auto' (flashinfer_trtllm, not on SM12x) is pinned to flashinfer_cutlass for NVFP4 checkpoints;
any other runner, differing gate/up global scales, or a release without the seam is refused (SM120_FP4_SELFTEST).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from typing import Callable

import torch

from .. import nvfp4
from ..backends import flashinfer
from ..deciding import refuse
from ..patching import Patcher, PatchSpec
from ..serving import LayerCheck, policy
from ..serving.policy import MoeLayer
from .hooks import sizes
from .release import DISTRIBUTION, MOE_RUNNER_FC, MOE_UTILS, RUNTIME_CONTEXT, sglang_version, supported

_LOG = logging.getLogger("sm120_fp4")
SEAM_VERSIONS = supported(">=0.5.15")
VERIFIED_RUNNER = "flashinfer_cutlass"  # the one MoE runner whose kernel seam is routed and verified
RUNNER_FLAG = f"--moe-runner-backend {VERIFIED_RUNNER}"
_PIN_WHY = (
    "SGLang's MoE runner 'auto' serves NVFP4 MoE with flashinfer_trtllm on every capability >= 10.0 (SM100-only "
    "kernels; on SM12x the layer fails, e.g. 'cannot unpack non-iterable NoneType object') unless --quantization is "
    "given; for an NVFP4 checkpoint on a served device pin 'auto' to flashinfer_cutlass, as SGLang's own SM120 rule "
    "does with --quantization modelopt_fp4, so the routed and verified seam is what serves"
)
MOE_RUNNER_PIN = PatchSpec(
    name="moe-runner-backend-pin",
    module=RUNTIME_CONTEXT,
    attribute="runner_backend",
    distribution=DISTRIBUTION,
    versions=supported(">=0.5.16"),
    why=_PIN_WHY + " (0.5.16+: get_flags().moe.runner_backend)",
    upstream="no upstream issue; SGLang's SM120 rule lives in _moe_runner_backend_quant_constraints (CLI only)",
    remove_when="when SGLang resolves 'auto' for NVFP4 MoE on SM12x from the checkpoint's own quantization",
)
MOE_RUNNER_PIN_LEGACY = dataclasses.replace(
    MOE_RUNNER_PIN,
    name="moe-runner-backend-pin-legacy",
    module=MOE_UTILS,
    attribute="MOE_RUNNER_BACKEND",
    versions=">=0.5.15,<0.5.16",
    why=_PIN_WHY + " (0.5.15-0.5.15.post1: the module global MOE_RUNNER_BACKEND)",
)


def model_path(args: tuple) -> str | None:
    """Return the checkpoint directory this process serves (0.5.15-0.5.18 pass server_args; 0.5.19+ publish it)."""
    path = getattr(args[0], "model_path", None) if args else None
    if path is None:
        context = sys.modules.get(RUNTIME_CONTEXT)
        try:
            path = getattr(context.get_model(), "model_path", None) if context is not None else None
        except (AttributeError, ValueError):  # no published model namespace in this process
            path = None
    return path if isinstance(path, str) else None


def pin_auto_runner(patcher: Patcher) -> bool:
    """Pin SGLang's MoE runner backend from AUTO to FLASHINFER_CUTLASS (the caller decided it applies)."""
    module = sys.modules.get(MOE_UTILS)
    enum = getattr(module, "MoeRunnerBackend", None)
    if enum is None or not all(hasattr(enum, m) for m in ("AUTO", "FLASHINFER_CUTLASS")):
        patcher.note(MOE_RUNNER_PIN, "skipped", "MoeRunnerBackend lacks AUTO/FLASHINFER_CUTLASS")
        return False
    legacy = "MOE_RUNNER_BACKEND" in vars(module)
    spec, owner = (MOE_RUNNER_PIN_LEGACY, module) if legacy else (MOE_RUNNER_PIN, module.get_flags().moe)
    pinned = patcher.pin(spec, owner, enum.FLASHINFER_CUTLASS, lambda current: current in (None, enum.AUTO))
    if pinned:
        _LOG.warning(
            "sm120_fp4: SGLang's MoE runner 'auto' would serve this NVFP4 checkpoint with flashinfer_trtllm, "
            "which does not run on SM12x; pinned to %s, the runner sm120_fp4 verifies",
            VERIFIED_RUNNER,
        )
    return pinned


def served_runner(method: object) -> str:
    """Return the MoE runner that will serve the layer of quant method `method` (as SGLang set it)."""
    backend = getattr(method, "_moe_runner_backend", None)  # set by create_moe_runner (ModelOpt, 0.5.19+)
    if backend is None:
        backend = getattr(getattr(method, "runner", None), "runner_backend", None)  # the MoeRunner it built
    if backend is None and getattr(method, "use_flashinfer_trtllm", False):  # compressed-tensors' own switch
        return "flashinfer_trtllm"
    if backend is None:
        module = sys.modules.get(MOE_UTILS)
        backend = module.get_moe_runner_backend() if module is not None else None
    return str(getattr(backend, "value", backend)) if backend is not None else "unknown"


def runner_problem(kind: str, method: object) -> str | None:
    """Return why this NVFP4 MoE layer cannot be verified (another runner serves it), or None."""
    runner = served_runner(method)
    if runner == VERIFIED_RUNNER:
        return None
    return (
        f"the NVFP4 MoE layer ({kind}) is served by SGLang's MoE runner {runner!r}, which sm120_fp4 does not route "
        f"or verify (on SM12x only {VERIFIED_RUNNER} is routed through the verified seam); start SGLang with "
        f"{RUNNER_FLAG}, or set SM120_FP4_SELFTEST=warn to serve this layer UNVERIFIED"
    )


def make_seam(original: Callable, make_front: Callable[[Callable, type], Callable], simulated: bool) -> Callable:
    """Wrap ``_flashinfer_cutlass_fused_moe()`` to return (make_front(kernel, ActivationType), ActivationType)."""
    fronts: dict[int, tuple] = {}

    @functools.wraps(original)
    def _flashinfer_cutlass_fused_moe(*args, **kwargs):
        try:
            fn, activation_type = original(*args, **kwargs)
        except RuntimeError:
            if not simulated:
                raise
            # Simulation on a CPU: SGLang's own lookup insists on CUDA; FlashInfer imports anyway.
            fn, activation_type = flashinfer.fused_moe_kernel()
        cached = fronts.get(id(fn))
        if cached is None or cached[0] is not fn:
            cached = fronts[id(fn)] = (fn, make_front(fn, activation_type))
        return cached[1], activation_type

    return _flashinfer_cutlass_fused_moe


def _seam() -> tuple[Callable, type] | None:
    """Return the patched seam's (front, ActivationType), or None where there is none of ours."""
    module = sys.modules.get(MOE_RUNNER_FC)
    seam = getattr(module, "_flashinfer_cutlass_fused_moe", None)
    if seam is None or getattr(seam, "__sm120_fp4_patch__", None) is None:
        return None
    return seam()


def served_options(layer: object) -> dict:
    """Return the keywords SGLang's cutlass runner passes for `layer` beside its tensors (activation, SwiGLU clamps)."""
    options = _swiglu(layer)
    config = getattr(layer, "moe_runner_config", None)
    mapping = getattr(sys.modules.get(MOE_RUNNER_FC), "_activation_type", None)  # the runner's own (0.5.23)
    if config is not None and mapping is not None:
        try:
            options["activation_type"] = mapping(config)
        except Exception as exc:  # an activation SGLang's cutlass runner does not take (it asserts)
            options["activation_type"] = f"{getattr(config, 'activation', None)} ({type(exc).__name__})"
    return options


def _swiglu(layer: object) -> dict:
    swiglu = getattr(layer, "_cutlass_swiglu_params", None) or (None, None, None)  # all None: no clamp configured
    return dict(zip(("swiglu_alpha", "swiglu_beta", "swiglu_limit"), swiglu))


def call_problem(layer: object) -> str | None:
    """Return why the seam call that serves `layer` passes an argument the MoE oracle does not model, or None."""
    seam = _seam()
    return flashinfer.unmodeled_moe_problem(served_options(layer), seam[1]) if seam is not None else None


def processed_weights(layer: object) -> MoeLayer | None:
    """Return the tensors SGLang passes to the kernel, its activation and ranks (None: not the cutlass layout)."""
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if not (
        isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w13.dtype == torch.uint8 and w13.dim() == 3
    ):
        return None
    # ModelOpt keeps the swizzled scales in *_blockscale_swizzled; compressed-tensors under *_weight_scale.
    w13_sf = getattr(layer, "w13_blockscale_swizzled", None)
    w2_sf = getattr(layer, "w2_blockscale_swizzled", None)
    if w13_sf is None or w2_sf is None:
        w13_sf, w2_sf = getattr(layer, "w13_weight_scale", None), getattr(layer, "w2_weight_scale", None)
    experts, rows, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * 2
    inter = w2.shape[2] * 2
    activation = "swiglu" if rows == 2 * inter else "relu2" if rows == inter else None
    if activation is None or w13_sf is None or w2_sf is None:
        return None
    weights = nvfp4.MoeWeights(
        w13=w13,
        w13_sf=w13_sf.view(torch.float8_e4m3fn).reshape(experts, *nvfp4.swizzled_scale_shape(rows, hidden)),
        w13_alpha=layer.g1_alphas.float().reshape(experts),
        w2=w2,
        w2_sf=w2_sf.view(torch.float8_e4m3fn).reshape(experts, *nvfp4.swizzled_scale_shape(hidden, inter)),
        w2_alpha=layer.g2_alphas.float().reshape(experts),
        a1_gscale=flashinfer.global_scale(layer.w13_input_scale_quant.float()),
        a2_gscale=flashinfer.global_scale(layer.w2_input_scale_quant.float()),
    )
    return MoeLayer(weights, activation, _ranks(layer))


def _ranks(layer: object) -> tuple[int, int, int, int]:
    names = ("moe_ep_size", "moe_ep_rank", "moe_tp_size", "moe_tp_rank")
    return tuple(getattr(layer, name, default) for name, default in zip(names, (1, 0, 1, 0)))


def moe_check(kind: str, layer: object, serve: Callable | None = None) -> LayerCheck | None:
    """Return the LayerCheck of one NVFP4 MoE layer (None: not the cutlass layout); `serve` defaults to the seam
    (the cost benchmarks pass the backend's call, wrapped to meter its memory)."""
    call = serve or functools.partial(_served_convention, layer)
    rebuild = lambda owner: moe_check(kind, owner, serve)  # noqa: E731
    return policy.moe_check(
        sizes(), kind, layer, processed_weights, call, rebuild, served_ids=serve is None, drops=True
    )


def _served_convention(layer, x, ids, topk_weights, *rest):
    """Serve a backend-convention call (its weights) through the seam as SGLang's _run_flashinfer_cutlass does."""
    front, activation_type = _seam()
    w, activation, out = nvfp4.MoeWeights(*rest[:8]), rest[8], rest[-1]  # `ids` global, -1 for a dropped slot
    scales = [_scalar(w.a1_gscale), w.w13_sf.view(torch.int32), w.w13_alpha]
    scales += [_scalar(w.a2_gscale), w.w2_sf.view(torch.int32), w.w2_alpha]
    swiglu = _swiglu(layer)
    ranks = dict(zip(("ep_size", "ep_rank", "tp_size", "tp_rank"), _ranks(layer)))
    out_dtype = dict(output=torch.empty(x.shape, dtype=x.dtype, device=x.device), output_dtype=x.dtype)
    tokens = dict(input=x, token_selected_experts=ids.to(torch.int32), token_final_scales=topk_weights, input_sf=None)
    experts = dict(
        fc1_expert_weights=w.w13.view(torch.long), fc2_expert_weights=w.w2.view(torch.long), quant_scales=scales
    )
    act = getattr(activation_type, flashinfer.MOE_ACTIVATIONS[activation])
    fixed = dict(tune_max_num_tokens=8192, activation_type=act, enable_alltoall=False, use_fused_finalize=False)
    served = front(**out_dtype, **tokens, **experts, **swiglu, **ranks, **fixed)
    out.copy_(served[0])
    return out


def _scalar(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(()) if scale.numel() == 1 else scale


def refuse_unverifiable(kind: str, settings) -> None:
    """Refuse (strict), warn about (warn) or allow (off) an NVFP4 MoE layer on a release without the seam."""
    message = (
        f"sm120_fp4: an NVFP4 MoE layer ({kind}) is being loaded on SGLang {sglang_version()}, where sm120_fp4 "
        f"cannot route or verify the fused-MoE kernel (its seam exists in SGLang {SEAM_VERSIONS}); "
        "upgrade SGLang, or set SM120_FP4_SELFTEST=warn to serve these experts UNVERIFIED"
    )
    refuse(settings, message, "serving these experts UNVERIFIED")


def b12x_problem() -> str | None:
    """Return why FlashInfer's b12x MoE cannot serve this SGLang process's server arguments, or None."""
    from .hooks import server_setting

    if server_setting("enable_pdmux"):
        return "b12x MoE's persistent kernels wait at a grid barrier: not under SGLang's --enable-pdmux"
    if server_setting("enable_deterministic_inference"):
        return "b12x MoE sums the top-k slots with bf16 atomics (not bitwise reproducible): not under --enable-deterministic-inference"
    ep = server_setting("ep_size") or 1
    if isinstance(ep, int) and ep > 1:
        return f"b12x MoE has no NVFP4 expert parallelism (FlashInfer raises): not with --ep-size {ep}"
    return None
