"""The hooks SGLang's load path runs through: each NVFP4 layer's tensors and served call handed to the verification
policy (serving.policy) before SGLang serves or captures CUDA graphs, again after capture; SGLang's batch sizes.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Callable

from ..errors import say_once
from ..serving import LayerCheck
from ..serving.policy import Sizes, dense_layer_check
from .release import ARG_OVERRIDES, RUNTIME_CONTEXT, SERVER_ARGS

_LOG = logging.getLogger("sm120_fp4")
DEFAULT_MAX_BATCH = 512
DEFAULT_CHUNKED_PREFILL = 8192  # SGLang 0.5.23's chunk on 90-160 GB GPUs, where no settings are visible
DEFAULT_MAX_PREFILL = 16384  # SGLang's max_prefill_tokens default


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
    # up to 0.5.13: graph_runner (num_tokens_per_bs), piecewise_cuda_graph_runner; 0.5.14+: decode_ and
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


def sizes() -> Sizes:
    """Return the batch sizes SGLang can pass a layer in this process, from its server settings."""
    return Sizes(max_capture_batch(), *prefill_sizes())


# Each dense format's apply and the tensors it serves with after processing: weight, block scales, alpha, input scale.
DENSE = {
    "ModelOptFp4LinearMethod": ("apply", "weight", "weight_scale_interleaved", "alpha", "input_scale_inv"),
    "CompressedTensorsW4A4Fp4": ("apply_weights", "weight_packed", "weight_scale", "alpha", "input_global_scale"),
}


def _format_check(kind: str, again: Callable, method: object, layer: object) -> LayerCheck | None:
    apply, *names = DENSE[kind]
    # ModelOpt may pad the weight's rows; compressed-tensors serves them all (None: the weight's).
    n_out = getattr(layer, "output_size_per_partition", None) if kind == "ModelOptFp4LinearMethod" else None
    return dense_layer_check(sizes(), kind, method, apply, layer, tuple(names), n_out, again)


def modelopt_check(method: object, layer: object) -> LayerCheck | None:
    """Return the LayerCheck of a ModelOptFp4LinearMethod layer (w4a4, the cutlass layout), or None."""
    if getattr(method, "quant_mode", "w4a4") != "w4a4" or not hasattr(layer, "weight_scale_interleaved"):
        return None
    return _format_check("ModelOptFp4LinearMethod", modelopt_check, method, layer)


def compressed_tensors_check(scheme: object, layer: object) -> LayerCheck | None:
    """Return the LayerCheck of a CompressedTensorsW4A4Fp4 layer."""
    return _format_check("CompressedTensorsW4A4Fp4", compressed_tensors_check, scheme, layer)
