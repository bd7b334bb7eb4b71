"""The ``emulated`` backends: the oracle's arithmetic (nvfp4 dequantize + float32 matmul), exact and
slow, on any device; ``emulated-cached`` keeps the dequantized weight (decode-speed emulation).
"""

from __future__ import annotations

import weakref

import torch

from .. import locks, nvfp4

__all__ = [
    "emulated_mm_fp4",
    "emulated_cached_mm_fp4",
    "emulated_moe",
    "invalidate_caches",
]


def emulated_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """The `emulated` backend: the nvfp4 reference GEMM (dequantize + float32 matmul)."""
    return nvfp4.reference_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out)


class _WeightCache:
    """Dequantized bf16 weights for `emulated-cached`, valid while the weight is alive and unchanged.

    Memory: 2 bytes per weight element, four times the packed FP4 weight (0.5 byte per element)
    plus its scales: opt in by naming the backend in SM120_FP4_BACKENDS. An entry is never made
    while a CUDA graph is being captured (its values would exist only once the graph replays), and
    every entry is dropped around SGLang's weight-update calls (:func:`invalidate_caches`), which
    write weights in place through ``param.data`` without bumping their version counter.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}
        self._lock = locks.lock()

    def get(self, b, b_descale, dtype):
        base = b._base if b._base is not None else b
        key = id(base)
        version = (base._version, b_descale._version, b.data_ptr(), b_descale.data_ptr(), tuple(b.shape), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is base and entry[1] == version:
            return entry[2]
        weight = nvfp4.dequantize_unscaled(b.T, b_descale.T, dtype)
        if b.is_cuda and torch.cuda.is_current_stream_capturing():
            return weight  # computed by the graph at every replay; never kept as if it held values now
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
            self._entries[key] = (weakref.ref(base), version, weight)
        return weight

    def clear(self) -> None:
        with self._lock:
            self._entries = {}


_weight_cache = _WeightCache()


def invalidate_caches() -> None:
    """Drop every kept copy of dequantized weights (SGLang is about to write, or has written, weights)."""
    _weight_cache.clear()


def emulated_cached_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """`emulated` with the weight's dequantization cached (decode-speed emulation, more memory).

    Only where the reference runs its bf16 GEMM (CUDA): the cached copy is the bf16 one.
    """
    dtype = nvfp4.gemm_operand_dtype(a)
    cached = _weight_cache.get(b, b_descale, dtype) if dtype == torch.bfloat16 else None
    return nvfp4.reference_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, dequantized_b=cached)


def _quantized(values: torch.Tensor, gscale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    packed, scales = nvfp4.quantize(values, gscale.reshape(()), check_finite=False)
    return nvfp4.dequantize_unscaled(packed, scales, dtype)


def emulated_moe(
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_sf,
    w13_alpha,
    w2,
    w2_sf,
    w2_alpha,
    a1_gscale,
    a2_gscale,
    activation,
    out_dtype,
    out,
):
    """The `emulated` MoE backend: nvfp4.reference_moe_fp4's arithmetic, written into `out`, with no
    host synchronisation (it runs inside CUDA-graph capture).

    The oracle's rounding points (FC1 and FC2 outputs rounded to the output dtype, the intermediate
    quantized from float32, the slots summed in slot order in float32), so its result is the
    oracle's: with NVFP4 operands every GEMM sum is exact in float32, whatever rows share a GEMM.
    Instead of grouping rows by expert (which needs the counts on the host), every expert runs over
    all T tokens and each slot takes its own expert's row: E times the oracle's GEMM work, no sync.
    A slot whose id is outside [0, E) -- another expert-parallel rank's expert, or SGLang's -1 drop
    sentinel -- is never computed and adds exactly nothing (no row of it, finite or not, is read).
    """
    tokens, hidden = x.shape
    experts, rows13 = w13.shape[0], w13.shape[1]
    inter = rows13 // 2 if activation == "swiglu" else rows13
    dtype = nvfp4.gemm_operand_dtype(x)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < experts)
    routed = torch.zeros((tokens, ids.shape[1], hidden), dtype=out_dtype, device=x.device)
    per_expert_a1, per_expert_a2 = a1_gscale.numel() > 1, a2_gscale.numel() > 1
    acts = None if per_expert_a1 else _quantized(x, a1_gscale, dtype)
    for e in range(experts):
        rows = _quantized(x, a1_gscale.reshape(-1)[e], dtype) if per_expert_a1 else acts
        fc1 = nvfp4.expert_mm(rows, nvfp4.dequantize_unscaled(w13[e], w13_sf[e], dtype), w13_alpha[e])
        act = nvfp4.expert_activation(fc1.to(out_dtype).float(), activation, inter)
        act = _quantized(act, a2_gscale.reshape(-1)[e] if per_expert_a2 else a2_gscale, dtype)
        row = nvfp4.expert_mm(act, nvfp4.dequantize_unscaled(w2[e], w2_sf[e], dtype), w2_alpha[e]).to(out_dtype)
        routed = torch.where((ids == e).unsqueeze(-1), row.unsqueeze(1), routed)
    total = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
    for slot in range(ids.shape[1]):
        term = topk_weights[:, slot : slot + 1] * routed[:, slot].float()
        total = total + torch.where(valid[:, slot : slot + 1], term, torch.zeros_like(term))
    out.copy_(total)
    return out
