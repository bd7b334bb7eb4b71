"""NVFP4 MoE verify-or-refuse at SGLang's real FusedMoE layer (simulated SM120, CPU).

install() patches the fused-MoE seam and the MoE weights hooks; building a layer decides the MoE
backend (run_moe) and verifies the layer's own configuration through the seam. Faulty MoE kernels
registered with register_moe are refused there; healthy ones with rounding-level differences serve.
"""

from __future__ import annotations

import pytest
import torch

from helpers import moe_faults
from helpers.common import simulated_moe_skip_reason
import sm120_fp4
from sm120_fp4 import backends, nvfp4, selection, selftest
from sm120_fp4.devices import Device
from sm120_fp4.errors import RefusedToServe

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
moe_layers = pytest.importorskip("sm120_fp4.sglang.moe_layers")
pytest.importorskip("sglang.srt.layers.moe.moe_runner.flashinfer_cutlass", reason="needs the pinned SGLang's MoE modules")

SIM = Device(-1, "simulated (no GPU)", (12, 0), simulated=True, source="simulate")
E, H, I, TOP_K = 8, 256, 128, 2


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched."""


def routing(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids, weights = selftest.moe_routing(tokens, TOP_K, E, "random", gen)
    x = (torch.randn(tokens, H, generator=gen) * 2).to(torch.bfloat16)
    return x, ids, weights


def test_sglangs_moe_forward_through_the_patched_seam_matches_the_oracle():
    status = sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    states = {p.name: p.state for p in status.patches}
    assert states["fused-moe-kernel-seam"] == "applied"
    assert states["modelopt-nvfp4-moe-weights-hook"] == "applied"
    ckpt = moe_layers.make_moe_checkpoint(E, H, I, seed=3)
    layer = moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)
    [decision] = [d for d in selection.decisions() if d.family == "moe"]
    assert decision.backend == "emulated" and decision.verified
    assert decision.layers and decision.layers[0].passed and decision.layers[0].config.startswith("ModelOptNvFp4FusedMoEMethod E=8 H=256 I=128 top_k=2 swiglu")
    x, ids, weights = routing(130)
    out = moe_layers.moe_forward(layer, x, ids, weights)
    want = moe_layers.reference_moe_output(ckpt, x, ids, weights)
    assert torch.equal(out, want), "SGLang's MoE apply() agrees with reference_moe_fp4 (bit-exact with the emulated backend)"
    assert sm120_fp4.status().moe_routes == {-1: "emulated"}


@pytest.mark.parametrize("fault", [moe_faults.drops_tile_rows_64_127, moe_faults.drops_one_expert,
                                   moe_faults.ignores_routing_weights, moe_faults.swaps_gate_and_up,
                                   moe_faults.drops_second_slot], ids=lambda f: f.__name__)
def test_a_faulty_moe_kernel_is_refused_at_the_real_layer(fault):
    backends.register_moe("faulty", fault)
    calls = {"n": 0}
    generic = 2 * len(selftest.SIMULATION_MOE_CONFIG.cases)  # two passes of the generic self-test

    def passes_the_generic_selftest_then_faulty(*args):
        calls["n"] += 1  # the generic self-test runs first; the layer check after it
        return (backends.emulated_moe if calls["n"] <= generic else fault)(*args)

    backends.register_moe("late-faulty", passes_the_generic_selftest_then_faulty)
    for name in ("faulty", "late-faulty"):
        sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends=name)
        # A kernel faulty from the start fails the generic MoE self-test; one that turns faulty only
        # after it fails the layer's own check, which names the layer and the batch (T=...).
        reason = (r"(?s)failed the served-layer check: ModelOptNvFp4FusedMoEMethod E=8 H=256 I=128 top_k=2 swiglu bfloat16: T=\d+ "
                  if name == "late-faulty" else r"(?s)no NVFP4 fused-MoE backend passed verification.*faulty: self-test failed: T=")
        with pytest.raises(RefusedToServe, match=reason):
            moe_layers.build_modelopt_moe_layer(moe_layers.make_moe_checkpoint(E, H, I, seed=1), TOP_K)
        sm120_fp4.uninstall()


def test_moe_fallback_emulated_serves_when_the_kernel_fails_the_layer():
    backends.register_moe("faulty", moe_faults.drops_one_expert)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="faulty", moe_fallback="emulated")
    layer = moe_layers.build_modelopt_moe_layer(moe_layers.make_moe_checkpoint(E, H, I, seed=2), TOP_K)
    assert sm120_fp4.status().moe_routes == {-1: "emulated"}
    x, ids, weights = routing(9)
    assert torch.isfinite(moe_layers.moe_forward(layer, x, ids, weights)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_healthy_kernel_with_flashinfers_rounding_serves(dtype):
    backends.register_moe("flashinfer-rounding", moe_faults.rounds_intermediate_first)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="flashinfer-rounding")
    moe_layers.build_modelopt_moe_layer(moe_layers.make_moe_checkpoint(E, H, I, seed=4), TOP_K, dtype=dtype)
    [decision] = [d for d in selection.decisions() if d.family == "moe"]
    assert decision.backend == "flashinfer-rounding" and all(r.passed for r in decision.layers)


def test_unequal_gate_and_up_scales_are_refused():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    ckpt = moe_layers.make_moe_checkpoint(E, H, I, seed=5)
    ckpt.w13_weight_scale_2[:, 1] *= 1.5
    with pytest.raises(RefusedToServe, match=r"gate and up weight_scale_2 differ"):
        moe_layers.build_modelopt_moe_layer(ckpt, TOP_K)


def test_under_expert_parallelism_this_ranks_experts_are_verified():
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    moe_layers.build_modelopt_moe_layer(moe_layers.make_moe_checkpoint(E, H, I, seed=6), TOP_K, ep_size=2, ep_rank=1)
    [decision] = [d for d in selection.decisions() if d.family == "moe"]
    assert decision.layers[0].config.startswith("ModelOptNvFp4FusedMoEMethod E=4 H=256 I=128 top_k=2 swiglu bfloat16 EP rank 1/2")
    assert decision.layers[0].passed


# ---- run_moe: the generic MoE self-test, its default configuration ------------------------------

def test_the_default_moe_configuration_covers_what_the_issue_names():
    cases = selftest.DEFAULT_MOE_CONFIG.cases
    assert max(c.experts for c in cases) >= 256
    assert {1, 8} <= {c.top_k for c in cases} and max(c.tokens for c in cases) >= 1024 and min(c.tokens for c in cases) == 1
    assert {c.activation for c in cases} == {"swiglu", "relu2"} and {c.dtype for c in cases} == {"bfloat16", "float16"}
    assert any(c.hidden % 128 == 0 for c in cases) and any(c.hidden % 128 for c in cases)
    assert any(c.intermediate % 128 == 0 for c in cases) and any(c.intermediate % 128 for c in cases)
    gen = torch.Generator().manual_seed(0)
    big = next(c for c in cases if c.experts >= 256 and c.routing == "balanced" and c.top_k == 8)
    ids, _ = selftest.moe_routing(big.tokens, big.top_k, big.experts, "balanced", gen)
    assert torch.bincount(ids.reshape(-1).long(), minlength=big.experts).min() > 0, "every expert receives rows"
    skew = next(c for c in cases if c.routing == "skewed" and c.experts >= 256)
    ids, _ = selftest.moe_routing(skew.tokens, skew.top_k, skew.experts, "skewed", gen)
    assert torch.bincount(ids.reshape(-1).long()).max() >= 128
    assert all(len(set(row.tolist())) == skew.top_k for row in ids), "distinct experts per token"
