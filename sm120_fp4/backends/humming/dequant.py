"""The activation dequantization as one Triton kernel (where the CUDA C one cannot be built), exact in bf16/fp16;
M is not specialised on, so no kernel is compiled at a batch size first seen inside CUDA-graph capture."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_G = 32  # 256 bytes, 512 elements of a row per program


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


@triton.jit(do_not_specialize=["m"])
def dequant(a_ptr, sf_ptr, out_ptr, m, half_k, kp, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program: BLOCK_M rows x BLOCK_G scale groups (BLOCK_G * 8 bytes of each row)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    row_ok = rows < m
    group_ok = groups < half_k // 8
    sf_off = (
        ((rows // 128) * 128 * kp)[:, None]
        + ((rows % 32) * 16 + ((rows % 128) // 32) * 4)[:, None]
        + ((groups // 4) * 512 + (groups % 4))[None, :]
    )
    scale = _e4m3(tl.load(sf_ptr + sf_off, mask=row_ok[:, None] & group_ok[None, :], other=0).to(tl.int32))
    cols = groups[:, None] * 8 + tl.arange(0, 8)[None, :]  # byte index in the row, (BLOCK_G, 8)
    in_mask = row_ok[:, None, None] & group_ok[None, :, None]
    byte = tl.load(a_ptr + rows[:, None, None] * half_k + cols[None, :, :], mask=in_mask, other=0).to(tl.int32)
    s = scale[:, :, None]
    vals = tl.reshape(tl.join(_e2m1(byte & 15) * s, _e2m1(byte >> 4) * s), (BLOCK_M, BLOCK_G * 16))
    ocol = tl.program_id(1) * BLOCK_G * 16 + tl.arange(0, BLOCK_G * 16)
    out_mask = row_ok[:, None] & (ocol < 2 * half_k)[None, :]
    tl.store(out_ptr + rows[:, None] * (2 * half_k) + ocol[None, :], vals.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch(a, sf_bytes, out, kp: int) -> None:
    """Dequantize `a` (M, K/2) uint8 with its swizzled scale bytes (`kp` scale columns) into `out` (M, K)."""
    m, half_k = a.shape
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(half_k // 8, BLOCK_G))
    dequant[grid](a, sf_bytes, out, m, half_k, kp, BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G)
