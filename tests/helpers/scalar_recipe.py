"""An independent, scalar, slow statement of FlashInfer's documented NVFP4 recipe.

Written element by element with numpy float32 arithmetic and explicit tables, sharing no
code with sm120_fp4.nvfp4, so the vectorised implementation is checked against the
recipe itself rather than against a copy of its own steps.
"""

from __future__ import annotations

import math

import numpy as np

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
F32 = np.float32


def _e4m3_table() -> list[tuple[float, int]]:
    """Every non-negative finite float8_e4m3fn value with its byte, from the bit layout."""
    table = []
    for byte in range(0x7F):  # 0x7F is NaN
        exp, man = byte >> 3, byte & 7
        value = (man / 8) * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        table.append((value, byte))
    return table


E4M3 = _e4m3_table()


def e4m3_byte(value: float) -> int:
    """Round a non-negative float to E4M3 (nearest, ties to even mantissa), saturating at 448."""
    value = min(float(value), 448.0)
    best = min(E4M3, key=lambda vb: (abs(vb[0] - value), vb[1] & 1))
    return best[1]


def e4m3_value(byte: int) -> float:
    return E4M3[byte][0]


def e2m1_code(value: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code, saturating at 6; sign in bit 3; zero is +0."""
    mag = min(abs(float(value)), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c & 1))
    if code and value < 0:
        code |= 8
    return code


def quantize_row(row: np.ndarray, gsf: float) -> tuple[list[int], list[int]]:
    """Codes and scale bytes of one row (float32 values), block by block."""
    gsf = F32(gsf)
    rcp6 = F32(1.0) / F32(6.0)
    codes, scales = [], []
    for start in range(0, len(row), 16):
        block = row[start : start + 16].astype(np.float32)
        amax = F32(np.max(np.abs(block)))
        byte = e4m3_byte(F32(gsf * F32(amax * rcp6)))
        sf = F32(e4m3_value(byte))
        out_scale = F32(F32(1.0) / F32(sf * F32(F32(1.0) / gsf))) if sf != 0 else F32(0.0)
        scales.append(byte)
        codes.extend(e2m1_code(F32(v * out_scale)) for v in block)
    return codes, scales


def swizzled_offset(r: int, c: int, kp: int) -> int:
    """Byte offset of scale (row r, block column c) in the 128x4 layout with kp padded columns."""
    return (r // 128) * 128 * kp + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def ceil_to(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple
