"""An independent, scalar, slow statement of the NVFP4 fused MoE that reference_moe_fp4 computes.

Element by element in numpy float32 and Python floats, sharing no code with sm120_fp4.nvfp4:
only scalar_recipe's E2M1/E4M3 tables, its row quantizer and its swizzle offset are reused.
It takes reference_moe_fp4's inputs (torch tensors, read once into Python values) and returns
the output's values as a float32 numpy array (T, H).

Each GEMM dot product is the exact sum of its (exactly representable) products, rounded once to
float32 (``math.fsum``): float32 accumulation in some order, which this statement does not fix,
lands on that value whenever its partial sums are exact, and within a float32 ulp or so of it
otherwise. Keyword switches move one rounding point each, so tests can show that each matters.
"""

from __future__ import annotations

import math

import numpy as np

from helpers import scalar_recipe as recipe

F32 = np.float32


def _e4m3(byte: int) -> float:
    """An E4M3 scale byte's value; the sign bit is honoured, NaN (0x7F, 0xFF) refused."""
    if byte & 0x7F == 0x7F:
        raise ValueError(f"scale byte {byte:#04x} is NaN")
    value = recipe.e4m3_value(byte & 0x7F)
    return -value if byte & 0x80 else value


def _e2m1(code: int) -> float:
    value = recipe.E2M1[code & 7]
    return -value if code & 8 else value


def _bytes(tensor) -> list:
    """A uint8 / float8 tensor's bytes as nested Python ints (its 'view' as uint8)."""
    import torch

    return tensor.detach().cpu().contiguous().view(torch.uint8).tolist()


def unscaled_weight_rows(packed: list, scales: list, rows: int, k: int) -> list:
    """One expert's e2m1(code) * sf as rows of Python floats, read byte by byte.

    `packed`: rows lists of k/2 bytes, element 2i in the low nibble; `scales`: the expert's
    swizzled (ceil128(rows), ceil4(k/16)) bytes as nested lists.
    """
    kp = recipe.ceil_to(k // 16, 4)
    flat = [b for line in scales for b in line]
    out = []
    for r in range(rows):
        row = []
        for j in range(k):
            byte = packed[r][j // 2]
            code = byte & 0x0F if j % 2 == 0 else byte >> 4
            sf = _e4m3(flat[recipe.swizzled_offset(r, j // 16, kp)])
            row.append(_e2m1(code) * sf)
        out.append(row)
    return out


def unscaled_activation_row(row: np.ndarray, gsf: float) -> list:
    """Quantize one float32 row with scalar_recipe and return e2m1(code) * sf per element."""
    codes, scale_bytes = recipe.quantize_row(row.astype(np.float32), gsf)
    return [_e2m1(c) * recipe.e4m3_value(scale_bytes[j // 16]) for j, c in enumerate(codes)]


def dot(a: list, b: list) -> np.float32:
    """The exact sum of a[j] * b[j], rounded once to float32."""
    return F32(math.fsum(x * y for x, y in zip(a, b)))


def round_to(value: np.float32, dtype: str) -> np.float32:
    """Round a float32 to bfloat16 / float16 (nearest, ties to even) and back; float32 as is."""
    value = F32(value)
    if dtype == "float32":
        return value
    if dtype == "float16":
        return F32(np.float16(value))
    if dtype != "bfloat16":
        raise ValueError(dtype)
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    if value != value:
        return value
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return np.array(bits & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def silu_times(gate: np.float32, up: np.float32) -> np.float32:
    """(gate * (1 / (1 + exp(-gate)))) * up, each operation rounded to float32."""
    with np.errstate(over="ignore"):
        e = F32(np.exp(-np.float64(gate)))
    sigmoid = F32(F32(1.0) / F32(F32(1.0) + e))
    return F32(F32(gate * sigmoid) * up)


def relu_squared(value: np.float32) -> np.float32:
    r = F32(max(F32(value), F32(0.0)))
    return F32(r * r)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def moe(
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
    activation: str = "swiglu",
    out_dtype=None,
    *,
    quantize_activations: bool = True,
    round_fc1: bool = True,
    round_fc2: bool = True,
    quantize_rounded_intermediate: bool = False,
    fused_finalize: bool = False,
) -> np.ndarray:
    """The fused MoE for every (token, slot), written out one value at a time.

    For each token t and slot j with expert e = topk_ids[t, j]:
      1. xq = e2m1 * sf of x[t] quantized with a1_gscale (unquantized x with
         quantize_activations=False);
      2. fc1[n] = float32(w13_alpha[e] * dot(xq, w13[e][n])), rounded to the output dtype
         (`round_fc1`); rows 0..I are "up", I..2I "gate";
      3. act[i] = silu(gate[i]) * up[i] (swiglu) or max(fc1[i], 0)^2 (relu2), float32;
      4. actq = e2m1 * sf of act quantized with a2_gscale from float32
         (`quantize_rounded_intermediate` quantizes act rounded to the output dtype instead,
         as FlashInfer's kernel does; quantize_activations=False uses act itself);
      5. row[n] = float32(w2_alpha[e] * dot(actq, w2[e][n])), rounded to the output dtype
         (`round_fc2`);
    and out[t, n] = sum over j in order of float32(topk_weights[t, j] * row_j[n]) in float32,
    rounded to `out_dtype` (None: x's dtype). The GEMM outputs round to the output dtype, or to
    x's dtype when `out_dtype` is float32.

    `fused_finalize` states FlashInfer's FINALIZE-fused GEMM2 epilogue instead of steps 5 and
    the sum: topk_weights[t, j] * (w2_alpha[e] * dot) in float32, rounded to the output dtype
    and added into an output-dtype accumulator (in slot order here; the kernel's atomic adds
    have none).
    """
    out_name = _dtype_name(out_dtype if out_dtype is not None else x.dtype)
    round_name = _dtype_name(x.dtype) if out_name == "float32" else out_name
    xs = x.detach().cpu().float().numpy()
    ids = topk_ids.detach().cpu().tolist()
    weights = topk_weights.detach().cpu().numpy().astype(np.float32)
    alpha13 = [F32(a) for a in w13_alpha.detach().cpu().tolist()]
    alpha2 = [F32(a) for a in w2_alpha.detach().cpu().tolist()]
    tokens, hidden = xs.shape
    rows13 = w13.shape[1]
    inter = rows13 // 2 if activation == "swiglu" else rows13
    a1 = float(a1_gscale) if a1_gscale is not None else None
    a2 = float(a2_gscale) if a2_gscale is not None else None

    cache: dict = {}

    def weights_of(e: int) -> tuple[list, list]:
        if e not in cache:
            cache[e] = (
                unscaled_weight_rows(_bytes(w13[e]), _bytes(w13_sf[e]), rows13, hidden),
                unscaled_weight_rows(_bytes(w2[e]), _bytes(w2_sf[e]), hidden, inter),
            )
        return cache[e]

    out = np.zeros((tokens, hidden), dtype=np.float32)
    for t in range(tokens):
        if quantize_activations:
            xq = unscaled_activation_row(xs[t], a1)
        else:
            xq = [float(v) for v in xs[t]]
        routed_rows = []
        for e in ids[t]:
            w13_rows, w2_rows = weights_of(e)
            fc1 = []
            for n in range(rows13):
                value = F32(alpha13[e] * dot(xq, w13_rows[n]))
                fc1.append(round_to(value, round_name) if round_fc1 else value)
            if activation == "swiglu":
                act = [silu_times(fc1[inter + i], fc1[i]) for i in range(inter)]
            else:
                act = [relu_squared(v) for v in fc1]
            if quantize_activations:
                source = [round_to(v, round_name) for v in act] if quantize_rounded_intermediate else act
                actq = unscaled_activation_row(np.array(source, dtype=np.float32), a2)
            else:
                actq = [float(v) for v in act]
            row = []
            for n in range(hidden):
                value = F32(alpha2[e] * dot(actq, w2_rows[n]))
                if fused_finalize:
                    value = round_to(F32(weights[t, len(routed_rows)] * value), round_name)
                row.append(round_to(value, round_name) if round_fc2 else value)
            routed_rows.append(row)
        for n in range(hidden):
            acc = F32(0.0)
            for j, row in enumerate(routed_rows):
                if fused_finalize:
                    acc = round_to(F32(acc + row[n]), round_name)
                else:
                    acc = F32(acc + F32(weights[t, j] * row[n]))
            out[t, n] = round_to(acc, out_name)
    return out
