"""The hooks SGLang's load path runs through: verify each NVFP4 layer configuration with the call
that will serve it, before SGLang serves or captures CUDA graphs, and once more after capture.

At ``process_weights_after_loading`` (ModelOpt NVFP4 linear, compressed-tensors W4A4 NVFP4): first
the device's backend is decided (a self-test; the runner enum is pinned), then SGLang processes the
weights, then this layer's configuration (its N, K, activation dtype and scale dtypes, its own
processed weights) is verified through SGLang's own ``apply`` at every batch-size bucket up to the
largest CUDA-graph batch, against the oracle. Every later layer of a configuration gets a light
check with its own weights and a fingerprint of them. After every CUDA-graph capture (the draft
model's included) every layer's fingerprint is compared and every verified configuration re-run
eagerly at its re-check sizes (decode, 2049, the prefill chunk) and at every captured graph size.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
from typing import Callable

import torch

from .. import backends, checkpoints, graphs, nvfp4, verify
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
    for param in layer.parameters():  # type: ignore[attr-defined]
        return param.get_device()
    return -1


def make_weights_hook(
    original: Callable,
    before: Callable[[object, object], object],
    scope: Callable,
    after: Callable[[object, object], None],
) -> Callable:
    """Wrap process_weights_after_loading: `before(method, layer)` (decide for the layer's device),
    SGLang's processing inside `scope()`, then `after(method, layer)` (verify the layer)."""

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
    """Wrap a call that captures CUDA graphs (ModelRunner.init_cuda_graphs; the scheduler's
    init_all_cuda_graphs / init_model_worker, which capture the draft model's graphs too): once
    warm-up and capture are done, re-check eagerly, `after(captured)` with the token counts of every
    graph just captured (graph_token_counts). Nested hooks (the model runners inside the scheduler's
    call) add their counts to the outermost one, which re-checks once, after every capture."""

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


def make_update_hook(
    original: Callable, begin: Callable[[], object] | None, end: Callable[[], object] | None
) -> Callable:
    """Wrap one of SGLang's weight-update calls: `begin()` before it (caches dropped), `end()` after
    it, whatever it did (the changed layers verified again). A begin-only or an end-only hook wraps
    the two halves of a weight-update session (begin_weight_update / end_weight_update)."""

    @functools.wraps(original)
    def update_weights(self, *args, **kwargs):
        if begin is not None:
            begin()
        try:
            return original(self, *args, **kwargs)
        finally:
            if end is not None:
                end()

    return update_weights


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _int_list(value: object) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) and all(map(_positive_int, value)) else []


def _runner_counts(runner: object) -> set[int]:
    """The token counts of one CUDA-graph runner: each captured batch size times the tokens per
    request (captured_req_width 0.5.16+, num_tokens_per_bs before), and capture_num_tokens."""
    tokens: set[int] = set()
    widths = [getattr(runner, name, None) for name in ("captured_req_width", "num_tokens_per_bs")]
    width = next((w for w in widths if _positive_int(w)), 1)
    tokens.update(b * width for b in _int_list(getattr(runner, "capture_bs", None)))
    tokens.update(_int_list(getattr(runner, "capture_num_tokens", None)))
    return tokens


_RUNNERS = (
    "decode_cuda_graph_runner",
    "graph_runner",
    "prefill_cuda_graph_runner",
    "piecewise_cuda_graph_runner",
    "cuda_graph_runner",
    "cuda_graph_runner_for_draft_extend",
)
_HOLDERS = (
    "tp_worker",
    "model_runner",
    "draft_worker",
    "_draft_worker",
    "draft_runner",
    "draft_model_runner",
    "target_worker",
)


def graph_token_counts(owner: object, depth: int = 3) -> list[int]:
    """The M of every CUDA graph captured under `owner` (a model runner, a speculative worker, the
    scheduler): every graph runner it holds (decode, prefill/piecewise, a draft model's decode and
    draft-extend runners), and those of the workers and model runners it holds, `depth` levels
    down. Every step that replays a graph runs the GEMMs at one of these. [] where none was captured.

    SGLang 0.5.3-0.5.13 keep the decode runner in `graph_runner` (`num_tokens_per_bs`) and the
    prefill one in `piecewise_cuda_graph_runner`; 0.5.14+ in `decode_cuda_graph_runner` and
    `prefill_cuda_graph_runner`, 0.5.16+ with `captured_req_width`; token lists in
    `capture_num_tokens`; speculative draft workers in `cuda_graph_runner` and
    `cuda_graph_runner_for_draft_extend`."""
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
    """SGLang's ServerArgs of this process, where it publishes them: 0.5.19+ through the runtime
    context, earlier through server_args.get_global_server_args() (retired, raising, in 0.5.23).
    Where none is published, one warning per process says why and what is verified instead."""
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
    """One of SGLang's server settings as it is in effect here: 0.5.23 resolves defaults after
    parsing (arg_groups.overrides.resolution_result: e.g. chunked_prefill_size from the GPU's
    memory); earlier releases write them into the ServerArgs. None where nothing is visible."""
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
    """The largest decode batch SGLang will capture in a CUDA graph, from its settings where this
    process can see them (0.5.23: the resolved cuda_graph_config's decode max_bs; earlier
    cuda_graph_max_bs); DEFAULT_MAX_BATCH otherwise."""
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
    """(SGLang's chunked-prefill size, the largest M a prefill batch reaches) as this process's
    settings have them. A prefill batch never exceeds the chunk (0.5.23's PrefillAdder budgets
    rem_chunk_tokens, mixed decode tokens included); with chunked prefill off (-1) it is bounded by
    max_prefill_tokens. Where no settings are visible: DEFAULT_CHUNKED_PREFILL, the size SGLang
    picks on the 90-160 GB GPUs (RTX PRO 6000, GB10); a 32 GB RTX 5090 gets 4096 from SGLang."""
    chunk = server_setting("chunked_prefill_size")
    largest_batch = server_setting("max_prefill_tokens")
    if _positive_int(chunk):
        return chunk, chunk
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk < 0:  # chunked prefill disabled
        largest = largest_batch if _positive_int(largest_batch) else DEFAULT_MAX_PREFILL
        return largest, largest
    return DEFAULT_CHUNKED_PREFILL, DEFAULT_CHUNKED_PREFILL


def batch_sizes(max_batch: int, largest_prefill: int | None = None) -> list[int]:
    """At least one M in every power-of-two bucket up to `max_batch` (the bucket's first value and
    an odd one inside it), `max_batch` itself, one M >= 2048, and then the prefill sizes up to
    `largest_prefill` (default: prefill_sizes()) the same way -- every bucket's first value and an
    odd one inside it -- and the largest prefill itself (a long prompt's every chunk but the last)."""
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
    """The batch sizes every verified configuration runs again after warm-up (besides the captured
    graphs' token counts): decode 1 and 7, the largest graph batch, 2049, and the prefill sizes."""
    chunk, largest = prefill_sizes()
    return sorted({1, 7, max_batch, LARGE_BATCH, chunk, largest})


def activation_dtypes(layer: object) -> tuple[torch.dtype, ...]:
    """The activation dtype SGLang will pass: the layer's params_dtype, else the default dtype SGLang
    loads the model under; both half types when neither says."""
    for dtype in (getattr(layer, "params_dtype", None), torch.get_default_dtype()):
        if dtype in HALF:
            return (dtype,)
    return HALF


def layer_name(layer: object) -> str:
    """The layer's name in the model (SGLang's `prefix`), else its layer id, else ""."""
    prefix = getattr(layer, "prefix", None)
    if isinstance(prefix, str) and prefix:
        return prefix
    layer_id = getattr(layer, "layer_id", None)
    return f"layer {layer_id}" if isinstance(layer_id, int) else ""


# The checkpoint's scales each hooked NVFP4 method has loaded into its layer when its
# process_weights_after_loading starts: (block scales, weight global scales, activation global scales).
CHECKPOINT_SCALES = {
    "ModelOptFp4LinearMethod": (("weight_scale",), ("weight_scale_2",), ("input_scale",)),
    "CompressedTensorsW4A4Fp4": (("weight_scale",), ("weight_global_scale",), ("input_global_scale",)),
    "ModelOptNvFp4FusedMoEMethod": (
        ("w13_weight_scale", "w2_weight_scale"),
        ("w13_weight_scale_2", "w2_weight_scale_2"),
        ("w13_input_scale", "w2_input_scale"),
    ),
    "CompressedTensorsW4A4Nvfp4MoE": (
        ("w13_weight_scale", "w2_weight_scale"),
        ("w13_weight_global_scale", "w2_weight_global_scale"),
        ("w13_input_global_scale", "w2_input_global_scale"),
    ),
}


def _first(mask: torch.Tensor) -> str:
    """The index of the first True of `mask`, as ``[i, j]`` (empty for a 0-dim tensor)."""
    flat = int(mask.reshape(-1).nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape)] if mask.dim() else []
    return f"[{', '.join(map(str, index))}]" if index else ""


W4A16_KNOB = "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"


def quant_mode_problem(kind: str, method: object) -> str | None:
    """Why a dense NVFP4 layer's quant mode cannot be served verified (None: W4A4, routed and verified).

    0.5.19+: ModelOptFp4LinearMethod takes quant_mode 'w4a16' when SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16 is
    set and the runner is flashinfer_cutedsl; its fp4_gemm op then calls FlashInfer's mm_bf16_fp4 directly
    (bf16 activations, FP4 weights), past the FP4 GEMM alias: no backend of this library serves that call."""
    mode = getattr(method, "quant_mode", "w4a4")
    if mode == "w4a4":
        return None
    return (
        f"SGLang serves {kind} with quant_mode={mode!r} ({W4A16_KNOB} with --fp4-gemm-backend flashinfer_cutedsl): "
        "its FP4 GEMM calls FlashInfer's mm_bf16_fp4 directly, which sm120_fp4 neither routes nor verifies on this "
        f"GPU. Unset {W4A16_KNOB} (the layer then runs W4A4 through the FP4 GEMM verified here), or set "
        "SM120_FP4_SELFTEST=warn to serve it unverified"
    )


def checkpoint_scale_problem(kind: str, method: object, layer: object) -> str | None:
    """Why the checkpoint scales `layer` loaded cannot serve (before SGLang processes them): a global or
    activation scale that is NaN, infinite, zero or negative, or a NaN E4M3 block scale (byte 0x7f/0xff);
    None when they are fine. These are the checkpoint's faults, whatever kernel would run."""
    block, weight_global, activation = CHECKPOINT_SCALES[kind]
    if getattr(method, "quant_mode", "w4a4") != "w4a4":
        activation = ()  # weight-only: no activation scale is loaded or read
    for name in (*weight_global, *activation):
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        values = tensor.detach().float()
        bad = ~(torch.isfinite(values) & (values > 0))
        if bool(bad.any()):
            at = _first(bad)
            value = float(values.reshape(-1)[int(bad.reshape(-1).nonzero()[0])])
            return checkpoints.scale_problem(f"the checkpoint's {name}{at}", value)
    for name in block:
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.float8_e4m3fn, torch.uint8):
            continue
        nan = (tensor.detach().view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            return (
                f"the checkpoint's {name}{_first(nan)} is a NaN block scale (E4M3 byte 0x7f/0xff); accepted: "
                "block scales that are not NaN (the checkpoint is corrupt, not a kernel)"
            )
    return None


# Where each dense format keeps its per-shard global scales before processing, and whether they are
# decode scales (ModelOpt: amax / (448 * 6), dequantized = code x block scale x it) or encode scales
# (compressed-tensors: the inverse).
SHARD_SCALES = {
    "ModelOptFp4LinearMethod": ("weight_scale_2", "input_scale", False),
    "CompressedTensorsW4A4Fp4": ("weight_global_scale", "input_global_scale", True),
}
_QKV = ("q", "k", "v")


def shard_scales_problem(
    kind: str, shards: list[str], weight_scales: list[float], input_scales: list[float]
) -> str | None:
    """Why a fused layer of format `kind` would serve wrong numbers from its shards' own
    global scales (as the checkpoint has them, before SGLang processes them), or None.

    SGLang (0.5.3-0.5.23) serves a fused layer (q/k/v, gate/up, any merged column layer) with ONE
    weight global scale, the largest over its shards (``weight_scale_2.max()`` /
    ``weight_global_scale.max()``): a shard quantized with another scale comes out scaled by the
    ratio, and the layer check cannot see it (its oracle reads the same processed alpha). A shard's
    scale that is zero, negative or not finite is hidden by the same max. The activation scales are
    reduced the same way, but every shard multiplies the same activation, quantized once with the
    reduced scale that the alpha also carries: different activation scales only change the
    activation's quantization, never the result's scale; one that is not a positive finite number
    is still a broken checkpoint, and named."""
    weight_name, input_name, encode = SHARD_SCALES[kind]
    for name, values in ((weight_name, weight_scales), (input_name, input_scales)):
        for shard, value in zip(shards, values):
            if not (math.isfinite(value) and value > 0):
                return (
                    f"the checkpoint's {name} of {shard} is {value!r}, not a usable global scale "
                    f"(accepted: a positive finite number); SGLang serves the fused layer with the largest of its "
                    f"shards' {name} ({', '.join(f'{s} {v:.6g}' for s, v in zip(shards, values))}), which hides it: "
                    "fix or requantize the checkpoint"
                )
    served = max(weight_scales)
    wrong = [(s, v) for s, v in zip(shards, weight_scales) if abs(v - served) > 1e-6 * served]
    if not wrong:
        return None
    # The served scale over the shard's own: decode scales multiply, encode scales divide.
    factors = ", ".join(f"{s} by {(v / served if encode else served / v):.4g}" for s, v in wrong)
    return (
        f"its shards' {weight_name} differ in the checkpoint "
        f"({', '.join(f'{s} {v:.6g}' for s, v in zip(shards, weight_scales))}): SGLang serves the fused layer with "
        f"one global scale, the largest, which scales the rows of {factors} (wrong numbers for every token); "
        f"requantize the checkpoint with one {weight_name} for the shards fused into this layer"
    )


def shard_names(layer: object, count: int) -> list[str]:
    """How a fused layer's shards are named: q, k, v (SGLang's QKVParallelLinear), else their index."""
    if count == 3 and type(layer).__name__ == "QKVParallelLinear":
        return list(_QKV)
    return [f"shard {i}" for i in range(count)] if count > 1 else ["(the only shard)"]


def layer_scales_problem(kind: str, method: object, layer: object) -> str | None:
    """shard_scales_problem of a dense NVFP4 layer as SGLang loaded it, read before it processes
    the weights (afterwards only the reduced scale is left). None for what is not served W4A4."""
    if kind not in SHARD_SCALES or getattr(method, "quant_mode", "w4a4") != "w4a4":
        return None
    weight_name, input_name, _ = SHARD_SCALES[kind]
    weights, inputs = getattr(layer, weight_name, None), getattr(layer, input_name, None)
    if not isinstance(weights, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        return None
    weights, inputs = (
        weights.detach().float().reshape(-1).cpu().tolist(),
        inputs.detach().float().reshape(-1).cpu().tolist(),
    )
    names = shard_names(layer, len(weights))
    return shard_scales_problem(kind, names, weights, inputs)


def _quantize(x: torch.Tensor, gsf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nvfp4.quantize(x, gsf, check_finite=False)


def _served_cases(
    serve: Callable,
    weight,
    weight_sf,
    alpha,
    input_gsf,
    n_out: int,
    k: int,
    ms: list[int],
    dtype: torch.dtype,
    seed: int,
    watched: tuple,
) -> list[verify.Case]:
    """The served calls at batch sizes `ms`: seeded activations in the layer's calibrated range, of
    every kind verify.structured_activations makes (the first M rows of one batch, so the oracle
    runs once), quantized by SGLang inside `serve`; the oracle quantizes the same rows with nvfp4
    and multiplies with the layer's own weights."""
    device = weight.device
    rows = max(ms)
    gsf = float(input_gsf.float().reshape(-1)[0].cpu())
    if not (math.isfinite(gsf) and gsf > 0):
        raise not_accepted(
            "dense layer check", "input_gsf", input_gsf, "the layer's positive finite input global scale"
        )
    x = verify.seeded_activations(rows, k, nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / gsf, seed, device).to(dtype)
    # Finite by construction, its scale read above; at a decode batch size from a CUDA graph (launch-bound).
    qx, sx = graphs.run(
        "quantize", _quantize, (x, input_gsf.float().reshape(())), lambda q: (q[0].clone(), q[1].clone())
    )
    k_weight = weight.shape[1] * 2
    if k_weight > k:  # SGLang pads K for the kernel's alignment: zero codes add nothing
        qx = torch.nn.functional.pad(qx, (0, (k_weight - k) // 2))
    # The checkpoint's bytes: where a backend converted the served storage in place (humming), its kept copy.
    ref_weight, ref_sf = backends.original(weight), backends.original(weight_sf)
    reference = nvfp4.reference_mm_fp4(qx, ref_weight.T, sx, ref_sf.T, alpha.float().reshape(1), torch.float32)[
        :, :n_out
    ]
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
    """The LayerCheck of one dense NVFP4 layer: its own weights, its call path, its batch sizes.
    `weights()` reads the tensors the layer serves with from the layer (default: the ones given);
    `rebuild(layer)` makes the check again from the layer's current state (re-checks, weight updates)."""
    if weight.numel() == 0 or weight.dtype != torch.uint8 or weight_sf.dim() != 2:
        _LOG.info(
            "sm120_fp4: %s N=%d K=%d: weights not in the cutlass layout (a fused path); not verified here",
            kind,
            n_out,
            k,
        )
        return None
    dtypes = activation_dtypes(layer)
    max_batch = max_capture_batch()
    watched = (weight, weight_sf, alpha, input_gsf)
    label = f"{kind} N={n_out} K={k} {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} (weight scales {str(weight_sf.dtype).removeprefix('torch.')})"
    key = (kind, tuple(weight.shape), n_out, k, dtypes, weight_sf.dtype, input_gsf.dtype)

    def cases(ms: list[int]) -> list[verify.Case]:
        return [
            case
            for i, dtype in enumerate(dtypes)
            for case in _served_cases(
                serve, weight, weight_sf, alpha, input_gsf, n_out, k, ms, dtype, 1000 + i, watched
            )
        ]

    return LayerCheck(
        weight.get_device(),
        key,
        label,
        "dense",
        cases,
        batch_sizes(max_batch),
        recheck_sizes(max_batch),
        layer=layer_name(layer),
        light_ms=[LIGHT_BATCH],
        weights=weights or (lambda: watched),
        rebuild=rebuild,
        owner=layer,
        tensors={"weight": weight, "weight_sf": weight_sf, "dtype": dtypes[0]},
    )


def modelopt_check(method: object, layer: object) -> LayerCheck | None:
    """ModelOptFp4LinearMethod after process_weights_after_loading (w4a4, the cutlass layout)."""
    if getattr(method, "quant_mode", "w4a4") != "w4a4" or not hasattr(layer, "weight_scale_interleaved"):
        return None
    n_out = getattr(layer, "output_size_per_partition", layer.weight.shape[0])
    k = getattr(layer, "input_size_per_partition", layer.weight.shape[1] * 2)
    return dense_check(
        "ModelOptFp4LinearMethod",
        functools.partial(method.apply, layer),
        layer,
        layer.weight,
        layer.weight_scale_interleaved,
        layer.alpha,
        layer.input_scale_inv,
        n_out,
        k,
        weights=lambda: (layer.weight, layer.weight_scale_interleaved, layer.alpha, layer.input_scale_inv),
        rebuild=functools.partial(modelopt_check, method),
    )


def compressed_tensors_check(scheme: object, layer: object) -> LayerCheck | None:
    """CompressedTensorsW4A4Fp4 after process_weights_after_loading."""
    n_out = layer.weight_packed.shape[0]
    k = getattr(layer, "input_size_per_partition", layer.weight_packed.shape[1] * 2)
    return dense_check(
        "CompressedTensorsW4A4Fp4",
        functools.partial(scheme.apply_weights, layer),
        layer,
        layer.weight_packed,
        layer.weight_scale,
        layer.alpha,
        layer.input_global_scale,
        n_out,
        k,
        weights=lambda: (layer.weight_packed, layer.weight_scale, layer.alpha, layer.input_global_scale),
        rebuild=functools.partial(compressed_tensors_check, scheme),
    )
