"""CUDA-only evidence (run on the H200 by scripts/gpu_check.sh): graphs, no sync, SELECT=fastest."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import faults

from sm120_fp4 import backends, devices, dispatch, nvfp4, serving, verify
from sm120_fp4.backends import flashinfer
from sm120_fp4.config import Settings
from sm120_fp4.dispatch import Router
from sm120_fp4.errors import SelfTestError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SIM = Settings(simulate="12.0", backends="emulated")


def quantized(m, n, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    return qx, qw.T, sx, sw.T, (1 / (gx * gw)).reshape(1)


def test_emulated_selftest_passes_on_cuda_and_reports_its_duration():
    device = devices.list_devices((12, 0))[0]
    assert device.is_cuda and device.simulated
    report = verify.run("emulated", device)
    assert report.passed, report.reason
    assert report.duration_s < 5.0
    print(f"emulated self-test on {device.label()}: {report.duration_s:.3f} s, max rel err {report.max_rel_err:.2e}")


def test_patched_dispatch_captured_in_a_cuda_graph_replays_new_inputs_like_eager():
    router = Router(SIM)
    router.ensure(0)  # decide (self-test) before capture, as the weight hook does
    dispatch = router.make_dispatch(lambda *a, **k: pytest.fail("original called"))
    static = [t.clone() for t in quantized(64, 256, 512, seed=1)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up outside capture (allocator, cuBLAS workspace)
            dispatch(*static, torch.bfloat16, backend="cutlass")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = dispatch(*static, torch.bfloat16, backend="cutlass")
    for seed in (2, 3, 4):
        fresh = quantized(64, 256, 512, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = dispatch(*fresh, torch.bfloat16, backend="cutlass")
        assert torch.equal(static_out, eager)
        assert torch.equal(eager, nvfp4.reference_mm_fp4(*fresh))


def test_selftest_refuses_to_run_inside_graph_capture():
    device = devices.list_devices((12, 0))[0]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(SelfTestError, match="inside CUDA-graph capture"):
        with torch.cuda.graph(graph):
            verify.run("emulated", device)


def test_the_routed_dispatch_never_synchronises():
    router = Router(SIM)
    router.ensure(0)
    dispatch = router.make_dispatch(lambda *a, **k: None)
    args = quantized(32, 128, 256, seed=5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dispatch(*args, torch.bfloat16, backend="auto")
        dispatch(
            *args, torch.bfloat16, backend="cutlass", out=torch.empty(32, 128, dtype=torch.bfloat16, device="cuda")
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")


def slow_emulated(*args):
    for _ in range(20):  # the same answer, twenty times the work
        out = faults.healthy(*args)
    return out


def fast_but_wrong(a, b, a_sf, b_sf, alpha, dtype, out):
    return out.zero_()


def test_select_fastest_picks_the_faster_of_two_verified_backends_on_the_gpu():
    backends.register("slow", slow_emulated)
    backends.register("fast", faults.healthy)
    device = devices.list_devices((12, 0))[0]
    d = serving.decide(device, ["slow", "fast"], settings=Settings(simulate="12.0", select="fastest"))
    assert d.backend == "fast" and set(d.timings_ms) == {"slow", "fast"}
    assert d.timings_ms["fast"] < d.timings_ms["slow"]
    print(f"timings (ms over the self-test shapes): {d.timings_ms}")


def test_select_fastest_never_picks_a_fast_backend_that_fails_verification():
    backends.register("slow", slow_emulated)
    backends.register("fast-wrong", fast_but_wrong)
    device = devices.list_devices((12, 0))[0]
    d = serving.decide(device, ["fast-wrong", "slow"], settings=Settings(simulate="12.0", select="fastest"))
    assert d.backend == "slow" and "all zeros" in d.rejected["fast-wrong"]


def test_flashinfer_backends_reject_operands_on_different_devices():
    from sm120_fp4.errors import InvalidArgument

    qx, b, sx, b_sf, alpha = quantized(4, 32, 64, seed=9)
    out = torch.empty(4, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(InvalidArgument, match=r"alpha=.*same device"):
        flashinfer.check_mm_fp4_args(qx, b, sx, b_sf, alpha.cpu(), torch.bfloat16, out)


class _ActivationType:  # FlashInfer's values for the two activations the MoE front serves
    Swiglu, Relu2 = 3, 6


def _moe_inputs(seed, tokens=32, top_k=4, experts=16, hidden=256):
    gen = torch.Generator().manual_seed(seed)
    ids, topk_weights = verify.moe_routing(
        tokens, top_k, 2 * experts, "padded", gen
    )  # global ids of 2 ranks, -1 dropped
    x = verify.structured_activations(tokens, hidden, 4.0, gen).to(torch.bfloat16)
    return [x.cuda(), ids.cuda(), topk_weights.cuda()]


def test_the_moe_front_with_the_emulated_moe_is_captured_and_replays_like_eager():
    """The MoE fallback serves inside SGLang's decode graphs: SGLang's call through the front
    (expert-parallel rank 1 of 2, global ids and -1 slots), captured in a CUDA graph, replayed with
    new inputs: equal to the eager call and to the oracle; the eager call never synchronises."""
    weights = verify.moe._moe_weights(16, 256, 128, "swiglu", torch.device("cuda"), 3)
    front = dispatch.moe_front(
        lambda **kw: pytest.fail("original called"),
        _ActivationType,
        lambda index: backends.emulated_moe,
        lambda index: "emulated",
    )
    static = _moe_inputs(1)
    out = torch.empty_like(static[0])
    scales = [
        weights.a1_gscale.reshape(()),
        weights.w13_sf.view(torch.int32),
        weights.w13_alpha,
        weights.a2_gscale.reshape(()),
        weights.w2_sf.view(torch.int32),
        weights.w2_alpha,
    ]

    def call(x, ids, topk_weights):
        return front(
            output=out,
            input=x,
            token_selected_experts=ids,
            token_final_scales=topk_weights,
            fc1_expert_weights=weights.w13.view(torch.long),
            fc2_expert_weights=weights.w2.view(torch.long),
            output_dtype=torch.bfloat16,
            input_sf=None,
            quant_scales=scales,
            ep_size=2,
            ep_rank=1,
            activation_type=_ActivationType.Swiglu,
        )[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call(*static)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(*static)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(*static)
    for seed in (2, 3):
        fresh = _moe_inputs(seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        eager = call(*fresh).clone()
        assert torch.equal(replayed, eager)
        x, ids, topk_weights = fresh
        local = ids.long() - 16
        mine = (ids >= 0) & (local >= 0) & (local < 16)
        want = nvfp4.reference_moe_fp4(
            x,
            torch.where(mine, local, 0),
            torch.where(mine, topk_weights, 0),
            weights.w13,
            weights.w13_sf,
            weights.w13_alpha,
            weights.w2,
            weights.w2_sf,
            weights.w2_alpha,
            weights.a1_gscale,
            weights.a2_gscale,
        )
        assert torch.equal(eager, want)


def test_checked_calls_run_on_the_callers_thread_and_current_stream():
    seen = []

    def recording(*args):
        seen.append((threading.get_ident(), torch.cuda.current_stream().cuda_stream))
        return faults.healthy(*args)

    backends.register("recording", recording)
    device = devices.list_devices((12, 0))[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        report = verify.run("recording", device)
    assert report.passed, report.reason
    assert set(seen) == {(threading.get_ident(), side.cuda_stream)}, "the serving thread's own stream, every call"


def test_emulated_serves_a_weight_written_through_data_eagerly_and_from_a_captured_graph():
    # SGLang's loaders write through .data (no version bump): the emulation keeps nothing derived from a weight.
    x = torch.randn(8, 256, device="cuda")
    w1, w2 = torch.randn(64, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    g, gx = nvfp4.global_scale(torch.cat([w1, w2])), nvfp4.global_scale(x)
    qx, sx = nvfp4.quantize(x, gx)
    q1, s1 = nvfp4.quantize(w1, g)
    q2, _ = nvfp4.quantize(w2, g)
    weight = torch.nn.Parameter(q1.clone(), requires_grad=False)
    alpha = (1 / (gx * g)).reshape(1)
    out = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
    emulated = backends.resolve("emulated")

    def oracle():
        return nvfp4.reference_mm_fp4(qx, weight.T, sx, s1.T, alpha, torch.bfloat16)

    emulated(qx, weight.T, sx, s1.T, alpha, torch.bfloat16, out)  # lookup tables made outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        emulated(qx, weight.T, sx, s1.T, alpha, torch.bfloat16, out)
    first = oracle()
    weight.data.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, oracle()) and not torch.equal(out, first), "the replay reads the written weight"
    eager = emulated(qx, weight.T, sx, s1.T, alpha, torch.bfloat16, torch.empty_like(out))
    assert torch.equal(eager, oracle())
