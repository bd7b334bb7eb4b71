"""The oracles of FlashInfer's mm_fp4 and cutlass_fused_moe in pure PyTorch, over :mod:`.format`."""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch

from ..errors import InvalidArgument, describe, not_accepted
from .format import (
    _SCALE_DTYPES,
    BLOCK_SIZE,
    _as_scale,
    _check_tensor,
    dequantize_unscaled,
    quantize,
    swizzled_scale_shape,
)

__all__ = [
    "check_mm_fp4_args",
    "check_moe_layout",
    "gemm_operand_dtype",
    "reference_mm_fp4",
    "reference_moe_fp4",
    "reference_moe_fp4_roundings",
    "MoeWeights",
    "expert_mm",
    "expert_activation",
    "requantized",
]

_DTYPES = (torch.bfloat16, torch.float16)  # what the FP4 GEMM kernels write
_OUT_DTYPES = (*_DTYPES, torch.float32)  # ... and the oracle
# torch.mm(..., out_dtype=) (bf16 in, float32 out) exists on CUDA from torch 2.8.
_HAS_MM_OUT_DTYPE = "out_dtype" in (torch.mm.__doc__ or "")


def gemm_operand_dtype(a: torch.Tensor) -> torch.dtype:
    """Return the exact dequantization dtype for `a`'s device: bf16 where bf16->fp32 mm exists, else fp32."""
    return torch.bfloat16 if a.is_cuda and _HAS_MM_OUT_DTYPE else torch.float32


def _transposed_contiguous(t: torch.Tensor) -> bool:
    """Return ``t.T.is_contiguous()`` for a 2-D `t` without making the view (microseconds per call)."""
    (n0, n1), (s0, s1) = t.shape, t.stride()
    if n0 == 0 or n1 == 0:
        return True
    return (n0 == 1 or s0 == 1) and (n1 == 1 or s1 == n0)


def _bad_out(out, dtype, shape: tuple) -> bool:
    return (
        not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous()
    )


def check_mm_fp4_args(
    a, b, a_descale, b_descale, alpha, out_dtype, out, align=(32, 8), *, func="mm_fp4", out_dtypes=_DTYPES
) -> None:
    """Validate mm_fp4 arguments from tensor metadata only (no host sync), as `func`.

    `out` None: unchecked; `align`: the kernel's (K, N) alignment; `out_dtypes`: the output dtypes it writes.
    """
    bad = functools.partial(not_accepted, func)
    if not isinstance(a, torch.Tensor) or a.dtype != torch.uint8 or a.dim() != 2:
        raise bad("a", a, "packed FP4 activations: a 2-D uint8 tensor (M, K/2)")
    m, k = a.shape[0], a.shape[1] * 2
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise bad("b", b, f"packed FP4 weights: a 2-D uint8 (K/2={a.shape[1]}, N) view")
    n = b.shape[1]
    if b.stride(0) != 1 or b.stride(1) != a.shape[1]:
        raise bad("b", b, "the column-major view w.T of a contiguous (N, K/2) weight (strides (1, K/2))")
    if k % align[0] or n % align[1]:
        raise bad("b", b, f"K % {align[0]} == 0 and N % {align[1]} == 0 for this kernel (got K={k}, N={n})")
    for name, sf, rows in (("a_descale", a_descale, m), ("b_descale", b_descale, n)):
        rp, cp = swizzled_scale_shape(rows, k)
        if not isinstance(sf, torch.Tensor) or sf.dtype not in _SCALE_DTYPES or sf.numel() != rp * cp:
            accepted = f"128x4 swizzled E4M3 scales (uint8 or float8_e4m3fn) of shape ({rp}, {cp}): {rp * cp} elements"
            raise bad(name, sf, accepted)
    if not isinstance(alpha, torch.Tensor) or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise bad("alpha", alpha, "a one-element float32 tensor (the SM120 kernel requires alpha)")
    if out_dtype not in out_dtypes:
        raise bad("out_dtype", out_dtype, " or ".join(map(str, out_dtypes)))
    if out is not None and _bad_out(out, out_dtype, (m, n)):
        raise bad("out", out, f"a contiguous ({m}, {n}) {out_dtype} tensor")
    if not a.is_contiguous():
        raise bad("a", a, "a contiguous tensor (row-major packed activations)")
    if not a_descale.is_contiguous():
        raise bad("a_descale", a_descale, "a contiguous tensor (the swizzled scale bytes in order)")
    if b_descale.dim() != 2 or not _transposed_contiguous(b_descale):
        raise bad("b_descale", b_descale, "the .T view of a contiguous swizzled (ceil128(N), ceil4(K/16)) tensor")
    others = (("b", b), ("a_descale", a_descale), ("b_descale", b_descale), ("alpha", alpha), ("out", out))
    for name, t in others:
        if t is not None and t.get_device() != a.get_device():
            raise bad(name, t, f"a tensor on the same device as a ({a.device})")


# FP4 values dequantized at a time by reference_mm_fp4: 32 MB of bf16 and its 32 MB lookup index per operand
# block, and the float32 product of two blocks (16 MB at K=8192): the check's oracle stays well inside its bound.
_DEQUANT_ELEMENTS = 1 << 24


def _row_blocks(packed: torch.Tensor, scales: torch.Tensor) -> list[tuple[slice, tuple[torch.Tensor, torch.Tensor]]]:
    """Return (rows, (packed rows, their swizzled scales)) blocks of whole 128-row scale tiles."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    tile_rows = scales.reshape(-1, swizzled_scale_shape(1, k)[1])  # row tile t holds rows 128t..128t+127
    step = max(128, _DEQUANT_ELEMENTS // max(k, 1) // 128 * 128)
    if rows <= step:
        return [(slice(0, rows), (packed, scales))]
    blocks = []
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        blocks.append((slice(lo, hi), (packed[lo:hi], tile_rows[lo : lo + -(-(hi - lo) // 128) * 128])))
    return blocks


def reference_mm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``alpha * (A @ B^T)`` with flashinfer.mm_fp4's arguments, exact in float32 before the cast."""
    # b is w.T of a contiguous (N, K/2) weight, b_descale the .T of its swizzled scales; alpha has one element.
    args = (a, b, a_descale, b_descale, alpha, out_dtype, out, (BLOCK_SIZE, 1))
    check_mm_fp4_args(*args, func="reference_mm_fp4", out_dtypes=_OUT_DTYPES)
    m, n = a.shape[0], b.shape[1]
    # E2M1 x E4M3 products are exact in bf16, float32 and TF32: only the summation order can differ.
    dtype = gemm_operand_dtype(a)
    # Both operands dequantized in blocks of rows (a weight of 57344 x 8192 would take 0.9 GB, its lookup
    # index twice that): the memory beyond the float32 result stays below a few _DEQUANT_ELEMENTS.
    a_blocks, w_blocks = _row_blocks(a, a_descale), _row_blocks(b.T, b_descale.T)
    if len(a_blocks) == 1 and len(w_blocks) == 1:
        acc = expert_mm(dequantize_unscaled(a, a_descale, dtype), dequantize_unscaled(b.T, b_descale.T, dtype), None)
    else:
        acc = torch.empty((m, n), dtype=torch.float32, device=a.device)
        for w_rows, w_values in ((rows, dequantize_unscaled(*block, dtype)) for rows, block in w_blocks):
            for a_rows, block in a_blocks:
                acc[a_rows, w_rows] = expert_mm(dequantize_unscaled(*block, dtype), w_values, None)
    acc.mul_(alpha.reshape(()))  # in place: a prefill-sized float32 result is gigabytes (M=8192, N=57344: 1.9 GB)
    if out is None:
        return acc.to(out_dtype)
    out.copy_(acc)
    return out


# The fused MoE's rounding points, as FlashInfer's kernels have them (flashinfer fb28d72,
# csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh):
# * both grouped GEMMs write the output dtype (moe_kernels.h: UnfusedGemmOutputType = BackBoneType): FC1's
#   alpha*acc and each routed row of FC2 are rounded to it before anything reads them;
# * doActivationKernel: swiglu is silu(gate) * up with the gate in FC1's second half; relu2 is relu(x)^2;
# * quantizePackedFPXValue rounds the activation to the output dtype before quantizing it; this oracle
#   quantizes it from float32 (intermediate_dtype=None), the kernel's rounding is intermediate_dtype=x.dtype;
# * finalizeMoeRoutingKernel sums the k slots in float, in slot order, and converts once;
# * ids outside [0, E) belong to other expert-parallel ranks there; this oracle rejects them as likely bugs.

_MOE = "reference_moe_fp4"  # the function the MoE argument checks name
_MOE_ACTIVATIONS = ("swiglu", "relu2")


def expert_mm(a: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """Return alpha * (a @ w^T) in float32 for a (M, K) and w (N, K) both bf16 or both float32."""
    if a.dtype == torch.bfloat16:
        acc = torch.mm(a, w.T, out_dtype=torch.float32)
    else:
        acc = a @ w.T
    return acc if alpha is None else acc * alpha


def requantized(values: torch.Tensor, gscale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return `values` quantized with one-element encode scale `gscale`, dequantized unscaled as `dtype` (no host sync)."""
    packed, scales = quantize(values, gscale.reshape(()), check_finite=False)
    return dequantize_unscaled(packed, scales, dtype)


def expert_activation(fc1: torch.Tensor, activation: str, inter: int) -> torch.Tensor:
    """Return the float32 activation of FC1's float32 output (rows [up; gate] for swiglu)."""
    if activation == "swiglu":
        up, gate = fc1[:, :inter], fc1[:, inter:]
        # cutlass's SiLu: x * sigmoid(x), sigmoid = 1 / (1 + exp(-x)), as tests/scalar_moe_recipe.py spells it.
        return (gate * (1.0 / (1.0 + torch.exp(-gate)))) * up
    relu = torch.clamp_min(fc1, 0.0)
    return relu * relu


class MoeWeights(NamedTuple):
    """One NVFP4 MoE layer's eight kernel tensors, in the fused-MoE argument order after topk_weights."""

    w13: torch.Tensor
    w13_sf: torch.Tensor
    w13_alpha: torch.Tensor
    w2: torch.Tensor
    w2_sf: torch.Tensor
    w2_alpha: torch.Tensor
    a1_gscale: torch.Tensor | None
    a2_gscale: torch.Tensor | None

    def map(self, fn) -> "MoeWeights":
        """Return these weights with `fn` applied to each tensor (None stays None)."""
        return MoeWeights(*(None if t is None else fn(t) for t in self))


def _check_sized(func: str, param: str, value: object, dtypes: tuple, shape: tuple, what: str, flat=False) -> None:
    """Check `value` has one of `dtypes` and `shape` (`flat`: or shape[0] rows of its elements, contiguous)."""
    _check_tensor(func, param, value, dtypes)
    same = tuple(value.shape) == shape
    if flat:  # the kernels read the bytes in order, whatever the shape after the expert dimension
        same = value.is_contiguous() and value.dim() >= 1 and value.shape[0] == shape[0]
        same = same and value.numel() == math.prod(shape)
    if not same:
        raise not_accepted(func, param, value, f"shape {shape} ({what})" + (", contiguous" if flat else ""))


def check_moe_layout(func, x, topk_ids, topk_weights, w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, activation):
    """Check one fused-MoE call's activation, x, routing and experts from metadata alone (no host sync); return (E, I)."""
    if not isinstance(activation, str) or activation not in _MOE_ACTIVATIONS:
        raise not_accepted(func, "activation", activation, "one of " + ", ".join(repr(a) for a in _MOE_ACTIVATIONS))
    _check_tensor(func, "x", x, _DTYPES, ndim=2)
    tokens, hidden = x.shape
    if hidden == 0 or hidden % BLOCK_SIZE:
        raise not_accepted(func, "x", x, f"a hidden size H that is a positive multiple of {BLOCK_SIZE}, got H={hidden}")
    _check_tensor(func, "topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2)
    if topk_ids.shape[0] != tokens or topk_ids.shape[1] == 0:
        raise not_accepted(func, "topk_ids", topk_ids, f"shape ({tokens}, k) with k >= 1 (one row per token of x)")
    _check_sized(func, "topk_weights", topk_weights, (torch.float32,), tuple(topk_ids.shape), "that of topk_ids")
    _check_tensor(func, "w13", w13, (torch.uint8,), ndim=3)
    experts, rows13 = w13.shape[0], w13.shape[1]
    gated = activation == "swiglu"
    inter = rows13 // 2 if gated else rows13
    if experts == 0 or w13.shape[2] * 2 != hidden or (gated and rows13 % 2) or inter == 0 or inter % BLOCK_SIZE:
        accepted = (
            f"shape (E >= 1, {'2I' if gated else 'I'}, H/2={hidden // 2}) for activation={activation!r}, "
            f"I a positive multiple of {BLOCK_SIZE}"
        )
        raise not_accepted(func, "w13", w13, accepted)
    per_expert = f"one per expert, E={experts}"
    swizzled = "128x4 swizzled scales of {} rows and K={} per expert"
    checks = (
        (
            "w13_sf",
            w13_sf,
            _SCALE_DTYPES,
            (experts, *swizzled_scale_shape(rows13, hidden)),
            swizzled.format(rows13, hidden),
        ),
        ("w13_alpha", w13_alpha, (torch.float32,), (experts,), per_expert),
        ("w2", w2, (torch.uint8,), (experts, hidden, inter // 2), f"E, H, I/2 with I={inter}"),
        (
            "w2_sf",
            w2_sf,
            _SCALE_DTYPES,
            (experts, *swizzled_scale_shape(hidden, inter)),
            swizzled.format(hidden, inter),
        ),
        ("w2_alpha", w2_alpha, (torch.float32,), (experts,), per_expert),
    )
    for param, value, dtypes, shape, what in checks:
        _check_sized(func, param, value, dtypes, shape, what, flat=param != "w2")
    return experts, inter


def _moe_gscale(param: str, value: object, experts: int, device: torch.device) -> torch.Tensor:
    """Return a global encode scale: 0-dim for one shared scale, (E,) for one per expert."""
    per_expert = isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.dim() == 1
    if per_expert and value.numel() == experts > 1:
        if value.device != device:
            raise not_accepted(_MOE, param, value, f"a tensor on {device} (where x is)")
        if not (torch.isfinite(value).all() and (value > 0).all()):
            raise not_accepted(_MOE, param, value, "positive finite values")
        return value
    return _as_scale(_MOE, param, value, device, True)


def _check_moe_options(x, weights: MoeWeights, topk: tuple, out_dtype, quantize_activations, dtypes) -> None:
    """Check reference_moe_fp4's options, and where its tensors are (its experts' bytes may be in host memory)."""
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise not_accepted(_MOE, "out_dtype", out_dtype, "None, torch.bfloat16, torch.float16 or torch.float32")
    if not isinstance(quantize_activations, bool):
        raise not_accepted(_MOE, "quantize_activations", quantize_activations, "True or False")
    for dtype in dtypes:
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise not_accepted(_MOE, "intermediate_dtype", dtype, "None, torch.bfloat16 or torch.float16")
    tensors = dict(zip(("topk_ids", "topk_weights", *MoeWeights._fields[:6]), (*topk, *weights[:6])))
    for param, value in tensors.items():
        host = param in ("w13", "w13_sf", "w2", "w2_sf")  # in host memory: each expert read is copied
        if value.device != x.device and not (host and value.device.type == "cpu"):
            where = " or in host memory (each expert read is copied)" if host else ""
            raise not_accepted(_MOE, param, value, f"a tensor on {x.device} (where x is){where}")


class _MoeRun:
    """One reference_moe_fp4_roundings call on checked arguments: the routing and the shared state."""

    def __init__(self, x, topk_ids, weights: MoeWeights, out_dtype, quantize_activations, weight_cache) -> None:
        self.x, self.weights, self.cache = x, weights, weight_cache
        self.out_dtype = x.dtype if out_dtype is None else out_dtype
        # The GEMM outputs are stored in the output dtype; a float32 output shows the sum before the final cast.
        self.round_dtype = x.dtype if self.out_dtype == torch.float32 else self.out_dtype
        # E2M1 x E4M3 values are exact in bf16; unquantized activations are not (W4A16: float32).
        self.dtype = gemm_operand_dtype(x) if quantize_activations else torch.float32
        self.top_k = topk_ids.shape[1]
        ids = topk_ids.reshape(-1).long()
        # Routed rows (token * k + slot) sorted by expert, stably: span (expert, lo, hi) is its rows lo..hi-1.
        self.order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=weights.w13.shape[0]).tolist()
        ends = itertools.accumulate(counts)
        self.spans = [(expert, end - count, end) for expert, (count, end) in enumerate(zip(counts, ends)) if count]

    def dequantized(self, which: str, expert: int) -> torch.Tensor:
        key = (which, expert, self.dtype)
        if self.cache is not None and key in self.cache:
            return self.cache[key]
        w = self.weights
        packed, scales = (w.w13, w.w13_sf) if which == "w13" else (w.w2, w.w2_sf)
        device = self.x.device  # an expert of weights kept in host memory: copied here, one at a time
        weight = dequantize_unscaled(packed[expert].to(device), scales[expert].to(device), self.dtype)
        if self.cache is not None:
            self.cache[key] = weight
        return weight

    def activated(self, a1: torch.Tensor | None, activation: str, inter: int) -> torch.Tensor:
        """Return FC1 of every routed row, rounded to the output dtype and activated, in float32."""
        x, token_of_row = self.x, self.order // self.top_k
        # One global scale: x quantized once; one per expert: each expert's rows with its own scale.
        if a1 is None:
            acts = x.float()
        elif a1.dim() == 0:
            acts = requantized(x, a1, self.dtype)
        intermediate = torch.empty((token_of_row.numel(), inter), dtype=torch.float32, device=x.device)
        for expert, lo, hi in self.spans:
            rows = token_of_row[lo:hi]
            rows = acts[rows] if a1 is None or a1.dim() == 0 else requantized(x[rows], a1[expert], self.dtype)
            fc1 = expert_mm(rows, self.dequantized("w13", expert), self.weights.w13_alpha[expert])
            intermediate[lo:hi] = expert_activation(fc1.to(self.round_dtype).float(), activation, inter)
        if a1 is not None and not torch.isfinite(intermediate).all():
            raise InvalidArgument(
                f"{_MOE}: FC1 of x={describe(x)} with w13 and w13_alpha is not finite once rounded to "
                f"{self.round_dtype} and activated; expected inputs whose intermediate can be quantized"
            )
        return intermediate

    def finish(self, intermediate, intermediate_dtype, a2: torch.Tensor | None, topk_weights) -> torch.Tensor:
        """Return the output from the activated rows: re-quantization, FC2 and the finalize's sum."""
        if a2 is not None:
            if intermediate_dtype is not None:
                intermediate = intermediate.to(intermediate_dtype).float()
            if a2.dim() == 0:
                intermediate = requantized(intermediate, a2, self.dtype)
            else:
                intermediate = intermediate.clone()  # the per-expert writes must not reach the shared FC1
                for expert, lo, hi in self.spans:
                    intermediate[lo:hi] = requantized(intermediate[lo:hi], a2[expert], self.dtype).float()
                intermediate = intermediate.to(self.dtype)  # exact: dequantized FP4 values fit bf16
        tokens, hidden = self.x.shape
        # Each routed row lands at its unsorted position token * k + slot, for the finalize.
        routed = torch.empty((tokens * self.top_k, hidden), dtype=self.round_dtype, device=self.x.device)
        for expert, lo, hi in self.spans:
            row = expert_mm(intermediate[lo:hi], self.dequantized("w2", expert), self.weights.w2_alpha[expert])
            routed[self.order[lo:hi]] = row.to(self.round_dtype)
        # finalizeMoeRoutingKernel's sum: float32, slot by slot, a product then an add.
        routed = routed.view(tokens, self.top_k, hidden)
        out = torch.zeros((tokens, hidden), dtype=torch.float32, device=self.x.device)
        for slot in range(self.top_k):
            out = out + topk_weights[:, slot : slot + 1] * routed[:, slot].float()
        return out.to(self.out_dtype)


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
    """Return reference_moe_fp4 once per entry of `intermediate_dtypes`, sharing routing, FC1 and activation."""
    if not isinstance(intermediate_dtypes, tuple) or not intermediate_dtypes:
        accepted = "a non-empty tuple of None, torch.bfloat16 or torch.float16"
        raise not_accepted("reference_moe_fp4_roundings", "intermediate_dtypes", intermediate_dtypes, accepted)
    weights = MoeWeights(w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1_gscale, a2_gscale)
    experts, inter = check_moe_layout(_MOE, x, topk_ids, topk_weights, *weights[:6], activation)
    _check_moe_options(x, weights, (topk_ids, topk_weights), out_dtype, quantize_activations, intermediate_dtypes)
    a1 = a2 = None  # W4A16: x and the intermediate enter the GEMMs unquantized
    if quantize_activations:
        a1 = _moe_gscale("a1_gscale", a1_gscale, experts, x.device)
        a2 = _moe_gscale("a2_gscale", a2_gscale, experts, x.device)
        if not torch.isfinite(x).all():
            raise not_accepted(_MOE, "x", x, "finite values (found NaN or inf)")
    low, high = torch.stack(torch.aminmax(topk_ids.reshape(-1).long())).tolist() if topk_ids.numel() else (0, 0)
    if low < 0 or high >= experts:
        accepted = f"expert ids in [0, E={experts}), got ids in [{low}, {high}] (expert-parallel ids of other ranks"
        raise not_accepted(_MOE, "topk_ids", topk_ids, accepted + " are not accepted)")
    if x.shape[0] == 0:
        dtype = x.dtype if out_dtype is None else out_dtype
        return tuple(torch.zeros((0, x.shape[1]), dtype=dtype, device=x.device) for _ in intermediate_dtypes)
    run = _MoeRun(x, topk_ids, weights, out_dtype, quantize_activations, weight_cache)
    intermediate = run.activated(a1, activation, inter)
    return tuple(run.finish(intermediate, dtype, a2, topk_weights) for dtype in intermediate_dtypes)


def reference_moe_fp4(*args, intermediate_dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor:
    """Return FlashInfer cutlass_fused_moe's NVFP4 output (T, H), with its rounding points."""
    # The arguments are reference_moe_fp4_roundings'; docs/verification.md ("The oracle") states the math.
    return reference_moe_fp4_roundings(*args, intermediate_dtypes=(intermediate_dtype,), **kwargs)[0]
