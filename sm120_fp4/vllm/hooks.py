"""The weights hooks: each NVFP4 linear layer verified through vLLM's own apply before vLLM serves."""

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


def make_weights_hook(original: Callable, before: Callable, scope: Callable, after: Callable) -> Callable:
    """Wrap process_weights_after_loading: `before(method, layer)`, vLLM's processing inside `scope()`, then `after`."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer, *args, **kwargs):
        before(self, layer)
        with scope():
            result = original(self, layer, *args, **kwargs)
        after(self, layer)
        return result

    return process_weights_after_loading


def make_warmup_hook(original: Callable, after: Callable[[list[int]], object]) -> Callable:
    """Wrap vLLM's ``kernel_warmup(worker)``: once it returns, `after(sizes)` with its graphs' batch sizes."""

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
    return sorted({s for s in sizes if _positive(s)})


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def layer_device_index(layer: object) -> int:
    return next((p.get_device() for p in layer.parameters()), -1)  # type: ignore[attr-defined]


def layer_name(layer: object) -> str:
    prefix = getattr(layer, "prefix", None)  # linear layers; MoE layers (RoutedExperts) name theirs layer_name
    prefix = prefix if isinstance(prefix, str) else getattr(layer, "layer_name", None)
    return prefix if isinstance(prefix, str) else ""


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


def _vllm_sizes() -> tuple[int, int]:
    """(largest CUDA-graph batch, prefill chunk) from vLLM's current config; vLLM's defaults where none is visible."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except Exception:
        config = None
    batch = getattr(getattr(config, "compilation_config", None), "max_cudagraph_capture_size", None)
    tokens = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
    return (batch if _positive(batch) else DEFAULT_MAX_BATCH, tokens if _positive(tokens) else DEFAULT_MAX_TOKENS)


def batch_sizes(max_batch: int, largest: int) -> list[int]:
    """At least one M in every power-of-two bucket up to `max_batch`, one M >= 2048, and the prefill sizes."""
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
    """The served calls at batch sizes `ms` against the oracle on the layer's own processed weights."""
    weight, weight_sf, alpha, input_gsf = watched
    gsf = float(input_gsf.float().reshape(-1)[0].cpu())
    if not (math.isfinite(gsf) and gsf > 0):
        what = "the layer's positive finite input global scale"
        raise not_accepted("vLLM dense layer check", "input_global_scale_inv", input_gsf, what)
    # One row more than the largest M: each M's twin is the next M rows, views (no rolled copy of the reference).
    x = verify.seeded_activations(max(ms) + 1, k, nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / gsf, seed, weight.device, dtype)
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


def dense_check(kind: str, serve: Callable, layer: object, rebuild: Callable) -> LayerCheck | None:
    """The LayerCheck of one vLLM NVFP4 linear layer served by FlashInferCutlassNvFp4LinearKernel."""
    weight, weight_sf = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    alpha, input_gsf = getattr(layer, "alpha", None), getattr(layer, "input_global_scale_inv", None)
    watched = (weight, weight_sf, alpha, input_gsf)
    if not all(isinstance(t, torch.Tensor) for t in watched) or weight.dtype != torch.uint8:
        _LOG.info("sm120_fp4: %s: weights not in the FlashInfer cutlass layout; not verified here", kind)
        return None
    n_out = int(getattr(layer, "output_size_per_partition", weight.shape[0]))
    k = int(getattr(layer, "input_size_per_partition", weight.shape[1] * 2))
    dtypes = activation_dtypes(layer)
    label = f"vLLM {kind} N={n_out} K={k} {dtype_names(dtypes)} (weight scales {dtype_names([weight_sf.dtype])})"
    key = ("vllm", kind, tuple(weight.shape), n_out, k, dtypes, weight_sf.dtype, input_gsf.dtype)

    def cases(ms: list[int]) -> list[verify.Case]:
        return [c for i, d in enumerate(dtypes) for c in _served_cases(serve, watched, n_out, k, ms, d, 1000 + i)]

    def current() -> tuple:
        return layer.weight, layer.weight_scale, layer.alpha, layer.input_global_scale_inv

    tensors = {"weight": weight, "weight_sf": weight_sf, "dtype": dtypes[0]}
    check = (weight.get_device(), key, label, "dense", cases)
    return layer_check(layer, check, (LARGE_BATCH,), weights=current, rebuild=rebuild, tensors=tensors)


def layer_check(layer: object, check: tuple, extra: tuple = (), **fields) -> LayerCheck:
    """LayerCheck(*check, **fields), each batch-size bucket in full, vLLM's graph and prefill sizes again."""
    max_batch, tokens = _vllm_sizes()
    recheck = sorted({1, 7, max_batch, tokens, *extra})
    ms = batch_sizes(max_batch, tokens)
    return LayerCheck(*check, ms, recheck, layer_name(layer), [LIGHT_BATCH], owner=layer, **fields)


def dtype_names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def _routed_check(kind: str, apply: str, method: object, layer: object) -> LayerCheck | None:
    """`method` after process_weights_after_loading: NVFP4 W4A4 layers on the routed kernel only, through `apply`."""
    kernel = nvfp4_kernel(method)
    if kernel is None or type(kernel).__name__ not in ROUTABLE_KERNELS:
        return None
    rebuild = functools.partial(_routed_check, kind, apply, method)
    return dense_check(kind, functools.partial(getattr(method, apply), layer), layer, rebuild)


modelopt_check = functools.partial(_routed_check, "ModelOptLinearMethod (NVFP4)", "apply")
compressed_tensors_check = functools.partial(_routed_check, "CompressedTensorsW4A4Fp4", "apply_weights")
