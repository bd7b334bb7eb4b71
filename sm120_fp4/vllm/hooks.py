"""The weights hooks: each NVFP4 linear layer's tensors and vLLM's own apply handed to the verification policy
(serving.policy) before vLLM serves; vLLM's batch sizes."""

from __future__ import annotations

import functools
import logging
import sys

from ..errors import say_once
from ..serving import LayerCheck
from ..serving.policy import Sizes, dense_layer_check
from .release import NVFP4_BASE

_LOG = logging.getLogger("sm120_fp4")
# vLLM's NVFP4 linear kernels whose GEMM calls the FlashInfer alias this library routes, in the layout (the
# 128x4 swizzled scales, K padded for cutlass) its backends are verified on. Every other kernel class (vLLM's own
# CUTLASS, Marlin, b12x, Humming, emulation, FlashInfer's CuTe DSL, TRT-LLM or cuDNN kernels) is refused.
ROUTABLE_KERNELS = frozenset({"FlashInferCutlassNvFp4LinearKernel"})
LINEAR_FLAG = "--linear-backend flashinfer_cutlass"
DEFAULT_MAX_BATCH = 512  # vLLM's default largest CUDA-graph capture size
DEFAULT_MAX_TOKENS = 8192  # vLLM's default max_num_batched_tokens (the prefill chunk) where no config is visible


def graph_sizes(worker: object) -> list[int]:
    """The batch sizes of the CUDA graphs `worker` captures after its warm-up ([] under enforce_eager)."""
    config = getattr(worker, "vllm_config", None)
    if getattr(getattr(config, "model_config", None), "enforce_eager", False):
        return []
    sizes = getattr(getattr(config, "compilation_config", None), "cudagraph_capture_sizes", None) or []
    return sorted({s for s in sizes if _positive(s)})


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def nvfp4_kernel(method: object) -> object | None:
    """The NVFP4 linear kernel vLLM selected for `method` (None: not an NVFP4 layer, e.g. ModelOpt FP8)."""
    kernel = getattr(method, "kernel", None)
    base = getattr(sys.modules.get(NVFP4_BASE), "NvFp4LinearKernel", None)
    return kernel if base is not None and isinstance(kernel, base) else None


def kernel_problem(kind: str, method: object) -> str | None:
    """Why the kernel vLLM selected for this NVFP4 layer cannot be served verified (None: it can)."""
    kernel = nvfp4_kernel(method)
    if kernel is None:
        return None
    name = type(kernel).__name__
    if name in ROUTABLE_KERNELS:
        return None
    spec = getattr(method, "spec", None)  # ModelOptLinearMethod's QuantSpec: no activation key for W4A16_NVFP4
    weight_only = spec is not None and hasattr(spec, "activation") and spec.activation is None
    if getattr(method, "use_a16", False) or weight_only or "W4A16" in name:
        return (
            f"vLLM serves {kind} weight-only (W4A16) with {name}: no kernel vLLM selects for W4A16 NVFP4 is routed "
            "or verified by sm120_fp4 on this GPU. Serve a W4A4 NVFP4 checkpoint (its layers run through the FP4 "
            "GEMM verified here), or set SM120_FP4_SELFTEST=warn to serve it unverified"
        )
    return (
        f"vLLM selected {name} for {kind}: that kernel's GEMM does not pass the FlashInfer FP4 GEMM this library "
        f"routes and verifies on this GPU, so nothing would check its numbers. Start vLLM with {LINEAR_FLAG} "
        "(FlashInferCutlassNvFp4LinearKernel: routed to the backend verified here), or set SM120_FP4_SELFTEST=warn "
        "to serve it unverified"
    )


def sizes() -> Sizes:
    """Return the batch sizes vLLM can pass a layer, from its current config (its defaults, said once, where none)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        problem = None if config is not None else "no current vLLM config"
    except Exception as exc:  # an older vLLM, or none importable here
        config, problem = None, f"{type(exc).__name__}: {exc}"
    compilation = getattr(config, "compilation_config", None)
    found = {
        "max_cudagraph_capture_size": getattr(compilation, "max_cudagraph_capture_size", None),
        "max_num_batched_tokens": getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None),
    }
    defaults = {"max_cudagraph_capture_size": DEFAULT_MAX_BATCH, "max_num_batched_tokens": DEFAULT_MAX_TOKENS}
    assumed = {name: default for name, default in defaults.items() if not _positive(found[name])}
    if assumed:
        say_once(
            logging.WARNING,
            "sm120_fp4: vLLM's batch sizes are not set in this process (%s): layers are verified assuming vLLM's "
            "defaults %s; load them where vLLM's config is current (set_current_vllm_config, as vLLM's workers do), "
            "with the --max-cudagraph-capture-size and --max-num-batched-tokens vLLM will serve with",
            problem or ", ".join(f"{name}={found[name]!r}" for name in assumed),
            ", ".join(f"{name}={value}" for name, value in assumed.items()),
        )
    # The CUDA graphs' sizes are left to the re-check after kernel_warmup, which runs every one captured.
    batch, tokens = ({**found, **assumed}[name] for name in defaults)
    return Sizes(batch, tokens, tokens)


def _routed_check(kind: str, apply: str, method: object, layer: object) -> LayerCheck | None:
    """`method` after process_weights_after_loading: NVFP4 W4A4 layers on the routed kernel only, through `apply`."""
    kernel = nvfp4_kernel(method)
    if kernel is None or type(kernel).__name__ not in ROUTABLE_KERNELS:
        return None
    names = ("weight", "weight_scale", "alpha", "input_global_scale_inv")
    again, n_out = functools.partial(_routed_check, kind, apply), getattr(layer, "output_size_per_partition", None)
    return dense_layer_check(sizes(), f"vLLM {kind}", method, apply, layer, names, n_out, again)


modelopt_check = functools.partial(_routed_check, "ModelOptLinearMethod (NVFP4)", "apply")
compressed_tensors_check = functools.partial(_routed_check, "CompressedTensorsW4A4Fp4", "apply_weights")
