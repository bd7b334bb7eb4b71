"""vLLM's real NVFP4 linear layers (vLLM 0.32-0.34) on a CPU with the device simulated as 12.0: each layer
configuration verified with its own weights through vLLM's own apply path, broken kernels and kernels this
library cannot route refused. Run with vLLM's venv (scripts/setup_vllm_env.sh):
``PYTHONPATH=$PWD .venv-vllm/bin/python -m pytest tests/engine_vllm -q``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from helpers import faults  # noqa: E402
from helpers.cases import case  # noqa: E402

import sm120_fp4  # noqa: E402
from sm120_fp4 import backends  # noqa: E402
from sm120_fp4.backends import emulated_mm_fp4  # noqa: E402
from sm120_fp4.demo import synthetic  # noqa: E402
from sm120_fp4.errors import RefusedToServe  # noqa: E402
from sm120_fp4.sglang.moe_layers import COMPRESSED_TENSORS, MODELOPT  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported():
    """vLLM's modules imported once, in simulation (its import chain starts a helper interpreter once per process,
    which the per-test process guard would count against the first test)."""
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


def _layer_reports():
    return [layer for decision in sm120_fp4.status().decisions for layer in decision.layers]


def test_a_modelopt_nvfp4_layer_is_verified_through_vllms_apply_and_serves_the_oracles_numbers():
    status = sm120_fp4.install(simulate="12.0", backends="emulated")
    assert status.message.startswith("installed (vllm ")
    ckpt = synthetic.make_checkpoint(128, 256, seed=0)
    with vllm_layers.vllm_context():
        layer = vllm_layers.build_modelopt_layer(ckpt)
        assert type(layer.quant_method.kernel).__name__ == "FlashInferCutlassNvFp4LinearKernel"
        x = torch.randn(5, 256, dtype=torch.bfloat16)
        out = layer(x)[0]
    assert torch.equal(out, synthetic.reference_output(ckpt, x))
    [report] = _layer_reports()
    assert report.passed and report.config.startswith("vLLM ModelOptLinearMethod (NVFP4) N=128 K=256 bfloat16")
    assert {s.m for s in report.shapes} >= {1, 8, 512, 2048}
    ledger = {p.name: p.state for p in sm120_fp4.status().patches}
    assert ledger["vllm-flashinfer-scaled-fp4-mm-alias"] == "applied"
    assert ledger["vllm-modelopt-linear-weights-hook"] == "applied"


def test_a_compressed_tensors_nvfp4_layer_is_verified_through_vllms_apply():
    sm120_fp4.install(simulate="12.0", backends="emulated")
    ckpt = synthetic.make_checkpoint(96, 160, seed=1)
    with vllm_layers.vllm_context():
        scheme, layer = vllm_layers.build_compressed_tensors_layer(ckpt)
        x = torch.randn(3, 160, dtype=torch.bfloat16)
        out = scheme.apply_weights(layer, x)
    assert torch.equal(out, synthetic.reference_output(ckpt, x))
    [report] = _layer_reports()
    assert report.passed and report.config.startswith("vLLM CompressedTensorsW4A4Fp4 N=96 K=160")


def zeros_when_wide(a, b, a_sf, b_sf, alpha, dtype, out):  # right on the self-test's shapes, zeros for N > 256
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if out.shape[1] > 256:
        out.zero_()
    return out


@case(
    "backend faults",
    "vLLM 0.33's ModelOpt NVFP4 layer (simulated 12.0) with a registered dense kernel that {fault}",
    "refused at vLLM's process_weights_after_loading ({where}); the layer never serves",
)
@pytest.mark.parametrize(
    "fault, where, reason",
    [
        (faults.returns_zeros, "by the self-test at the first NVFP4 layer", r"no FP4 GEMM backend passed verification"),
        (
            zeros_when_wide,
            "by the layer check of N=512 K=256, naming it and M",
            r"N=512 K=256 bfloat16.*M=1 .*all zeros",
        ),
    ],
)
def test_a_broken_dense_kernel_is_refused_at_vllms_weight_processing(fault, where, reason):
    backends.register("broken", fault)
    sm120_fp4.install(simulate="12.0", backends="broken")
    with vllm_layers.vllm_context(), pytest.raises(RefusedToServe, match=reason):
        vllm_layers.build_modelopt_layer(synthetic.make_checkpoint(512, 256, seed=2))


@case(
    "configuration",
    "vLLM selects an NVFP4 linear kernel whose GEMM does not pass the routed FlashInfer alias "
    "(FlashInferCutlassNvFp4LinearKernel disabled through VLLM_DISABLED_KERNELS)",
    "refused at process_weights_after_loading naming the kernel vLLM selected and --linear-backend flashinfer_cutlass",
)
def test_a_layer_on_a_kernel_the_library_cannot_route_is_refused_naming_it_and_the_flag(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "FlashInferCutlassNvFp4LinearKernel")
    sm120_fp4.install(simulate="12.0", backends="emulated")
    with vllm_layers.vllm_context(), pytest.raises(RefusedToServe) as refused:
        vllm_layers.build_modelopt_layer(synthetic.make_checkpoint(128, 256, seed=3))
    message = str(refused.value)
    assert "vLLM selected " in message and "--linear-backend flashinfer_cutlass" in message
    assert "FlashInferCutlassNvFp4LinearKernel" in message  # the remedy names the routed kernel


def test_uninstall_restores_vllms_alias_and_weights_hook():
    from vllm.model_executor.kernels.linear.nvfp4 import flashinfer as linear
    from vllm.model_executor.layers.quantization.modelopt import ModelOptLinearMethod

    before = linear.flashinfer_scaled_fp4_mm, ModelOptLinearMethod.process_weights_after_loading
    sm120_fp4.install(simulate="12.0", backends="emulated")
    assert linear.flashinfer_scaled_fp4_mm is not before[0]
    sm120_fp4.uninstall()
    assert (linear.flashinfer_scaled_fp4_mm, ModelOptLinearMethod.process_weights_after_loading) == before


def _worker(capture_sizes: list[int], enforce_eager: bool = False):
    """What the warm-up hook reads of vLLM's GPU worker: its config's graph sizes and enforce_eager."""
    from types import SimpleNamespace

    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=capture_sizes),
            model_config=SimpleNamespace(enforce_eager=enforce_eager),
        )
    )


@case(
    "backend faults",
    "vLLM 0.33 (simulated 12.0): a dense kernel right at load that zeros its output after vLLM's "
    "kernel_warmup (as a tactic FlashInfer's autotuner picks there could), only at M=24, a graph batch size about to be captured",
    "refused right after kernel_warmup, before CUDA-graph capture, naming the configuration and M=24",
)
def test_a_kernel_that_goes_wrong_in_vllms_warmup_is_refused_before_graph_capture(monkeypatch):
    import vllm.v1.worker.gpu_worker as gpu_worker

    tuned = []

    def zeros_at_24_once_tuned(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if tuned and a.shape[0] == 24:
            out.zero_()
        return out

    # vLLM's warm-up, standing in for the real one (which needs a GPU worker): it tunes the kernels.
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker, **kwargs: tuned.append(True))
    backends.register("tuned-wrong", zeros_at_24_once_tuned)
    sm120_fp4.install(simulate="12.0", backends="tuned-wrong")
    with vllm_layers.vllm_context():
        vllm_layers.build_modelopt_layer(synthetic.make_checkpoint(128, 256, seed=4))
    assert [layer.passed for layer in _layer_reports()] == [True]
    with pytest.raises(RefusedToServe, match=r"N=128 K=256 .*M=24 .*all zeros"):
        gpu_worker.kernel_warmup(_worker([1, 2, 4, 8, 16, 24, 32]))


def test_the_recheck_after_vllms_warmup_passes_a_healthy_kernel(monkeypatch):
    import vllm.v1.worker.gpu_worker as gpu_worker

    calls = []
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker, **kwargs: calls.append(worker))
    sm120_fp4.install(simulate="12.0", backends="emulated")
    with vllm_layers.vllm_context():
        vllm_layers.build_modelopt_layer(synthetic.make_checkpoint(128, 256, seed=5))
    worker = _worker([1, 2, 4, 8, 24])
    gpu_worker.kernel_warmup(worker)
    assert calls == [worker]
    assert {p.name: p.state for p in sm120_fp4.status().patches}["vllm-post-warmup-recheck"] == "applied"


@case(
    "configuration",
    "a ModelOpt FP8 linear layer under vLLM (ModelOptLinearMethod serves FP8 too), with a broken FP4 "
    "GEMM backend the only candidate",
    "left to vLLM: no FP4 self-test, no decision, no refusal (it is not an NVFP4 layer)",
)
def test_a_modelopt_fp8_layer_is_left_alone():
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config

    backends.register("broken", faults.returns_zeros)
    sm120_fp4.install(simulate="12.0", backends="broken")
    config = ModelOptFp8Config(
        quant_method="FP8", is_checkpoint_fp8_serialized=True, kv_cache_quant_method=None, exclude_modules=[]
    )
    with vllm_layers.vllm_context():
        layer = ReplicatedLinear(256, 128, bias=False, quant_config=config, prefix="fp8", params_dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.data.zero_()
            layer.weight_scale.data.fill_(1.0)
            layer.input_scale.data.fill_(1.0)
        layer.quant_method.process_weights_after_loading(layer)
    status = sm120_fp4.status()
    assert not status.decisions and not status.refusals


@case(
    "backend faults",
    "vLLM 0.33 (simulated 12.0), largest CUDA-graph batch 512, max_num_batched_tokens 8192: a registered dense "
    "kernel wrong only for M in {low}-{high} (inside one autotuner bucket past the graph batches)",
    "refused at process_weights_after_loading naming M={m}: an M of every power-of-two bucket is verified",
)
@pytest.mark.parametrize("low, high, m", [(600, 1000, 767), (1100, 2000, 1535)])
def test_a_kernel_wrong_only_inside_one_bucket_above_the_graph_batches_is_refused(low, high, m):
    from sm120_fp4.serving import policy
    from sm120_fp4.vllm import hooks

    backends.register("bucket-wrong", faults.wrong_rows_between(low, high))
    sm120_fp4.install(simulate="12.0", backends="bucket-wrong")
    with vllm_layers.vllm_context(max_tokens=8192, max_batch=512):
        assert hooks.sizes()[:3] == policy.Sizes(512, 8192, 8192)[:3]
        with pytest.raises(RefusedToServe, match=rf"N=128 K=256 .*M={m} "):
            vllm_layers.build_modelopt_layer(synthetic.make_checkpoint(128, 256, seed=6))


@case(
    "backend faults",
    "vLLM 0.33's ModelOpt NVFP4 layer served by a backend that converts the layer's weights in place "
    "(humming, its CPU stand-in), healthy; then the same backend with a wrong kernel",
    "the healthy one verifies against the checkpoint's bytes (never the converted layout) and serves the "
    "oracle's numbers; the wrong one is refused at process_weights_after_loading",
)
def test_a_layer_served_by_a_converting_backend_is_checked_against_the_checkpoints_bytes(monkeypatch):
    from helpers.humming_stand_in import StandInEngine, engine

    ckpt = synthetic.make_checkpoint(256, 512, seed=7)
    with engine(StandInEngine()) as stand_in:
        sm120_fp4.install(simulate="12.0", backends="humming")
        with vllm_layers.vllm_context():
            layer = vllm_layers.build_modelopt_layer(ckpt)
            x = torch.randn(5, 512, dtype=torch.bfloat16)
            out = layer(x)[0]
        assert not torch.equal(layer.weight, ckpt.weight) and stand_in.prepared  # converted in place
        [report] = _layer_reports()
        assert report.passed and report.backend == "humming", report.reason
        assert torch.equal(out, synthetic.reference_output(ckpt, x))
        sm120_fp4.uninstall()
        # Wrong only on this layer's shape (N=256), right on the self-test's: the layer check must see it.
        healthy = stand_in.gemm

        def halved_at_n_256(prepared, x, scale_2, out):
            healthy(prepared, x, scale_2, out)
            return out.mul_(0.5) if prepared.n == 256 else out

        monkeypatch.setattr(stand_in, "gemm", halved_at_n_256)
        sm120_fp4.install(simulate="12.0", backends="humming")
        with (
            vllm_layers.vllm_context(),
            pytest.raises(RefusedToServe, match=r"humming: failed the served-layer .*N=256 K=512"),
        ):
            vllm_layers.build_modelopt_layer(ckpt)


def test_vllms_batch_sizes_not_visible_are_assumed_and_said_once(monkeypatch, caplog):
    import logging

    from sm120_fp4 import errors
    from sm120_fp4.vllm import hooks

    monkeypatch.setattr(errors, "_said", set())  # "once per process": this test's process starts now
    sm120_fp4.install(simulate="12.0", backends="emulated")  # vLLM's config reads the (simulated) platform
    with caplog.at_level(logging.WARNING, logger="sm120_fp4"):
        assert [tuple(hooks.sizes()[:3]) for _ in range(2)] == [(512, 8192, 8192)] * 2  # no current vLLM config
        with vllm_layers.vllm_context(max_tokens=3000, max_batch=160):
            assert hooks.sizes()[:3] == (160, 3000, 3000)
    [said] = [r.getMessage() for r in caplog.records if "batch sizes are not set" in r.getMessage()]
    assert "no current vLLM config" in said and "max_cudagraph_capture_size=512" in said, said
    assert "max_num_batched_tokens=8192" in said and "--max-num-batched-tokens" in said, said


from helpers.scale_faults import SHARD_FAULTS, faulty_shards  # noqa: E402


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("fault", list(SHARD_FAULTS))
@case(
    "configuration",
    "vLLM's fused q/k/v layer ({fmt}) whose checkpoint has {fault} (the same fault as SGLang's test)",
    "refused at vLLM's weights hook, before vLLM reduces the shards' scales to one, naming the layer and the tensor "
    "as SGLang does; no kernel checked",
)
def test_vllm_refuses_the_checkpoint_scales_sglang_refuses(fmt, fault):
    sm120_fp4.install(simulate="12.0", backends="emulated")
    with vllm_layers.vllm_context(), pytest.raises(RefusedToServe) as err:
        vllm_layers.build_fused_layer(faulty_shards(fault), fmt)
    message = str(err.value)
    assert "refusing to serve the vLLM NVFP4 layer model.layers.0.self_attn.qkv_proj" in message, message
    assert re.search(SHARD_FAULTS[fault][1], message), message
    assert not _layer_reports(), "no kernel was checked or blamed"
