"""reference_moe_fp4 checked against an independent scalar statement of the fused NVFP4 MoE."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import scalar_moe_recipe as moe_recipe

from sm120_fp4 import nvfp4
from sm120_fp4.errors import InvalidArgument

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tests run thousands of tiny tensor ops, which intra-op threads only slow down: by
    4-10x on a 2-core machine that is busy with anything else."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- inputs -------------------------------------------------------------------------------


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert: packed (E, N, K/2), swizzled float8 scales, global encode scales (E,)."""
    packed, scales, gscales = [], [], []
    for expert in w:
        gsf = nvfp4.global_scale(expert)
        p, s = nvfp4.quantize(expert, gsf)
        packed.append(p)
        scales.append(s)
        gscales.append(gsf)
    return torch.stack(packed), torch.stack(scales), torch.stack(gscales)


def _activate(fc1: torch.Tensor, activation: str, inter: int) -> torch.Tensor:
    if activation == "swiglu":
        return torch.nn.functional.silu(fc1[..., inter:]) * fc1[..., :inter]
    return torch.relu(fc1) ** 2


def make_moe(seed, tokens, experts, top_k, hidden, inter, activation="swiglu", dtype=BF16, device="cpu"):
    """Seeded inputs in reference_moe_fp4's order, as a dict of its keyword arguments.

    Ids are distinct per token (as FlashInfer's routers give them); routing weights do not sum
    to 1; a2_gscale is calibrated on the float64 intermediate of every (token, expert) pair.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if activation == "swiglu" else inter
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    # Experts of different magnitudes, so the per-expert alphas differ.
    spread = torch.logspace(-1.5, -0.5, experts).view(experts, 1, 1)
    w13, w13_sf, g13 = _quantize_experts(torch.randn(experts, rows, hidden, generator=gen) * spread)
    w2, w2_sf, g2 = _quantize_experts(torch.randn(experts, hidden, inter, generator=gen) * spread.flip(0))
    a1 = nvfp4.global_scale(x)
    deq13 = torch.stack([nvfp4.dequantize(w13[e], w13_sf[e], g13[e]) for e in range(experts)]).double()
    intermediate = _activate(torch.einsum("th,erh->ter", x.double(), deq13), activation, inter)
    a2 = (448.0 * 6.0 / intermediate.abs().max()).float()
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen) * 1.5 + 0.05
    args = dict(
        x=x,
        topk_ids=ids,
        topk_weights=weights,
        w13=w13,
        w13_sf=w13_sf,
        w13_alpha=1.0 / (a1 * g13),
        w2=w2,
        w2_sf=w2_sf,
        w2_alpha=1.0 / (a2 * g2),
        a1_gscale=a1,
        a2_gscale=a2,
    )
    args = {k: v.to(device) for k, v in args.items()}
    args["activation"] = activation
    args["_gscales"] = (g13.to(device), g2.to(device))
    return args


def _call(args: dict, **overrides) -> torch.Tensor:
    kwargs = {k: v for k, v in args.items() if not k.startswith("_")}
    kwargs.update(overrides)
    return nvfp4.reference_moe_fp4(**kwargs)


def _scalar(args: dict, **overrides) -> np.ndarray:
    kwargs = {k: v for k, v in args.items() if not k.startswith("_")}
    kwargs.update(overrides)
    return moe_recipe.moe(**kwargs)


def _ulps(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Distance in units in the last place of `dtype` between two arrays of dtype values."""
    a = got.float().cpu().to(dtype)
    b = torch.from_numpy(np.ascontiguousarray(want)).to(dtype)
    assert torch.equal(a.float(), got.float().cpu()), "the oracle's output is not in its dtype"
    assert torch.equal(b.float(), torch.from_numpy(want)), "the scalar statement's output is not in its dtype"
    int_type = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]

    def ordered(t):  # sign-magnitude bits -> integers in value order
        bits = t.view(int_type).long()
        return torch.where(bits < 0, -(bits & (2 ** (8 * t.element_size() - 1) - 1)), bits)

    return (ordered(a) - ordered(b)).abs()


# ---- agreement with the scalar statement ----------------------------------------------------

# tokens, experts, top_k, H, I, activation, dtype: H and I multiples of 16, none of 128, and
# rows past 128 (2I = 160, H = 144) so the scale padding to 256 rows is read.
CASES = [
    (3, 3, 1, 48, 16, "swiglu", BF16),
    (5, 4, 2, 80, 32, "swiglu", BF16),
    (7, 5, 2, 48, 48, "relu2", BF16),
    (9, 3, 2, 112, 16, "swiglu", FP16),
    (6, 5, 1, 16, 80, "swiglu", FP16),
    (8, 4, 2, 144, 32, "relu2", FP16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-{}-{}".format(*c[:6], str(c[6])[6:]))
def test_oracle_matches_the_scalar_statement(device, case):
    tokens, experts, top_k, hidden, inter, activation, dtype = case
    args = make_moe(sum(case[:5]), tokens, experts, top_k, hidden, inter, activation, dtype, device)
    got = _call(args)
    assert got.dtype == dtype and tuple(got.shape) == (tokens, hidden) and got.device == args["x"].device
    want = _scalar(args)
    assert np.abs(want).max() > 0
    ulps = _ulps(got, want, dtype)
    # Bit-exact on every case here (and on 36 seeds of these shapes tried on the CPU). The one
    # freedom left is the GEMMs' float32 summation order (the statement sums exactly, then
    # rounds; torch's order differs again on CUDA, with bf16 operands): it can move a value only
    # where a partial sum is inexact and the rounding to the output dtype sits on a boundary,
    # hence one ulp on at most a rare element. (Such a change in FC1 could also flip an FP4 code
    # of the intermediate and then move FC2's rows by more; these seeded cases hit none.)
    assert int(ulps.max()) <= 1, f"{int((ulps > 0).sum())} elements differ, by up to {int(ulps.max())} ulps"
    assert int((ulps > 0).sum()) <= max(1, got.numel() // 1000)


def test_float32_output_is_the_sum_before_the_final_cast(device):
    args = make_moe(11, 5, 4, 2, 48, 32, "swiglu", BF16, device)
    wide = _call(args, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide.to(BF16), _call(args))
    np.testing.assert_array_equal(wide.cpu().numpy(), _scalar(args, out_dtype=torch.float32))
    # An fp16 output rounds the GEMM outputs to fp16 too.
    half = _call(args, out_dtype=FP16)
    assert half.dtype == FP16
    assert int(_ulps(half, _scalar(args, out_dtype=FP16), FP16).max()) <= 1


def test_a_token_routed_twice_to_one_expert_sums_both_slots(device):
    # FlashInfer's routers pick distinct experts, but its kernels treat every (token, slot) as
    # its own row, so a repeated expert is computed twice and both are summed; so does the oracle.
    args = make_moe(5, 4, 3, 2, 48, 16, "swiglu", BF16, device)
    args["topk_ids"][0] = torch.tensor([2, 2], dtype=torch.int32)
    args["topk_ids"][3] = torch.tensor([1, 1], dtype=torch.int32)
    got = _call(args, out_dtype=torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), _scalar(args, out_dtype=torch.float32))
    # Against the single routed row (weight 1): w0 * row + w1 * row, in float32.
    single = dict(
        args, topk_ids=args["topk_ids"][:, :1].contiguous(), topk_weights=torch.ones_like(args["topk_weights"][:, :1])
    )
    row = _call(single, out_dtype=torch.float32)[0]
    w = args["topk_weights"][0]
    assert torch.equal(got[0], w[0] * row + w[1] * row)


def test_int64_ids_and_uint8_scale_bytes_give_the_same_result(device):
    args = make_moe(3, 6, 4, 2, 32, 16, "relu2", FP16, device)
    want = _call(args)
    same = _call(
        args,
        topk_ids=args["topk_ids"].long(),
        w13_sf=args["w13_sf"].view(torch.uint8),
        w2_sf=args["w2_sf"].view(torch.uint8),
        a1_gscale=float(args["a1_gscale"]),
        a2_gscale=args["a2_gscale"].reshape(1),
    )
    assert torch.equal(same, want)


@pytest.mark.parametrize(
    "activation, dtype, per_expert, w4a16",
    [
        ("swiglu", BF16, False, False),
        ("relu2", FP16, False, False),
        ("swiglu", BF16, True, False),
        ("swiglu", BF16, False, True),
    ],
)
def test_several_roundings_in_one_pass_equal_one_call_each(device, activation, dtype, per_expert, w4a16):
    # The self-tests' reference and the kernel's rounding of the intermediate share FC1: one pass
    # must give, bit for bit, what one reference_moe_fp4 call per intermediate_dtype gives.
    args = make_moe(17, 9, 5, 3, 48, 32, activation, dtype, device)
    if per_expert:  # compressed-tensors: one activation scale per expert
        experts = args["w13"].shape[0]
        args["a1_gscale"] = args["a1_gscale"].reshape(1).repeat(experts) * torch.linspace(
            0.9, 1.1, experts, device=device
        )
        args["a2_gscale"] = args["a2_gscale"].reshape(1).repeat(experts) * torch.linspace(
            1.1, 0.9, experts, device=device
        )
    kwargs = {k: v for k, v in args.items() if not k.startswith("_")}
    extra = dict(quantize_activations=False) if w4a16 else {}
    roundings = (None, dtype, None) if not w4a16 else (None,)
    together = nvfp4.reference_moe_fp4_roundings(
        **kwargs, out_dtype=torch.float32, intermediate_dtypes=roundings, **extra
    )
    assert len(together) == len(roundings)
    for got, rounding in zip(together, roundings):
        assert torch.equal(
            got, nvfp4.reference_moe_fp4(**kwargs, out_dtype=torch.float32, intermediate_dtype=rounding, **extra)
        )
    with pytest.raises(InvalidArgument, match="intermediate_dtypes"):
        nvfp4.reference_moe_fp4_roundings(**kwargs, intermediate_dtypes=())
    with pytest.raises(InvalidArgument, match="intermediate_dtype"):
        nvfp4.reference_moe_fp4_roundings(**kwargs, intermediate_dtypes=(None, torch.float32))


def test_no_tokens_gives_an_empty_output(device):
    args = make_moe(1, 2, 3, 2, 32, 16, "swiglu", BF16, device)
    empty = dict(args, x=args["x"][:0], topk_ids=args["topk_ids"][:0], topk_weights=args["topk_weights"][:0])
    out = _call(empty)
    assert tuple(out.shape) == (0, 32) and out.dtype == BF16


# ---- the rounding points are exercised -----------------------------------------------------


@pytest.fixture(scope="module")
def rounding_case():
    """One seeded case, its oracle output, and the scalar statement's (computed once)."""
    args = make_moe(2024, 8, 4, 2, 128 - 16, 64, "swiglu", BF16)
    got = _call(args).float().numpy()
    want = _scalar(args)
    return args, got, want


@pytest.mark.parametrize(
    "moved",
    [
        dict(round_fc1=False),
        dict(round_fc2=False),
        dict(quantize_rounded_intermediate=True),
        dict(fused_finalize=True),
    ],
    ids=["fc1-not-rounded", "fc2-not-rounded", "intermediate-quantized-after-rounding", "fused-finalize"],
)
def test_moving_one_rounding_point_changes_the_result(rounding_case, moved):
    # The oracle is the statement with its rounding points where they are, and each one moved
    # changes some output values on this case: none of them is left unexercised.
    # "intermediate-quantized-after-rounding" is what FlashInfer's doActivationKernel does and
    # "fused-finalize" what its FINALIZE-fused GEMM2 epilogue does (see nvfp4/reference.py).
    args, got, want = rounding_case
    np.testing.assert_array_equal(got, want)
    differing = int((_scalar(args, **moved) != got).sum())
    assert differing > 0, f"{moved} changed nothing on this case: the rounding point is not exercised"


# ---- W4A16 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_w4a16_matches_a_float64_computation_on_dequantized_weights(device, activation):
    tokens, experts, top_k, hidden, inter = 6, 4, 2, 64, 32
    args = make_moe(7, tokens, experts, top_k, hidden, inter, activation, BF16, device)
    g13, g2 = args["_gscales"]
    args.update(w13_alpha=1.0 / g13, w2_alpha=1.0 / g2, a1_gscale=None, a2_gscale=None)
    got = _call(args, quantize_activations=False, out_dtype=torch.float32).cpu().double()

    deq13 = [nvfp4.dequantize(args["w13"][e], args["w13_sf"][e], g13[e]).cpu().double() for e in range(experts)]
    deq2 = [nvfp4.dequantize(args["w2"][e], args["w2_sf"][e], g2[e]).cpu().double() for e in range(experts)]
    x = args["x"].cpu().double()
    ids, weights = args["topk_ids"].cpu().tolist(), args["topk_weights"].cpu().double()
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j, e in enumerate(ids[t]):
            act = _activate(x[t] @ deq13[e].T, activation, inter)
            want[t] += weights[t, j] * (act @ deq2[e].T)
    # The only differences: the two roundings to bf16 (2^-9 relative each) and float32 sums.
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    assert torch.allclose(got, want, rtol=2**-6, atol=2**-6 * want.abs().max().item())
    np.testing.assert_array_equal(
        _call(args, quantize_activations=False).float().cpu().numpy(),
        _scalar(args, quantize_activations=False),
    )
    quantized = make_moe(7, tokens, experts, top_k, hidden, inter, activation, BF16, device)
    assert not torch.equal(_call(quantized).cpu().double(), got.to(BF16).double())


# ---- many experts: grouping by expert equals a per-token loop --------------------------------


def _per_token(args: dict, t: int) -> torch.Tensor:
    """Token t on its own, slot by slot, with nvfp4's quantize / dequantize_unscaled."""
    inter = args["w2"].shape[2] * 2
    x = args["x"][t : t + 1]
    qx, sx = nvfp4.quantize(x, args["a1_gscale"])
    xa = nvfp4.dequantize_unscaled(qx, sx)
    acc = torch.zeros(x.shape[1])
    for j, e in enumerate(args["topk_ids"][t].tolist()):
        w13 = nvfp4.dequantize_unscaled(args["w13"][e], args["w13_sf"][e])
        fc1 = (args["w13_alpha"][e] * (xa @ w13.T)).to(x.dtype).float()
        up, gate = fc1[:, :inter], fc1[:, inter:]
        act = (gate * (1.0 / (1.0 + torch.exp(-gate)))) * up
        qa, sa = nvfp4.quantize(act, args["a2_gscale"])
        w2 = nvfp4.dequantize_unscaled(args["w2"][e], args["w2_sf"][e])
        row = (args["w2_alpha"][e] * (nvfp4.dequantize_unscaled(qa, sa) @ w2.T)).to(x.dtype).float()
        acc = acc + args["topk_weights"][t, j] * row[0]
    return acc.to(x.dtype)


def test_256_experts_top8_equals_the_per_token_loop():
    args = make_moe(256, 64, 256, 8, 64, 32, "swiglu", BF16)
    out = _call(args)
    assert tuple(out.shape) == (64, 64) and torch.isfinite(out).all()
    for t in (0, 17, 42, 63):
        assert torch.equal(out[t], _per_token(args, t)), f"token {t}"


# ---- bad input ------------------------------------------------------------------------------


def _bad(args, **changes):
    return dict(args, **changes)


BAD = [
    (lambda a: _bad(a, x=a["x"].float()), r"x=tensor\(shape=\(4, 48\), dtype=torch.float32.*dtype in"),
    (lambda a: _bad(a, x=torch.zeros(4, 40, dtype=BF16)), r"x=.*multiple of 16, got H=40"),
    (lambda a: _bad(a, x=torch.full((4, 48), float("inf"), dtype=BF16)), r"x=.*finite values"),
    (lambda a: _bad(a, topk_ids=a["topk_ids"].float()), r"topk_ids=.*dtype in"),
    (lambda a: _bad(a, topk_ids=a["topk_ids"][:3]), r"topk_ids=.*shape \(4, k\)"),
    (
        lambda a: _bad(a, topk_ids=torch.full((4, 2), 3, dtype=torch.int32)),
        r"topk_ids=.*\[0, E=3\), got ids in \[3, 3\]",
    ),
    (lambda a: _bad(a, topk_ids=torch.full((4, 2), -1, dtype=torch.int64)), r"topk_ids=.*got ids in \[-1, -1\]"),
    (lambda a: _bad(a, topk_weights=a["topk_weights"].half()), r"topk_weights=.*dtype in"),
    (lambda a: _bad(a, topk_weights=a["topk_weights"][:, :1]), r"topk_weights=.*shape \(4, 2\)"),
    (lambda a: _bad(a, w13=a["w13"][:, :, :8]), r"w13=.*H/2=24"),
    (lambda a: _bad(a, w13=a["w13"][:, :31]), r"w13=.*\(E >= 1, 2I, H/2=24\) for activation='swiglu'"),
    (lambda a: _bad(a, activation="relu2"), r"w2=.*shape \(3, 48, 16\)"),
    (lambda a: _bad(a, w13_sf=a["w13_sf"][:, :, :2]), r"w13_sf=.*shape \(3, 128, 4\)"),
    (lambda a: _bad(a, w13_sf=a["w13_sf"].float()), r"w13_sf=.*dtype in"),
    (lambda a: _bad(a, w13_alpha=a["w13_alpha"][:2]), r"w13_alpha=.*shape \(3,\)"),
    (lambda a: _bad(a, w2=a["w2"][:, :, :4]), r"w2=.*shape \(3, 48, 8\)"),
    (lambda a: _bad(a, w2_sf=a["w2_sf"][:2]), r"w2_sf=.*shape \(3, 128, 4\)"),
    (lambda a: _bad(a, w2_alpha=a["w2_alpha"].double()), r"w2_alpha=.*dtype in"),
    (lambda a: _bad(a, w2=a["w2"].to("meta")), r"w2=.*a tensor on cpu"),
    (lambda a: _bad(a, a1_gscale=None), r"a1_gscale=None.*positive finite"),
    (lambda a: _bad(a, a2_gscale=torch.tensor(0.0)), r"a2_gscale=.*positive finite value"),
    (lambda a: _bad(a, w13_alpha=a["w13_alpha"] * 1e36), r"FC1 of x=.*not finite once rounded to torch.bfloat16"),
    (lambda a: _bad(a, activation="gelu"), r"activation='gelu'.*'swiglu', 'relu2'"),
    (lambda a: _bad(a, out_dtype=torch.int8), r"out_dtype=torch.int8"),
    (lambda a: _bad(a, quantize_activations=1), r"quantize_activations=1.*True or False"),
]


@pytest.mark.parametrize("mutate, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_parameter_and_what_is_accepted(mutate, message):
    args = make_moe(9, 4, 3, 2, 48, 16, "swiglu", BF16)
    with pytest.raises(InvalidArgument, match=r"reference_moe_fp4: " + message):
        _call(mutate(args))


def test_w4a16_accepts_missing_activation_scales_and_relu2_takes_i_rows():
    args = make_moe(4, 4, 3, 2, 48, 16, "relu2", BF16)
    out = _call(args, a1_gscale=None, a2_gscale=None, quantize_activations=False)
    assert tuple(out.shape) == (4, 48) and torch.isfinite(out).all()
    with pytest.raises(InvalidArgument, match=r"w13=.*\(E >= 1, I, H/2=24\) for activation='relu2'"):
        _call(args, w13=args["w13"][:, :8])
