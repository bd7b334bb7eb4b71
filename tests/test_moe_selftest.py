"""verify.run_moe over the default MoE configuration, the MoE registry, and FlashInfer's
cutlass_fused_moe called the way SGLang calls it (with a recording stand-in: no SM100+ GPU here)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from helpers import moe_faults
from helpers.cases import case
from helpers.common import slow_but_one

from sm120_fp4 import backends, dispatch, nvfp4, verify
from sm120_fp4.backends import flashinfer
from sm120_fp4.devices import Device
from sm120_fp4.errors import ConfigError, InvalidArgument

SIM = Device(-1, "simulated (no GPU)", (12, 0), simulated=True, source="simulate")

FAULTS = moe_faults.kernel_faults()


@pytest.mark.parametrize("fault", slow_but_one(FAULTS, keep=4), ids=lambda f: f.__name__)
def test_run_moe_refuses_each_fault_on_the_default_configuration(fault):
    backends.register_moe("faulty", fault)
    report = verify.run_moe("faulty", SIM)
    assert not report.passed and report.reason.startswith("T=")
    failed = [s for s in report.shapes if not s.passed]
    assert len(failed) == 1 and failed[0].label in report.reason


@pytest.mark.slow
def test_run_moe_accepts_flashinfers_rounding_on_the_default_configuration():
    backends.register_moe("flashinfer-rounding", moe_faults.rounds_intermediate_first)
    report = verify.run_moe("flashinfer-rounding", SIM)
    assert report.passed, report.reason
    # Two passes, the first calling each case twice in a row; every case, a repeat probe for each of at most
    # REPEAT_MAX_TOKENS tokens, and the expert-0 poison probe, both called in the first pass only.
    small = sum(c.tokens <= verify.REPEAT_MAX_TOKENS for c in verify.DEFAULT_MOE_CONFIG.cases)
    assert len(report.shapes) == len(verify.DEFAULT_MOE_CONFIG.cases) + small + 1
    probes = [s for s in report.shapes if "in a row" in s.label or "expert 0 non-finite" in s.label]
    assert all(s.calls == (1 if s in probes else 3) for s in report.shapes)
    assert sum("in a row" in s.label for s in probes) == small and any("expert 0" in s.label for s in probes)
    assert all(verify.REPEAT_MIN <= s.repeats <= verify.REPEAT_CALLS for s in probes if "in a row" in s.label)


# The simulation's first layer and decode batches of 1 and 5 tokens (repeat-probed) on a second one.
SMALL = verify.MoeConfig(
    cases=(
        verify.SIMULATION_MOE_CONFIG.cases[0],
        *(c.model_copy(update={"tokens": t}) for c, t in zip(verify.SIMULATION_MOE_CONFIG.cases[3:], (1, 5))),
    )
)


@case(
    "backend faults",
    "a fast MoE kernel that loses one 8-column group of row 0 at the 37th and 81st call in a row of one batch",
    "refused by the repeat probe alone (every other case calls a batch at most twice in a row), whose report "
    "says how many calls ran",
)
def test_the_repeat_probe_refuses_an_intermittent_loss_within_its_time_budget():
    backends.register_moe("lossy", moe_faults.loses_in_a_row())
    report = verify.run_moe("lossy", SIM, SMALL)
    assert not report.passed and "in a row (worst judged)" in report.reason, report.reason
    [failed] = [s for s in report.shapes if not s.passed]
    assert failed.repeats >= 37 and f"the worst of {failed.repeats} in a row" in failed.reason


@case(
    "properties",
    "a slow MoE kernel (20 ms a call) under the default probe budget (Bounds.probe_s, 0.5 s per check)",
    "each repeat probe makes fewer calls than REPEAT_CALLS, never fewer than REPEAT_MIN, and says how many",
)
def test_the_repeat_probe_bounds_its_time_by_the_check_budget():
    fast = moe_faults.fast()

    def slow(*args):
        time.sleep(0.02)
        return fast(*args)

    backends.register_moe("slow-moe", slow)
    report = verify.run_moe("slow-moe", SIM, SMALL)
    assert report.passed, report.reason
    probes = [s for s in report.shapes if "in a row" in s.label]
    assert probes and all(verify.REPEAT_MIN <= s.repeats < verify.REPEAT_CALLS for s in probes)
    assert sum(s.duration_s for s in probes) < verify.MOE_BOUNDS.probe_s + 0.5 * len(probes)


def _poisons_through_expert0(x, ids, w, w13, w13_sf, w13_alpha, *rest):
    """Computes each -1 slot on expert 0 with weight 0, multiplied through: 0 x inf where expert 0 overflows."""
    out = backends.emulated_moe(x, ids, w, w13, w13_sf, w13_alpha, *rest)
    poisoned = (ids < 0).any(dim=1, keepdim=True) & ~torch.isfinite(w13_alpha[0])
    return out.copy_(torch.where(poisoned, torch.full_like(out, float("nan")), out))


@case(
    "backend faults",
    "a MoE kernel that computes SGLang's -1 slots on expert 0 with weight 0 (b12x's way), multiplied through",
    "refused by the expert-0 poison probe alone, in its one call (expert 0 is finite in every other case)",
)
def test_the_expert0_probe_refuses_rows_poisoned_through_expert_0():
    backends.register_moe("poisons", _poisons_through_expert0)
    report = verify.run_moe("poisons", SIM, SMALL)
    [failed] = [s for s in report.shapes if not s.passed]
    assert "expert 0 non-finite" in failed.label and failed.calls == 1 and "non-finite" in failed.reason


WIDE = verify.MoeCase(
    experts=4,
    hidden=8192,
    intermediate=128,
    activation="swiglu",
    top_k=2,
    tokens=64,
    dtype="bfloat16",
    routing="random",
)


def _loses_a_column_group(x, ids, *rest):
    """Loses columns 8-15 of row 0 in batches of 16 tokens or more: 3% of an 8192-wide row, inside its bound."""
    out = backends.emulated_moe(x, ids, *rest)
    if x.shape[0] >= 16:
        out[0, 8:16] = 0
    return out


@case(
    "backend faults",
    "a MoE kernel that loses one 8-column group of one row of an 8192-wide output",
    "refused by the column-group check alone: with it off (Bounds.column_group=None) the same run passes",
)
@pytest.mark.slow
def test_the_column_group_check_refuses_a_lost_group_inside_the_row_bound():
    backends.register_moe("loses-group", _loses_a_column_group)
    config = verify.MoeConfig(cases=(WIDE,))
    report = verify.run_moe("loses-group", SIM, config)
    assert not report.passed and "group(s) of 8 columns lost" in report.reason and "row 0" in report.reason
    blind = verify.run_moe(
        "loses-group", SIM, config, bounds=verify.MOE_BOUNDS.model_copy(update={"column_group": None})
    )
    assert blind.passed, blind.reason


def test_run_moe_checks_every_call_returns_out_and_leaves_inputs_alone():
    def returns_copy(*args):
        return backends.emulated_moe(*args).clone()

    def scales_alphas(x, ids, w, w13, w13_sf, w13_alpha, *rest):
        out = backends.emulated_moe(x, ids, w, w13, w13_sf, w13_alpha, *rest)
        w13_alpha.mul_(1.0)  # bumps nothing numerically ...
        w13_alpha[0] *= 2  # ... but this changes the layer's alpha for every later call
        return out

    small = verify.MoeConfig(cases=verify.SIMULATION_MOE_CONFIG.cases[:1])
    for name, fn, reason in (("copy", returns_copy, "other than `out`"), ("alphas", scales_alphas, "in place")):
        backends.register_moe(name, fn)
        report = verify.run_moe(name, SIM, small)
        assert not report.passed and reason in report.reason


def test_the_moe_registry_names_what_it_accepts():
    with pytest.raises(InvalidArgument, match=r"register_moe: name='Bad Name'"):
        backends.register_moe("Bad Name", print)
    with pytest.raises(InvalidArgument, match=r"register_moe: fn=3"):
        backends.register_moe("x", 3)
    with pytest.raises(ConfigError, match=r"unknown NVFP4 fused-MoE backend 'nope'; known: cutlass, b12x, emulated"):
        backends.get_moe("nope")
    ok, why = backends.is_moe_supported("cutlass", SIM)
    assert not ok and "simulated" in why


def _layer_args(experts=4, hidden=128, inter=64, tokens=3, top_k=2):
    weights = verify.moe._moe_weights(experts, hidden, inter, "swiglu", torch.device("cpu"), 5)
    ids, topk_weights = verify.moe_routing(tokens, top_k, experts, "random", torch.Generator().manual_seed(0))
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    return x, ids, topk_weights, weights


def test_the_flashinfer_moe_backend_calls_cutlass_fused_moe_as_sglang_does(monkeypatch):
    calls = []

    class ActivationType:
        Swiglu, Relu2 = 3, 6

    def recording_cutlass_fused_moe(**kwargs):
        calls.append(kwargs)
        return [kwargs["output"]]

    monkeypatch.setattr(flashinfer, "fused_moe_kernel", lambda: (recording_cutlass_fused_moe, ActivationType))
    x, ids, topk_weights, w = _layer_args()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    fn = flashinfer.moe_backend("cutlass")
    assert (
        fn(
            x,
            ids,
            topk_weights,
            w.w13,
            w.w13_sf,
            w.w13_alpha,
            w.w2,
            w.w2_sf,
            w.w2_alpha,
            w.a1_gscale,
            w.a2_gscale,
            "swiglu",
            torch.bfloat16,
            out,
        )
        is out
    )
    [kw] = calls
    assert kw["output"] is out and kw["input"] is x and kw["input_sf"] is None and kw["use_fused_finalize"] is False
    assert kw["fc1_expert_weights"].dtype == torch.int64 and kw["fc1_expert_weights"].shape == (4, 128, 128 // 16)
    assert kw["token_selected_experts"].dtype == torch.int32 and kw["activation_type"] == 3
    scales = kw["quant_scales"]
    assert [t.dtype for t in scales] == [
        torch.float32,
        torch.int32,
        torch.float32,
        torch.float32,
        torch.int32,
        torch.float32,
    ]
    assert scales[0].dim() == 0 and torch.equal(
        scales[1].view(torch.float8_e4m3fn).view(torch.uint8), w.w13_sf.view(torch.uint8)
    )
    with pytest.raises(InvalidArgument, match=r"fused MoE: topk_weights=.*dtype in \(torch.float32\)"):
        fn(
            x,
            ids,
            topk_weights.double(),
            w.w13,
            w.w13_sf,
            w.w13_alpha,
            w.w2,
            w.w2_sf,
            w.w2_alpha,
            w.a1_gscale,
            w.a2_gscale,
            "swiglu",
            torch.bfloat16,
            out,
        )


def test_the_seam_front_maps_sglangs_call_and_expert_parallel_ids():
    class ActivationType:
        Swiglu, Relu2 = 3, 6

    original_calls = []
    seen = []

    def original(**kwargs):
        original_calls.append(kwargs)
        return [kwargs["output"]]

    def backend(*args):
        seen.append(args)
        return backends.emulated_moe(*args)

    front = dispatch.moe_front(original, ActivationType, lambda index: backend, lambda index: "test")
    x, ids, topk_weights, w = _layer_args(experts=4)
    common = dict(
        input=x,
        token_final_scales=topk_weights,
        fc1_expert_weights=w.w13.view(torch.long),
        fc2_expert_weights=w.w2.view(torch.long),
        output_dtype=torch.bfloat16,
        input_sf=None,
        quant_scales=[
            w.a1_gscale.reshape(()),
            w.w13_sf.view(torch.int32),
            w.w13_alpha,
            w.a2_gscale.reshape(()),
            w.w2_sf.view(torch.int32),
            w.w2_alpha,
        ],
        activation_type=3,
    )
    # Rank 1 of 2 holds global experts 4..7: ids 0..3 belong to rank 0, -1 is SGLang's dropped slot;
    # the convention gives each of them -1 (skipped: no work on a local expert), weights unchanged.
    global_ids = torch.tensor([[4, 0], [5, 7], [1, -1]], dtype=torch.int32)
    [out] = front(
        output=torch.empty(x.shape, dtype=torch.bfloat16),
        token_selected_experts=global_ids,
        ep_size=2,
        ep_rank=1,
        **common,
    )
    local, weights = seen[-1][1], seen[-1][2]
    assert local.tolist() == [[0, -1], [1, 3], [-1, -1]]
    assert torch.equal(weights, topk_weights)
    mine = local >= 0
    want = nvfp4.reference_moe_fp4(
        x,
        torch.where(mine, local, 0),
        torch.where(mine, weights, 0),
        w.w13,
        w.w13_sf,
        w.w13_alpha,
        w.w2,
        w.w2_sf,
        w.w2_alpha,
        w.a1_gscale,
        w.a2_gscale,
    )
    assert torch.equal(out, want) and not original_calls and bool((out[2] == 0).all())
    # Without expert parallelism an id outside [0, E) is skipped the same way.
    front(
        output=torch.empty(x.shape, dtype=torch.bfloat16),
        token_selected_experts=torch.tensor([[3, -1], [0, 9], [1, 2]], dtype=torch.int32),
        **common,
    )
    assert seen[-1][1].tolist() == [[3, -1], [0, -1], [1, 2]]
    # A call this library does not serve (biases) goes to FlashInfer unchanged.
    front(
        output=torch.empty(x.shape, dtype=torch.bfloat16),
        token_selected_experts=ids,
        fc1_expert_biases=torch.zeros(1),
        **common,
    )
    assert len(original_calls) == 1
    # Any argument the oracle does not model, a keyword added later included, is named to the engine's `unknown`
    # (its refusal); the neutral ones (TP ranks, tuning, finalize) and defaults pass and are served.
    told = []
    front = dispatch.moe_front(original, ActivationType, lambda i: backend, lambda i: "test", lambda *a: told.append(a))
    neutral = dict(tp_size=2, tp_rank=1, tune_max_num_tokens=8192, use_fused_finalize=True, enable_alltoall=False)
    front(output=torch.empty(x.shape, dtype=torch.bfloat16), token_selected_experts=ids, **neutral, **common)
    assert not told and len(original_calls) == 1
    unmodeled = dict(swiglu_limit=torch.full((4,), 7.0), fc2_expert_biases=torch.zeros(4, 256), a_new_flag=True)
    for name, value in unmodeled.items():
        front(output=torch.empty(x.shape, dtype=torch.bfloat16), token_selected_experts=ids, **{name: value}, **common)
    geglu = {**common, "activation_type": 4}
    front(output=torch.empty(x.shape, dtype=torch.bfloat16), token_selected_experts=ids, **geglu)
    assert [(index, problem.split(" passes ")[1].split(", which ")[0]) for index, problem in told] == [
        (-1, "swiglu_limit=a (4,) float32 tensor"),
        (-1, "fc2_expert_biases=a (4, 256) float32 tensor"),
        (-1, "a_new_flag=True"),
        (-1, "activation_type=4"),
    ]
    assert len(original_calls) == 5 and all("does not model" in problem for _, problem in told)


class _HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync():
    """Every way Python reads a tensor's value on the host raises inside: what a CUDA-graph capture
    forbids (`.tolist()`, `.item()`, `bool(t)`, `int(t)`, `float(t)`)."""

    def forbidden(name):
        def read(self, *args, **kwargs):
            raise _HostSync(f"Tensor.{name} read a value on the host")

        return read

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    try:
        for name in names:
            setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.Tensor, name, value)


@pytest.mark.parametrize(
    "activation,per_expert", [("swiglu", False), ("relu2", True)], ids=["swiglu", "relu2, per-expert scales"]
)
def test_the_emulated_moe_front_is_the_oracle_bit_for_bit_without_a_host_sync(activation, per_expert):
    """The emulation serves inside CUDA-graph capture: the front and the backend read no value on
    the host, and the answer is still the oracle's, with SGLang's -1 slots skipped."""

    class ActivationType:
        Swiglu, Relu2 = 3, 6

    weights = verify.moe._moe_weights(8, 128, 64, activation, torch.device("cpu"), 9)
    ids, topk_weights = verify.moe_routing(40, 3, 8, "padded", torch.Generator().manual_seed(4))
    x = verify.structured_activations(40, 128, 4.0, torch.Generator().manual_seed(5)).to(torch.bfloat16)
    a1 = weights.a1_gscale.expand(8) * (1 + torch.arange(8) / 8) if per_expert else weights.a1_gscale.reshape(())
    front = dispatch.moe_front(
        lambda **kw: pytest.fail("original called"),
        ActivationType,
        lambda index: backends.emulated_moe,
        lambda index: "emulated",
    )
    scales = [
        a1,
        weights.w13_sf.view(torch.int32),
        weights.w13_alpha,
        weights.a2_gscale.reshape(()),
        weights.w2_sf.view(torch.int32),
        weights.w2_alpha,
    ]
    nvfp4.quantize(x[:1], weights.a2_gscale.reshape(()))  # per-device constants made before, as the self-test does
    with no_host_sync():
        [out] = front(
            output=torch.empty(x.shape, dtype=torch.bfloat16),
            input=x,
            token_selected_experts=ids,
            token_final_scales=topk_weights,
            fc1_expert_weights=weights.w13.view(torch.long),
            fc2_expert_weights=weights.w2.view(torch.long),
            output_dtype=torch.bfloat16,
            input_sf=None,
            quant_scales=scales,
            activation_type=3 if activation == "swiglu" else 6,
        )
    mine = ids >= 0
    want = nvfp4.reference_moe_fp4(
        x,
        torch.where(mine, ids, 0),
        torch.where(mine, topk_weights, 0),
        weights.w13,
        weights.w13_sf,
        weights.w13_alpha,
        weights.w2,
        weights.w2_sf,
        weights.w2_alpha,
        a1.reshape(-1) if per_expert else a1,
        weights.a2_gscale,
        activation=activation,
    )
    assert torch.equal(out, want)


@pytest.mark.parametrize("tokens, top_k, experts", [(16, 2, 8), (64, 8, 32), (512, 8, 256), (20, 1, 20)])
def test_balanced_routing_lets_every_expert_lead_a_token(tokens, top_k, experts):
    # So that a dropped or wrong expert shows in the rows it leads, whatever the other slots add.
    ids, weights = verify.moe_routing(tokens, top_k, experts, "balanced", torch.Generator().manual_seed(5))
    assert ids.dtype == torch.int32 and tuple(ids.shape) == (tokens, top_k) == tuple(weights.shape)
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct experts per token
    assert set(ids[:, 0].tolist()) == set(range(experts))  # every expert leads
    assert bool((weights[:, 0] >= 0.8).all()) and bool((weights[:, 1:] <= 0.1).all())
    assert set(ids.flatten().tolist()) == set(range(experts))


@case(
    "own failures",
    "the generic MoE self-test run while torch's default dtype is bf16 (SGLang loads a model under the model's dtype)",
    "it passes with a healthy kernel: every probe makes its routing weights float32 itself",
)
def test_the_moe_self_test_runs_under_a_bf16_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        report = verify.run_moe("emulated", SIM, verify.SIMULATION_MOE_CONFIG)
    finally:
        torch.set_default_dtype(default)
    assert report.passed, report.reason


def _wrong_past_token_16(x, ids, *rest):
    """Scales every token past the 16th by 1.1: right for any batch of up to 16 tokens."""
    out = backends.emulated_moe(x, ids, *rest)
    out[16:] *= 1.1
    return out


@case(
    "properties",
    "MoE plans that are the leading tokens of one batch (T=1, 7, 16, 40 of one 40-token batch)",
    "share one oracle run and one output buffer (views of the longest), with the numbers of separate plans; a "
    "correct kernel passes and one wrong only past token 16 is refused at T=40",
)
def test_moe_plans_that_are_one_batchs_leading_tokens_share_its_oracle_run():
    weights = verify.moe._moe_weights(8, 160, 96, "swiglu", torch.device("cpu"), 5)
    gen = torch.Generator().manual_seed(3)
    ids, tw = verify.moe_routing(40, 2, 8, "random", gen)
    x = verify.structured_activations(40, 160, 4.0, gen).to(torch.bfloat16)
    plans = [(f"T={m}", x[:m], ids[:m], tw[:m]) for m in (1, 7, 16, 40)]
    cases = verify.moe_cases(backends.emulated_moe, weights, "swiglu", plans)
    assert len({c.reference.untyped_storage().data_ptr() for c in cases}) == 1
    assert len({c.out.untyped_storage().data_ptr() for c in cases}) == 1
    for c, plan in zip(cases, plans):
        [alone] = verify.moe_cases(backends.emulated_moe, weights, "swiglu", [plan])
        torch.testing.assert_close(c.reference, alone.reference, rtol=1e-6, atol=1e-6)
    assert all(r.passed for r in verify.sweep(cases, verify.MOE_BOUNDS, torch.device("cpu")))
    wrong = verify.moe_cases(_wrong_past_token_16, weights, "swiglu", plans)
    results = verify.sweep(wrong, verify.MOE_BOUNDS, torch.device("cpu"))
    assert [r.m for r in results if not r.passed] == [40], [(r.m, r.reason) for r in results]
