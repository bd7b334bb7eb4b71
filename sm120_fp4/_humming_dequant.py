"""The humming backend's activation dequantization, one Triton kernel (imported only on CUDA, by
:func:`sm120_fp4.humming.dequantize_activations`: Triton is not on the import path of a worker).

FP4 activations (M, K/2) as SGLang's quantizer returns them (element 2i in the low nibble) and
their 128x4-swizzled E4M3 scales become ``e2m1(code) * float(scale)`` (M, K): 5 significant bits,
exact in bf16 and fp16; the same values as :func:`sm120_fp4.nvfp4.dequantize_unscaled`, checked
bit for bit on the GPU (tests/test_humming.py) and through the self-test of every candidate.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    mag = code & 7
    e = (mag >> 1).to(tl.float32)
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2(e - 1.0))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _e4m3(byte):
    # Decoded arithmetically: no float8 type needed (sm_80 has none). S.EEEE.MMM, bias 7; 0x7F/0xFF NaN.
    exp = ((byte >> 3) & 15).to(tl.float32)
    man = (byte & 7).to(tl.float32)
    v = tl.where(exp == 0, man * 0.001953125, (1.0 + man * 0.125) * tl.exp2(exp - 7.0))
    v = tl.where((byte & 127) == 127, float("nan"), v)
    return tl.where((byte & 128) != 0, -v, v)


@triton.jit
def dequant(a_ptr, sf_ptr, out_ptr, half_k, kp, BLOCK: tl.constexpr):
    """One program: BLOCK bytes (2*BLOCK elements) of one row."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # byte index in the row
    mask = col < half_k
    byte = tl.load(a_ptr + row * half_k + col, mask=mask, other=0).to(tl.int32)
    g = col // 8  # one scale per 16 elements, 8 bytes
    sf_off = (row // 128) * 128 * kp + (g // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + (g % 4)
    scale = _e4m3(tl.load(sf_ptr + sf_off, mask=mask, other=0).to(tl.int32))
    vals = tl.reshape(tl.join(_e2m1(byte & 15) * scale, _e2m1(byte >> 4) * scale), (2 * BLOCK,))
    ocol = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + row * 2 * half_k + ocol, vals.to(out_ptr.dtype.element_ty), mask=ocol < 2 * half_k)
