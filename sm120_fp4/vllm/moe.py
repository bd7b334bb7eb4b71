"""vLLM's NVFP4 fused MoE: the FlashInfer kernel call routed (FlashInferExperts then take bf16 activations),
each layer verified through its own ``apply``; any other backend, and weight-only (W4A16) MoE, refused."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .. import backends, nvfp4
from ..serving import LayerCheck, policy
from ..serving.policy import MoeLayer
from .hooks import sizes

VERIFIED_BACKEND = "flashinfer_cutlass"  # NvFp4MoeBackend.FLASHINFER_CUTLASS: its experts call the routed alias
VERIFIED_EXPERTS_CLASS = "FlashInferExperts"
MOE_FLAG = f"--moe-backend {VERIFIED_BACKEND}"
# vLLM's MoEActivation values -> the convention's activation names (FlashInfer's Swiglu / Relu2).
ACTIVATIONS = {"silu": "swiglu", "relu2_no_mul": "relu2"}


def backend_problem(kind: str, method: object) -> str | None:
    """Why this NVFP4 MoE layer cannot be served verified (None: FlashInfer cutlass, W4A4)."""
    backend = getattr(method, "nvfp4_backend", None)
    name = str(getattr(backend, "value", backend)).lower()
    experts = getattr(getattr(method, "experts_cls", None), "__name__", "?")
    if getattr(method, "use_a16", False):
        return (
            f"vLLM serves the NVFP4 MoE layer ({kind}) weight-only (W4A16, backend {name!r}): no MoE kernel vLLM "
            "selects for W4A16 NVFP4 is routed or verified by sm120_fp4 on this GPU. Serve a W4A4 NVFP4 checkpoint, "
            "or set SM120_FP4_SELFTEST=warn to serve it unverified"
        )
    if getattr(method, "per_token_activation", False):
        return (
            f"the NVFP4 MoE layer ({kind}) quantizes activations per token (backend {name!r}), which sm120_fp4 "
            "does not route or verify; set SM120_FP4_SELFTEST=warn to serve it unverified"
        )
    if name == VERIFIED_BACKEND and experts == VERIFIED_EXPERTS_CLASS:
        return None
    return (
        f"vLLM selected the NVFP4 MoE backend {name!r} ({experts}) for {kind}: its kernel does not pass the "
        f"FlashInfer fused-MoE call this library routes and verifies on this GPU, so nothing would check its numbers. "
        f"Start vLLM with {MOE_FLAG} (FlashInferExperts: routed to the backend verified here), or set "
        "SM120_FP4_SELFTEST=warn to serve it unverified"
    )


def served_options(experts: object, layer: object) -> dict:
    """Return the keywords FlashInferExperts.apply passes for an NVFP4 layer beside its tensors (vLLM 0.32-0.34)."""
    options = {"swiglu_limit": getattr(experts, "gemm1_clamp_limit", None)}  # SiLU: a clamp limit where set
    if str(getattr(getattr(layer, "activation", None), "value", "")).startswith("swigluoai"):
        options.update(
            swiglu_alpha=getattr(experts, "gemm1_alpha", None), swiglu_beta=getattr(experts, "gemm1_beta", None)
        )
    return options


def layer_problem(kind: str, method: object, layer: object) -> str | None:
    """Why the layer check cannot cover this NVFP4 MoE layer on FlashInfer's experts (None: it can)."""
    warn = "set SM120_FP4_SELFTEST=warn to serve it unverified"
    found = processed_weights(method, layer)
    if found is None:
        activation = getattr(getattr(layer, "activation", None), "value", None)
        w13 = getattr(layer, "w13_weight", None)
        shape = f"{tuple(w13.shape)} {w13.dtype}" if isinstance(w13, torch.Tensor) else type(w13).__name__
        return (
            f"its processed weights are not in the layout the layer check reads (FlashInferExperts with packed uint8 "
            f"w13 and activation {' or '.join(ACTIVATIONS)}; found activation {activation!r}, w13 {shape}), so nothing "
            f"would check its numbers; {warn}"
        )
    count = found.weights.w13.shape[0]
    total = getattr(layer, "global_num_experts", count)
    if getattr(layer, "expert_map", None) is not None or total != count:
        return (
            f"expert parallelism (this rank holds {count} of global_num_experts={total} experts, an expert map "
            f"{'set' if getattr(layer, 'expert_map', None) is not None else 'unset'}) is not covered by the layer "
            f"check sm120_fp4 runs in vLLM; serve without --enable-expert-parallel, or {warn}"
        )
    problem = backends.flashinfer.unmodeled_moe_problem(served_options(method.moe_kernel.fused_experts, layer))
    return f"{problem}; {warn}" if problem is not None else None


class _Property(property):
    """A property that can carry the patcher's marker attribute."""


def make_defer(original: property, served: Callable[[int], bool]) -> property:
    """``FlashInferExperts.expects_unquantized_inputs``: True for NVFP4 W4A4 experts on a served device."""

    def expects_unquantized_inputs(self) -> bool:
        config = getattr(self, "quant_config", None)
        scale = getattr(self, "w1_scale", None) if getattr(config, "use_nvfp4_w4a4", False) else None
        if isinstance(scale, torch.Tensor) and served(scale.get_device()):  # the experts' device (-1: CPU, simulated)
            return True
        return original.fget(self)

    replacement = _Property(expects_unquantized_inputs, doc=original.__doc__)
    replacement.__wrapped__ = original
    return replacement


def make_shapes(original: Callable) -> Callable:
    """``FlashInferExperts.workspace_shapes``: with unquantized NVFP4 activations the output is (M, K)."""

    @functools.wraps(original)
    def workspace_shapes(self, M, N, K, *args, **kwargs):
        shapes = original(self, M, N, K, *args, **kwargs)
        if getattr(self, "quant_dtype", None) == "nvfp4" and self.expects_unquantized_inputs:
            return (*shapes[:2], (M, K))
        return shapes

    return workspace_shapes


def make_alias(original: Callable, make_front: Callable[[Callable, type], Callable]) -> Callable:
    """vLLM's ``flashinfer_cutlass_fused_moe(**kwargs)`` over the library's MoE front."""
    fronts: list[Callable] = []

    @functools.wraps(original)
    def flashinfer_cutlass_fused_moe(*args, **kwargs):
        if args:  # vLLM calls it by keyword only; anything else is not the call the front knows
            return original(*args, **kwargs)
        if not fronts:
            fronts.append(make_front(original, backends.flashinfer.fused_moe_kernel()[1]))
        return fronts[0](**kwargs)

    flashinfer_cutlass_fused_moe.__qualname__ = "sm120_fp4.vllm.flashinfer_cutlass_fused_moe"
    return flashinfer_cutlass_fused_moe


def processed_weights(method: object, layer: object) -> MoeLayer | None:
    """The tensors vLLM's FlashInfer experts hand the kernel and the activation (None: another layout)."""
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if experts is None or type(experts).__name__ != VERIFIED_EXPERTS_CLASS:
        return None
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    activation = ACTIVATIONS.get(str(getattr(getattr(layer, "activation", None), "value", "")))
    tensors = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    if not tensors or w13.dtype != torch.uint8 or activation is None:
        return None
    count, rows, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * 2
    inter = w2.shape[2] * 2
    if rows != (2 * inter if activation == "swiglu" else inter):
        return None
    e4m3, shape = torch.float8_e4m3fn, nvfp4.swizzled_scale_shape
    w13_sf = experts.w1_scale.view(e4m3).reshape(count, *shape(rows, hidden))
    w2_sf = experts.w2_scale.view(e4m3).reshape(count, *shape(hidden, inter))
    alpha1, alpha2 = (a.float().reshape(count) for a in (experts.g1_alphas, experts.g2_alphas))
    a1, a2 = (backends.flashinfer.global_scale(g.float()) for g in (experts.a1_gscale, experts.a2_gscale))
    return MoeLayer(nvfp4.MoeWeights(w13, w13_sf, alpha1, w2, w2_sf, alpha2, a1, a2), activation)


def moe_check(kind: str, method: object, layer: object) -> LayerCheck | None:
    """The LayerCheck of one NVFP4 MoE layer on FlashInfer's experts, through ``method.apply``."""
    if layer_problem(kind, method, layer) is not None:
        return None  # refused, or served unverified and shown in status() (the wiring asked layer_problem first)

    def serve(x, ids, topk_weights, *rest):
        return rest[-1].copy_(method.apply(layer, x, topk_weights, ids, None, None))

    read, rebuild = functools.partial(processed_weights, method), functools.partial(moe_check, kind, method)
    return policy.moe_check(sizes(), f"vLLM {kind}", layer, read, serve, rebuild)
