"""NVFP4 MoE verify-or-refuse at SGLang's real FusedMoE layer (simulated SM120, CPU).

install() patches the fused-MoE seam and the MoE weights hooks; building a layer decides the MoE
backend (run_moe) and verifies the layer's own configuration through the seam. Faulty MoE kernels
registered with register_moe are refused there; healthy ones with rounding-level differences serve.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers import moe_faults, sglang_layers
from helpers.cases import case
from helpers.common import simulated_moe_skip_reason, slow_but_one

import sm120_fp4
from sm120_fp4 import backends, serving, verify
from sm120_fp4.config import Settings
from sm120_fp4.demo import synthetic
from sm120_fp4.devices import Device
from sm120_fp4.errors import RefusedToServe

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
moe_layers = pytest.importorskip("sm120_fp4.sglang.moe_layers")
pytest.importorskip(
    "sglang.srt.layers.moe.moe_runner.flashinfer_cutlass", reason="needs the pinned SGLang's MoE modules"
)

SIM = Device(-1, "simulated (no GPU)", (12, 0), simulated=True, source="simulate")
E, H, I, TOP_K = 8, 256, 128, 2


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched."""


def routing(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids, weights = verify.moe_routing(tokens, TOP_K, E, "random", gen)
    x = (torch.randn(tokens, H, generator=gen) * 2).to(torch.bfloat16)
    return x, ids, weights


@pytest.mark.slow
def test_sglangs_moe_forward_through_the_patched_seam_matches_the_oracle():
    status = sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    states = {p.name: p.state for p in status.patches}
    assert states["fused-moe-kernel-seam"] == "applied"
    assert states["modelopt-nvfp4-moe-weights-hook"] == "applied"
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=3)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    assert decision.backend == "emulated" and decision.verified
    assert (
        decision.layers
        and decision.layers[0].passed
        and decision.layers[0].config.startswith("ModelOptNvFp4FusedMoEMethod E=8 H=256 I=128 top_k=2 swiglu")
    )
    x, ids, weights = routing(130)
    out = moe_layers.moe_forward(layer, x, ids, weights)
    want = synthetic.reference_moe_output(ckpt, x, ids, weights)
    assert torch.equal(out, want), (
        "SGLang's MoE apply() agrees with reference_moe_fp4 (bit-exact with the emulated backend)"
    )
    assert sm120_fp4.status().moe_routes == {-1: "emulated"}


@pytest.mark.parametrize(
    "fault",
    slow_but_one(
        moe_faults.kernel_faults(),
        keep=2,  # the cheapest case at the real layer on 2 cores
    ),
    ids=lambda f: f.__name__,
)
def test_a_faulty_moe_kernel_is_refused_at_the_real_layer(fault):
    backends.register_moe("faulty", fault)
    calls = {"n": 0}
    # Two passes of the generic self-test, the first calling each case twice in a row (its cases and
    # the expert-0 poison probe; no case is small enough for the repeat probe).
    generic = 3 * (len(verify.SIMULATION_MOE_CONFIG.cases) + 1)

    def passes_the_generic_selftest_then_faulty(*args):
        calls["n"] += 1  # the generic self-test runs first; the layer check after it
        return (backends.emulated_moe if calls["n"] <= generic else fault)(*args)

    backends.register_moe("late-faulty", passes_the_generic_selftest_then_faulty)
    for name in ("faulty", "late-faulty"):
        sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends=name)
        # A kernel faulty from the start fails the generic MoE self-test; one that turns faulty only
        # after it fails the layer's own check, which names the layer and the batch (T=...).
        reason = (
            r"(?s)failed the served-layer check: ModelOptNvFp4FusedMoEMethod E=8 H=256 I=128 top_k=2 swiglu bfloat16: T=\d+ "
            if name == "late-faulty"
            else r"(?s)no NVFP4 fused-MoE backend passed verification.*faulty: self-test failed: T="
        )
        with pytest.raises(RefusedToServe, match=reason):
            moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)
        sm120_fp4.uninstall()


@pytest.mark.slow
def test_moe_fallback_emulated_serves_when_the_kernel_fails_the_layer():
    backends.register_moe("faulty", moe_faults.drops_one_expert)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="faulty", moe_fallback="emulated")
    layer = moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=2), TOP_K)
    assert sm120_fp4.status().moe_routes == {-1: "emulated"}
    x, ids, weights = routing(9)
    assert torch.isfinite(moe_layers.moe_forward(layer, x, ids, weights)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.slow
def test_a_healthy_kernel_with_flashinfers_rounding_serves(dtype):
    backends.register_moe("flashinfer-rounding", moe_faults.rounds_intermediate_first)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="flashinfer-rounding")
    moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=4), TOP_K, dtype=dtype)
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    assert decision.backend == "flashinfer-rounding" and all(r.passed for r in decision.layers)


def test_unequal_gate_and_up_scales_are_refused():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=5)
    ckpt.w13_weight_scale_2[:, 1] *= 1.5
    with pytest.raises(RefusedToServe, match=r"gate and up weight_scale_2 differ"):
        moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)


@case(
    "configuration",
    "a served NVFP4 MoE layer ({fmt}) whose checkpoint has {fault}",
    "refused at its weights hook before any kernel is checked; the message names the tensor and says checkpoint",
)
@pytest.mark.parametrize(
    "fmt, fault",
    slow_but_one(
        [
            ("ModelOpt", "expert 2's w2_input_scale infinite"),
            ("ModelOpt", "expert 0's w13_weight_scale_2 zero (both shards)"),
            ("compressed-tensors", "expert 5's w2 weight_global_scale NaN"),
            ("compressed-tensors", "a NaN w13 block-scale byte (0xff)"),
        ]
    ),
)
def test_a_moe_layer_with_bad_checkpoint_scales_is_refused_naming_the_tensor(fmt, fault):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=7)
    if "w2_input_scale" in fault:
        ckpt.w2_input_scale[2] = float("inf")
        named = "the checkpoint's w2_input_scale[2] = inf"
    elif "w13_weight_scale_2" in fault:
        ckpt.w13_weight_scale_2[0] = 0.0
        named = "the checkpoint's w13_weight_scale_2[0, 0] = 0.0"
    elif "global_scale" in fault:
        ckpt.w2_weight_scale_2[5] = float("nan")
        named = "the checkpoint's w2_weight_global_scale[5] = nan"
    else:
        ckpt.w13_weight_scale.view(torch.uint8)[1, 2, 3] = 0xFF
        named = "the checkpoint's w13_weight_scale["
    build = (
        sglang_layers.build_compressed_tensors_moe_layer
        if fmt == "compressed-tensors"
        else moe_layers.build_modelopt_moe_layer
    )
    with pytest.raises(RefusedToServe) as err:
        build(ckpt, TOP_K)
    message = str(err.value)
    assert named in message and "checkpoint" in message and "candidate" not in message, message
    assert not any(d.layers for d in serving.decisions()), "no kernel was checked or blamed"


@pytest.mark.slow
def test_under_expert_parallelism_this_ranks_experts_are_verified():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=6), TOP_K, ep_size=2, ep_rank=1)
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    assert decision.layers[0].config.startswith(
        "ModelOptNvFp4FusedMoEMethod E=4 H=256 I=128 top_k=2 swiglu bfloat16 EP rank 1/2"
    )
    assert decision.layers[0].passed


# ---- run_moe: the generic MoE self-test, its default configuration ------------------------------


def test_the_default_moe_configuration_covers_what_the_issue_names():
    cases = verify.DEFAULT_MOE_CONFIG.cases
    assert max(c.experts for c in cases) >= 256
    assert (
        {1, 8} <= {c.top_k for c in cases}
        and max(c.tokens for c in cases) >= 1024
        and min(c.tokens for c in cases) == 1
    )
    assert {c.activation for c in cases} == {"swiglu", "relu2"} and {c.dtype for c in cases} == {"bfloat16", "float16"}
    assert any(c.hidden % 128 == 0 for c in cases) and any(c.hidden % 128 for c in cases)
    assert any(c.intermediate % 128 == 0 for c in cases) and any(c.intermediate % 128 for c in cases)
    gen = torch.Generator().manual_seed(0)
    big = next(c for c in cases if c.experts >= 256 and c.routing == "balanced" and c.top_k == 8)
    ids, _ = verify.moe_routing(big.tokens, big.top_k, big.experts, "balanced", gen)
    assert torch.bincount(ids.reshape(-1).long(), minlength=big.experts).min() > 0, "every expert receives rows"
    skew = next(c for c in cases if c.routing == "skewed" and c.experts >= 256)
    ids, _ = verify.moe_routing(skew.tokens, skew.top_k, skew.experts, "skewed", gen)
    assert torch.bincount(ids.reshape(-1).long()).max() >= 128
    assert all(len(set(row.tolist())) == skew.top_k for row in ids), "distinct experts per token"


# ---- the MoE runner that really serves (SGLang's 'auto' picks flashinfer_trtllm on every cc >= 10) ----


def _runner():
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend()


@pytest.mark.slow
def test_sglangs_auto_runner_is_pinned_to_the_verified_one_for_an_nvfp4_checkpoint():
    # compressed-tensors is named by the checkpoint's config only, as SGLang's default flags leave it:
    # SGLang's own SM120 rule (with --quantization) never fires, and 'auto' stays AUTO without us.
    with moe_layers.sglang_moe_context("auto", quantization=moe_layers.COMPRESSED_TENSORS):
        assert _runner().is_auto(), "the fault: nothing resolves 'auto' for this checkpoint on SM12x"
    status = sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    assert {p.name: p.state for p in status.patches}["moe-runner-config-hook"] == "applied"
    with moe_layers.sglang_moe_context("auto", quantization=moe_layers.COMPRESSED_TENSORS):
        assert _runner().is_flashinfer_cutlass()
        assert {p.name: p.state for p in sm120_fp4.status().patches}["moe-runner-backend-pin"] == "applied"
        layer = sglang_layers.build_compressed_tensors_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=2), TOP_K)
        assert layer.quant_method is not None
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    assert decision.layers[0].passed and decision.layers[0].config.startswith("CompressedTensorsW4A4Nvfp4MoE")


def test_an_explicit_runner_the_library_does_not_verify_is_refused_naming_it_and_the_flag():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    with moe_layers.sglang_moe_context("flashinfer_trtllm"):
        assert _runner().is_flashinfer_trtllm(), "an operator's explicit choice is never re-pinned"
        with pytest.raises(
            RefusedToServe,
            match="served by SGLang's MoE runner 'flashinfer_trtllm'.*--moe-runner-backend flashinfer_cutlass",
        ):
            moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)
    assert not [d.layers for d in serving.decisions() if d.family == "moe" and d.layers], "nothing recorded as verified"


def test_warn_serves_an_unverified_runner_saying_so(caplog):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated", selftest="warn")
    with moe_layers.sglang_moe_context("flashinfer_trtllm"), caplog.at_level("WARNING", logger="sm120_fp4"):
        try:
            moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)
        except RefusedToServe:  # pragma: no cover - warn must not refuse for the runner
            raise
        except Exception:
            pass
    assert any(
        "flashinfer_trtllm" in r.getMessage() and "serving it UNVERIFIED" in r.getMessage() for r in caplog.records
    )


@dataclasses.dataclass
class ClampedCheckpoint(synthetic.MoeCheckpoint):
    """A MoE checkpoint whose model clamps its SwiGLU (config.json's swiglu_limit, as MiniMax-M3)."""

    swiglu_limit: float = 7.0


@case(
    "configuration",
    "an NVFP4 MoE layer whose model clamps its SwiGLU (swiglu_limit=7, SGLang passes it to the fused-MoE call), "
    "SM120_FP4_SELFTEST={selftest}",
    "strict: refused at load naming swiglu_limit (the oracle models SwiGLU without clamps); warn: loaded, "
    "status().unverified names the layer and swiglu_limit",
)
@pytest.mark.parametrize("selftest", ["strict", "warn"])
def test_a_clamped_swiglu_moe_layer_is_refused_or_shown_unverified(selftest):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated", selftest=selftest)
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=4)
    clamped = ClampedCheckpoint(**{f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)})
    unmodeled = r"swiglu_limit=a \(8,\) float32 tensor, which the MoE oracle does not model"
    if selftest == "strict":
        with pytest.raises(RefusedToServe, match=rf"NVFP4 MoE layer .*\(ModelOptNvFp4FusedMoEMethod\).*{unmodeled}"):
            moe_layers.build_modelopt_moe_layer(clamped, TOP_K)
        return
    moe_layers.build_modelopt_moe_layer(clamped, TOP_K)
    [entry] = sm120_fp4.status().unverified
    assert "ModelOptNvFp4FusedMoEMethod" in entry.what and __import__("re").search(unmodeled, entry.reason)
    assert not [d.layers for d in serving.decisions() if d.family == "moe" and d.layers], "nothing shown as verified"


@case(
    "configuration",
    "a verified NVFP4 MoE layer later called through SGLang's seam with SwiGLU clamps it was not verified with",
    "the call is refused by name (swiglu_alpha, swiglu_beta, swiglu_limit), never served by the routed backend",
)
@pytest.mark.slow
def test_a_seam_call_with_arguments_the_oracle_does_not_model_is_refused_naming_them():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    layer = moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=4), TOP_K)
    layer._cutlass_swiglu_params = tuple(torch.full((E,), v) for v in (1.0, 0.0, 7.0))  # as SGLang sets a clamp
    x, ids, weights = routing(4)
    with pytest.raises(RefusedToServe, match=r"swiglu_alpha=a \(8,\) float32 tensor, swiglu_beta=.*swiglu_limit="):
        moe_layers.moe_forward(layer, x, ids, weights)


# ---- what serves: the layer's own top-k, every expert, expert-parallel calls as served ----------------


def at_most_8_slots(x, ids, w, *rest):
    """Handles the first 8 slots of a token and drops the rest (a kernel sized for top-k <= 8)."""
    keep = (torch.arange(ids.shape[1]) < 8).to(w.dtype)
    return backends.emulated_moe(x, ids, w * keep, *rest)


def drops_expert(expert: int):
    def kernel(x, ids, w, *rest):
        return backends.emulated_moe(x, ids, torch.where(ids == expert, torch.zeros_like(w), w), *rest)

    return kernel


def wraps_skipped_slots(x, ids, w, *rest):
    """Reads a -1 slot (not this rank's, or dropped) as the last local expert (Python's negative index)."""
    experts = rest[0].shape[0]
    return backends.emulated_moe(x, torch.where(ids < 0, ids + experts, ids), w, *rest)


def combines_by_token_and_expert(x, ids, w, *rest):
    """Adds each (token, expert) once, with the weight of the last slot naming it: right for SGLang's
    routers (distinct experts per token), wrong wherever a call repeats an expert in a token."""
    w = w.clone()
    for j in range(ids.shape[1]):
        later = (ids[:, j + 1 :] == ids[:, j : j + 1]).any(dim=1)
        w[:, j] = torch.where(later, torch.zeros_like(w[:, j]), w[:, j])
        for i in range(j):
            w[:, i] = torch.where(ids[:, i] == ids[:, j], w[:, j], w[:, i])
    return backends.emulated_moe(x, ids, w, *rest)


@case(
    "backend faults",
    "a MoE kernel that handles at most 8 slots per token, under a layer with top_k=10 (Qwen3-Next routes 10)",
    "refused at load: the layer is checked with its own top_k=10 (no clamp to 8), naming top_k=10",
)
@pytest.mark.slow
def test_a_kernel_handling_at_most_8_slots_is_refused_for_a_top_10_layer():
    backends.register_moe("top-8", moe_faults.after_generic(at_most_8_slots))
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="top-8")
    with pytest.raises(
        RefusedToServe, match=r"served-layer check: ModelOptNvFp4FusedMoEMethod E=16 H=256 I=128 top_k=10 swiglu"
    ):
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(16, H, I, seed=11), 10)


@case(
    "backend faults",
    "a MoE kernel that drops expert {expert} of 16 (not among the 8 experts every batch routes to)",
    "refused at load by the batch that routes to every expert of the rank",
)
@pytest.mark.parametrize(
    "expert", [12, 1, 7, 14]
)  # none of the 8 experts the batch sizes route among (0, 2, 4, 6, 9, 11, 13, 15)
@pytest.mark.slow
def test_every_local_expert_is_exercised(expert):
    # Outside the experts every batch size routes among: only the batch that routes to every
    # expert, where each leads two tokens (most of their output), can see it.
    backends.register_moe(f"no-{expert}", moe_faults.after_generic(drops_expert(expert)))
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends=f"no-{expert}")
    with pytest.raises(RefusedToServe, match=r"E=16 .*: T=\d+ balanced \(every expert\)"):
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(16, H, I, seed=12), TOP_K)


@pytest.mark.parametrize(
    "ep_size", [1, 2], ids=["no EP (SGLang's -1 drop sentinel)", "EP rank 1/2 (other ranks' experts)"]
)
@case(
    "backend faults",
    "a MoE kernel that reads a slot not on this rank (another rank's expert, SGLang's -1) as a local expert, {ep_size}",
    "refused at load: the checks pass ids as SGLang serves them (global under EP, -1 dropped slots)",
)
def test_a_kernel_mishandling_slots_not_on_this_rank_is_refused(ep_size):
    backends.register_moe("wraps", wraps_skipped_slots)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="wraps")
    with pytest.raises(
        RefusedToServe,
        match=r"(?s)wraps: (self-test failed|failed the served-layer check).*(padded|random|pointing nowhere)",
    ):
        moe_layers.build_modelopt_moe_layer(
            synthetic.make_moe_checkpoint(E, H, I, seed=13), TOP_K, ep_size=ep_size, ep_rank=ep_size - 1
        )


@case(
    "backend faults",
    "expert parallelism (rank 1 of 2) with a kernel that combines slots by (token, expert), and a recording kernel",
    "served right (no call repeats an expert in a token: other ranks' slots are -1, not local expert 0); local expert 0 gets only its own rows",
)
@pytest.mark.slow
def test_expert_parallel_calls_fold_nothing_onto_a_local_expert():
    seen = []

    def recording(x, ids, w, *rest):
        seen.append(ids.clone())
        return combines_by_token_and_expert(x, ids, w, *rest)

    backends.register_moe("by-token-expert", recording)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="by-token-expert")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=14)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K, ep_size=2, ep_rank=1)
    assert sm120_fp4.status().moe_routes == {-1: "by-token-expert"}
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(64)]).to(torch.int32)
    weights = torch.rand(64, TOP_K, generator=gen).float()
    x = (torch.randn(64, H, generator=gen) * 2).to(torch.bfloat16)
    seen.clear()
    with moe_layers.sglang_moe_context(ep_size=2, ep_rank=1):
        out = moe_layers.moe_forward(layer, x, ids, weights)
        want = sglang_layers.reference_moe_output(ckpt, x, ids, weights, ep_size=2, ep_rank=1)
    assert torch.equal(out, want)
    [local] = seen
    real = ((ids >= 4) & (ids < 8)).sum()
    assert int((local >= 0).sum()) == int(real) and int((local == 0).sum()) == int((ids == 4).sum())
    assert all(len(set(row.tolist()) - {-1}) == int((row >= 0).sum()) for row in local), "no expert twice in a token"


@case(
    "backend faults",
    "expert parallelism (rank 1 of 2): local expert 0's output overflows (its alpha set to inf after loading) for tokens that never route to it",
    "their output stays finite: other ranks' slots are never computed on expert 0, so no 0 * inf = NaN",
)
@pytest.mark.slow
def test_a_non_finite_expert_row_cannot_leak_into_other_ranks_slots():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=15)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K, ep_size=2, ep_rank=1)
    with torch.no_grad():
        layer.g1_alphas[0] = float("inf")  # global expert 4
    ids = torch.tensor([[0, 5], [1, 2], [6, 3], [4, 7]], dtype=torch.int32)  # token 3 alone routes to expert 4
    weights = torch.full((4, TOP_K), 0.5)
    x = (torch.randn(4, H, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    with moe_layers.sglang_moe_context(ep_size=2, ep_rank=1):
        out = moe_layers.moe_forward(layer, x, ids, weights)
    assert bool(torch.isfinite(out[:3]).all()) and not bool(torch.isfinite(out[3]).all())
    assert bool((out[1] == 0).all()), "a token with no slot on this rank gets exactly zero"


@case(
    "own failures",
    "Ctrl-C (KeyboardInterrupt) during an MoE layer check, then the same load again, the kernel now dropping an expert",
    "nothing recorded as verified; the retry checks the layer again and refuses",
)
@pytest.mark.slow
def test_an_interrupted_moe_layer_check_is_checked_again():
    calls = {"n": 0}
    generic = 3 * (
        len(verify.SIMULATION_MOE_CONFIG.cases) + 1
    )  # two passes (the first calling each case twice in a row) of its cases and the expert-0 poison probe

    def interrupted_then_faulty(*args):
        calls["n"] += 1
        if calls["n"] == generic + 2:
            raise KeyboardInterrupt
        return (backends.emulated_moe if calls["n"] <= generic + 2 else moe_faults.drops_one_expert)(*args)

    backends.register_moe("interrupted", interrupted_then_faulty)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="interrupted")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=16)
    with pytest.raises(KeyboardInterrupt):
        moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    with pytest.raises(RefusedToServe, match=r"failed the served-layer check: ModelOptNvFp4FusedMoEMethod E=8"):
        moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)


# ---- b12x (FlashInfer's B12xMoEWrapper) on SGLang's cutlass tensors, through a CPU stand-in ----------

from helpers.scale_faults import MOE_FAULTS, faulty_moe  # noqa: E402


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("fault", slow_but_one(MOE_FAULTS))
@case(
    "configuration",
    "SGLang's {fmt} NVFP4 MoE layer whose checkpoint has {fault} (the same fault as vLLM's test)",
    "refused at SGLang's weights hook before any kernel is checked, naming the tensor as vLLM does",
)
def test_sglang_refuses_the_moe_checkpoint_scales_vllm_refuses(fmt, fault):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    build = (
        sglang_layers.build_compressed_tensors_moe_layer
        if fmt == "compressed-tensors"
        else moe_layers.build_modelopt_moe_layer
    )
    with pytest.raises(RefusedToServe) as err:
        build(faulty_moe(fault, E, H, I), TOP_K)
    assert re.search(MOE_FAULTS[fault][1], str(err.value)), str(err.value)
    assert not any(d.layers for d in serving.decisions()), "no kernel was checked or blamed"


from helpers import b12x_stand_in  # noqa: E402

from sm120_fp4.backends import b12x_moe, flashinfer  # noqa: E402

B12X_TOOLCHAIN = flashinfer.Toolchain((13, 0), "test", (2, 39), None)


@pytest.fixture
def b12x(monkeypatch):
    """b12x's wrapper is the stand-in (healthy unless a test sets its fault; no GPU needed, every other check
    applies); CUDA 13 and the CuTe DSL present."""
    monkeypatch.setattr(b12x_stand_in.StandIn, "fault", None)
    monkeypatch.setattr(b12x_stand_in.StandIn, "made", [])
    monkeypatch.setattr(flashinfer, "toolchain", lambda: B12X_TOOLCHAIN)
    monkeypatch.setattr(b12x_moe, "moe_supported", lambda name, device: (True, None))  # a real GPU's answer
    monkeypatch.setattr(b12x_moe, "_wrapper_class", lambda: b12x_stand_in.StandIn)
    b12x_moe.reset()
    yield b12x_stand_in.StandIn
    b12x_moe.reset()


@pytest.mark.slow
def test_b12x_serves_the_oracles_numbers_at_sglangs_layer(b12x):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=3)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    [decision] = [d for d in serving.decisions() if d.family == "moe"]
    assert decision.backend == "b12x" and decision.verified and all(r.passed for r in decision.layers)
    x, ids, weights = routing(130)
    out = moe_layers.moe_forward(layer, x, ids, weights)
    assert torch.equal(out, synthetic.reference_moe_output(ckpt, x, ids, weights))
    assert sm120_fp4.status().moe_routes == {-1: "b12x"}
    info = b12x_moe.describe()
    configs = [w["config"] for w in info["workspaces"]]
    assert (
        f"E={E} top_k={TOP_K} H={H} I={I} swiglu" in configs
        and len(set(configs)) == len(configs)
        and info["workspace_bytes"] > 0
    )
    by_config = {}
    for m in b12x.made:  # one workspace per configuration, shared by every wrapper of it, never replaced
        owner = by_config.setdefault((m._moe_output.shape, m.activation, m.top_k), m)
        assert m._static_workspace is owner._static_workspace and m._moe_output is owner._moe_output


@case(
    "configuration",
    "b12x serves with SM120_FP4_SELFTEST=off (no call at load), then sm120_fp4.uninstall()",
    "the layer's wrapper and its configuration's workspace are made when its weights are prepared (status shows "
    "their bytes before any call), and uninstall releases them",
)
def test_b12x_workspace_is_made_at_load_and_released_by_uninstall(b12x):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x", selftest="off")
    layer = moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=5), TOP_K)
    [made] = b12x.made
    assert made.calls == 0 and b12x_moe.describe()["workspace_bytes"] > 0 and b12x_moe.describe()["layers"] == 1
    x, ids, weights = routing(8)
    moe_layers.moe_forward(layer, x, ids, weights)
    assert b12x.made == [made] and made.calls == 1, "the call used the wrapper made at load"
    sm120_fp4.uninstall()
    assert b12x_moe.describe() == {"workspaces": [], "layers": 0, "workspace_bytes": 0}


@case(
    "configuration",
    "SGLang's weight update writes new alphas into a layer b12x serves (through .data: no version bump)",
    "b12x's derived scales and the wrapper's folded alpha are refreshed in place: the next call computes with the "
    "new weights, in the same tensors a captured graph reads",
)
@pytest.mark.slow
def test_b12x_serves_the_new_scales_after_an_in_place_weight_update(b12x):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x")
    ckpt = synthetic.make_moe_checkpoint(E, H, I, seed=3)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    x, ids, weights = routing(40)
    before = moe_layers.moe_forward(layer, x, ids, weights)
    wrapper = b12x.made[-1]
    folded = wrapper._folded_w1_alpha
    serving.weights_update_begin()
    layer.g1_alphas.data.mul_(2)  # as SGLang's update_weights writes: in place, the version counter unchanged
    serving.weights_update_end(Settings(simulate="12.0"))
    after = moe_layers.moe_forward(layer, x, ids, weights)
    new = dataclasses.replace(ckpt, w13_weight_scale_2=ckpt.w13_weight_scale_2 * 2)
    assert torch.equal(after, synthetic.reference_moe_output(new, x, ids, weights)) and not torch.equal(after, before)
    assert wrapper._folded_w1_alpha is folded, "refolded in its own tensor (a captured graph reads that one)"


@case(
    "backend faults",
    "a b12x stand-in that reads its activation global scales in cutlass's direction (not 1/a1, 1/a2)",
    "refused at load: the outputs are off by the scale's square",
)
def test_b12x_with_the_scale_direction_inverted_is_refused(b12x):
    b12x.fault = "inverted"
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x")
    with pytest.raises(RefusedToServe, match=r"(?s)b12x"):
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)


@case(
    "backend faults",
    "a b12x stand-in that loses one 8-column group of one row in 2 of every 100 calls",
    "refused at load by the repeat probe (100 calls in a row at each decode batch size, the worst judged)",
)
@pytest.mark.slow
def test_b12x_losing_a_column_group_intermittently_is_refused(b12x):
    b12x.fault = "lossy"
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x")
    with pytest.raises(
        RefusedToServe, match=r"(?s)b12x: failed the served-layer check: .* x100 in a row \(worst judged\)"
    ):
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)


@case(
    "backend faults",
    "a b12x stand-in that computes a -1 slot on expert 0 with weight 0, multiplied through, while expert 0 yields non-finite rows",
    "refused at load: 0 x inf poisons rows that route nowhere near expert 0",
)
def test_b12x_poisoning_rows_through_expert_0_is_refused(b12x):
    b12x.fault = "poison"
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="b12x")
    with pytest.raises(
        RefusedToServe,
        match=r"(?s)b12x: self-test failed: expert 0 non-finite, -1 slots pointing nowhere: call 1: .*non-finite",
    ):
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(E, H, I, seed=1), TOP_K)


def _no_cute():
    return flashinfer.Toolchain((13, 0), "test", (2, 39), "nvidia-cutlass-dsl is not installed")


@case(
    "backend faults",
    "b12x named where it cannot serve: {why}",
    "skipped with that reason in the candidate list; nothing served by it",
)
@pytest.mark.parametrize(
    "why, toolchain, setting, capability, match",
    [
        (
            "CUDA 12.8",
            lambda: flashinfer.Toolchain((12, 8), "test", (2, 39), None),
            None,
            "12.0",
            r"needs CUDA >= 13\.0; found 12\.8",
        ),
        ("no CuTe DSL", _no_cute, None, "12.0", r"needs the CuTe DSL"),
        ("pdmux", None, "enable_pdmux", "12.0", r"--enable-pdmux"),
        ("deterministic inference", None, "enable_deterministic_inference", "12.0", r"deterministic-inference"),
        ("expert parallelism", None, "ep_size", "12.0", r"no NVFP4 expert parallelism"),
        ("two ranks", None, "world_size", "12.0", r"refused with 2 ranks .*vLLM #47365"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v[:3] else None,
)
def test_b12x_skip_reasons_are_reported(b12x, monkeypatch, request, why, toolchain, setting, capability, match):
    from sm120_fp4.sglang import hooks

    if setting == "world_size":  # a TP=2 run: torch.distributed's world spans two ranks
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        request.addfinalizer(torch.distributed.destroy_process_group)
    elif setting is not None:
        monkeypatch.setattr(
            hooks, "server_setting", lambda name: (2 if name == "ep_size" else True) if name == setting else None
        )
    major, minor = map(int, capability.split("."))
    dev = Device(-1, "simulated (no GPU)", (major, minor), simulated=True, source="simulate")
    monkeypatch.setattr(flashinfer, "toolchain", toolchain or (lambda: B12X_TOOLCHAIN))
    sglangs = setting not in (None, "world_size")  # SGLang's settings are checked where it is installed
    if capability == "12.1" or sglangs:
        sm120_fp4.install(simulate=capability, backends="emulated", moe_fallback="emulated", select="fastest")
    ok, reason = backends.is_moe_supported("b12x", dev)
    assert not ok and __import__("re").search(match, reason), reason
    if sglangs:  # added by install(), removed by uninstall(): nothing registered at import
        sm120_fp4.uninstall()
        assert backends.is_moe_supported("b12x", dev) == (True, None)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ((E, H, I, "swiglu", torch.float16), r"bf16 activations"),
        ((E, H, 96, "swiglu", torch.bfloat16), r"I % 128 == 0 \(this layer: I=96"),
        ((E, H, 1024, "swiglu", torch.bfloat16), r"fails to launch on SM120 for I >= 1024 \(FlashInfer #3807"),
    ],
    ids=["fp16", "I off 128", "I 1024"],
)
def test_b12x_layer_limits_are_named(sizes, match):
    assert __import__("re").search(match, b12x_moe.layer_problem(*sizes))


def test_b12x_is_not_in_the_default_moe_order():
    assert "b12x" not in flashinfer.default_moe_order((12, 0)) and flashinfer.default_moe_order((12, 0))[0] == "cutlass"
    assert flashinfer.default_moe_order((12, 0), fastest=True)[-1] == "b12x"
    # sm_121 (illegal memory accesses reported there: FlashInfer #3170): b12x only where the operator names it
    assert "b12x" not in flashinfer.default_moe_order((12, 1), fastest=True)
