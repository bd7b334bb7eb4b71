"""The hooks SGLang's load path runs through: decide, then verify each NVFP4 layer configuration with the call
that will serve it, at every batch-size bucket, before SGLang serves or captures CUDA graphs, and again after capture.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
from typing import Callable

import torch

from .. import backends, graphs, nvfp4, verify
from ..errors import not_accepted, say_once
from ..serving import LayerCheck
from .release import ARG_OVERRIDES, RUNTIME_CONTEXT, SERVER_ARGS

_LOG = logging.getLogger("sm120_fp4")
HALF = (torch.bfloat16, torch.float16)
DEFAULT_MAX_BATCH = 512
LARGE_BATCH = 2049  # one prefill-sized M >= 2048, not a power of two
DEFAULT_CHUNKED_PREFILL = 8192  # SGLang 0.5.23's chunk on 90-160 GB GPUs, where no settings are visible
DEFAULT_MAX_PREFILL = 16384  # SGLang's max_prefill_tokens default
LIGHT_BATCH = 8  # every layer of an already verified configuration: one decode batch of its own weights


def layer_device_index(layer: object) -> int:
    """Return the CUDA ordinal of the layer's first parameter (-1: CPU, or none)."""
    for param in layer.parameters():  # type: ignore[attr-defined]
        return param.get_device()
    return -1


def make_weights_hook(original: Callable, before: Callable, scope: Callable, after: Callable) -> Callable:
    """Wrap process_weights_after_loading: `before`, SGLang's processing inside `scope()`, then `after`."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer, *args, **kwargs):
        before(self, layer)
        with scope():
            result = original(self, layer, *args, **kwargs)
        after(self, layer)
        return result

    return process_weights_after_loading


_graphs = threading.local()  # the token counts collected by the outermost capture hook running on this thread


def make_warmup_hook(original: Callable, after: Callable[[list[int]], object]) -> Callable:
    """Wrap a call that captures CUDA graphs: afterwards call `after` with every captured graph's token count."""

    # Nested hooks (model runners inside the scheduler's call) add to the outermost, which re-checks once.

    @functools.wraps(original)
    def init_cuda_graphs(self, *args, **kwargs):
        outer = getattr(_graphs, "counts", None) is None
        if outer:
            _graphs.counts = set()
        try:
            result = original(self, *args, **kwargs)
            _graphs.counts.update(graph_token_counts(self))
            counts = sorted(_graphs.counts)
        finally:
            if outer:
                _graphs.counts = None
        if outer:
            after(counts)
        return result

    return init_cuda_graphs


def make_call_hook(original: Callable, before=None, after=None, end: Callable | None = None) -> Callable:
    """Wrap a call: `before(*args)` first, `after(*args)` once it has returned (not when it raised), `end()` always."""

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        if before is not None:
            before(*args)
        try:
            result = original(*args, **kwargs)
        finally:
            if end is not None:
                end()
        if after is not None:
            after(*args)
        return result

    return hooked


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _int_list(value: object) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) and all(map(_positive_int, value)) else []


def _runner_counts(runner: object) -> set[int]:
    """Return one graph runner's token counts: captured batch sizes times tokens per request, capture_num_tokens."""
    tokens: set[int] = set()
    widths = [getattr(runner, name, None) for name in ("captured_req_width", "num_tokens_per_bs")]
    width = next((w for w in widths if _positive_int(w)), 1)
    tokens.update(b * width for b in _int_list(getattr(runner, "capture_bs", None)))
    tokens.update(_int_list(getattr(runner, "capture_num_tokens", None)))
    return tokens


_RUNNERS = "decode_cuda_graph_runner graph_runner prefill_cuda_graph_runner piecewise_cuda_graph_runner".split()
_RUNNERS += ["cuda_graph_runner", "cuda_graph_runner_for_draft_extend"]
_HOLDERS = "tp_worker model_runner draft_worker _draft_worker draft_runner draft_model_runner target_worker".split()


def graph_token_counts(owner: object, depth: int = 3) -> list[int]:
    """Return the M of every CUDA graph captured under `owner`, its workers and model runners (`depth` levels)."""
    # 0.5.3-0.5.13: graph_runner (num_tokens_per_bs), piecewise_cuda_graph_runner; 0.5.14+: decode_ and
    # prefill_cuda_graph_runner (captured_req_width 0.5.16+); draft workers: cuda_graph_runner(_for_draft_extend).
    tokens: set[int] = set()
    seen: set[int] = set()

    def walk(obj: object, left: int) -> None:
        if obj is None or id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        for name in _RUNNERS:
            runner = getattr(obj, name, None)
            if runner is not None:
                tokens.update(_runner_counts(runner))
        for name in _HOLDERS:
            walk(getattr(obj, name, None), left - 1)

    walk(owner, depth)
    return sorted(tokens)


def _server_args() -> object | None:
    """Return this process's ServerArgs (runtime context 0.5.19+, else the global one), or warn once and None."""
    problem = None
    for module_name, getter in ((RUNTIME_CONTEXT, "get_server_args"), (SERVER_ARGS, "get_global_server_args")):
        module = sys.modules.get(module_name)
        try:
            args = getattr(module, getter)() if module is not None and hasattr(module, getter) else None
        except Exception as exc:  # nothing published in this process (a bare layer, a test), or retired
            args, problem = None, problem or f"{type(exc).__name__}: {exc}"
        if args is not None:
            return args
    say_once(
        logging.WARNING,
        "sm120_fp4: SGLang's server args are not readable in this process (%s): layers are "
        "verified at batch sizes up to %d, the default largest CUDA-graph batch, and prefill sizes up to %d, "
        "SGLang's default chunk on 90-160 GB GPUs (the re-check after warm-up still runs every captured size)",
        problem or "none published",
        DEFAULT_MAX_BATCH,
        DEFAULT_CHUNKED_PREFILL,
    )
    return None


def server_setting(name: str) -> object:
    """Return SGLang's server setting `name` as in effect here (0.5.23 resolves defaults after parsing), or None."""
    args = _server_args()
    if args is None:
        return None
    overrides = sys.modules.get(ARG_OVERRIDES)
    resolve = getattr(overrides, "resolution_result", None)
    if resolve is not None:
        try:
            return resolve(args, name)
        except Exception:  # a field this release does not have
            pass
    return getattr(args, name, None)


def max_capture_batch() -> int:
    """Return the largest decode batch SGLang will capture in a CUDA graph (DEFAULT_MAX_BATCH if not visible)."""
    config = server_setting("cuda_graph_config")
    decode = getattr(config, "decode", None)
    for value in (
        getattr(decode, "max_bs", None),
        server_setting("cuda_graph_max_bs_decode"),
        server_setting("cuda_graph_max_bs"),
    ):
        if _positive_int(value):
            return value
    for value in (getattr(decode, "bs", None), server_setting("cuda_graph_bs_decode"), server_setting("cuda_graph_bs")):
        if _int_list(value):
            return max(value)
    return DEFAULT_MAX_BATCH


def prefill_sizes() -> tuple[int, int]:
    """Return (SGLang's chunked-prefill size, the largest M a prefill batch reaches) from its settings."""
    # A prefill batch never exceeds the chunk; with chunking off (-1), max_prefill_tokens bounds it.
    chunk = server_setting("chunked_prefill_size")
    largest_batch = server_setting("max_prefill_tokens")
    if _positive_int(chunk):
        return chunk, chunk
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk < 0:  # chunked prefill disabled
        largest = largest_batch if _positive_int(largest_batch) else DEFAULT_MAX_PREFILL
        return largest, largest
    return DEFAULT_CHUNKED_PREFILL, DEFAULT_CHUNKED_PREFILL


def batch_sizes(max_batch: int, largest_prefill: int | None = None) -> list[int]:
    """Return the first and an odd M of every power-of-two bucket up to `max_batch`, then up to the largest prefill."""
    largest = prefill_sizes()[1] if largest_prefill is None else largest_prefill
    ms = {1, 2, 3, max_batch, min(LARGE_BATCH, max(largest, max_batch))}
    power = 4
    while power <= max_batch:
        ms.update({power, min(power + power // 2 - 1, max_batch)})
        power *= 2
    power = 2048
    while power < largest:
        if power > 2048:  # 2049 stands for the 2048 bucket
            ms.add(power)
        ms.add(min(power + power // 2 - 1, largest))
        power *= 2
    ms.add(max(largest, max_batch))
    return sorted(ms)


def recheck_sizes(max_batch: int) -> list[int]:
    """Return the batch sizes every verified configuration runs again after warm-up, besides the graphs'."""
    chunk, largest = prefill_sizes()
    return sorted({1, 7, max_batch, LARGE_BATCH, chunk, largest})


def activation_dtypes(layer: object) -> tuple[torch.dtype, ...]:
    """Return the activation dtype SGLang will pass (params_dtype, else the default dtype; both halves if neither)."""
    for dtype in (getattr(layer, "params_dtype", None), torch.get_default_dtype()):
        if dtype in HALF:
            return (dtype,)
    return HALF


def layer_name(layer: object) -> str:
    """Return the layer's name in the model (SGLang's `prefix`), else its layer id, else ""."""
    prefix = getattr(layer, "prefix", None)
    if isinstance(prefix, str) and prefix:
        return prefix
    layer_id = getattr(layer, "layer_id", None)
    return f"layer {layer_id}" if isinstance(layer_id, int) else ""


def _quantize(x: torch.Tensor, gsf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nvfp4.quantize(x, gsf, check_finite=False)


def _served_cases(
    serve: Callable, watched: tuple, n_out: int, k: int, ms: list[int], dtype: torch.dtype, seed: int
) -> list[verify.Case]:
    """Return the served calls at batch sizes `ms` on seeded activations, each with its oracle result."""
    weight, weight_sf, alpha, input_gsf = watched
    gsf = float(input_gsf.float().reshape(-1)[0].cpu())
    if not (math.isfinite(gsf) and gsf > 0):
        raise not_accepted(
            "dense layer check", "input_gsf", input_gsf, "the layer's positive finite input global scale"
        )
    # One row more than the largest M: each M's twin is the next M rows, views (no rolled copy of the reference).
    x = verify.seeded_activations(max(ms) + 1, k, nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / gsf, seed, weight.device, dtype)
    # Finite by construction, its scale read above; at a decode batch size from a CUDA graph (launch-bound).
    qx, sx = graphs.run(
        "quantize", _quantize, (x, input_gsf.float().reshape(())), lambda q: (q[0].clone(), q[1].clone())
    )
    k_weight = weight.shape[1] * 2
    if k_weight > k:  # SGLang pads K for the kernel's alignment: zero codes add nothing
        qx = torch.nn.functional.pad(qx, (0, (k_weight - k) // 2))
    # The checkpoint's bytes: where a backend converted the served storage in place (humming), its kept copy.
    ref_weight, ref_sf = backends.original(weight), backends.original(weight_sf)
    reference = nvfp4.reference_mm_fp4(qx, ref_weight.T, sx, ref_sf.T, alpha.float().reshape(1), torch.float32)
    reference = reference[:, :n_out]
    return verify.served_cases(ms, n_out, k, serve, x, reference, watched)


def dense_check(
    kind: str,
    serve: Callable,
    layer: object,
    weight,
    weight_sf,
    alpha,
    input_gsf,
    n_out: int,
    k: int,
    weights: Callable[[], tuple] | None = None,
    rebuild: Callable[[object], LayerCheck | None] | None = None,
) -> LayerCheck | None:
    """Return the LayerCheck of one dense NVFP4 layer: its own weights, its call path, its batch sizes."""
    if weight.numel() == 0 or weight.dtype != torch.uint8 or weight_sf.dim() != 2:
        _LOG.info(
            "sm120_fp4: %s N=%d K=%d: weights not in the cutlass layout (a fused path); not verified here",
            kind,
            n_out,
            k,
        )
        return None
    dtypes = activation_dtypes(layer)
    watched = (weight, weight_sf, alpha, input_gsf)
    dtype_names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
    label = f"{kind} N={n_out} K={k} {dtype_names} (weight scales {str(weight_sf.dtype).removeprefix('torch.')})"
    key = (kind, tuple(weight.shape), n_out, k, dtypes, weight_sf.dtype, input_gsf.dtype)

    def cases(ms: list[int]) -> list[verify.Case]:
        return [c for i, d in enumerate(dtypes) for c in _served_cases(serve, watched, n_out, k, ms, d, 1000 + i)]

    tensors = {"weight": weight, "weight_sf": weight_sf, "dtype": dtypes[0]}
    return layer_check(
        layer, weight.get_device(), key, label, "dense", cases, weights or (lambda: watched), rebuild, tensors
    )


def layer_check(layer, index: int, key: tuple, label: str, family: str, cases, weights, rebuild, tensors) -> LayerCheck:
    """Return the LayerCheck of `layer`: every batch-size bucket, the re-check's sizes, one light decode batch."""
    max_batch = max_capture_batch()
    ms, name = (batch_sizes(max_batch), recheck_sizes(max_batch)), layer_name(layer)
    kwargs = dict(layer=name, light_ms=[LIGHT_BATCH], weights=weights, rebuild=rebuild, owner=layer, tensors=tensors)
    return LayerCheck(index, key, label, family, cases, *ms, **kwargs)


# Each dense format's apply and the tensors it serves with after processing: weight, block scales, alpha, input scale.
DENSE = {
    "ModelOptFp4LinearMethod": ("apply", "weight", "weight_scale_interleaved", "alpha", "input_scale_inv"),
    "CompressedTensorsW4A4Fp4": ("apply_weights", "weight_packed", "weight_scale", "alpha", "input_global_scale"),
}


def _format_check(kind: str, again: Callable, method: object, layer: object) -> LayerCheck | None:
    apply, *names = DENSE[kind]
    weight = getattr(layer, names[0])
    # ModelOpt may pad the weight's rows; compressed-tensors serves them all.
    padded = kind == "ModelOptFp4LinearMethod"
    n_out = getattr(layer, "output_size_per_partition", weight.shape[0]) if padded else weight.shape[0]
    k = getattr(layer, "input_size_per_partition", weight.shape[1] * 2)
    serve, tensors = functools.partial(getattr(method, apply), layer), [getattr(layer, name) for name in names]

    def current() -> tuple:
        return tuple(getattr(layer, name) for name in names)

    return dense_check(
        kind, serve, layer, *tensors, n_out, k, weights=current, rebuild=functools.partial(again, method)
    )


def modelopt_check(method: object, layer: object) -> LayerCheck | None:
    """Return the LayerCheck of a ModelOptFp4LinearMethod layer (w4a4, the cutlass layout), or None."""
    if getattr(method, "quant_mode", "w4a4") != "w4a4" or not hasattr(layer, "weight_scale_interleaved"):
        return None
    return _format_check("ModelOptFp4LinearMethod", modelopt_check, method, layer)


def compressed_tensors_check(scheme: object, layer: object) -> LayerCheck | None:
    """Return the LayerCheck of a CompressedTensorsW4A4Fp4 layer."""
    return _format_check("CompressedTensorsW4A4Fp4", compressed_tensors_check, scheme, layer)
