"""Verify exactly what will be served: each layer configuration through SGLang's real apply().

Faulty kernels of the kinds SM12x reports describe (shape-, dtype-, batch-, call-count- and
state-dependent) pass the generic self-test's small shapes but are wrong on what the layer serves;
each must be refused at process_weights_after_loading with a reason naming the configuration and M.
Healthy kernels that differ from the oracle only by rounding must serve, in bf16 and fp16.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
import threading
import types

import pytest
import torch
from helpers import faults
from helpers.cases import case
from helpers.common import release_specs, slow_but_one

import sm120_fp4
from sm120_fp4 import backends, nvfp4, serving, verify
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.demo import synthetic
from sm120_fp4.errors import RefusedToServe
from sm120_fp4.serving import policy
from sm120_fp4.sglang import hooks, layers
from sm120_fp4.sglang.moe_layers import COMPRESSED_TENSORS, MODELOPT
from sm120_fp4.sglang.release import MODEL_RUNNER, sglang_version
from sm120_fp4.versions import version_in

pytest.importorskip(
    "sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)"
)


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched."""


def build(n: int, k: int, dtype=torch.bfloat16, seed: int = 0):
    return layers.build_modelopt_layer(synthetic.make_checkpoint(n, k, seed=seed), dtype=dtype)


# ---- faults: each is right on the self-test's shapes and wrong on what the layer serves ----------


def zeros_when_wide(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if b.shape[1] > 256:
        out.zero_()
    return out


def wrong_for_fp16(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if dtype == torch.float16:
        out.mul_(0.5)
    return out


def zeros_for_decode_batches(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if 8 <= a.shape[0] <= 128:
        out.zero_()
    return out


def make_wears_out(good_calls: int):
    calls = {"n": 0}

    def wears_out(a, b, a_sf, b_sf, alpha, dtype, out):
        calls["n"] += 1
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if calls["n"] > good_calls:
            out.zero_()
        return out

    return wears_out


def scales_its_weight_scales(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if b.shape[1] == 288:  # the layer's weights, not the self-test's
        raw = b_sf.view(torch.uint8)
        raw.copy_(torch.where(raw > 8, raw - 8, raw))  # halves every E4M3 scale, in place
    return out


def returns_none(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    return None


def reads_scale_bytes_as_values(a, b, a_sf, b_sf, alpha, dtype, out):
    if a_sf.dtype == torch.uint8:  # SGLang's quantizer returns uint8 bytes: converted as integers
        a_sf = a_sf.to(torch.float8_e4m3fn)
    return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


FAULTS = {
    "zeros when N > 256": (zeros_when_wide, dict(n=512, k=256), r"N=512 K=256 bfloat16.*M=1 .*all zeros"),
    "wrong for fp16 out": (
        wrong_for_fp16,
        dict(n=96, k=160, dtype=torch.float16),
        r"N=96 K=160 float16.*M=1 .*norm is 0.5x",
    ),
    "zeros for decode batches 8..128": (zeros_for_decode_batches, dict(n=96, k=160), r"N=96 K=160 .*M=8 .*all zeros"),
    "right for 16 calls, then zeros": (make_wears_out(16), dict(n=96, k=160), r"N=96 K=160 .*M=\d+ .*all zeros"),
    "scales its own weight scales in place": (
        scales_its_weight_scales,
        dict(n=288, k=160),
        r"N=288 K=160 .*M=1 .*changed its input\(s\) \[1\] in place",
    ),
    "writes out, returns None": (returns_none, dict(n=96, k=160), r"returned None"),
    "reads uint8 scale bytes as values": (reads_scale_bytes_as_values, dict(n=96, k=160), r"M=1 N=96 K=1056"),
}


@pytest.mark.parametrize("name", slow_but_one(FAULTS, keep=list(FAULTS).index("writes out, returns None")))
def test_a_fault_in_what_the_layer_serves_is_refused_naming_configuration_and_m(name):
    fault, shape, reason = FAULTS[name]
    backends.register("faulty", fault)
    sm120_fp4.install(simulate="12.0", backends="faulty")
    with pytest.raises(RefusedToServe, match=reason):
        build(**shape)
    status = sm120_fp4.status()
    assert status.refusals and status.refusals[-1].message.startswith("sm120_fp4: refusing to serve NVFP4")


@pytest.mark.slow
def test_a_backend_that_fails_one_layer_is_replaced_by_one_that_passes_every_layer(caplog):
    backends.register("wide-zeros", zeros_when_wide)
    sm120_fp4.install(simulate="12.0", backends="wide-zeros,emulated")
    method_small, small = build(96, 160)
    assert sm120_fp4.status().routes == {-1: "wide-zeros"}, "wide-zeros is right on narrow layers"
    method_wide, wide = build(512, 256)
    assert sm120_fp4.status().routes == {-1: "emulated"}
    x = torch.randn(5, 160).to(torch.bfloat16)
    assert torch.equal(method_small.apply(small, x), synthetic.reference_output(synthetic.make_checkpoint(96, 160), x))
    [decision] = [d for d in serving.decisions() if d.backend == "emulated"]
    assert {r.config.split(" (")[0] for r in decision.layers} == {
        "ModelOptFp4LinearMethod N=96 K=160 bfloat16",
        "ModelOptFp4LinearMethod N=512 K=256 bfloat16",
    }
    assert all(r.passed for r in decision.layers)


def test_fallback_emulated_serves_when_no_candidate_passes_a_layer():
    backends.register("wide-zeros", zeros_when_wide)
    sm120_fp4.install(simulate="12.0", backends="wide-zeros", fallback="emulated")
    method, layer = build(512, 256)
    assert sm120_fp4.status().routes == {-1: "emulated"}
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x), synthetic.reference_output(synthetic.make_checkpoint(512, 256), x))


def test_each_distinct_configuration_is_verified_once_per_process():
    sm120_fp4.install(simulate="12.0", backends="emulated")
    for seed in range(3):
        build(96, 160, seed=seed)
    build(64, 160)
    [decision] = serving.decisions()
    assert [r.config for r in decision.layers] == [
        "ModelOptFp4LinearMethod N=96 K=160 bfloat16 (weight scales float8_e4m3fn)",
        "ModelOptFp4LinearMethod N=64 K=160 bfloat16 (weight scales float8_e4m3fn)",
    ]
    ms = [s.m for s in decision.layers[0].shapes]
    assert ms == policy.load_ms(hooks.sizes()) and all(
        s.calls == 3 for s in decision.layers[0].shapes
    )  # M twice in a row, then again


# ---- healthy kernels: rounding-level differences must serve in bf16 and fp16 ------------------


def bf16_products(a, b, a_sf, b_sf, alpha, dtype, out):  # bf16 operands, float32 accumulation
    deq_a = nvfp4.dequantize_unscaled(a, a_sf.contiguous(), torch.bfloat16).float()
    deq_b = nvfp4.dequantize_unscaled(b.T, b_sf.T, torch.bfloat16).float()
    out.copy_((deq_a @ deq_b.T) * alpha)
    return out


def noisy(a, b, a_sf, b_sf, alpha, dtype, out):  # 1e-3 relative noise
    acc = nvfp4.reference_mm_fp4(a, b, a_sf, b_sf, alpha, torch.float32)
    gen = torch.Generator().manual_seed(a.shape[0])
    out.copy_(acc * (1 + 1e-3 * torch.randn(acc.shape, generator=gen)))
    return out


def split_k(a, b, a_sf, b_sf, alpha, dtype, out):  # another summation order: two K halves
    deq_a = nvfp4.dequantize_unscaled(a, a_sf.contiguous())
    deq_b = nvfp4.dequantize_unscaled(b.T, b_sf.T)
    half = deq_a.shape[1] // 2
    acc = deq_a[:, half:] @ deq_b[:, half:].T + deq_a[:, :half] @ deq_b[:, :half].T
    out.copy_(acc * alpha)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kernel", slow_but_one([bf16_products, noisy, split_k]), ids=lambda f: f.__name__)
def test_healthy_kernels_with_rounding_differences_serve(kernel, dtype):
    backends.register("healthy", kernel)
    sm120_fp4.install(simulate="12.0", backends="healthy")
    method, layer = build(288, 512, dtype=dtype)
    [decision] = serving.decisions()
    assert decision.backend == "healthy" and decision.verified and decision.layers[0].passed
    assert method.apply(layer, torch.randn(4, 512).to(dtype)).dtype == dtype


# ---- after warm-up and CUDA-graph capture ------------------------------------------------------


def _warmup_spec():
    """The installed release's warm-up seam: init_cuda_graphs (0.5.15+) or init_device_graphs."""
    specs = release_specs()
    return specs.get("post-warmup-recheck") or specs["post-warmup-recheck-legacy"]


def _warmup(runner) -> None:
    getattr(runner, _warmup_spec().attribute.split(".")[1])()


def _captured_graphs(runner, decode_bs, per_request, prefill_tokens):
    """What this release's init_cuda_graphs / init_device_graphs leave on the model runner: the
    decode graph runner (captured batch sizes, tokens per request) and the prefill graph runner."""
    new = version_in(sglang_version(), ">=0.5.14")
    width = "captured_req_width" if version_in(sglang_version(), ">=0.5.16") else "num_tokens_per_bs"
    decode = types.SimpleNamespace(capture_bs=list(decode_bs), **{width: per_request})
    prefill = types.SimpleNamespace(capture_num_tokens=list(prefill_tokens))
    setattr(runner, "decode_cuda_graph_runner" if new else "graph_runner", decode)
    setattr(runner, "prefill_cuda_graph_runner" if new else "piecewise_cuda_graph_runner", prefill)
    runner.decode_cuda_graph_capture_bs = list(decode_bs)


def _model_runner_stand_in(warmup, decode_bs=(1, 2, 4, 8), per_request=1, prefill_tokens=()):
    """SGLang's model runner cannot be imported on a CPU: a stand-in with this release's warm-up seam."""
    module = types.ModuleType(MODEL_RUNNER)

    def init_graphs(self, capture_decode_cuda_graph=True):
        warmup()  # what SGLang's warm-up and capture do: forward passes at the captured sizes
        _captured_graphs(self, decode_bs, per_request, prefill_tokens)

    module.ModelRunner = type("ModelRunner", (), {_warmup_spec().attribute.split(".")[1]: init_graphs})
    return module


def test_the_recheck_after_warmup_refuses_a_kernel_that_goes_wrong_after_warmup(monkeypatch, tmp_path):
    state = {"warm": False}

    def goes_wrong_after_warmup(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if state["warm"]:
            out.mul_(0.04)  # an autotuned tactic that is wrong
        return out

    layer_box = {}

    def warmup():
        method, layer = layer_box["layer"]
        method.apply(layer, torch.randn(8, 160).to(torch.bfloat16))
        state["warm"] = True

    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(warmup))
    backends.register("tuned", goes_wrong_after_warmup)
    report = tmp_path / "report.json"
    status = sm120_fp4.install(simulate="12.0", backends="tuned", report=str(report))
    assert {p.name: p.state for p in status.patches}[_warmup_spec().name] == "applied"
    layer_box["layer"] = build(96, 160)
    with pytest.raises(RefusedToServe, match=r"(?s)fails after warm-up.*N=96 K=160 .*M=1 .*norm is 0.04x"):
        _warmup(sys.modules[MODEL_RUNNER].ModelRunner())
    data = json.loads(report.read_text())
    assert data["refusals"][-1]["config"].endswith("(re-check after warm-up)")
    assert data["refusals"][-1]["reports"][0]["shapes"][0]["m"] == 1


# Decode graphs for 1-12 requests of 2 tokens each (speculative decoding) and two prefill graphs:
# captured token counts 2, 4, 8, 16, 24, 96, 512.
SPECULATIVE_GRAPHS = dict(decode_bs=(1, 2, 4, 8, 12), per_request=2, prefill_tokens=(96, 512))


@case(
    "backend faults",
    "a kernel that zeros its output only at M=24 and M=96: a captured decode graph (12 requests x 2 tokens, speculative) and a captured prefill graph, between the batch sizes checked at load",
    "the layer verifies at load; after warm-up and capture the re-check runs every captured graph size and refuses, naming M=24",
)
def test_the_recheck_runs_every_captured_graph_size(monkeypatch, tmp_path):
    def zeros_at_captured_sizes(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if a.shape[0] in (24, 96):
            out.zero_()
        return out

    assert not {24, 96} & set(policy.load_ms(hooks.sizes())), "the fault must be invisible at load"
    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: None, **SPECULATIVE_GRAPHS))
    backends.register("captured", zeros_at_captured_sizes)
    report = tmp_path / "report.json"
    sm120_fp4.install(simulate="12.0", backends="captured", report=str(report))
    build(96, 160)
    assert sm120_fp4.status().decisions[0].backend == "captured"  # verified at load
    with pytest.raises(RefusedToServe, match=r"(?s)fails after warm-up.*N=96 K=160 .*M=24 .*all zeros"):
        _warmup(sys.modules[MODEL_RUNNER].ModelRunner())
    assert json.loads(report.read_text())["refusals"][-1]["config"].endswith("(re-check after warm-up)")


def test_the_recheck_calls_the_kernel_at_every_captured_graph_size(monkeypatch):
    seen = []

    def recording(a, b, a_sf, b_sf, alpha, dtype, out):
        seen.append(a.shape[0])
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)

    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: None, **SPECULATIVE_GRAPHS))
    backends.register("recording", recording)
    sm120_fp4.install(simulate="12.0", backends="recording")
    build(96, 160)
    seen.clear()
    _warmup(sys.modules[MODEL_RUNNER].ModelRunner())
    assert {2, 4, 8, 16, 24, 96, 512} <= set(seen), "every captured graph's token count is re-checked"


def test_the_recheck_after_warmup_passes_a_healthy_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: None))
    sm120_fp4.install(simulate="12.0", backends="emulated")
    build(96, 160)
    _warmup(sys.modules[MODEL_RUNNER].ModelRunner())  # no refusal
    sm120_fp4.uninstall()
    assert not hasattr(
        getattr(sys.modules[MODEL_RUNNER].ModelRunner, _warmup_spec().attribute.split(".")[1]), "__sm120_fp4_patch__"
    )


def _nan_block_scale(ckpt):
    ckpt.weight_scale.view(torch.uint8)[5, 1] = 0x7F


@case(
    "configuration",
    "a served ModelOpt NVFP4 linear layer whose checkpoint has {fault}",
    "refused at its weights hook before any layer check: the message names the tensor and says it is the checkpoint's, "
    "never that every kernel failed",
)
@pytest.mark.parametrize(
    "fault, tensor",
    slow_but_one(
        [
            ("a NaN weight_scale_2", "weight_scale_2[0] = nan"),
            ("an infinite weight_scale_2", "weight_scale_2[0] = inf"),
            ("a zero input_scale", "input_scale[0] = 0.0"),
            ("a negative input_scale", "input_scale[0] = -1.0"),
            ("a NaN block scale (E4M3 0x7f)", "weight_scale[5, 1] is a NaN block scale"),
        ]
    ),
)
def test_a_layer_with_bad_checkpoint_scales_is_refused_naming_the_tensor(fault, tensor):
    sm120_fp4.install(simulate="12.0", backends="emulated")
    ckpt = synthetic.make_checkpoint(128, 256, seed=3)
    if "block" in fault:
        _nan_block_scale(ckpt)
    else:
        value = {"NaN": float("nan"), "infinite": float("inf"), "zero": 0.0, "negative": -1.0}[fault.split()[1]]
        getattr(ckpt, tensor.split("[")[0]).fill_(value)
    with pytest.raises(RefusedToServe) as err:
        layers.build_modelopt_layer(ckpt)
    message = str(err.value)
    assert f"the checkpoint's {tensor}" in message and "ModelOptFp4LinearMethod" in message, message
    assert "candidate" not in message and not any(d.layers for d in serving.decisions()), (
        "no kernel was checked or blamed"
    )


def test_a_refusal_writes_the_report_before_raising_and_status_shows_it(tmp_path):
    backends.register("wide-zeros", zeros_when_wide)
    report = tmp_path / "r.json"
    sm120_fp4.install(simulate="12.0", backends="wide-zeros", report=str(report))
    with pytest.raises(RefusedToServe):
        build(512, 256)
    data = json.loads(report.read_text())
    [refusal] = data["refusals"]
    assert refusal["config"].startswith("ModelOptFp4LinearMethod N=512 K=256")
    shapes = refusal["reports"][0]["shapes"]
    assert shapes[0]["m"] == 1 and not shapes[0]["passed"] and "all zeros" in shapes[0]["reason"]
    assert sm120_fp4.status().refusals[0].config == refusal["config"]
    assert sm120_fp4.status().decisions, "the decision that was refused stays visible"


@case(
    "own failures",
    "layers loaded where SGLang's server args cannot be read (no runtime context published), two configurations",
    "verified up to the default largest CUDA-graph batch (512), and one warning says so and why: never a silent fallback",
)
def test_a_missing_max_batch_is_said_once(monkeypatch, caplog):
    import logging

    from sm120_fp4 import errors

    monkeypatch.setattr(errors, "_said", set())  # "once per process": this test's process starts now
    caplog.set_level(logging.WARNING, "sm120_fp4")
    sm120_fp4.install(simulate="12.0", backends="emulated")
    for n in (32, 48):  # two layer configurations, no server args published in this process
        build(n, 64)
    said = [r.getMessage() for r in caplog.records if "server args" in r.getMessage()]
    assert len(said) == 1 and "up to 512" in said[0] and "Global server args is not set" in said[0], said
    assert [len(d.layers) for d in sm120_fp4.status().decisions] == [2]


# ---- what serves: every M, the serving thread, every layer, the weights as loaded -----------------------


def _after_the_selftest(fault, healthy=emulated_mm_fp4):
    """`fault` on every call after the generic self-test's (two passes over its shapes, the first calling each twice in a row): a kernel
    the self-test cannot see, so only the layer checks can."""
    calls = {"n": 0}
    generic = 3 * len(verify.DEFAULT_SHAPES)

    def kernel(*args):
        calls["n"] += 1
        return (healthy if calls["n"] <= generic else fault)(*args)

    return kernel


@case(
    "backend faults",
    "a kernel wrong only at M >= 4096 (a quarter of the right output), SGLang's settings not visible",
    "refused at load naming M=4096: the layer checks run the prefill sizes up to SGLang's chunk on 90-160 GB GPUs (8192)",
)
@pytest.mark.default_prefill
def test_a_kernel_wrong_only_at_large_m_is_refused_at_load():
    def quarter_at_large_m(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if a.shape[0] >= 4096:
            out.mul_(0.25)
        return out

    assert hooks.prefill_sizes() == (8192, 8192) and {4096, 8192} <= set(policy.load_ms(hooks.sizes()))
    backends.register("large-m", quarter_at_large_m)
    sm120_fp4.install(simulate="12.0", backends="large-m")
    with pytest.raises(RefusedToServe, match=r"N=96 K=160 .*M=4096 .*norm is 0.25x"):
        build(96, 160)


@case(
    "backend faults",
    "a registered kernel wrong only for M in {low}-{high} (inside one autotuner bucket past the largest graph "
    "batch), the largest CUDA-graph batch 512 (a GPU's default) and SGLang's chunked_prefill_size 8192",
    "refused at load naming M={m}: the layer checks run an M in every power-of-two bucket up to the chunk",
)
@pytest.mark.parametrize("low, high, m", [(600, 1000, 767), (1100, 2000, 1535)])
def test_a_kernel_wrong_only_inside_one_bucket_above_the_graph_batches_is_refused(monkeypatch, low, high, m):
    backends.register("bucket-wrong", faults.wrong_rows_between(low, high))
    sm120_fp4.install(simulate="12.0", backends="bucket-wrong")
    # SGLang resolves a CPU server's graph batch itself (32): a GPU's default 512 stands in, read where SGLang's is.
    monkeypatch.setattr(hooks, "max_capture_batch", lambda: 512)
    with published_server_args(chunked_prefill_size=8192):
        assert hooks.sizes() == policy.Sizes(512, 8192, 8192)
        with pytest.raises(RefusedToServe, match=rf"N=96 K=160 .*M={m} "):
            build(96, 160)


@contextlib.contextmanager
def published_server_args(**fields):
    """SGLang's ServerArgs with `fields`, published where this release's scheduler publishes them, and
    what was published before back afterwards: a scheduler runtime context where SGLang has the scoped
    seams (0.5.22+, moe_layers.sglang_moe_context); else the runtime context's own scoped
    override_server_args (0.5.16+); else set_global_server_args_for_scheduler, as the scheduler calls it
    (0.5.3.post3-0.5.15.post1: into a module global, or from 0.5.15 the runtime context's slot). A release
    with none of them publishes no server args: skipped."""
    from sm120_fp4.sglang import moe_layers

    if moe_layers.builder_problem() is None:
        with moe_layers.sglang_moe_context(server_args=fields):
            yield
        return
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:  # before 0.5.15: no runtime context
        get_context = None
    if get_context is not None and hasattr(get_context(), "override_server_args"):
        with get_context().override_server_args(**fields):
            yield
        return
    from sglang.srt import server_args as sglang_server_args

    publish = getattr(sglang_server_args, "set_global_server_args_for_scheduler", None)
    if publish is None:
        pytest.skip(f"SGLang {sglang_version()} publishes no server args (no set_global_server_args_for_scheduler)")
    # where that function stores them, read from the release (0.5.14 has a runtime context, but without the
    # slot: the module global still holds them)
    context = get_context() if get_context is not None else None
    for owner, slot in ((sglang_server_args, "_global_server_args"), (context, "_server_args")):
        if owner is not None and hasattr(owner, slot):
            break
    else:
        raise AssertionError(
            f"SGLang {sglang_version()}: set_global_server_args_for_scheduler stores the server args in "
            "neither server_args._global_server_args nor the runtime context's _server_args"
        )
    previous = getattr(owner, slot)
    with tempfile.TemporaryDirectory(prefix="sm120_fp4_args_") as root:
        publish(
            sglang_server_args.ServerArgs(
                model_path=moe_layers._write_model_dir(root, moe_layers.MODELOPT),
                device="cpu",
                skip_tokenizer_init=True,
                **fields,
            )
        )
        try:
            yield
        finally:
            setattr(owner, slot, previous)


@case(
    "configuration",
    "SGLang's server arguments set chunked_prefill_size=3000 (its runtime context, as a scheduler publishes it)",
    "the layer checks and the re-check run M=3000 (the chunk every long prompt is served in), and no larger M",
)
def test_the_layer_checks_run_sglangs_own_chunked_prefill_size():
    def wrong_from_3000(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if a.shape[0] >= 3000:
            out[a.shape[0] // 2 :] = 0
        return out

    backends.register("wrong-from-3000", wrong_from_3000)
    sm120_fp4.install(simulate="12.0", backends="emulated,wrong-from-3000")
    with published_server_args(chunked_prefill_size=3000):
        assert hooks.prefill_sizes() == (3000, 3000) and 3000 in policy.recheck_ms(hooks.sizes())
        build(96, 160)
        [decision] = serving.decisions()
        assert max(s.m for s in decision.layers[0].shapes) == 3000
        sm120_fp4.uninstall()
        sm120_fp4.install(simulate="12.0", backends="wrong-from-3000")
        with pytest.raises(RefusedToServe, match=r"N=96 K=160 .*M=3000 .*row\(s\) all zero"):
            build(96, 160)


@case(
    "backend faults",
    "a kernel with per-thread state (a split-K workspace it never clears): right on a thread's first call only",
    "refused at load: every checked call runs on the thread that will serve, so the second call is wrong and seen",
)
def test_a_kernel_with_per_thread_state_is_refused_and_checks_run_on_the_calling_thread():
    state = threading.local()
    threads = set()

    def split_k_workspace(a, b, a_sf, b_sf, alpha, dtype, out):
        threads.add(threading.get_ident())
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if not hasattr(state, "workspace"):
            state.workspace = torch.zeros(4096, 1024)  # made once per thread, zero only then
        part = state.workspace[: out.shape[0], : out.shape[1]]
        out.add_(part)  # the previous call's partial sums, never cleared
        part.copy_(out)
        return out

    backends.register("per-thread", split_k_workspace)
    sm120_fp4.install(simulate="12.0", backends="per-thread")
    with pytest.raises(RefusedToServe, match=r"self-test failed: M=1 N=96 K=1056: call 2: output is all zeros"):
        build(96, 160)
    assert threads == {threading.get_ident()}, "every checked call ran on this (the loading) thread"


@case(
    "backend faults",
    "a kernel that corrupts another, already verified layer's weights (an out-of-bounds write flipping its FP4 signs) while serving a second layer",
    "both layers pass their own checks; the re-check after warm-up compares every verified layer's fingerprint and refuses, naming the corrupted layer",
)
def test_a_verified_layers_weights_corrupted_later_are_refused_naming_the_layer(monkeypatch):
    victim = {}

    def writes_out_of_bounds(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if b.shape[1] == 512 and "layer" in victim:
            victim.pop("layer").weight.data.bitwise_xor_(0x88)  # once: negates every code of the other layer
        return out

    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: None))
    backends.register("oob", writes_out_of_bounds)
    sm120_fp4.install(simulate="12.0", backends="oob")
    _, victim["layer"] = build(96, 160)
    build(512, 256)  # verified: its own output is right
    with pytest.raises(
        RefusedToServe, match=r"(?s)weights of 1 verified layer\(s\) changed after they were verified.*N=96 K=160"
    ):
        _warmup(sys.modules[MODEL_RUNNER].ModelRunner())


@case(
    "own failures",
    "Ctrl-C (KeyboardInterrupt) during a layer check, then the same load again in the same process (a notebook), the kernel now returning zeros",
    "the interrupt propagates and nothing is recorded as verified; the retry checks the layer again and refuses the zeros",
)
def test_an_interrupted_layer_check_is_never_recorded_and_the_retry_checks_again():
    calls = {"n": 0}

    def interrupted_then_zeros(a, b, a_sf, b_sf, alpha, dtype, out):
        calls["n"] += 1
        if calls["n"] <= 3 * len(verify.DEFAULT_SHAPES):
            return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if calls["n"] == 3 * len(verify.DEFAULT_SHAPES) + 3:
            raise KeyboardInterrupt
        return (
            out.zero_()
            if calls["n"] > 3 * len(verify.DEFAULT_SHAPES) + 3
            else emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        )

    backends.register("interrupted", interrupted_then_zeros)
    sm120_fp4.install(simulate="12.0", backends="interrupted")
    with pytest.raises(KeyboardInterrupt):
        build(96, 160)
    assert not serving.decisions()[0].layers, "an interrupted check is no verified configuration"
    with pytest.raises(RefusedToServe, match=r"N=96 K=160 .*all zeros"):
        build(96, 160)


@case(
    "backend faults",
    "a kernel right for the first layer of a configuration and wrong for every other layer's weights (same N, K, dtype)",
    "the second layer's own light check (one decode batch, its own weights) refuses it, naming the layer check",
)
def test_every_layer_of_a_configuration_gets_a_check_with_its_own_weights():
    first = {}

    def right_for_one_weight_only(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if b.shape[1] == 96:
            first.setdefault("ptr", b.data_ptr())
            if b.data_ptr() != first["ptr"]:
                out.neg_()
        return out

    backends.register("one-weight", _after_the_selftest(right_for_one_weight_only))
    sm120_fp4.install(simulate="12.0", backends="one-weight")
    build(96, 160, seed=0)
    with pytest.raises(RefusedToServe, match=r"N=96 K=160 bfloat16 .*\(layer check\): M=8 "):
        build(96, 160, seed=1)


def _subnormal_scales_flushed(a, b, a_sf, b_sf, alpha, dtype, out):
    raw = a_sf.view(torch.uint8)
    subnormal = ((raw & 0x78) == 0) & ((raw & 0x07) != 0)  # E4M3 exponent 0, mantissa not: a subnormal
    flushed = torch.where(subnormal, torch.zeros_like(raw), raw).view(a_sf.dtype)  # flush-to-zero
    return emulated_mm_fp4(a, b, flushed, b_sf, alpha, dtype, out)


def _one_signed_rows_zeroed(a, b, a_sf, b_sf, alpha, dtype, out):
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    codes = nvfp4.unpack_nibbles(a)
    out[~(codes >= 8).any(dim=1)] = 0  # a row without a negative code: a ReLU^2 row
    return out


def _mostly_zero_blocks_skipped(a, b, a_sf, b_sf, alpha, dtype, out):
    """A sparsity shortcut: a 16-block with at most 4 non-zero codes is skipped. Gaussian rows never
    have such blocks; sparse rows, and rows with outliers 1e3-1e4 times the rest (whose other values
    quantize to zero next to the outlier), are made of them."""
    codes = nvfp4.unpack_nibbles(a)
    blocks = codes.view(codes.shape[0], -1, 16)
    sparse = ((blocks & 7) != 0).sum(dim=-1, keepdim=True) <= 4
    kept = torch.where(sparse, torch.zeros_like(blocks), blocks).view_as(codes)
    kept = kept[:, 0::2] | (kept[:, 1::2] << 4)
    return emulated_mm_fp4(kept, b, a_sf, b_sf, alpha, dtype, out)


@pytest.mark.parametrize(
    "fault",
    [_subnormal_scales_flushed, _one_signed_rows_zeroed, _mostly_zero_blocks_skipped],
    ids=["subnormal scales flushed", "ReLU^2 rows zeroed", "sparse and outlier blocks skipped"],
)
@case(
    "backend faults",
    "a kernel right on Gaussian activations and wrong on {fault} (the generic self-test passes it)",
    "refused at load: the layer checks' activations include every row kind of verify.ROW_KINDS",
)
def test_a_kernel_wrong_on_structured_activations_is_refused_at_load(fault):
    backends.register("structured", _after_the_selftest(fault))
    sm120_fp4.install(simulate="12.0", backends="structured")
    with pytest.raises(RefusedToServe, match=r"failed the served-layer check: ModelOptFp4LinearMethod N=96 K=160 .*M="):
        build(96, 160)


def _updater(model):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda **kw: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )


@pytest.mark.skipif(
    not version_in(sglang_version() or "0", ">=0.5.21"),
    reason="the WeightUpdater with weight-update sessions (0.5.21+)",
)
@case(
    "configuration",
    "SGLang's own weight update (WeightUpdater.update_weights_from_tensor in a begin/end session) writes new weights into a verified layer",
    "the changed layer is verified again with its new weights (light check) and its fingerprint renewed: the re-check after it passes",
)
def test_sglangs_weight_update_reverifies_the_layer_and_the_recheck_accepts_it(monkeypatch):
    seen = []

    def recording(a, b, a_sf, b_sf, alpha, dtype, out):
        seen.append(b.data_ptr())
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)

    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: None))
    backends.register("recording", recording)
    sm120_fp4.install(simulate="12.0", backends="recording")
    with published_server_args():  # 0.5.21 lacks the seams of a scheduler context: its own scoped override
        method, layer = build(96, 160)
        updater = _updater(layer)
        assert {p.name: p.state for p in sm120_fp4.status().patches}["weight-update-session-end"] == "applied"
        new = synthetic.make_checkpoint(96, 160, seed=7).weight
        seen.clear()
        updater.begin_weight_update()
        assert updater.update_weights_from_tensor(named_tensors=[("weight", new)], load_format="direct")[0]
        assert not seen, "nothing is verified while the session is open"
        try:
            updater.end_weight_update(run_post_load=False)
        except Exception as exc:  # SGLang's own postprocess may need more than this CPU stand-in has
            pytest.skip(f"SGLang's end_weight_update cannot run on this CPU stand-in: {type(exc).__name__}: {exc}")
        assert torch.equal(layer.weight, new) and seen, "the layer was checked again after the update"
        _warmup(sys.modules[MODEL_RUNNER].ModelRunner())  # the re-check: the new fingerprint, no refusal
        layer.weight.data.bitwise_xor_(0x01)  # a write outside SGLang's update path
        with pytest.raises(RefusedToServe, match=r"changed after they were verified"):
            _warmup(sys.modules[MODEL_RUNNER].ModelRunner())


@pytest.mark.skipif(
    not version_in(sglang_version() or "0", ">=0.5.14"), reason="Scheduler.init_all_cuda_graphs (0.5.14+)"
)
@case(
    "backend faults",
    "speculative decoding: a kernel that zeros its output only at M=9, the token count of the draft model's own decode graphs (3 requests x 3 tokens), captured after the model runners'",
    "the re-check runs once, after the scheduler's init_all_cuda_graphs has captured every graph, the draft worker's included, and refuses naming M=9",
)
def test_the_recheck_runs_after_every_capture_the_draft_models_included(monkeypatch):
    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ModuleNotFoundError as exc:  # a server package SGLang's scheduler imports, absent from this venv
        if not exc.name or exc.name.split(".")[0] == "sglang":
            raise
        pytest.skip(
            f"SGLang {sglang_version()}'s scheduler module needs {exc.name}, which this venv does not have "
            "(SGLang installed --no-deps; the import step source-checks its hooks)"
        )

    rechecks = []

    def zeros_at_9(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if a.shape[0] == 9:
            out.zero_()
        return out

    monkeypatch.setitem(
        sys.modules, MODEL_RUNNER, _model_runner_stand_in(lambda: rechecks.append("target"), decode_bs=(1, 2, 4))
    )
    backends.register("zeros-at-9", zeros_at_9)
    sm120_fp4.install(simulate="12.0", backends="zeros-at-9")
    assert {p.name: p.state for p in sm120_fp4.status().patches}["post-capture-recheck-all-graphs"] == "applied"
    build(96, 160)
    runner_cls = sys.modules[MODEL_RUNNER].ModelRunner
    graphs = _warmup_spec().attribute.split(".")[1]

    class TpWorker:
        model_runner = runner_cls()

        def init_cuda_graphs(self, capture_decode_cuda_graph=True):
            getattr(self.model_runner, graphs)()

    class DraftWorker:  # what EAGLEWorkerV2's draft worker does: its runner's graphs, then its own
        draft_runner = runner_cls()

        def init_cuda_graphs(self):
            getattr(self.draft_runner, graphs)()
            self.cuda_graph_runner = types.SimpleNamespace(capture_bs=[1, 2, 3], num_tokens_per_bs=3)

    scheduler = types.SimpleNamespace(tp_worker=TpWorker(), draft_worker=DraftWorker())
    real_recheck = serving.recheck
    monkeypatch.setattr(
        serving,
        "recheck",
        lambda settings, captured: rechecks.append(sorted(captured)) or real_recheck(settings, captured),
    )
    with pytest.raises(RefusedToServe, match=r"(?s)fails after warm-up.*N=96 K=160 .*M=9 .*all zeros"):
        Scheduler.init_all_cuda_graphs(scheduler)
    assert rechecks == ["target", "target", [1, 2, 3, 4, 6, 9]], (
        "both captures first, then one re-check of every graph size"
    )


# ---- fused layers: the shards' own global scales, read before SGLang reduces them to one ----------

from helpers.sglang_layers import build_fused_dense_layer, fused_dense_shards  # noqa: E402

QKV = [128, 64, 64]


def _shards(scale_q: float = 1.0, input_k: float = 1.0):
    shards = fused_dense_shards(QKV, 160)
    shards[0]["weight_scale_2"] = shards[0]["weight_scale_2"] * scale_q
    shards[1]["input_scale"] = shards[1]["input_scale"] * input_k
    return shards


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize(
    "scale_q, expected",
    [
        (
            0.25,
            r"weight_\w+ differ in the checkpoint \(shard 0 [\d.e-]+, shard 1 [\d.e-]+, "
            r"shard 2 [\d.e-]+\).*rows of shard \d by (4|0.25)\b",
        ),
        (0.0, r"checkpoint's weight_\w+\[0\] = (0.0|inf); accepted: a finite positive scale.*checkpoint"),
    ],
    ids=["q 4x smaller", "q zero"],
)
@case(
    "configuration",
    "a fused q/k/v layer ({fmt}) whose q shard's global scale is {scale_q} times k's and v's (SGLang serves it with the largest)",
    "refused before SGLang processes the weights, naming the layer, the shards and their values (the layer check cannot see it)",
)
def test_a_fused_layer_whose_shards_global_scales_differ_is_refused_naming_them(fmt, scale_q, expected):
    sm120_fp4.install(simulate="12.0", backends="emulated")
    with pytest.raises(
        RefusedToServe, match=r"refusing to serve the NVFP4 layer model.layers.0.self_attn.qkv_proj .*" + expected
    ):
        build_fused_dense_layer(_shards(scale_q=scale_q), fmt)


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_a_fused_layer_with_one_global_scale_serves_and_activation_scales_may_differ(fmt):
    sm120_fp4.install(simulate="12.0", backends="emulated")
    method, layer = build_fused_dense_layer(_shards(input_k=2.0), fmt)
    assert sm120_fp4.status().refusals == []
    assert any(c.passed for d in serving.decisions() for c in d.layers), "the fused layer was verified"


from helpers.scale_faults import SHARD_FAULTS, faulty_shards  # noqa: E402


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("fault", slow_but_one(SHARD_FAULTS))
@case(
    "configuration",
    "SGLang's fused q/k/v layer ({fmt}) whose checkpoint has {fault} (the same fault as vLLM's test)",
    "refused at SGLang's weights hook, before SGLang reduces the shards' scales to one, naming the layer and the "
    "tensor as vLLM does; no kernel checked",
)
def test_sglang_refuses_the_checkpoint_scales_vllm_refuses(fmt, fault):
    sm120_fp4.install(simulate="12.0", backends="emulated")
    with pytest.raises(RefusedToServe) as err:
        build_fused_dense_layer(faulty_shards(fault), fmt)
    message = str(err.value)
    assert "refusing to serve the NVFP4 layer model.layers.0.self_attn.qkv_proj" in message, message
    assert re.search(SHARD_FAULTS[fault][1], message), message
    assert not any(d.layers for d in serving.decisions()), "no kernel was checked or blamed"


@case(
    "configuration",
    "a fused layer whose shards' global scales differ, with SM120_FP4_SELFTEST=warn",
    "served, with one warning naming the layer and the shards' values",
)
def test_different_shard_scales_under_warn_are_said_and_served(caplog):
    sm120_fp4.install(simulate="12.0", backends="emulated", selftest="warn")
    with caplog.at_level("WARNING", logger="sm120_fp4"):
        build_fused_dense_layer(_shards(scale_q=0.25), MODELOPT)
    assert any(
        "differ in the checkpoint" in r.getMessage() and "SELFTEST=warn" in r.getMessage() for r in caplog.records
    )


@case(
    "backend faults",
    "a kernel with a per-thread workspace kept between calls of one shape (never cleared): right on the self-test's shapes and on a shape's first call, its previous result from the second call in a row of the layer's shape (N=288) on",
    "refused at load: the layer check calls each served M twice in a row, the second time with other rows, and names that call",
)
def test_a_kernel_wrong_from_the_second_call_in_a_row_of_a_served_shape_is_refused():
    stale = faults.make_stale_workspace()

    def stale_at_288(a, b, a_sf, b_sf, alpha, dtype, out):
        return (stale if b.shape[1] == 288 else emulated_mm_fp4)(a, b, a_sf, b_sf, alpha, dtype, out)

    backends.register("stale", stale_at_288)
    sm120_fp4.install(simulate="12.0", backends="stale")
    with pytest.raises(
        RefusedToServe, match=r"N=288 K=160 .*M=1 .*call 2: .*the same shape called again right after its first call"
    ):
        build(288, 160)
