"""The hooks vLLM's load path runs through: each NVFP4 linear layer verified with its own weights through vLLM's
own apply path, before vLLM serves or captures CUDA graphs.

At ``process_weights_after_loading`` (ModelOpt's ``ModelOptLinearMethod`` for NVFP4, compressed-tensors'
``CompressedTensorsW4A4Fp4``): first the device's backend is decided (a self-test) and the kernel vLLM selected
for the layer is checked (only ``FlashInferCutlassNvFp4LinearKernel`` calls the FlashInfer alias this library
routes, in the layout it verifies); then vLLM processes the weights; then the layer's configuration (N, K,
activation dtype, its own processed weights) is verified through ``method.apply`` at every batch-size bucket up
to vLLM's largest CUDA-graph batch and its prefill chunk, against the oracle.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from typing import Callable

import torch

from .. import graphs, nvfp4, verify
from ..errors import not_accepted
from ..serving import LayerCheck
from .release import NVFP4_BASE

__all__ = [
    "ROUTABLE_KERNELS",
    "LINEAR_FLAG",
    "make_weights_hook",
    "make_warmup_hook",
    "graph_sizes",
    "layer_device_index",
    "layer_name",
    "kernel_problem",
    "batch_sizes",
    "dense_check",
    "modelopt_check",
    "compressed_tensors_check",
]

_LOG = logging.getLogger("sm120_fp4")
HALF = (torch.bfloat16, torch.float16)
# vLLM's NVFP4 linear kernels whose GEMM calls the FlashInfer alias this library routes, in the layout (the
# 128x4 swizzled scales, K padded for cutlass) its backends are verified on. Every other kernel class (vLLM's own
# CUTLASS, Marlin, b12x, Humming, emulation, FlashInfer's CuTe DSL, TRT-LLM or cuDNN kernels) is refused.
ROUTABLE_KERNELS = frozenset({"FlashInferCutlassNvFp4LinearKernel"})
LINEAR_FLAG = "--linear-backend flashinfer_cutlass"
DEFAULT_MAX_BATCH = 512  # vLLM's default largest CUDA-graph capture size
DEFAULT_MAX_TOKENS = 8192  # vLLM's default max_num_batched_tokens (the prefill chunk) where no config is visible
LARGE_BATCH = 2049
LIGHT_BATCH = 8


def make_weights_hook(
    original: Callable,
    before: Callable[[object, object], object],
    scope: Callable,
    after: Callable[[object, object], None],
) -> Callable:
    """Wrap process_weights_after_loading: `before(method, layer)`, vLLM's processing inside `scope()`, then
    `after(method, layer)`."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer, *args, **kwargs):
        before(self, layer)
        with scope():
            result = original(self, layer, *args, **kwargs)
        after(self, layer)
        return result

    return process_weights_after_loading


def make_warmup_hook(original: Callable, after: Callable[[list[int]], object]) -> Callable:
    """Wrap vLLM's ``kernel_warmup(worker)`` (FlashInfer's autotuner picks its tactics there, right before CUDA-graph
    capture): once it returns, `after(sizes)` with the batch sizes of every graph the worker is about to capture
    (none with enforce_eager)."""

    @functools.wraps(original)
    def kernel_warmup(worker, *args, **kwargs):
        result = original(worker, *args, **kwargs)
        after(graph_sizes(worker))
        return result

    return kernel_warmup


def graph_sizes(worker: object) -> list[int]:
    """The batch sizes of the CUDA graphs `worker` captures after its warm-up ([] under enforce_eager)."""
    config = getattr(worker, "vllm_config", None)
    if getattr(getattr(config, "model_config", None), "enforce_eager", False):
        return []
    sizes = getattr(getattr(config, "compilation_config", None), "cudagraph_capture_sizes", None) or []
    return sorted({s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0})


def layer_device_index(layer: object) -> int:
    for param in layer.parameters():  # type: ignore[attr-defined]
        return param.get_device()
    return -1


def layer_name(layer: object) -> str:
    prefix = getattr(layer, "prefix", None)
    return prefix if isinstance(prefix, str) else ""


def nvfp4_kernel(method: object) -> object | None:
    """The NVFP4 linear kernel vLLM selected for `method` (None: not an NVFP4 layer, e.g. ModelOpt FP8)."""
    kernel = getattr(method, "kernel", None)
    base = getattr(sys.modules.get(NVFP4_BASE), "NvFp4LinearKernel", None)
    return kernel if base is not None and isinstance(kernel, base) else None


def kernel_problem(kind: str, method: object) -> str | None:
    """Why the kernel vLLM selected for this NVFP4 layer cannot be served verified (None: routed and verified,
    or not an NVFP4 layer)."""
    kernel = nvfp4_kernel(method)
    if kernel is None:
        return None
    name = type(kernel).__name__
    if name in ROUTABLE_KERNELS:
        return None
    if getattr(method, "use_a16", False) or "W4A16" in name:
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


def _vllm_sizes() -> tuple[int, int]:
    """(largest CUDA-graph batch, prefill chunk) from vLLM's current config; vLLM's defaults where none is visible."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except Exception:
        config = None
    compilation = getattr(config, "compilation_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    batch = getattr(compilation, "max_cudagraph_capture_size", None)
    tokens = getattr(scheduler, "max_num_batched_tokens", None)
    batch = batch if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0 else DEFAULT_MAX_BATCH
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else DEFAULT_MAX_TOKENS
    return batch, tokens


def batch_sizes(max_batch: int, largest: int) -> list[int]:
    """At least one M in every power-of-two bucket up to `max_batch` (the bucket's first value and an odd one
    inside it), `max_batch`, one M >= 2048, and the prefill sizes up to `largest` the same way."""
    ms = {1, 2, 3, max_batch, min(LARGE_BATCH, max(largest, max_batch))}
    power = 4
    while power <= max(max_batch, largest):
        top = max_batch if power <= max_batch else largest
        ms.update({power, min(power + power // 2 - 1, top)})
        power *= 2
    ms.add(max(largest, max_batch))
    return sorted(m for m in ms if m <= max(largest, max_batch))


def _quantize(x: torch.Tensor, gsf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nvfp4.quantize(x, gsf, check_finite=False)


def _served_cases(serve: Callable, watched: tuple, n_out: int, k: int, ms: list[int], dtype, seed: int) -> list:
    """The served calls at batch sizes `ms`: seeded activations in the layer's calibrated range, quantized by
    vLLM inside `serve`; the oracle quantizes the same rows (zero-padded to the weight's K, as vLLM pads them)
    and multiplies with the layer's own processed weights: ``reference_mm_fp4(a, b.t(), sa, sb.t(), alpha)``,
    the transposes vLLM's FlashInfer wrapper makes."""
    weight, weight_sf, alpha, input_gsf = watched
    device = weight.device
    rows = max(ms)
    gsf = float(input_gsf.float().reshape(-1)[0].cpu())
    if not (math.isfinite(gsf) and gsf > 0):
        raise not_accepted(
            "vLLM dense layer check",
            "input_global_scale_inv",
            input_gsf,
            "the layer's positive finite input global scale",
        )
    x = verify.seeded_activations(rows, k, nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / gsf, seed, device).to(dtype)
    k_weight = weight.shape[1] * 2
    padded = torch.nn.functional.pad(x, (0, k_weight - k)) if k_weight > k else x
    qx, sx = graphs.run(
        "quantize", _quantize, (padded, input_gsf.float().reshape(())), lambda q: (q[0].clone(), q[1].clone())
    )
    reference = nvfp4.reference_mm_fp4(
        qx, weight.t(), sx, weight_sf.view(torch.uint8).t(), alpha.float().reshape(1), torch.float32
    )[:, :n_out]
    return verify.served_cases(ms, n_out, k, serve, x, reference, watched)


def activation_dtypes(layer: object) -> tuple[torch.dtype, ...]:
    for dtype in (getattr(layer, "params_dtype", None), torch.get_default_dtype()):
        if dtype in HALF:
            return (dtype,)
    return HALF


def dense_check(
    kind: str, serve: Callable, layer: object, rebuild: Callable[[object], LayerCheck | None]
) -> LayerCheck | None:
    """The LayerCheck of one vLLM NVFP4 linear layer served by FlashInferCutlassNvFp4LinearKernel: its processed
    weights (``weight``, ``weight_scale``, ``alpha``, ``input_global_scale_inv``), its call path, its batch sizes."""
    weight, weight_sf = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    alpha, input_gsf = getattr(layer, "alpha", None), getattr(layer, "input_global_scale_inv", None)
    if (
        not all(isinstance(t, torch.Tensor) for t in (weight, weight_sf, alpha, input_gsf))
        or weight.dtype != torch.uint8
    ):
        _LOG.info("sm120_fp4: %s: weights not in the FlashInfer cutlass layout; not verified here", kind)
        return None
    n_out = int(getattr(layer, "output_size_per_partition", weight.shape[0]))
    k = int(getattr(layer, "input_size_per_partition", weight.shape[1] * 2))
    dtypes = activation_dtypes(layer)
    max_batch, tokens = _vllm_sizes()
    watched = (weight, weight_sf, alpha, input_gsf)
    label = (
        f"vLLM {kind} N={n_out} K={k} {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} "
        f"(weight scales {str(weight_sf.dtype).removeprefix('torch.')})"
    )
    key = ("vllm", kind, tuple(weight.shape), n_out, k, dtypes, weight_sf.dtype, input_gsf.dtype)

    def cases(ms: list[int]) -> list[verify.Case]:
        return [c for i, d in enumerate(dtypes) for c in _served_cases(serve, watched, n_out, k, ms, d, 1000 + i)]

    return LayerCheck(
        weight.get_device(),
        key,
        label,
        "dense",
        cases,
        batch_sizes(max_batch, tokens),
        sorted({1, 7, max_batch, LARGE_BATCH, tokens}),
        layer=layer_name(layer),
        light_ms=[LIGHT_BATCH],
        weights=lambda: (layer.weight, layer.weight_scale, layer.alpha, layer.input_global_scale_inv),
        rebuild=rebuild,
        owner=layer,
        tensors={"weight": weight, "weight_sf": weight_sf, "dtype": dtypes[0]},
    )


def modelopt_check(method: object, layer: object) -> LayerCheck | None:
    """ModelOptLinearMethod after process_weights_after_loading: NVFP4 W4A4 layers on the routed kernel only."""
    kernel = nvfp4_kernel(method)
    if kernel is None or type(kernel).__name__ not in ROUTABLE_KERNELS:
        return None
    return dense_check(
        "ModelOptLinearMethod (NVFP4)",
        functools.partial(method.apply, layer),
        layer,
        functools.partial(modelopt_check, method),
    )


def compressed_tensors_check(scheme: object, layer: object) -> LayerCheck | None:
    """CompressedTensorsW4A4Fp4 after process_weights_after_loading, on the routed kernel only."""
    kernel = nvfp4_kernel(scheme)
    if kernel is None or type(kernel).__name__ not in ROUTABLE_KERNELS:
        return None
    return dense_check(
        "CompressedTensorsW4A4Fp4",
        functools.partial(scheme.apply_weights, layer),
        layer,
        functools.partial(compressed_tensors_check, scheme),
    )
