"""The oracles: the dense NVFP4 GEMM (FlashInfer's mm_fp4) and the fused MoE (cutlass_fused_moe),
in pure PyTorch over the format in :mod:`.format`. Functions check their inputs and raise
:class:`~sm120_fp4.errors.InvalidArgument` (a ``ValueError``) naming the parameter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InvalidArgument, describe, not_accepted
from .format import (
    _SCALE_DTYPES,
    BLOCK_SIZE,
    _as_scale,
    _check_packed_and_scales,
    _check_tensor,
    dequantize_unscaled,
    quantize,
    swizzled_scale_shape,
)

__all__ = [
    "gemm_operand_dtype",
    "reference_mm_fp4",
    "reference_moe_fp4",
    "reference_moe_fp4_roundings",
    "MoeWeights",
    "expert_mm",
    "expert_activation",
]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch.mm(..., out_dtype=) (bf16 in, float32 out) exists on CUDA from torch 2.8.
_HAS_MM_OUT_DTYPE = "out_dtype" in (torch.mm.__doc__ or "")


def _check_alpha(alpha: object, m: int, device: torch.device) -> torch.Tensor | None:
    if alpha is None:
        return None
    if not isinstance(alpha, torch.Tensor) or alpha.dtype != torch.float32 or alpha.numel() not in (1, m):
        raise not_accepted("reference_mm_fp4", "alpha", alpha, f"None or a float32 tensor of 1 or M={m} elements")
    if alpha.device != device:
        raise not_accepted("reference_mm_fp4", "alpha", alpha, f"a tensor on {device} (where a is)")
    return alpha.reshape(-1, 1) if alpha.numel() == m and m != 1 else alpha.reshape(())


def gemm_operand_dtype(a: torch.Tensor) -> torch.dtype:
    """The dtype reference_mm_fp4 dequantizes to for `a`'s device: bf16 where a bf16 GEMM with
    float32 output exists (CUDA), float32 elsewhere. Both hold the dequantized values exactly."""
    return torch.bfloat16 if a.is_cuda and _HAS_MM_OUT_DTYPE else torch.float32


def reference_mm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    *,
    dequantized_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 GEMM with ``flashinfer.mm_fp4``'s calling convention, computed exactly in float32.

    `a`: packed (M, K/2); `b`: the column-major (K/2, N) view ``w_packed.T`` of a contiguous
    (N, K/2) weight; `a_descale`: A's swizzled scales; `b_descale`: the ``.T`` of the weight's
    swizzled scales; `alpha`: float32, 1 element (or M, one per row) = 1/(gsf_a*gsf_b).
    Returns ``alpha * (A @ B^T)`` in `out_dtype` (bf16, fp16, or fp32 to see it before the cast),
    written into `out` when given. `dequantized_b`, when given, is a kept copy of
    ``dequantize_unscaled(b.T, b_descale.T, gemm_operand_dtype(a))`` used instead of recomputing it.
    """
    func = "reference_mm_fp4"
    _check_tensor(func, "b", b, (torch.uint8,), ndim=2)
    if not b.T.is_contiguous():
        raise not_accepted(func, "b", b, "the column-major (K/2, N) view w.T of a contiguous (N, K/2) weight")
    m, k = _check_packed_and_scales(func, a, a_descale, "a", "a_descale")
    if b.shape[0] != a.shape[1]:
        raise not_accepted(func, "b", b, f"shape (K/2={a.shape[1]}, N) to match a={describe(a)}")
    if b.device != a.device:
        raise not_accepted(func, "b", b, f"a tensor on {a.device} (where a is)")
    if not isinstance(b_descale, torch.Tensor) or b_descale.dim() != 2:
        raise not_accepted(func, "b_descale", b_descale, "the 2-D .T view of the weight's swizzled scales")
    n = b.shape[1]
    w_scales = b_descale.T
    _check_packed_and_scales(func, b.T, w_scales, "b", "b_descale.T")
    if not w_scales.is_contiguous():
        raise not_accepted(
            func, "b_descale", b_descale, "the .T view of a contiguous swizzled (ceil128(N), ceil4(K/16)) tensor"
        )
    scale = _check_alpha(alpha, m, a.device)
    if out_dtype not in _OUT_DTYPES:
        raise not_accepted(func, "out_dtype", out_dtype, "torch.bfloat16, torch.float16 or torch.float32")
    if out is not None:
        _check_tensor(func, "out", out, (out_dtype,), ndim=2)
        if tuple(out.shape) != (m, n) or out.device != a.device:
            raise not_accepted(func, "out", out, f"shape ({m}, {n}) on {a.device}")
    # Products of E2M1 x E4M3 values are exact in bf16, float32 and TF32, so only the summation
    # order can differ from the kernel's float32 accumulator. On CUDA: bf16 operands, float32
    # output (half the bytes of a float32 GEMM); elsewhere a float32 GEMM.
    dtype = gemm_operand_dtype(a)
    if dequantized_b is None:
        dequantized_b = dequantize_unscaled(b.T, w_scales, dtype)
    elif dequantized_b.dtype != dtype or tuple(dequantized_b.shape) != (n, k):
        raise not_accepted(
            func, "dequantized_b", dequantized_b, f"a ({n}, {k}) {dtype} tensor (dequantize_unscaled of b)"
        )
    deq_a = dequantize_unscaled(a, a_descale, dtype)
    if dtype == torch.bfloat16:
        acc = torch.mm(deq_a, dequantized_b.T, out_dtype=torch.float32)
    else:
        acc = deq_a @ dequantized_b.T
    if scale is not None:
        acc.mul_(scale)  # in place: a prefill-sized float32 result is gigabytes (M=8192, N=57344: 1.9 GB)
    if out is None:
        return acc.to(out_dtype)
    out.copy_(acc)
    return out


# ---- the fused MoE (FlashInfer's cutlass_fused_moe, NVFP4) -----------------------------------
#
# What FlashInfer's kernels do, read in flashinfer-ai/flashinfer (commit fb28d72),
# csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh unless named otherwise:
#
# * Both grouped GEMMs write UnfusedGemmOutputType, which is BackBoneType, which must be the
#   output type (moe_kernels.h: "using UnfusedGemmOutputType = BackBoneType;" and
#   "static_assert(std::is_same_v<OutputType, BackBoneType>"): FC1's alpha*acc and each routed
#   row of FC2 are rounded to the output dtype before anything else reads them.
# * doActivationKernel reads the gate from the second half of FC1's row
#   ("gemm_result_vec + elem_index + gated_off_vec", gated_off = inter_size) and the linear part
#   from the first half, converts both to float and applies GLUAdaptor: "fn(gate) * linear".
#   Relu2 is the ungated IdentityAdaptor<Relu2>: "val = relu_op(value); return mul(val, val)".
# * It then quantizes through quantizePackedFPXValue, which first casts the float activation to
#   the GEMM output type: "packed_vec.elts[i].x = static_cast<GemmOutputType>(post_act_val[...])".
#   So the kernel quantizes the intermediate *after rounding it to the output dtype*. This oracle's
#   contract (fixed by callers outside this repository) quantizes it from float32 instead; the
#   two differ on values near a rounding boundary. To follow the kernel, quantize
#   ``intermediate.to(round_dtype)`` in reference_moe_fp4 instead.
# * finalizeMoeRoutingKernel sums in float over the k slots in slot order
#   ("ComputeElem = cutlass::Array<float, ...>", "thread_output = thread_output + row_scale *
#   expert_result") and converts once ("arrayConvert<ComputeElem, OutputElem>(thread_output)").
#   With a FINALIZE-fused GEMM2 tactic (use_fused_finalize=True, flashinfer's default, offered
#   for SM >= 90 including SM120) the epilogue instead rounds scale * (alpha * acc) to the output
#   dtype and red.add's it into the output in that dtype, in no fixed order
#   (cutlass_extensions/epilogue/fusion/sm90_visitor_scatter.hpp): up to k roundings more.
# * Expert ids outside [start_expert, end_expert) belong to other expert-parallel ranks: routing
#   sorts them past the local experts ("is_valid_expert ? (expert - start_expert) :
#   num_experts_per_node") and finalize skips them ("if (expert_id < 0 || expert_id >=
#   num_experts_per_node) continue;"), so they add nothing. This oracle has no rank arguments,
#   so an id outside [0, E) is far more likely a bug than a foreign expert: it is rejected.

_MOE_ACTIVATIONS = ("swiglu", "relu2")
_MOE_X_DTYPES = (torch.bfloat16, torch.float16)
_MOE_ID_DTYPES = (torch.int32, torch.int64)


def expert_mm(a: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """alpha * (a @ w^T) in float32: a (M, K) and w (N, K) in the same dtype (bf16 or float32)."""
    if a.dtype == torch.bfloat16:
        acc = torch.mm(a, w.T, out_dtype=torch.float32)
    else:
        acc = a @ w.T
    return acc * alpha


def expert_activation(fc1: torch.Tensor, activation: str, inter: int) -> torch.Tensor:
    """The activation of FC1's float32 output (rows [up; gate] for swiglu), in float32."""
    if activation == "swiglu":
        up, gate = fc1[:, :inter], fc1[:, inter:]
        # cutlass's SiLu is x * sigmoid(x) with sigmoid = 1 / (1 + exp(-x)); the scalar statement
        # in tests/scalar_moe_recipe.py spells the same operations in the same order.
        return (gate * (1.0 / (1.0 + torch.exp(-gate)))) * up
    relu = torch.clamp_min(fc1, 0.0)
    return relu * relu


def _check_moe_expert_tensor(
    func: str, param: str, value: object, dtypes: tuple, shape: tuple, what: str, device: torch.device
) -> None:
    _check_tensor(func, param, value, dtypes, ndim=len(shape))
    if tuple(value.shape) != shape:
        raise not_accepted(func, param, value, f"shape {shape} ({what})")
    if value.device != device:
        raise not_accepted(func, param, value, f"a tensor on {device} (where x is)")


def _moe_gscale(func: str, param: str, value: object, experts: int, device: torch.device) -> torch.Tensor:
    """A global encode scale: one for all experts (0-dim result), or one per expert ((E,) result)."""
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.dim() == 1
        and value.numel() == experts > 1
    ):
        if value.device != device:
            raise not_accepted(func, param, value, f"a tensor on {device} (where x is)")
        if not (torch.isfinite(value).all() and (value > 0).all()):
            raise not_accepted(func, param, value, "positive finite values")
        return value
    return _as_scale(func, param, value, device, True)


class MoeWeights(NamedTuple):
    """One NVFP4 MoE layer's eight kernel tensors, in the fused-MoE convention's order: after x,
    topk_ids and topk_weights, before activation, out_dtype and out. ``reference_moe_fp4(x, ids, w,
    *weights)`` and every MoE backend ``fn(x, ids, w, *weights, activation, out_dtype, out)`` take
    them so; reference_moe_fp4's docstring says what each holds."""

    w13: torch.Tensor
    w13_sf: torch.Tensor
    w13_alpha: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    w2_alpha: torch.Tensor
    a1_gscale: torch.Tensor | None
    a2_gscale: torch.Tensor | None

    def map(self, fn) -> "MoeWeights":
        """The same weights with `fn` applied to each tensor (None stays None)."""
        return MoeWeights(*(None if t is None else fn(t) for t in self))


class _MoeShape(NamedTuple):
    """What reference_moe_fp4's argument checks established, for its math."""

    tokens: int
    hidden: int
    experts: int
    inter: int
    top_k: int
    out_dtype: torch.dtype
    a1: torch.Tensor | None  # the activation global scales as tensors (None for W4A16)
    a2: torch.Tensor | None


def _check_moe_args(
    x,
    topk_ids,
    topk_weights,
    weights: MoeWeights,
    activation,
    out_dtype,
    quantize_activations,
    intermediate_dtypes: tuple,
) -> _MoeShape:
    """reference_moe_fp4's argument checks: each names the parameter, the value and what is accepted."""
    func = "reference_moe_fp4"
    w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1_gscale, a2_gscale = weights
    _check_tensor(func, "x", x, _MOE_X_DTYPES, ndim=2)
    tokens, hidden = x.shape
    if hidden == 0 or hidden % BLOCK_SIZE:
        raise not_accepted(func, "x", x, f"a hidden size H that is a positive multiple of {BLOCK_SIZE}, got H={hidden}")
    device = x.device
    if not isinstance(activation, str) or activation not in _MOE_ACTIVATIONS:
        raise not_accepted(func, "activation", activation, "one of " + ", ".join(repr(a) for a in _MOE_ACTIVATIONS))
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise not_accepted(func, "out_dtype", out_dtype, "None, torch.bfloat16, torch.float16 or torch.float32")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if not isinstance(quantize_activations, bool):
        raise not_accepted(func, "quantize_activations", quantize_activations, "True or False")
    for intermediate_dtype in intermediate_dtypes:
        if intermediate_dtype not in (None, torch.bfloat16, torch.float16):
            raise not_accepted(func, "intermediate_dtype", intermediate_dtype, "None, torch.bfloat16 or torch.float16")

    _check_tensor(func, "topk_ids", topk_ids, _MOE_ID_DTYPES, ndim=2)
    if topk_ids.shape[0] != tokens or topk_ids.shape[1] == 0:
        raise not_accepted(func, "topk_ids", topk_ids, f"shape ({tokens}, k) with k >= 1 (one row per token of x)")
    if topk_ids.device != device:
        raise not_accepted(func, "topk_ids", topk_ids, f"a tensor on {device} (where x is)")
    top_k = topk_ids.shape[1]
    _check_moe_expert_tensor(
        func, "topk_weights", topk_weights, (torch.float32,), (tokens, top_k), "that of topk_ids", device
    )

    _check_tensor(func, "w13", w13, (torch.uint8,), ndim=3)
    experts, rows13 = w13.shape[0], w13.shape[1]
    gated = activation == "swiglu"
    inter = rows13 // 2 if gated else rows13
    if experts == 0 or w13.shape[2] * 2 != hidden or (gated and rows13 % 2) or inter == 0 or inter % BLOCK_SIZE:
        rows_text = "2I" if gated else "I"
        raise not_accepted(
            func,
            "w13",
            w13,
            f"shape (E >= 1, {rows_text}, H/2={hidden // 2}) for activation={activation!r}, "
            f"I a positive multiple of {BLOCK_SIZE}",
        )
    if w13.device != device:
        raise not_accepted(func, "w13", w13, f"a tensor on {device} (where x is)")
    per_expert = f"one per expert, E={experts}"
    _check_moe_expert_tensor(
        func,
        "w13_sf",
        w13_sf,
        _SCALE_DTYPES,
        (experts, *swizzled_scale_shape(rows13, hidden)),
        f"128x4 swizzled scales of {rows13} rows and K={hidden} per expert",
        device,
    )
    _check_moe_expert_tensor(func, "w13_alpha", w13_alpha, (torch.float32,), (experts,), per_expert, device)
    _check_moe_expert_tensor(
        func, "w2", w2, (torch.uint8,), (experts, hidden, inter // 2), f"E, H, I/2 with I={inter}", device
    )
    _check_moe_expert_tensor(
        func,
        "w2_sf",
        w2_sf,
        _SCALE_DTYPES,
        (experts, *swizzled_scale_shape(hidden, inter)),
        f"128x4 swizzled scales of {hidden} rows and K={inter} per expert",
        device,
    )
    _check_moe_expert_tensor(func, "w2_alpha", w2_alpha, (torch.float32,), (experts,), per_expert, device)
    if quantize_activations:
        a1 = _moe_gscale(func, "a1_gscale", a1_gscale, experts, device)
        a2 = _moe_gscale(func, "a2_gscale", a2_gscale, experts, device)
        if not torch.isfinite(x).all():
            raise not_accepted(func, "x", x, "finite values (found NaN or inf)")
    low, high = torch.stack(torch.aminmax(topk_ids.reshape(-1).long())).tolist() if tokens else (0, 0)
    if low < 0 or high >= experts:
        raise not_accepted(
            func,
            "topk_ids",
            topk_ids,
            f"expert ids in [0, E={experts}), got ids in [{low}, {high}] "
            "(expert-parallel ids of other ranks are not accepted)",
        )

    return _MoeShape(
        tokens,
        hidden,
        experts,
        inter,
        top_k,
        out_dtype,
        a1 if quantize_activations else None,
        a2 if quantize_activations else None,
    )


def _moe_forward(
    x,
    topk_ids,
    topk_weights,
    weights: MoeWeights,
    shape: _MoeShape,
    activation,
    quantize_activations,
    intermediate_dtypes: tuple,
    weight_cache,
) -> list[torch.Tensor]:
    """reference_moe_fp4's math, on checked arguments (its docstring states it): one output per
    entry of `intermediate_dtypes` (its `intermediate_dtype`), FC1 computed once for all."""
    tokens, hidden, experts, inter, top_k, out_dtype, a1, a2 = shape
    w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha = weights[:6]  # the activation scales: a1, a2 as checked
    device = x.device
    func = "reference_moe_fp4"
    ids = topk_ids.reshape(-1).long()
    # The GEMM outputs are stored in the output dtype; a float32 output shows the sum before
    # the final cast of a run in x's dtype.
    round_dtype = x.dtype if out_dtype == torch.float32 else out_dtype
    # E2M1 x E4M3 values are exact in bf16 (CUDA: bf16 GEMM, float32 output); unquantized
    # activations are not, so W4A16 multiplies in float32.
    dtype = gemm_operand_dtype(x) if quantize_activations else torch.float32
    # Routed rows (token * k + slot) sorted by expert, stable so each expert's rows keep token
    # order: a span (expert, lo, hi) is that expert's rows, sorted positions lo..hi-1.
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts).tolist()
    token_of_row = order // top_k
    spans = []
    start = 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
        start += count

    def quantized(values: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
        packed, scales = quantize(values, gscale, check_finite=False)
        return dequantize_unscaled(packed, scales, dtype)

    # One global scale: x quantized once; one per expert (compressed-tensors): each expert's rows
    # quantized with that expert's scale, as the kernel does.
    if not quantize_activations:
        acts = x.float()
    elif a1.dim() == 0:
        acts = quantized(x, a1)
    intermediate = torch.empty((ids.numel(), inter), dtype=torch.float32, device=device)

    def dequantized(which: str, expert: int) -> torch.Tensor:
        key = (which, expert, dtype)
        if weight_cache is not None and key in weight_cache:
            return weight_cache[key]
        packed_w, scales_w = (w13, w13_sf) if which == "w13" else (w2, w2_sf)
        weight = dequantize_unscaled(packed_w[expert], scales_w[expert], dtype)
        if weight_cache is not None:
            weight_cache[key] = weight
        return weight

    for expert, lo, hi in spans:
        weight = dequantized("w13", expert)
        rows = (
            acts[token_of_row[lo:hi]]
            if not quantize_activations or a1.dim() == 0
            else quantized(x[token_of_row[lo:hi]], a1[expert])
        )
        fc1 = expert_mm(rows, weight, w13_alpha[expert])
        intermediate[lo:hi] = expert_activation(fc1.to(round_dtype).float(), activation, inter)

    if quantize_activations and not torch.isfinite(intermediate).all():
        raise InvalidArgument(
            f"{func}: FC1 of x={describe(x)} with w13 and w13_alpha is not finite once rounded to "
            f"{round_dtype} and activated; expected inputs whose intermediate can be quantized"
        )
    return [
        _moe_finish(
            intermediate,
            intermediate_dtype,
            topk_weights,
            weights,
            shape,
            spans,
            order,
            dtype,
            round_dtype,
            quantized,
            dequantized,
        )
        for intermediate_dtype in intermediate_dtypes
    ]


def _moe_finish(
    intermediate,
    intermediate_dtype,
    topk_weights,
    weights: MoeWeights,
    shape: _MoeShape,
    spans,
    order,
    dtype,
    round_dtype,
    quantized,
    dequantized,
) -> torch.Tensor:
    """_moe_forward from the activated intermediate on: its re-quantization (rounded to
    `intermediate_dtype` first where given), FC2 and the finalize's sum."""
    tokens, hidden, _, _, top_k, out_dtype, _, a2 = shape
    w2_alpha = weights.w2_alpha
    if a2 is not None:  # quantized activations
        if intermediate_dtype is not None:
            intermediate = intermediate.to(intermediate_dtype).float()
        if a2.dim() == 0:
            intermediate = quantized(intermediate, a2)
        else:
            intermediate = intermediate.clone()  # the per-expert writes below must not reach a shared FC1 result
            for expert, lo, hi in spans:
                intermediate[lo:hi] = quantized(intermediate[lo:hi], a2[expert]).float()
            intermediate = intermediate.to(dtype)  # exact: dequantized FP4 values fit bf16
    # Each routed row lands at its unsorted position token * k + slot, for the finalize.
    routed = torch.empty((tokens * top_k, hidden), dtype=round_dtype, device=intermediate.device)
    for expert, lo, hi in spans:
        weight = dequantized("w2", expert)
        routed[order[lo:hi]] = expert_mm(intermediate[lo:hi], weight, w2_alpha[expert]).to(round_dtype)

    # finalizeMoeRoutingKernel's sum: float32, slot by slot, a product then an add.
    routed = routed.view(tokens, top_k, hidden)
    out = torch.zeros((tokens, hidden), dtype=torch.float32, device=intermediate.device)
    for slot in range(top_k):
        out = out + topk_weights[:, slot : slot + 1] * routed[:, slot].float()
    return out.to(out_dtype)


def reference_moe_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_sf: torch.Tensor,
    w13_alpha: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    w2_alpha: torch.Tensor,
    a1_gscale: object,
    a2_gscale: object,
    activation: str = "swiglu",
    out_dtype: torch.dtype | None = None,
    *,
    quantize_activations: bool = True,
    intermediate_dtype: torch.dtype | None = None,
    weight_cache: dict | None = None,
) -> torch.Tensor:
    """NVFP4 fused MoE with FlashInfer ``cutlass_fused_moe``'s conventions, in plain PyTorch (T, H).

    `x` (T, H) bf16/fp16; `topk_ids` (T, k) int32/int64 expert ids in [0, E); `topk_weights`
    (T, k) float32, used as given (they need not sum to 1). `w13` (E, 2I, H/2) packed E2M1 with
    rows [up; gate] for "swiglu", (E, I, H/2) for "relu2"; `w13_sf` (E, ceil128(rows),
    ceil4(H/16)) float8_e4m3fn or its uint8 bytes, each expert's slice 128x4 swizzled;
    `w13_alpha` (E,) float32 = 1 / (a1_gscale * w13's global encode scale). `w2` (E, H, I/2),
    `w2_sf` (E, ceil128(H), ceil4(I/16)), `w2_alpha` (E,) likewise with a2_gscale. `a1_gscale`,
    `a2_gscale`: the global encode scales of x and of the intermediate (float, or a one-element
    float32 tensor; or, as compressed-tensors checkpoints have them, an (E,) float32 tensor of one
    scale per expert, each expert's rows quantized with its own). H and I must be multiples of 16.

    Per routed (token, slot) with expert e, with the kernel's rounding points:
    ``fc1 = w13_alpha[e] * (dq(quantize(x, a1)) @ dq(w13[e])^T)`` (float32 accumulation, dq =
    :func:`dequantize_unscaled`) rounded to the output dtype; ``act = silu(gate) * up`` (gate =
    rows I..2I) or ``relu(fc1)^2`` in float32; ``act`` quantized from float32 with a2_gscale;
    ``row = w2_alpha[e] * (dq(act_q) @ dq(w2[e])^T)`` rounded to the output dtype; the output
    is ``sum_j topk_weights[t, j] * row_j`` in float32 over the slots in order, cast to
    `out_dtype`. A token routed twice to one expert gets both slots, each computed and summed
    (as FlashInfer's kernels do; its routers never pick an expert twice).

    `out_dtype`: None means x.dtype; bf16 or fp16 is also the rounding dtype of the GEMM
    outputs; float32 returns the float32 sum before its final cast (GEMM outputs are then rounded
    to x.dtype), so ``reference_moe_fp4(..., out_dtype=torch.float32).to(x.dtype)`` is the default.

    ``quantize_activations=False`` is W4A16 (SGLang's Marlin MoE fallback): x and the
    intermediate enter the GEMMs unquantized, in float32; `a1_gscale`/`a2_gscale` are ignored and
    may be None; the alphas are then the weights' dequant factors (``w13_alpha[e]`` = 1 / w13's
    global encode scale). The rounding of both GEMM outputs to the output dtype stays.

    `intermediate_dtype` (bf16/fp16), when given, rounds the activated intermediate to that dtype
    before it is re-quantized, as FlashInfer's kernel does (``quantizePackedFPXValue``); the default
    (None) quantizes it from float32, as stated above. The two differ only where a value sits near a
    rounding boundary; a self-test bound must allow that difference, and no more.

    Rows are grouped by expert: only experts that receive rows are dequantized, one GEMM each.
    `weight_cache`, a dict the caller keeps, holds those dequantized experts across calls with the
    same, unchanged weights (a self-test's references); the caller empties it when weights change.
    """
    return reference_moe_fp4_roundings(
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
        quantize_activations=quantize_activations,
        intermediate_dtypes=(intermediate_dtype,),
        weight_cache=weight_cache,
    )[0]


def reference_moe_fp4_roundings(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_sf: torch.Tensor,
    w13_alpha: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    w2_alpha: torch.Tensor,
    a1_gscale: object,
    a2_gscale: object,
    activation: str = "swiglu",
    out_dtype: torch.dtype | None = None,
    *,
    quantize_activations: bool = True,
    intermediate_dtypes: tuple = (None,),
    weight_cache: dict | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`reference_moe_fp4` once per entry of `intermediate_dtypes` (each its
    `intermediate_dtype`), in one pass: the routing, FC1 and the activation are computed once and
    shared, so ``reference_moe_fp4_roundings(..., intermediate_dtypes=(None, torch.bfloat16))``
    equals the two reference_moe_fp4 calls bit for bit at about two thirds of their cost (a
    self-test's reference and the kernel's rounding of the intermediate, whose difference bounds
    what the oracle cannot decide)."""
    if not isinstance(intermediate_dtypes, tuple) or not intermediate_dtypes:
        raise not_accepted(
            "reference_moe_fp4_roundings",
            "intermediate_dtypes",
            intermediate_dtypes,
            "a non-empty tuple of None, torch.bfloat16 or torch.float16",
        )
    weights = MoeWeights(w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1_gscale, a2_gscale)
    shape = _check_moe_args(
        x, topk_ids, topk_weights, weights, activation, out_dtype, quantize_activations, intermediate_dtypes
    )
    if shape.tokens == 0:
        return tuple(
            torch.zeros((0, shape.hidden), dtype=shape.out_dtype, device=x.device) for _ in intermediate_dtypes
        )
    return tuple(
        _moe_forward(
            x,
            topk_ids,
            topk_weights,
            weights,
            shape,
            activation,
            quantize_activations,
            intermediate_dtypes,
            weight_cache,
        )
    )
