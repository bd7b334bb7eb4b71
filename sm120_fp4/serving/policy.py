"""The verification policy, the same for every engine: which batch sizes (M) are checked at load, after warm-up
and by the canary, the dense and MoE layer checks, and the weights hook.

An engine home supplies its layers' tensors, the call that serves them and its `Sizes`; what is checked, and
against which weights (always the checkpoint's bytes), is decided here once.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, NamedTuple

import torch

from .. import backends, graphs, nvfp4, verify
from ..deciding import refuse
from ..errors import not_accepted
from .records import LayerCheck, record_unverified, routes

_LOG = logging.getLogger("sm120_fp4")
HALF = (torch.bfloat16, torch.float16)
LIGHT_BATCH = 8  # every other layer of a verified configuration: one decode batch of its own weights
RECHECK_DECODE = (1, 7)  # after warm-up: one token, and an odd decode batch
VERIFIED_EXPERTS = 8  # a few of a MoE layer's experts: the oracle keeps only the ones it routes to dequantized
# What a MoE layer check's repeat probes take together (verify.ProbeBudget), of its 2 s target per GPU: a fast
# kernel (Humming on an H100: ~0.4 ms a decode call) makes about 60 calls in a row per batch, a slow one fewer.
LAYER_PROBE_S = 0.25


class Sizes(NamedTuple):
    """The batch sizes (M) an engine can pass one layer, read by its home from the engine's own config."""

    max_batch: int  # the largest decode batch it captures in a CUDA graph
    prefill_chunk: int  # the chunk every long prompt is served in
    largest_prefill: int  # the largest M of one prefill batch
    # CUDA graphs' token counts known before capture (both engines leave them to the re-check after warm-up, which
    # runs every graph captured: timing dozens of graph sizes at load would multiply SELECT=fastest's cost)
    graph_sizes: tuple[int, ...] = ()

    def largest(self) -> int:
        """Return the largest M the engine can pass."""
        return max(self.largest_prefill, self.max_batch)


def _buckets(top: int) -> list[tuple[int, int]]:
    """Return (the first M, an odd M) of each power-of-two bucket [p, 2p) from 1 up to `top` (the odd one <= top)."""
    # FlashInfer's autotuner picks one tactic per power-of-two bucket of M: each bucket is served by its own kernel.
    buckets, low, top_odd = [], 1, top if top % 2 else top - 1
    while low <= top:
        odd = min(low + low // 2 - 1 if low >= 4 else low | 1, top_odd)
        buckets.append((low, odd if odd >= low else low))
        low *= 2
    return buckets


def load_ms(sizes: Sizes) -> list[int]:
    """Return the M of a configuration's full sweep at load: two in every bucket, and the engine's boundaries."""
    top = sizes.largest()
    ms = {m for bucket in _buckets(top) for m in bucket} | {sizes.max_batch, sizes.prefill_chunk, top}
    return sorted(m for m in ms if 0 < m <= top)


def recheck_ms(sizes: Sizes, captured=()) -> list[int]:
    """Return the M every verified configuration runs again after warm-up: the tuned tactics of every bucket."""
    # An odd M of each bucket (its tactic as tuned), the boundaries, and every CUDA graph's token count.
    top = sizes.largest()
    ms = {odd for _, odd in _buckets(top)} | {*RECHECK_DECODE, sizes.max_batch, sizes.prefill_chunk, top}
    return sorted({m for m in ms if 0 < m <= top} | set(sizes.graph_sizes) | set(captured))


def canary_ms(check: LayerCheck, captured=()) -> list[int]:
    """Return the M the serving canary draws a configuration's runs from: the load's, the re-check's, the graphs'."""
    return sorted(set(check.ms) | set(check.recheck_ms) | set(captured))


def layer_check(sizes: Sizes, layer, index: int, key: tuple, label: str, family: str, cases, **fields) -> LayerCheck:
    """Return the LayerCheck of `layer`: the M of `sizes` as this policy checks them, one light decode batch."""
    ms = load_ms(sizes), recheck_ms(sizes)
    return LayerCheck(index, key, label, family, cases, *ms, layer_name(layer), [LIGHT_BATCH], owner=layer, **fields)


def layer_device_index(layer: object) -> int:
    """Return the CUDA ordinal of the layer's first parameter (-1: CPU, or none)."""
    return next((p.get_device() for p in layer.parameters()), -1)  # type: ignore[attr-defined]


def layer_name(layer: object) -> str:
    """Return the layer's name in the model (the engine's `prefix`; vLLM's MoE layers: `layer_name`), else its layer
    id, else ""."""
    for name in ("prefix", "layer_name"):
        prefix = getattr(layer, name, None)
        if isinstance(prefix, str) and prefix:
            return prefix
    layer_id = getattr(layer, "layer_id", None)
    return f"layer {layer_id}" if isinstance(layer_id, int) else ""


def activation_dtypes(layer: object) -> tuple[torch.dtype, ...]:
    """Return the activation dtype the engine will pass (params_dtype, else the default dtype; both halves if neither)."""
    for dtype in (getattr(layer, "params_dtype", None), torch.get_default_dtype()):
        if dtype in HALF:
            return (dtype,)
    return HALF


def dtype_names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def make_weights_hook(original: Callable, before: Callable, scope: Callable, after: Callable) -> Callable:
    """Wrap process_weights_after_loading: `before(method, layer)`, the engine's processing inside `scope()`, `after`."""

    @functools.wraps(original)
    def process_weights_after_loading(self, layer, *args, **kwargs):
        before(self, layer)
        with scope():
            result = original(self, layer, *args, **kwargs)
        after(self, layer)
        return result

    return process_weights_after_loading


def _served_cases(serve, watched: tuple, n_out: int, k: int, ms: list[int], dtype, seed: int, scale_name: str):
    """Return the served calls at batch sizes `ms` on seeded activations, each with its oracle result."""
    weight, weight_sf, alpha, input_gsf = watched
    gsf = float(input_gsf.float().reshape(-1)[0].cpu())
    if not (math.isfinite(gsf) and gsf > 0):
        what = "the layer's positive finite input global scale"
        raise not_accepted("dense layer check", scale_name, input_gsf, what)
    # One row more than the largest M: each M's twin is the next M rows, views (no rolled copy of the reference).
    x = verify.seeded_activations(max(ms) + 1, k, nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / gsf, seed, weight.device, dtype)
    k_weight = weight.shape[1] * 2
    padded = torch.nn.functional.pad(x, (0, k_weight - k)) if k_weight > k else x  # zero codes add nothing
    # Finite by construction, its scale read above; at a decode batch size from a CUDA graph (launch-bound).
    quantize = functools.partial(nvfp4.quantize, check_finite=False)
    qx, sx = graphs.run(
        "quantize", quantize, (padded, input_gsf.float().reshape(())), lambda q: (q[0].clone(), q[1].clone())
    )
    # The checkpoint's bytes, never a converted layout: where a backend converted the served storage in place
    # (humming), its kept copy. The scales as E4M3 bytes, whichever dtype the engine keeps them in.
    ref_weight, ref_sf = backends.original(weight), backends.original(weight_sf).view(torch.uint8)
    reference = nvfp4.reference_mm_fp4(qx, ref_weight.T, sx, ref_sf.T, alpha.float().reshape(1), torch.float32)
    return verify.served_cases(ms, n_out, k, serve, x, reference[:, :n_out], watched)


def dense_check(
    sizes: Sizes,
    kind: str,
    serve: Callable,
    layer: object,
    watched: tuple,
    n_out: int | None,
    k: int | None,
    weights: Callable[[], tuple] | None = None,
    rebuild: Callable[[object], LayerCheck | None] | None = None,
    scale_name: str = "input_gsf",
) -> LayerCheck | None:
    """Return the LayerCheck of one dense NVFP4 layer: its own (weight, block scales, alpha, input scale) `watched`,
    served through `serve(x)`, at the M of `sizes`; None where its weights are not in the cutlass layout.
    `n_out` and `k`: the layer's own where the engine pads them (None: the weight's)."""
    weight, weight_sf, alpha, input_gsf = watched
    tensors = all(isinstance(t, torch.Tensor) for t in watched)
    if not tensors or weight.numel() == 0 or weight.dtype != torch.uint8 or weight_sf.dim() != 2:
        _LOG.info("sm120_fp4: %s: weights not in the cutlass layout (a fused path); not verified here", kind)
        return None
    n_out, k = int(weight.shape[0] if n_out is None else n_out), int(weight.shape[1] * 2 if k is None else k)
    dtypes = activation_dtypes(layer)
    label = f"{kind} N={n_out} K={k} {dtype_names(dtypes)} (weight scales {dtype_names([weight_sf.dtype])})"
    key = (kind, tuple(weight.shape), n_out, k, dtypes, weight_sf.dtype, input_gsf.dtype)

    def cases(ms: list[int]) -> list[verify.Case]:
        seeded = [(d, 1000 + i) for i, d in enumerate(dtypes)]
        return [c for d, s in seeded for c in _served_cases(serve, watched, n_out, k, ms, d, s, scale_name)]

    fields = dict(weights=weights or (lambda: watched), rebuild=rebuild)
    tensors = {"weight": weight, "weight_sf": weight_sf, "dtype": dtypes[0]}
    return layer_check(sizes, layer, weight.get_device(), key, label, "dense", cases, tensors=tensors, **fields)


def dense_layer_check(
    sizes: Sizes, kind: str, method: object, apply: str, layer: object, names: tuple, n_out: int | None, again: Callable
) -> LayerCheck | None:
    """Return the dense_check of `layer` served through ``method.<apply>(layer, x)``, its (weight, block scales,
    alpha, input scale) its attributes `names` (read again for each fingerprint), K its input_size_per_partition,
    `n_out` its own where the engine pads its rows; rebuilt by ``again(method, layer)``."""

    def current() -> tuple:
        return tuple(getattr(layer, name) for name in names)

    serve, k = functools.partial(getattr(method, apply), layer), getattr(layer, "input_size_per_partition", None)
    options = dict(weights=current, rebuild=functools.partial(again, method), scale_name=names[3])
    return dense_check(sizes, kind, serve, layer, current(), n_out, k, **options)


def expert_subset(experts: int, at_least: int) -> list[int]:
    """Return max(VERIFIED_EXPERTS, `at_least`) of a layer's `experts` spread from first to last (or all)."""
    count = min(experts, max(VERIFIED_EXPERTS, at_least))
    if count >= experts:
        return list(range(experts))
    step = (experts - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})


class MoeLayer(NamedTuple):
    """One NVFP4 MoE layer's experts as its engine passes them to the kernel, read by the engine's home."""

    weights: nvfp4.MoeWeights  # this rank's experts
    activation: str  # "swiglu" or "relu2"
    ranks: tuple[int, int, int, int] = (1, 0, 1, 0)  # ep_size, ep_rank, tp_size, tp_rank


def moe_check(
    sizes: Sizes,
    kind: str,
    layer: object,
    read: Callable[[object], MoeLayer | None],
    serve: Callable,
    rebuild: Callable[[object], LayerCheck | None],
    *,
    served_ids: bool = True,
    drops: bool = False,
) -> LayerCheck | None:
    """Return the LayerCheck of one NVFP4 MoE layer: the experts `read(layer)` finds (None: not this layout), served
    through `serve` (the backend convention; it gets the plans' global ids where `served_ids`, else this rank's, -1
    for every other slot), at the M of `sizes`. `drops`: the engine's calls carry -1 slots (SGLang: other ranks'
    experts, padded graph rows); its full sweep adds a padded batch and the expert-0 poison probe (vLLM refuses expert
    parallelism: its check routes to real experts only). Every full sweep has the repeat probes."""
    moe = read(layer)
    if moe is None:
        _LOG.info("sm120_fp4: %s: MoE weights not in the cutlass layout (another runner); not verified here", kind)
        return None
    w = moe.weights
    experts, hidden, inter = w.w13.shape[0], w.w13.shape[2] * 2, w.w2.shape[2] * 2
    ep_size, ep_rank, tp_size, tp_rank = moe.ranks
    first, total = ep_rank * experts, experts * ep_size
    top_k = int(getattr(layer, "top_k", 2) or 2)
    if top_k > total:
        _LOG.warning(
            "sm120_fp4: %s: top_k=%d is more than its %d experts; verified with top_k=%d", kind, top_k, total, total
        )
        top_k = total
    subset = expert_subset(experts, top_k)  # this rank's experts every batch routes among (kept dequantized)
    # Their global ids, plus a few other ranks' experts (which must add nothing); balanced batches: every expert.
    foreign = [
        e for e in (0, first - 1, first + experts, total - 1) if not first <= e < first + experts and 0 <= e < total
    ]
    pool, everyone = torch.tensor(sorted({first + e for e in subset} | set(foreign))), torch.arange(total)
    dtypes = activation_dtypes(layer)
    ep = f" EP rank {ep_rank}/{ep_size}" if ep_size > 1 else ""
    tp = f" TP rank {tp_rank}/{tp_size}" if tp_size > 1 else ""
    label = f"{kind} E={experts} H={hidden} I={inter} top_k={top_k} {moe.activation} {dtype_names(dtypes)}{ep}{tp}"
    key = ("moe", kind, tuple(w.w13.shape), tuple(w.w2.shape), top_k, dtypes, w.a1_gscale.numel(), ep_size, tp_size)
    index = layer_device_index(layer)

    def cases(ms: list[int]) -> list[verify.Case]:
        full = len(ms) > 1  # the full sweep (a light check is one decode batch)
        plans = _moe_plans(ms, w, dtypes, top_k, pool, everyone, drops)
        # The oracle on the checkpoint's bytes, in the mode (W4A4 or W4A16) of the backend that serves the device.
        mode = backends.mode_of("moe", routes("moe").get(index, backends.EMULATED))
        cache = verify.ExpertCache(subset)  # every-expert batches dequantize the others per call
        oracle = dict(cache=cache, mode=mode, reference_weights=w.map(backends.original))
        # An intermittent loss is the kernel's, whatever the engine: every full sweep and re-check probes it, a light
        # check does not. The expert-0 probe's calls carry -1 slots: only where the engine's do.
        probes = dict(repeat_tokens=verify.REPEAT_MAX_TOKENS if full else 0, poison_expert0=drops and full)
        ours = dict(first_expert=first, served_ids=served_ids, budget=verify.ProbeBudget(LAYER_PROBE_S), **probes)
        return verify.moe_cases(serve, w, moe.activation, plans, **oracle, **ours)

    def current() -> tuple:
        now = read(layer)
        return tuple(now.weights) if now is not None else ()

    tensors = {**w._asdict(), "dtype": dtypes[0], "top_k": top_k}
    return layer_check(sizes, layer, index, key, label, "moe", cases, weights=current, rebuild=rebuild, tensors=tensors)


def _moe_plans(ms, w: nvfp4.MoeWeights, dtypes, top_k: int, pool, everyone, padded: bool) -> list[tuple]:
    """Return (name, x, topk_ids, topk_weights) per batch: random routing among `pool` at each M of `ms`; a full
    sweep adds skewed routing, a `padded` one (-1 slots), and balanced routing over `everyone`."""
    device = w.w13.device
    amax = float(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / w.a1_gscale.float().max().cpu())
    gen = torch.Generator().manual_seed(2024)
    batches = [(m, "random", pool) for m in ms]
    if len(ms) > 1:
        batches.append((160, "skewed", pool))
        batches += [(max(16, top_k), "padded", pool)] if padded else []
        batches.append((max(8, 2 * everyone.numel()), "balanced", everyone))  # every expert leads two tokens
    plans = []
    for dtype in dtypes:
        # The random batches are the leading M tokens of one batch of the largest M: the oracle runs once for them
        # all (verify.moe_cases shares its result), and a check holds one reference, not one per M.
        shared = None
        for m, routing, among in batches:
            if routing != "random" or shared is None:
                n = max(ms) if routing == "random" else m
                ids, topk_weights = verify.moe_routing(n, min(top_k, among.numel()), among.numel(), routing, gen)
                ids = torch.where(ids >= 0, among[ids.long().clamp_min(0)], -1).to(torch.int32)  # served ids; -1 stays
                x = verify.seeded_activations(n, w.w13.shape[2] * 2, amax, 2024 + len(plans), device, dtype)
                made = (x, ids.to(device), topk_weights.to(device))
                shared = made if routing == "random" else shared
            every = " (every expert)" if among is everyone else ""
            name = f"T={m} {routing}{every} {str(dtype).removeprefix('torch.')}"
            plans.append((name, *(t[:m] for t in (shared if routing == "random" else made))))
    return plans


def refuse_unverifiable(settings, what: str, problem: str | None) -> None:
    """Refuse to serve `what` for `problem` as SM120_FP4_SELFTEST says (deciding.refuse); under warn it serves, and
    status() and the report list it unverified. None: nothing to refuse. Both engine homes refuse through here."""
    if problem is not None:
        refuse(settings, f"sm120_fp4: refusing to serve {what}: {problem}")
        if settings.selftest == "warn":
            record_unverified(what, problem)
