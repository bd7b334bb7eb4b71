"""The NVFP4 reference pinned to FlashInfer's documented format, without calling FlashInfer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import scalar_recipe as recipe
from helpers.cases import case
from helpers.common import HYPOTHESIS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from sm120_fp4 import nvfp4
from sm120_fp4.errors import InvalidArgument

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RAGGED = [(1, 16), (3, 48), (127, 80), (129, 32), (300, 112)]


# ---- E2M1 codes, through quantize ----------------------------------------------------------


def encode(values: torch.Tensor) -> torch.Tensor:
    """Return the E2M1 codes `quantize` gives `values`: each stands in a block beside 6.0 under global
    scale 448, so its block scale is 448 and its output scale exactly 1 (the code is e2m1(value))."""
    x = values.float().reshape(-1, 1)
    blocks = torch.cat((torch.full_like(x, 6.0), x, torch.zeros(x.shape[0], 14, device=x.device)), dim=1)
    packed, scales = nvfp4.quantize(blocks, 448.0, check_finite=False)
    assert bool((nvfp4.unswizzle_scales(scales, len(x), 16).view(torch.uint8) == 0x7E).all()), "block scale 448"
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(len(x), 16)
    return codes[:, 1]


def decode(codes: torch.Tensor) -> torch.Tensor:
    """Return the values of E2M1 codes, from the documented table."""
    return torch.tensor(nvfp4.E2M1_VALUES, device=codes.device)[codes.long()]


TIES = [  # value on a threshold -> the value of the even code it must round to
    (0.25, 0.0),
    (0.75, 1.0),
    (1.25, 1.0),
    (1.75, 2.0),
    (2.5, 2.0),
    (3.5, 4.0),
    (5.0, 4.0),
]


@pytest.mark.parametrize("value, expected", TIES + [(-v, -e) for v, e in TIES])
def test_every_tie_rounds_to_the_even_code(device, value, expected):
    code = encode(torch.tensor([value], device=device))
    assert decode(code).item() == expected
    if expected == 0.0:
        assert code.item() == 0, "zero must encode as +0 even from a negative input"


def test_values_beside_each_tie_round_to_their_nearest(device):
    eps = 1e-3
    for value, _ in TIES:
        lo, hi = value - eps, value + eps
        got = decode(encode(torch.tensor([lo, hi], device=device))).tolist()
        want = [min(recipe.E2M1, key=lambda e: abs(e - v)) for v in (lo, hi)]
        assert got == want


def test_all_sixteen_codes_round_trip_and_zero_is_positive(device):
    codes = torch.arange(16, dtype=torch.uint8, device=device)
    values = decode(codes)
    assert values.tolist() == list(nvfp4.E2M1_VALUES)
    back = encode(values)
    expected = codes.clone()
    expected[8] = 0  # -0.0 encodes as +0
    assert torch.equal(back, expected)


def test_encode_saturates_at_six_with_its_sign(device):
    x = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, -float("inf")], device=device)
    assert encode(x).tolist() == [7, 7, 7, 7, 15, 15]


def test_encode_is_nearest_even_at_every_group_of_float32_bit_patterns(device):
    # The CPU encodes float32 by the float's top 12 bits and whether a lower bit is set: every such
    # group of floats (sign, exponent, 3 mantissa bits), at its lowest, second-lowest, middle and
    # highest member, against the rounding rule written out in float64 (all 2**32 patterns agree
    # too; that run takes minutes, too long for the suite).
    top = torch.arange(1 << 12, dtype=torch.int64) << 20
    low = torch.tensor([0, 1, 0x7FFFF, 0x80000, 0xFFFFF], dtype=torch.int64)
    words = (top.unsqueeze(1) | low).reshape(-1)
    x = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    codes = encode(x.to(device)).cpu()
    target = x.double().abs().clamp(max=6.0)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    distance = (magnitudes - target.unsqueeze(1)).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    want = torch.where(nearest.sum(dim=1) == 2, even.int().argmax(dim=1), nearest.int().argmax(dim=1))
    want = want + 8 * ((x < 0) & (want > 0)).long()
    assert torch.equal(codes.long(), want)


# ---- nibble unpacking -----------------------------------------------------------------------


def test_element_2i_is_the_low_nibble(device):
    packed = torch.tensor([[0x21, 0x0F, 0x97]], dtype=torch.uint8, device=device)
    assert nvfp4.unpack_nibbles(packed).tolist() == [[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]]


# ---- 128x4 scale layout -------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 127, 128, 129, 300])
@pytest.mark.parametrize("kblocks", [1, 3, 4, 5, 7])
def test_swizzle_matches_the_byte_offset_formula(m, kblocks):
    sf = torch.randint(1, 256, (m, kblocks), dtype=torch.uint8)
    out = nvfp4.swizzle_scales(sf)
    mp, kp = recipe.ceil_to(m, 128), recipe.ceil_to(kblocks, 4)
    assert tuple(out.shape) == (mp, kp) == nvfp4.swizzled_scale_shape(m, kblocks * 16)
    flat = out.flatten().tolist()
    rows = sf.tolist()
    seen = set()
    for r in range(m):
        for c in range(kblocks):
            off = recipe.swizzled_offset(r, c, kp)
            assert flat[off] == rows[r][c], (r, c, off)
            seen.add(off)
    assert all(flat[i] == 0 for i in range(mp * kp) if i not in seen), "padding must be zero"


@pytest.mark.parametrize("m, k", RAGGED)
def test_unswizzle_inverts_swizzle_for_both_scale_dtypes(device, m, k):
    sf = torch.randint(0, 0x7F, (m, k // 16), dtype=torch.uint8, device=device)
    for s in (sf, sf.view(torch.float8_e4m3fn)):
        sw = nvfp4.swizzle_scales(s)
        assert sw.dtype == s.dtype
        assert torch.equal(nvfp4.unswizzle_scales(sw, m, k).view(torch.uint8), sf)
        assert torch.equal(nvfp4.unswizzle_scales(sw.flatten(), m, k).view(torch.uint8), sf)


def test_unswizzle_names_the_shape_it_needs():
    with pytest.raises(InvalidArgument, match=r"sf_swizzled=.*shape \(128, 4\)"):
        nvfp4.unswizzle_scales(torch.zeros(128, 3, dtype=torch.uint8), 5, 48)
    with pytest.raises(InvalidArgument, match="k=40"):
        nvfp4.unswizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), 5, 40)


# ---- quantize: bit-exact against the scalar recipe ---------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m, k", RAGGED[:4])
def test_quantize_is_bit_exact_with_the_documented_recipe(device, dtype, m, k):
    x = (torch.randn(m, k) * torch.logspace(-3, 3, m).unsqueeze(1)).to(dtype).to(device)
    if m * k > 16:
        x[0, :16] = 0  # one all-zero block
    gsf = nvfp4.global_scale(x)
    packed, scales = nvfp4.quantize(x, gsf)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (m, k // 2)
    assert scales.dtype == torch.float8_e4m3fn
    assert tuple(scales.shape) == (recipe.ceil_to(m, 128), recipe.ceil_to(k // 16, 4))
    codes = nvfp4.unpack_nibbles(packed).cpu().tolist()
    sf = nvfp4.unswizzle_scales(scales, m, k).view(torch.uint8).cpu().tolist()
    rows = x.float().cpu().numpy()
    for r in range(m):
        want_codes, want_sf = recipe.quantize_row(rows[r], gsf.item())
        assert sf[r] == want_sf, f"scale bytes of row {r}"
        assert codes[r] == want_codes, f"codes of row {r}"


@case(
    "properties",
    "an activation larger than quantize's block of values (300 rows of K=64, quantized 7 rows at a time)",
    "the same bytes as quantized whole (rows are independent; the scales swizzled once), and a NaN in a later "
    "block still refused naming x: a prefill's activation costs no more memory than one block",
)
def test_quantize_in_row_blocks_is_bit_exact_with_quantizing_whole(device, monkeypatch):
    from sm120_fp4.nvfp4 import format as nvfp4_format

    x = (torch.randn(300, 64) * torch.logspace(-3, 3, 300).unsqueeze(1)).to(torch.bfloat16).to(device)
    gsf = nvfp4.global_scale(x)
    whole = nvfp4.quantize(x, gsf)
    monkeypatch.setattr(nvfp4_format, "_QUANTIZE_ELEMENTS", 64 * 7)
    blocked = nvfp4.quantize(x, gsf)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1].view(torch.uint8), whole[1].view(torch.uint8))
    x[250, 3] = float("nan")
    with pytest.raises(InvalidArgument, match="x=.*finite values"):
        nvfp4.quantize(x, gsf)


def test_quantize_saturates_scales_when_the_global_scale_is_too_large(device):
    x = torch.full((1, 16), 10.0, device=device)
    packed, scales = nvfp4.quantize(x, 1000.0)  # gsf * amax / 6 = 1666 > 448
    assert nvfp4.unswizzle_scales(scales, 1, 16).float().tolist() == [[448.0]]
    assert set(nvfp4.unpack_nibbles(packed).flatten().tolist()) == {7}


@pytest.mark.parametrize("m, k", RAGGED)
def test_representable_values_round_trip_exactly(device, m, k):
    codes = torch.randint(0, 16, (m, k), dtype=torch.uint8, device=device)
    codes[:, 0] = 7  # every block holds its maximum, 6, so the scale is exact
    codes[:, 16::16] = 7
    sf_exp = torch.randint(-6, 8, (m, k // 16, 1), device=device).float()
    gsf = torch.tensor(4.0, device=device)
    x = decode(codes).view(m, k // 16, 16) * torch.exp2(sf_exp) / gsf
    packed, scales = nvfp4.quantize(x.view(m, k), gsf)
    back = nvfp4.dequantize(packed, scales, gsf)
    assert torch.equal(back, x.view(m, k))
    same = nvfp4.unpack_nibbles(packed)
    assert torch.equal(decode(same), decode(codes))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_round_trip_error_is_within_one_block_scale_step(device, dtype):
    x = (torch.randn(129, 96) * 3).to(dtype).to(device)
    gsf = nvfp4.global_scale(x)
    packed, scales = nvfp4.quantize(x, gsf)
    back = nvfp4.dequantize(packed, scales, gsf)
    step = nvfp4.unswizzle_scales(scales, 129, 96).float().repeat_interleave(16, dim=1) / gsf
    assert torch.all((back - x.float()).abs() <= step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_unscaled_is_code_value_times_scale_for_every_byte_and_scale_byte(device, dtype):
    # Every packed byte (both nibbles) under every E4M3 scale byte, NaN bytes included, from the
    # documented decode: e2m1(code) * float(sf), exactly, in float32 and in bf16.
    rows = 256  # row r: scale byte r in every block; the 256 bytes, 16 to a block, over 16 blocks
    packed = torch.arange(256, dtype=torch.uint8, device=device).repeat(rows, 1)
    sf_bytes = torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(1).repeat(1, 32)
    scales = nvfp4.swizzle_scales(sf_bytes)
    got = nvfp4.dequantize_unscaled(packed, scales, dtype)
    codes = nvfp4.unpack_nibbles(packed)
    want = (decode(codes) * sf_bytes.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, 512)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.any(dim=1).sum()) == 2  # the two NaN scale bytes, 0x7f and 0xff
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[~nan].signbit(), want[~nan].signbit())  # -0.0 stays -0.0


# ---- bad input ----------------------------------------------------------------------------


def test_quantize_errors_name_parameter_value_and_what_is_accepted():
    with pytest.raises(InvalidArgument, match=r"quantize: x=tensor\(shape=\(2, 30\).*multiple of 16, got K=30"):
        nvfp4.quantize(torch.randn(2, 30), 1.0)
    with pytest.raises(InvalidArgument, match=r"quantize: x=.*int32.*dtype in"):
        nvfp4.quantize(torch.ones(2, 32, dtype=torch.int32), 1.0)
    with pytest.raises(InvalidArgument, match=r"quantize: x=.*finite values"):
        nvfp4.quantize(torch.tensor([[float("inf")] + [0.0] * 15]), 1.0)
    with pytest.raises(InvalidArgument, match=r"global_scale=.*positive finite"):
        nvfp4.quantize(torch.ones(1, 16), 0.0)
    with pytest.raises(InvalidArgument, match=r"global_scale=.*one-element float32"):
        nvfp4.quantize(torch.ones(1, 16), torch.ones(2))
    with pytest.raises(InvalidArgument, match="2-D"):
        nvfp4.quantize(torch.ones(16), 1.0)


def test_global_scale_is_448_times_6_over_amax_and_refuses_zeros(device):
    x = torch.tensor([[0.5, -4.0]], device=device)
    assert nvfp4.global_scale(x).item() == pytest.approx(448 * 6 / 4.0)
    assert nvfp4.global_scale(x).dtype == torch.float32 and nvfp4.global_scale(x).dim() == 0
    with pytest.raises(InvalidArgument, match="not all zero"):
        nvfp4.global_scale(torch.zeros(2, 16, device=device))


# ---- the GEMM reference -------------------------------------------------------------------


def _operands(m, n, k, device, dtype=torch.bfloat16):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) * 0.05
    ga, gb = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qa, sa = nvfp4.quantize(x, ga)
    qb, sb = nvfp4.quantize(w, gb)
    alpha = (1.0 / (ga * gb)).reshape(1)
    return (qa, qb.T, sa, sb.T, alpha), (ga, gb)


@pytest.mark.parametrize("m, n, k", [(1, 32, 64), (7, 96, 160), (129, 40, 48), (300, 64, 32)])
def test_reference_mm_agrees_with_float64_matmul_of_dequantized_operands(device, m, n, k):
    (qa, b, sa, b_sf, alpha), (ga, gb) = _operands(m, n, k, device)
    got = nvfp4.reference_mm_fp4(qa, b, sa, b_sf, alpha, out_dtype=torch.float32)
    deq_a = nvfp4.dequantize(qa, sa, ga).double()
    deq_b = nvfp4.dequantize(b.T, b_sf.T, gb).double()
    want = deq_a @ deq_b.T
    rel = (got.double() - want).norm() / want.norm()
    assert rel < 1e-5, rel
    bf16 = nvfp4.reference_mm_fp4(qa, b, sa, b_sf, alpha)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, got.to(torch.bfloat16))


def test_reference_mm_writes_into_out_and_accepts_uint8_scales(device):
    (qa, b, sa, b_sf, alpha), _ = _operands(5, 32, 64, device)
    out = torch.full((5, 32), float("nan"), dtype=torch.float16, device=device)
    ret = nvfp4.reference_mm_fp4(qa, b, sa.view(torch.uint8), b_sf.view(torch.uint8), alpha, torch.float16, out)
    assert ret is out and torch.isfinite(out).all()
    assert torch.equal(out, nvfp4.reference_mm_fp4(qa, b, sa, b_sf, alpha, torch.float16))


def test_reference_mm_rejects_row_major_b_and_mismatched_shapes():
    (qa, b, sa, b_sf, alpha), _ = _operands(4, 32, 64, "cpu")
    with pytest.raises(InvalidArgument, match=r"reference_mm_fp4: b=.*column-major"):
        nvfp4.reference_mm_fp4(qa, b.contiguous(), sa, b_sf, alpha)
    with pytest.raises(InvalidArgument, match=r"b=.*K/2=16"):
        nvfp4.reference_mm_fp4(qa[:, :16], b, nvfp4.swizzle_scales(torch.zeros(4, 2, dtype=torch.uint8)), b_sf, alpha)
    with pytest.raises(InvalidArgument, match=r"a_descale=.*\(128, 4\)"):
        nvfp4.reference_mm_fp4(qa, b, sa[:, :2].contiguous(), b_sf, alpha)
    with pytest.raises(InvalidArgument, match=r"alpha=.*one-element float32 tensor"):
        nvfp4.reference_mm_fp4(qa, b, sa, b_sf, torch.ones(3))
    with pytest.raises(InvalidArgument, match="out_dtype"):
        nvfp4.reference_mm_fp4(qa, b, sa, b_sf, alpha, torch.int8)
    with pytest.raises(InvalidArgument, match=r"out=.*\(4, 32\)"):
        nvfp4.reference_mm_fp4(qa, b, sa, b_sf, alpha, torch.bfloat16, torch.empty(4, 31, dtype=torch.bfloat16))


# ---- properties over shapes and value ranges ----------------------------------------------

MAGNITUDES = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30])


@st.composite
def matrices(draw):
    m = draw(st.integers(1, 140))
    kblocks = draw(st.integers(1, 6))
    scale = draw(MAGNITUDES)
    kind = draw(st.sampled_from(["normal", "positive", "negative", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    return (_signed(m, kblocks * 16, kind, gen) * scale).float()


def _signed(m: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A float64 (m, k) normal sample made all positive, all negative or 90% zeros by `kind`."""
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    if kind == "positive":
        return x.abs()
    if kind == "negative":
        return -x.abs()
    if kind == "sparse":
        return x * (torch.rand(x.shape, generator=gen, dtype=torch.float64) < 0.1)
    return x


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=matrices(), n=st.integers(1, 48))
def test_property_reference_mm_matches_float64(x, n):
    m, k = x.shape
    n = n * 8
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    gx = nvfp4.global_scale(x) if x.abs().max() > 0 else torch.tensor(1.0)
    gw = nvfp4.global_scale(w)
    qa, sa = nvfp4.quantize(x, gx)
    qb, sb = nvfp4.quantize(w, gw)
    alpha = (1.0 / (gx * gw)).reshape(1)
    got = nvfp4.reference_mm_fp4(qa, qb.T, sa, sb.T, alpha, torch.float32)
    want = nvfp4.dequantize(qa, sa, gx).double() @ nvfp4.dequantize(qb, sb, gw).double().T
    assert torch.isfinite(got).all()
    if want.norm() == 0:
        assert torch.all(got == 0)
    else:
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_numpy_recipe_agrees_with_itself_on_known_values():
    # Guard the oracle: the scalar recipe's E4M3 table and ties are right.
    assert recipe.e4m3_byte(448.0) == 0x7E and recipe.e4m3_byte(1000.0) == 0x7E
    assert recipe.e4m3_value(recipe.e4m3_byte(2.0**-9)) == 2.0**-9
    assert recipe.e4m3_byte(1.0625) == recipe.e4m3_byte(1.0)  # tie -> even mantissa
    assert recipe.e2m1_code(np.float32(-0.1)) == 0


# ---- reliability properties (issue item 6) -------------------------------------------------------

E2M1_MAGNITUDES = sorted(set(abs(v) for v in nvfp4.E2M1_VALUES))


@case(
    "properties",
    "E2M1 encode over all finite float32 incl. ties, +-6, +-inf, subnormals, -0",
    "decode(encode(x)) is the nearest E2M1 value of clamp(x, -6, 6), ties to the even code, sign kept",
)
@hsettings(max_examples=150, **HYPOTHESIS)
@given(
    st.lists(
        st.one_of(
            st.floats(width=32, allow_nan=False),
            st.sampled_from(
                [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 448.0, -0.0, 1e-45, float("inf"), -float("inf")]
            ),
        ),
        min_size=1,
        max_size=64,
    )
)
def test_e2m1_encoding_is_round_to_nearest_even_and_saturating(values):
    x = torch.tensor(values, dtype=torch.float32)
    codes = encode(x)
    got = decode(codes)
    for value, code, decoded in zip(values, codes.tolist(), got.tolist()):
        target = min(abs(value), 6.0)
        best = min(abs(m - target) for m in E2M1_MAGNITUDES)
        assert abs(abs(decoded) - target) == best
        ties = [i for i, m in enumerate(E2M1_MAGNITUDES) if abs(m - target) == best]
        if len(ties) == 2:
            assert (code & 7) % 2 == 0, (value, code)
        assert decoded == 0 or (decoded < 0) == (value < 0)


@case(
    "properties",
    "nibble pack/unpack and 128x4 scale swizzle over shapes 1..300 rows and E4M3 extreme bytes",
    "exact round trips; padding is zero",
)
@hsettings(max_examples=60, **HYPOTHESIS)
@given(
    rows=st.integers(1, 300),
    blocks=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    extremes=st.sampled_from([None, 0x00, 0x01, 0x7E, 0x80, 0xFE]),
)
def test_packing_and_swizzling_round_trip(rows, blocks, seed, extremes):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, blocks * 16), dtype=torch.uint8, generator=gen)
    assert torch.equal(nvfp4.unpack_nibbles(codes[:, 0::2] | (codes[:, 1::2] << 4)), codes)
    raw = torch.randint(0, 256, (rows, blocks), dtype=torch.uint8, generator=gen)
    if extremes is not None:
        raw[::2] = extremes
    sf = raw.view(torch.float8_e4m3fn)
    swizzled = nvfp4.swizzle_scales(sf)
    assert tuple(swizzled.shape) == nvfp4.swizzled_scale_shape(rows, blocks * 16)
    assert torch.equal(nvfp4.unswizzle_scales(swizzled, rows, blocks * 16).view(torch.uint8), raw)
    assert int(swizzled.view(torch.uint8).sum()) == int(raw.sum(dtype=torch.int64))  # padding adds nothing


@case(
    "properties",
    "quantize/dequantize over shapes, magnitudes 2^-100..2^100, signs, sparse and all-zero blocks, global scale x2^-20..x2^20",
    "scales finite and <= 448 (never the NaN byte), zeros stay exact zeros, error <= one E2M1 step of the block scale",
)
@hsettings(max_examples=80, **HYPOTHESIS)
@given(
    m=st.integers(1, 40),
    blocks=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    exponent=st.integers(-100, 100),
    zero_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    gsf_shift=st.sampled_from([0, -20, -8, 8, 20]),
    kind=st.sampled_from(["normal", "positive", "negative", "sparse"]),
)
def test_quantize_is_bounded_for_any_magnitude_and_zero_blocks(
    m, blocks, seed, exponent, zero_fraction, gsf_shift, kind
):
    gen = torch.Generator().manual_seed(seed)
    k = blocks * 16
    x = (_signed(m, k, kind, gen) * 2.0**exponent).float()
    zero = torch.rand(m, blocks, generator=gen) < zero_fraction
    x = (x.view(m, blocks, 16) * ~zero.unsqueeze(-1)).view(m, k)
    zero = zero | (x.view(m, blocks, 16) == 0).all(-1)
    if not bool(x.any()):
        with pytest.raises(InvalidArgument, match="not all zero"):
            nvfp4.global_scale(x)
        gsf = torch.tensor(1.0)
    else:
        gsf = nvfp4.global_scale(x) * 2.0**gsf_shift
        assume(bool(torch.isfinite(gsf)))  # 2^-100 data with a 2^20 larger scale overflows float32
    packed, swizzled = nvfp4.quantize(x, gsf)
    sf_bytes = nvfp4.unswizzle_scales(swizzled, m, k).view(torch.uint8)
    assert not bool(((sf_bytes & 0x7F) == 0x7F).any()), "no NaN scale"
    sf = sf_bytes.view(torch.float8_e4m3fn).float()
    assert bool((sf >= 0).all()) and bool((sf <= 448).all())
    deq = nvfp4.dequantize(packed, swizzled, gsf)
    assert bool(torch.isfinite(deq).all())
    assert bool((deq.view(m, blocks, 16)[zero] == 0).all()) and bool((sf[zero] == 0).all())
    assert bool(((x == 0) <= (deq == 0)).all()), "zeros must stay zero"
    # Within range, the error is at most one E2M1 step (2 at the top, of a scale rounded to E4M3)
    # plus what the scale's own rounding (relative 2^-4, or 2^-10 absolute below E4M3 normals) moves.
    amax = x.view(m, blocks, 16).abs().amax(-1)
    wanted = (gsf * amax / 6).clamp(max=448)
    step = (sf / gsf).unsqueeze(-1)
    slack = (
        (amax.unsqueeze(-1) * ((gsf * amax / 6) > 448).unsqueeze(-1))
        + 6 * 2.0**-10 / gsf
        + 6 * (wanted - sf).abs().unsqueeze(-1) / gsf
    )
    err = (deq.view(m, blocks, 16) - x.view(m, blocks, 16)).abs()
    assert bool((err <= step + slack + 1e-30).all())


@case(
    "properties",
    "reference GEMM with all-zero A, all-zero scales, zero rows, and alpha scaling",
    "exact zeros where the input is zero; alpha scales the float32 result exactly",
)
@hsettings(max_examples=30, **HYPOTHESIS)
@given(
    m=st.integers(1, 140),
    n8=st.integers(1, 6),
    k32=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    alpha=st.sampled_from([1.0, 2.0**-20, 3.0, 2.0**20]),
)
def test_reference_gemm_of_zero_inputs_is_exactly_zero(m, n8, k32, seed, alpha):
    gen = torch.Generator().manual_seed(seed)
    n, k = 8 * n8, 32 * k32
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    zero_rows = torch.rand(m, generator=gen) < 0.3
    x[zero_rows] = 0
    qw, sw = nvfp4.quantize(w, nvfp4.global_scale(w))
    qx, sx = nvfp4.quantize(x, torch.tensor(1.0))
    one, scaled = torch.ones(1), torch.full((1,), alpha)
    out = nvfp4.reference_mm_fp4(qx, qw.T, sx, sw.T, one, torch.float32)
    assert bool((out[zero_rows] == 0).all())
    assert torch.equal(nvfp4.reference_mm_fp4(qx, qw.T, sx, sw.T, scaled, torch.float32), out * alpha)
    zeros_a = torch.zeros_like(qx)
    assert bool((nvfp4.reference_mm_fp4(zeros_a, qw.T, sx, sw.T, one, torch.float32) == 0).all())
    zero_scales = torch.zeros_like(sx)
    assert bool((nvfp4.reference_mm_fp4(qx, qw.T, zero_scales, sw.T, one, torch.bfloat16) == 0).all())


@case(
    "properties",
    "global_scale of a tensor whose amax is a float32 subnormal (1e-37)",
    "a finite scale or an InvalidArgument naming x, never inf",
)
def test_global_scale_is_never_infinite():
    try:
        gsf = nvfp4.global_scale(torch.full((1, 16), 1e-37))
    except InvalidArgument:
        return
    assert bool(torch.isfinite(gsf))
