"""The NVFP4 format in pure PyTorch, written from FlashInfer's documented recipe (128x4 scale layout).

E2M1 codes: bit 3 the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}, nearest with ties to even,
saturating at 6; two a byte, element 2i in the low nibble. One E4M3 scale per 16 elements, 128x4
swizzled, zero padded. Quantize: ``sf = e4m3(min(gsf * (amax * fl32(1/6)), 448))``, ``code =
e2m1(x * (1 / (float(sf) * (1 / gsf))))`` (FlashInfer's fast-math reciprocals may move a boundary
value by one code). Dequantize: ``e2m1(code) * float(sf) / gsf``; a GEMM's alpha is 1/(gsf_a*gsf_b).
"""

from __future__ import annotations

import torch

from ..errors import not_accepted

__all__ = [
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "unpack_nibbles",
    "swizzled_scale_shape",
    "swizzle_scales",
    "unswizzle_scales",
    "global_scale",
    "quantize",
    "dequantize",
    "dequantize_unscaled",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# Thresholds between neighbouring E2M1 magnitudes; one on a threshold goes to the even code (ties to even).
_ROUND_DOWN_AT = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_AT = (0.75, 1.75, 3.5)
_LUT_CACHE: dict = {}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_tensor(func: str, param: str, value: object, dtypes: tuple, ndim: int | None = None) -> None:
    if not isinstance(value, torch.Tensor):
        raise not_accepted(func, param, value, "a torch.Tensor")
    if value.dtype not in dtypes:
        raise not_accepted(func, param, value, "dtype in (" + ", ".join(str(d) for d in dtypes) + ")")
    if ndim is not None and value.dim() != ndim:
        raise not_accepted(func, param, value, f"a {ndim}-D tensor")


def _check_k(func: str, param: str, value: torch.Tensor, k: int) -> None:
    if k <= 0 or k % BLOCK_SIZE:
        accepted = f"K (the element count of a row) a positive multiple of {BLOCK_SIZE}, got K={k}"
        raise not_accepted(func, param, value, accepted)


def _device_constant(key: tuple, make):
    """Return `make()`, made once per `key` (which names the device) and kept."""
    # Kept so the quantizer and the oracle copy nothing to the device (they run inside CUDA-graph capture).
    value = _LUT_CACHE.get(key)
    if value is None:
        value = _LUT_CACHE.setdefault(key, make())
    return value


def _constant(values, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return torch.tensor(values) on `device`, made once and kept."""
    return _device_constant((values, device, dtype), lambda: torch.tensor(values, dtype=dtype, device=device))


def _encode_by_comparison(x: torch.Tensor) -> torch.Tensor:
    # Code = thresholds passed (> a round-down one, >= a round-up one: ties to even); NaN passes none.
    mag = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _ROUND_DOWN_AT:
        codes += mag > t
    for t in _ROUND_UP_AT:
        codes += mag >= t
    return _signed(x, codes)


def _signed(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Return `codes` with x's sign bit on non-zero codes (-0.0 and tiny negatives encode as +0)."""
    negative = (x < 0) & (codes > 0)
    return codes | (negative.to(torch.uint8) << 3)


# A float32's code is fixed by its top 12 bits (sign, exponent, 3 mantissa bits) and whether any of its 20
# lower bits is set: every threshold has at most 2 mantissa bits, so only a group's lowest float can equal
# one. The table holds, per group, the codes of that lowest float and of the one above it, by comparison.
_GROUP_SHIFT = 20


def _float32_code_table(device: torch.device) -> torch.Tensor:
    def make() -> torch.Tensor:
        top = torch.arange(1 << (32 - _GROUP_SHIFT), dtype=torch.int64) << _GROUP_SHIFT
        lowest = torch.where(top >= 1 << 31, top - (1 << 32), top).to(torch.int32)  # as a signed 32-bit word
        members = torch.stack((lowest, lowest | 1), dim=-1).view(torch.float32)
        return _encode_by_comparison(members).reshape(-1).to(device)

    return _device_constant(("e2m1 codes", device), make)


def _encode(x: torch.Tensor) -> torch.Tensor:
    """Return the E2M1 codes (uint8 0..15) of float32 `x`: nearest, ties to even, saturating at 6."""
    # On CUDA two sorted searches (4 launches instead of 15: a decode quantize is launch-bound); on the
    # CPU one lookup per element in _float32_code_table (3-4x faster than the comparisons). quantize
    # passes float32 only.
    if x.is_cuda:
        mag = x.abs()
        down, up = _constant(_ROUND_DOWN_AT, x.device, mag.dtype), _constant(_ROUND_UP_AT, x.device, mag.dtype)
        mag = mag.nan_to_num(nan=0.0)
        codes = torch.bucketize(mag, down, out_int32=True) + torch.bucketize(mag, up, out_int32=True, right=True)
        return _signed(x, codes.to(torch.uint8))
    bits = x.view(torch.int32)
    group = bits >> (_GROUP_SHIFT - 1)  # in place from here: each temporary costs as much as the lookup
    group &= (1 << (33 - _GROUP_SHIFT)) - 2  # the top 12 bits, times 2
    lower = bits & ((1 << _GROUP_SHIFT) - 1)
    group |= lower.ne_(0)  # + 1 where a lower bit is set
    return torch.index_select(_float32_code_table(x.device), 0, group.reshape(-1)).reshape(x.shape)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Return the codes (..., K) of bytes (..., K/2), low nibble first."""
    _check_tensor("unpack_nibbles", "packed", packed, (torch.uint8,))
    if packed.dim() == 0:
        raise not_accepted("unpack_nibbles", "packed", packed, "at least 1 dimension")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def swizzled_scale_shape(rows: int, k: int) -> tuple[int, int]:
    """Return the 128x4 swizzled scales' shape for `rows` x `k` elements: (ceil128(rows), ceil4(k/16))."""
    return _round_up(rows, 128), _round_up(k // BLOCK_SIZE, 4)


def swizzle_scales(sf: torch.Tensor) -> torch.Tensor:
    """Return block scales (M, K/16) in the zero-padded 128x4 layout (ceil128(M), ceil4(K/16))."""
    # Byte offset of scale (r, c): (r//128)*128*Kp + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4.
    _check_tensor("swizzle_scales", "sf", sf, _SCALE_DTYPES, ndim=2)
    rows, cols = sf.shape
    mp, kp = _round_up(rows, 128), _round_up(cols, 4)
    raw = sf.view(torch.uint8)
    padded = raw.new_zeros((mp, kp))
    padded[:rows, :cols] = raw
    tiles = padded.view(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(mp, kp).view(sf.dtype)


def unswizzle_scales(sf_swizzled: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Return the (m, k/16) scales of swizzled (ceil128(m), ceil4(k/16)) or flat ones; k counts elements."""
    func = "unswizzle_scales"
    _check_tensor(func, "sf_swizzled", sf_swizzled, _SCALE_DTYPES)
    if not isinstance(m, int) or m <= 0:
        raise not_accepted(func, "m", m, "a positive int (rows)")
    if not isinstance(k, int) or k <= 0 or k % BLOCK_SIZE:
        raise not_accepted(func, "k", k, f"a positive int multiple of {BLOCK_SIZE} (elements per row)")
    mp, kp = swizzled_scale_shape(m, k)
    if tuple(sf_swizzled.shape) not in ((mp, kp), (mp * kp,)):
        raise not_accepted(func, "sf_swizzled", sf_swizzled, f"shape ({mp}, {kp}) or ({mp * kp},) for m={m}, k={k}")
    if not sf_swizzled.is_contiguous():
        raise not_accepted(func, "sf_swizzled", sf_swizzled, "a contiguous tensor (the swizzled bytes in order)")
    raw = sf_swizzled.view(torch.uint8).reshape(mp // 128, kp // 4, 32, 4, 4)
    plain = raw.permute(0, 3, 2, 1, 4).reshape(mp, kp)
    return plain[:m, : k // BLOCK_SIZE].view(sf_swizzled.dtype)


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """Return the encode scale 448 * 6 / amax(|x|) as a float32 0-dim tensor on x's device."""
    _check_tensor("global_scale", "x", x, _FLOAT_INPUTS)
    if x.numel() == 0:
        raise not_accepted("global_scale", "x", x, "a non-empty tensor")
    amax = x.float().abs().amax()
    if not torch.isfinite(amax) or amax == 0:
        raise not_accepted("global_scale", "x", x, f"finite values, not all zero (amax(|x|)={float(amax)})")
    scale = torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=x.device) / amax
    if not torch.isfinite(scale):
        accepted = f"amax(|x|) large enough for a finite float32 scale (amax={float(amax):.3g})"
        raise not_accepted("global_scale", "x", x, accepted)
    return scale


def _as_scale(func: str, param: str, value: object, device: torch.device, check: bool) -> torch.Tensor:
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        value = torch.tensor(float(value), dtype=torch.float32, device=device)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.numel() != 1:
        raise not_accepted(func, param, value, "a positive finite float or a one-element float32 tensor")
    if value.device != device:
        raise not_accepted(func, param, value, f"a tensor on {device}")
    if check and not (torch.isfinite(value).all() and (value > 0).all()):
        raise not_accepted(func, param, value, f"a positive finite value, got {value.item()!r}")
    return value.reshape(())


# Values quantized at a time: a prefill-sized activation (M=8192, K=28672: 235M values) would otherwise take
# several float32 and int32 temporaries of its own size at once (5 GB); rows are independent.
_QUANTIZE_ELEMENTS = 1 << 24


def quantize(x: torch.Tensor, global_scale: object, *, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Return x (M, K) in NVFP4: packed uint8 (M, K/2) and 128x4 swizzled float8_e4m3fn scales."""
    # global_scale: the encode scale (SGLang passes 1 / input_scale). check_finite=False skips the host-syncing
    # checks where the caller guarantees finite input (inside graph capture).
    _check_tensor("quantize", "x", x, _FLOAT_INPUTS, ndim=2)
    m, k = x.shape
    _check_k("quantize", "x", x, k)
    if m == 0:
        raise not_accepted("quantize", "x", x, "at least one row")
    gsf = _as_scale("quantize", "global_scale", global_scale, x.device, check_finite)
    step = max(1, _QUANTIZE_ELEMENTS // k)
    if m <= step:
        packed, sf = _quantize_rows(x, gsf, check_finite, x)
    else:
        packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
        sf = torch.empty((m, k // BLOCK_SIZE), dtype=torch.float8_e4m3fn, device=x.device)
        for lo in range(0, m, step):
            packed[lo : lo + step], sf[lo : lo + step] = _quantize_rows(x[lo : lo + step], gsf, check_finite, x)
    return packed, swizzle_scales(sf)


def _quantize_rows(rows: torch.Tensor, gsf: torch.Tensor, check_finite: bool, x: torch.Tensor) -> tuple:
    """Return `rows` of quantize's `x` as packed codes and their (unswizzled) block scales."""
    m, k = rows.shape
    blocks = rows.float().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)
    # A block's amax is NaN or inf exactly where the block holds one: the check reads 16x fewer values.
    if check_finite and not torch.isfinite(amax).all():
        raise not_accepted("quantize", "x", x, "finite values (found NaN or inf)")
    rcp6 = _constant(1.0 / E2M1_MAX, rows.device)  # fl32(1/6)
    sf = torch.clamp(gsf * (amax * rcp6), max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.float()
    # The kernel's output scale: 1 / (float(sf) * (1 / gsf)), and 0 for an all-zero block.
    out_scale = torch.where(sf_f != 0, 1.0 / (sf_f * (1.0 / gsf)), torch.zeros_like(sf_f))
    codes = _encode(blocks * out_scale.unsqueeze(-1)).reshape(m, k)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), sf  # element 2i in the low nibble


def _check_packed_and_scales(
    func: str, packed: torch.Tensor, scales: torch.Tensor, p_name: str, s_name: str
) -> tuple[int, int]:
    _check_tensor(func, p_name, packed, (torch.uint8,), ndim=2)
    rows, k = packed.shape[0], packed.shape[1] * 2
    _check_k(func, p_name, packed, k)
    _check_tensor(func, s_name, scales, _SCALE_DTYPES)
    mp, kp = swizzled_scale_shape(rows, k)
    if tuple(scales.shape) not in ((mp, kp), (mp * kp,)):
        accepted = f"128x4 swizzled scales of shape ({mp}, {kp}) for {rows} rows and K={k}"
        raise not_accepted(func, s_name, scales, accepted)
    if scales.device != packed.device:
        raise not_accepted(func, s_name, scales, f"a tensor on {packed.device} (where {p_name} is)")
    return rows, k


def _scaled_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Return the (65536, 2) table ``byte | scale_byte << 8`` -> the byte's (low, high) values times the scale."""

    # Every entry is exact in float32 and bf16 (2 significant bits times 4; 2**-10 <= |product| <= 2688).
    def make() -> torch.Tensor:
        index = torch.arange(1 << 16)
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        scale = (index >> 8).to(torch.uint8).view(torch.float8_e4m3fn).float()
        pairs = torch.stack((values[index & 0x0F], values[(index >> 4) & 0x0F]), dim=-1) * scale.unsqueeze(-1)
        return pairs.to(device=device, dtype=dtype)

    return _device_constant(("scaled", device, dtype), make)


def dequantize_unscaled(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return e2m1(code) * float(sf) (rows, K), exact in float32 and in bfloat16 alike."""
    rows, k = _check_packed_and_scales("dequantize_unscaled", packed, scales, "packed", "scales")
    if dtype not in (torch.float32, torch.bfloat16):
        raise not_accepted("dequantize_unscaled", "dtype", dtype, "torch.float32 or torch.bfloat16")
    # One lookup per byte gives both nibbles' values times their block's scale: the index is the byte and
    # its scale's byte (uint8 scales hold E4M3 bytes: reinterpreted, never converted).
    sf = unswizzle_scales(scales.contiguous(), rows, k).view(torch.uint8)
    index = (sf.int() << 8).unsqueeze(-1) | packed.reshape(rows, k // BLOCK_SIZE, BLOCK_SIZE // 2)
    # Gathered as one word per pair: index_select of words takes about half an embedding's GPU time (H200).
    words = _scaled_lut(packed.device, dtype).view(torch.int32 if dtype == torch.bfloat16 else torch.int64).reshape(-1)
    return torch.index_select(words, 0, index.reshape(-1)).view(dtype).view(rows, k)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: object) -> torch.Tensor:
    """Return NVFP4 (packed (M, K/2), swizzled scales) dequantized to float32 (M, K): e2m1 * sf / gsf."""
    _check_packed_and_scales("dequantize", packed, scales, "packed", "scales")
    gsf = _as_scale("dequantize", "global_scale", global_scale, packed.device, True)
    return dequantize_unscaled(packed, scales) / gsf
