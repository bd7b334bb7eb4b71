"""The `humming` fallback (dense and MoE): support checks, the default chain, verification in both
oracle modes, conversion in place with the kept originals, refusal of a broken Humming call, and,
on a CUDA device with humming-kernels (the H200, scripts/humming_check.sh), the real kernels:
self-tests, a wrong scale layout refused, both routed fronts captured in CUDA graphs and replayed.

On a CPU Humming cannot run: helpers.humming_stand_in computes what it would, in a layout of its own.
"""

from __future__ import annotations

import enum
import importlib.util
import types

import pytest
import torch
from helpers.cases import case
from helpers.humming_stand_in import StandInEngine, WrongScaleLayout, engine

import sm120_fp4
from sm120_fp4 import backends, deciding, devices, dispatch, doctor, nvfp4, serving, verify
from sm120_fp4.backends import flashinfer, humming
from sm120_fp4.config import Settings
from sm120_fp4.errors import ConfigError, RefusedToServe

HAS_HUMMING = importlib.util.find_spec("humming") is not None
ON_GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_HUMMING), reason="needs a CUDA device and humming-kernels"
)
SIM_CPU = devices.Device(-1, "simulated (no GPU)", (12, 0), True, "simulated")


@pytest.fixture
def stand_in():
    with engine(StandInEngine()) as e:
        yield e


# ---- without Humming: the chain, the reasons -------------------------------------------------


def test_default_chains_on_12x_end_with_humming_and_nothing_changes_elsewhere():
    assert flashinfer.default_order((12, 0)) == ("cutlass", "b12x", "humming")
    assert flashinfer.default_order((12, 1)) == ("cutlass", "humming")
    assert flashinfer.default_moe_order((12, 0)) == ("cutlass", "humming")
    assert flashinfer.default_order((9, 0)) == ("cutlass", "b12x")
    assert flashinfer.default_moe_order((9, 0)) == ("cutlass",)
    settings = Settings(simulate="12.0")
    assert deciding.candidate_names(settings, family=deciding.MOE, device=SIM_CPU) == ["cutlass", "humming"]
    assert "emulated" not in deciding.candidate_names(settings, device=SIM_CPU)  # opt-in only


def test_moe_backends_auto_and_explicit_lists_are_accepted_and_bad_ones_named():
    assert Settings(moe_backends="auto").moe_backends == "auto"
    assert Settings(moe_backends="humming,emulated").moe_backends == ("humming", "emulated")
    with pytest.raises(ConfigError, match="moe_backends='humming,,x' is not accepted"):
        Settings(moe_backends="humming,,x")


@case(
    "own failures",
    "humming-kernels not installed, the default chain on a simulated sm_120",
    "humming is a 'not supported: humming-kernels is not installed' candidate in the refusal, never a crash",
)
@pytest.mark.skipif(HAS_HUMMING, reason="humming-kernels is installed here")
def test_missing_humming_is_a_clear_not_supported_reason_and_the_refusal_names_it():
    ok, why = backends.is_supported("humming", SIM_CPU)
    assert not ok and "humming-kernels is not installed" in why
    ok, why = backends.is_moe_supported("humming", SIM_CPU)
    assert not ok and "humming-kernels is not installed" in why
    with pytest.raises(RefusedToServe, match="humming: not supported: humming-kernels is not installed"):
        serving.decide(SIM_CPU, settings=Settings(simulate="12.0"))


def test_no_compiler_is_a_clear_reason(monkeypatch):
    monkeypatch.setenv("HUMMING_COMPILER", "nvcc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_NVCC_PATH", raising=False)
    tool, why = humming.compiler()
    if tool is None:
        assert "no nvcc found" in why
    else:  # this machine has /usr/local/cuda/bin/nvcc
        assert tool == "nvcc"


def test_doctor_shows_humming_version_and_whether_it_can_compile():
    info = doctor.collect(deep=False)["humming"]
    assert set(info) >= {"version", "compiler", "can_compile", "cache_dir"}
    assert info["version"] == humming.version()
    assert info["can_compile"] == (info["compiler"] is not None)


# ---- with the stand-in: verification, modes, memory ----------------------------------------------


def test_dense_self_test_passes_against_the_w4a4_oracle(stand_in):
    report = verify.run("humming", SIM_CPU)
    assert report.passed, report.reason
    assert stand_in.prepared == len(verify.DEFAULT_SHAPES) and stand_in.calls == 3 * len(verify.DEFAULT_SHAPES)
    assert backends.mode_of("dense", "humming") == "w4a4"


def test_moe_self_test_passes_against_the_w4a16_oracle_and_fails_against_w4a4(stand_in):
    report = verify.run_moe("humming", SIM_CPU, verify.SIMULATION_MOE_CONFIG)
    assert report.passed, report.reason
    assert backends.mode_of("moe", "humming") == "w4a16"
    # The same backend judged by the W4A4 oracle (quantized activations) is caught: the modes differ.
    weights = verify.moe._moe_weights(8, 160, 96, "relu2", torch.device("cpu"), 5)
    gen = torch.Generator().manual_seed(1)
    ids, tw = verify.moe_routing(9, 2, 8, "random", gen)
    x = (torch.randn(9, 160, generator=gen) * 1.5).clamp(-4, 4).to(torch.bfloat16)
    cases = verify.moe_cases(humming.fused_moe, weights, "relu2", [("T=9", x, ids, tw)], mode="w4a4")
    assert not all(r.passed for r in verify.sweep(cases, verify.Bounds(), torch.device("cpu")))


@case(
    "backend faults",
    "a Humming call given SGLang's 128x4-swizzled scale bytes as linear ones (dense and MoE)",
    "both self-tests fail with a scale error; decide() refuses humming",
)
def test_a_wrong_scale_layout_is_refused_in_both_families():
    with engine(WrongScaleLayout(StandInEngine())):
        dense = verify.run("humming", SIM_CPU)
        moe = verify.run_moe("humming", SIM_CPU, verify.SIMULATION_MOE_CONFIG)
        assert not dense.passed and "reference" in dense.reason
        assert not moe.passed
        with pytest.raises(RefusedToServe, match="humming: self-test failed"):
            serving.decide(SIM_CPU, ["humming"], settings=Settings(simulate="12.0"))


def test_dense_rejects_what_it_cannot_serve(stand_in):
    a, b, a_sf, b_sf, alpha = verify.quantized_inputs((3, 96, 160), torch.device("cpu"), 1)[2]
    out = torch.empty(3, 96, dtype=torch.bfloat16)
    with pytest.raises(sm120_fp4.InvalidArgument, match="alpha"):
        humming.mm_fp4(a, b, a_sf, b_sf, None, torch.bfloat16, out)
    with pytest.raises(sm120_fp4.InvalidArgument, match="out"):
        humming.mm_fp4(a, b, a_sf, b_sf, alpha, torch.bfloat16, torch.empty(3, 95, dtype=torch.bfloat16))


def _served_layer(n=256, k=512, seed=1):
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import layers

    ckpt = synthetic.make_checkpoint(n, k, seed=seed)
    method, layer = layers.build_modelopt_layer(ckpt)
    return ckpt, method, layer


@pytest.mark.sglang
def test_served_dense_layers_are_converted_in_place_verified_and_rechecked(stand_in):
    from sm120_fp4.demo import synthetic

    sm120_fp4.install(simulate="12.0", backends="humming")
    try:
        ckpt, method, layer = _served_layer(seed=1)
        other_ckpt, other_method, other_layer = _served_layer(seed=2)  # same configuration: not re-checked
        [decision] = serving.decisions()
        assert decision.backend == "humming" and decision.verified and decision.mode == "w4a4"
        assert len(decision.layers) == 1 and decision.layers[0].passed
        for c, m, lay in ((ckpt, method, layer), (other_ckpt, other_method, other_layer)):
            assert not torch.equal(lay.weight, c.weight)  # SGLang's storage now holds the engine's layout
            x = torch.randn(7, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
            assert torch.equal(m.apply(lay, x), synthetic.reference_output(c, x))
        info = decision.backend_info
        assert "W4A4" in info["mode"] and info["engine"] == "stand-in"
        [memory] = [v for k, v in info["memory"].items() if k.startswith("dense N=256 K=512")]
        assert memory["layers"] == 2 and memory["in_place"] and memory["ratio"] <= 1.1
        # The kept original serves the oracle; a layer converted without one cannot be read by it.
        assert torch.equal(backends.original(layer.weight), ckpt.weight)
        with pytest.raises(sm120_fp4.SelfTestError, match="not kept"):
            backends.original(other_layer.weight)
        reports = serving.recheck(Settings(simulate="12.0", backends="humming"), [3, 64])
        assert reports and all(r.passed for r in reports)
        status = sm120_fp4.status().model_dump(mode="json")
        assert status["decisions"][0]["mode"] == "w4a4" and status["decisions"][0]["backend_info"]["memory"]
        # The first layer's original bytes, kept for the re-checks and the canary, counted where they live.
        kept = status["decisions"][0]["backend_info"]["kept_original_bytes"]
        assert kept == {"gpu": 0, "host": ckpt.weight.nbytes + layer.weight_scale_interleaved.nbytes}, kept
    finally:
        sm120_fp4.uninstall()


@case(
    "properties",
    "the serving canary on with humming serving three layers of one configuration (converted in place; the oracle keeps the first layer's checkpoint bytes only)",
    "every run passes: the canary re-checks the configuration's first layer (its kept bytes) and sweeps every layer's fingerprint; it never asks the oracle for bytes not kept",
)
@pytest.mark.sglang
def test_the_canary_with_humming_rechecks_the_layer_whose_bytes_are_kept(stand_in):
    from sm120_fp4 import canary

    sm120_fp4.install(simulate="12.0", backends="humming", canary="30", canary_action="log")
    try:
        served = [_served_layer(seed=seed) for seed in (1, 2, 3)]  # kept alive, as a model keeps its layers
        c = serving.STATE.canary
        now = [1000.0]
        c.clock = lambda: now[0]
        canary.idle()  # arms it
        for _ in range(4):
            now[0] += 30.0
            for _ in range(20):
                canary.idle()
        status = c.status()
        assert status.runs >= 4 and status.failures == 0, [r.reason for r in status.recent if not r.passed]
        del served
    finally:
        sm120_fp4.uninstall()


@case(
    "backend faults",
    "humming wrong only on a later layer of a configuration already verified (its own converted weights)",
    "that layer's own check (its original bytes kept while it is checked, then dropped) refuses it: no layer is served unchecked",
)
@pytest.mark.sglang
def test_a_later_layer_of_a_verified_configuration_is_checked_with_its_own_weights(stand_in, monkeypatch):
    sm120_fp4.install(simulate="12.0", backends="humming")
    try:
        _, _, first = _served_layer(256, 512, seed=1)
        original_gemm, verified = stand_in.gemm, humming.prepared_for(first.weight, torch.bfloat16)
        assert verified is not None

        def wrong_on_the_second_layer(prepared, x, scale_2, out):
            original_gemm(prepared, x, scale_2, out)
            if prepared is not verified:
                out.mul_(-1.0)

        monkeypatch.setattr(stand_in, "gemm", wrong_on_the_second_layer)
        with pytest.raises(RefusedToServe, match="layer check"):
            _served_layer(256, 512, seed=2)
    finally:
        sm120_fp4.uninstall()


@case(
    "backend faults",
    "humming fails a second layer configuration after converting only the first (checked) layer",
    "the kept bytes are written back and the fallback (emulated) serves every configuration",
)
@pytest.mark.sglang
@pytest.mark.slow
def test_a_humming_failure_after_only_checked_layers_restores_them_for_the_fallback(stand_in, monkeypatch):
    sm120_fp4.install(simulate="12.0", backends="humming", fallback="emulated")
    try:
        ckpt, method, layer = _served_layer(256, 512, seed=1)
        original_gemm = stand_in.gemm

        def fails_on_k_1024(prepared, x, scale_2, out):
            original_gemm(prepared, x, scale_2, out)
            if prepared.k == 1024:
                out.mul_(0.5)

        monkeypatch.setattr(stand_in, "gemm", fails_on_k_1024)
        _served_layer(256, 1024, seed=2)  # a second configuration: humming fails it, emulated takes over
        [decision] = serving.decisions()
        assert decision.backend == "emulated" and decision.mode == "w4a4"
        assert torch.equal(layer.weight, ckpt.weight)  # restored from the kept bytes
        assert humming.converted_layers("dense") == 0
    finally:
        sm120_fp4.uninstall()


@case(
    "backend faults",
    "humming fails a layer configuration after converting layers whose bytes it did not keep",
    "the worker refuses, saying those layers are in humming's layout and no other backend can serve them",
)
@pytest.mark.sglang
def test_a_humming_failure_after_unchecked_layers_were_converted_refuses_saying_why(stand_in, monkeypatch):
    sm120_fp4.install(simulate="12.0", backends="humming", fallback="emulated")
    try:
        _served_layer(256, 512, seed=1)
        _served_layer(256, 512, seed=2)  # converted in place, no kept copy (same configuration)
        monkeypatch.setattr(stand_in, "gemm", lambda p, x, s, out: out.zero_())
        with pytest.raises(RefusedToServe, match="converted served layers' weights to its own layout in place"):
            _served_layer(256, 1024, seed=3)
    finally:
        sm120_fp4.uninstall()


@case(
    "backend faults",
    "the first candidate passes its self-test, then fails a later layer configuration; humming is next",
    "humming converts every layer seen so far (the checked ones keeping their bytes), passes every configuration and serves them all",
)
@pytest.mark.sglang
@pytest.mark.slow
def test_humming_taking_over_converts_the_layers_seen_before_and_serves_them(stand_in):
    from sm120_fp4.demo import synthetic

    def right_until_k_1024(a, b, a_sf, b_sf, alpha, out_dtype, out):
        backends.emulated_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out)
        if a.shape[1] * 2 == 1024:
            out.mul_(1.25)
        return out

    backends.register("flaky", right_until_k_1024)
    sm120_fp4.install(simulate="12.0", backends="flaky,humming")
    try:
        served = [_served_layer(256, 512, seed=1), _served_layer(256, 512, seed=2)]
        assert humming.converted_layers("dense") == 0
        served.append(_served_layer(256, 1024, seed=3))  # flaky fails here; humming takes over
        [decision] = serving.decisions()
        assert decision.backend == "humming" and decision.verified and len(decision.layers) == 2
        assert humming.converted_layers("dense") == 3
        for ckpt, method, layer in served:
            assert not torch.equal(layer.weight, ckpt.weight)
            x = torch.randn(4, ckpt.weight.shape[1] * 2, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
            assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))
    finally:
        sm120_fp4.uninstall()


@pytest.mark.sglang
@pytest.mark.slow
def test_served_moe_layer_is_converted_and_verified_in_w4a16(stand_in):
    from helpers.common import simulated_moe_skip_reason

    if simulated_moe_skip_reason() is not None:
        pytest.skip(simulated_moe_skip_reason())
    from helpers import sglang_layers

    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import moe_layers

    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="humming")
    try:
        ckpt = synthetic.make_moe_checkpoint(8, 128, 64, seed=1)
        layer = moe_layers.build_modelopt_moe_layer(ckpt, 2)
        [decision] = [d for d in serving.decisions() if d.family == "moe"]
        assert decision.backend == "humming" and decision.mode == "w4a16" and decision.verified
        assert decision.layers and decision.layers[0].passed
        assert "W4A16" in decision.backend_info["mode"]
        gen = torch.Generator().manual_seed(4)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
        tw = torch.rand(5, 2, generator=gen)
        x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
        out = moe_layers.moe_forward(layer, x, ids, tw)
        w = sglang_layers.moe_weights(layer)
        ref = nvfp4.reference_moe_fp4(
            x,
            ids,
            tw,
            backends.original(w["w13"]),
            backends.original(w["w13_sf"]),
            w["w13_alpha"] * w["a1_gscale"],
            backends.original(w["w2"]),
            backends.original(w["w2_sf"]),
            w["w2_alpha"] * w["a2_gscale"],
            None,
            None,
            quantize_activations=False,
        )
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    finally:
        sm120_fp4.uninstall()


@case(
    "configuration",
    "SELECT=fastest over MoE candidates of different modes (humming w4a16 first, emulated w4a4 faster)",
    "the faster one serves and its decision says its own mode (w4a4), not the first candidate's",
)
@pytest.mark.sglang
@pytest.mark.slow
def test_select_fastest_across_modes_records_the_winners_own_mode(stand_in, monkeypatch):
    from helpers.common import simulated_moe_skip_reason

    if simulated_moe_skip_reason() is not None:
        pytest.skip(simulated_moe_skip_reason())
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import moe_layers

    grouped = stand_in.grouped_gemm
    clock = [0.0]  # the timings' clock: only humming's calls advance it, so the ranking cannot depend on load
    clock_only = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(deciding, "time", clock_only)  # the self-test's and the served calls' timing

    def slow_grouped_gemm(prepared, x, scale_2, offsets, out):
        clock[0] += 0.05
        return grouped(prepared, x, scale_2, offsets, out)

    monkeypatch.setattr(stand_in, "grouped_gemm", slow_grouped_gemm)
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="humming,emulated", select="fastest")
    try:
        moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(8, 128, 64, seed=1), 2)
        [decision] = [d for d in serving.decisions() if d.family == "moe"]
        assert set(decision.timings_ms) == {"humming", "emulated"}, decision.timings_ms
        assert decision.backend == "emulated" and decision.mode == "w4a4"
    finally:
        sm120_fp4.uninstall()


# ---- on a CUDA device with humming-kernels (the H200) ------------------------------------------


def _cuda_sim() -> devices.Device:
    device = devices.list_devices((12, 0))[0]
    assert device.is_cuda and device.simulated
    return device


@pytest.mark.gpu
@ON_GPU
def test_real_humming_self_tests_pass_on_cuda():
    device = _cuda_sim()
    dense = verify.run("humming", device)
    moe = verify.run_moe("humming", device)
    print(
        f"humming {humming.version()} dense self-test {dense.duration_s:.1f} s max rel {dense.max_rel_err}; "
        f"MoE {moe.duration_s:.1f} s max rel {moe.max_rel_err}; startup {humming.startup()['configurations']}"
    )
    assert dense.passed, dense.reason
    assert moe.passed, moe.reason


@pytest.mark.gpu
@ON_GPU
def test_real_humming_with_a_wrong_scale_layout_is_refused():
    device = _cuda_sim()
    with engine(WrongScaleLayout(humming.engine._HummingEngine())):
        dense = verify.run("humming", device)
        moe = verify.run_moe("humming", device)
        print(f"wrong scale layout: dense {dense.reason}; MoE {moe.reason}")
        assert not dense.passed and not moe.passed
        with pytest.raises(RefusedToServe):
            serving.decide(device, ["humming"], settings=Settings(simulate="12.0"))


class _ActivationType(enum.IntEnum):  # FlashInfer's enum (FlashInfer cannot run on the H200)
    Swiglu = 3
    Relu2 = 6


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@ON_GPU
def test_real_humming_dense_front_captures_replays_and_never_syncs():
    from sm120_fp4.dispatch import Router

    settings = Settings(simulate="12.0", backends="humming")
    router = Router(settings)
    assert router.ensure(0) is not None  # decide (self-test) before capture, as the weights hook does
    dispatch = router.make_dispatch(lambda *a, **k: pytest.fail("original called"))
    n, k, m = 512, 1024, 16
    _, _, (qx, qw_t, sx, sw_t, alpha) = verify.quantized_inputs((m, n, k), torch.device("cuda"), 5)
    weight, weight_sf = qw_t.T, sw_t.T
    kept_w, kept_sf = weight.clone(), weight_sf.clone()
    humming.prepare_dense(weight, weight_sf, torch.bfloat16, keep_original=True)  # as the layer check does
    assert not torch.equal(weight, kept_w)
    static = [qx.clone(), sx.view(torch.uint8).clone()]
    graph, static_out = _capture(
        lambda: dispatch(static[0], qw_t, static[1], sw_t, alpha, torch.bfloat16, backend="cutlass")
    )
    for seed in (6, 7):
        _, _, (fx, _, fsx, _, _) = verify.quantized_inputs((m, n, k), torch.device("cuda"), seed)
        static[0].copy_(fx)
        static[1].copy_(fsx.view(torch.uint8))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = dispatch(fx, qw_t, fsx.view(torch.uint8), sw_t, alpha, torch.bfloat16, backend="cutlass")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
    ref = nvfp4.reference_mm_fp4(fx, kept_w.T, fsx, kept_sf.T, alpha, torch.float32)
    assert float((eager.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@ON_GPU
def test_real_humming_moe_front_captures_replays_and_never_syncs():
    device = torch.device("cuda")
    experts, hidden, inter, top_k, tokens = 16, 256, 128, 4, 8
    weights = verify.moe._moe_weights(experts, hidden, inter, "swiglu", device, 3)
    kept = weights.map(torch.clone)
    humming.prepare_moe({**weights._asdict(), "dtype": torch.bfloat16}, torch.bfloat16, keep_original=True)
    front = dispatch.moe_front(
        lambda **kw: pytest.fail("original called"),
        _ActivationType,
        lambda index: humming.fused_moe,
        lambda index: "humming",
    )
    gen = torch.Generator().manual_seed(9)
    # "padded": SGLang's -1 slots (another rank's expert, the padding rows of a captured graph): each
    # rides with expert 0 as a zero row and is discarded, inside the graph, with no host sync.
    ids, tw = verify.moe_routing(tokens, top_k, experts, "padded", gen)
    static = {
        "x": (torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16).to(device),
        "ids": ids.to(device),
        "tw": tw.to(device),
    }
    scales = [
        weights.a1_gscale.reshape(()),
        weights.w13_sf.view(torch.int32),
        weights.w13_alpha,
        weights.a2_gscale.reshape(()),
        weights.w2_sf.view(torch.int32),
        weights.w2_alpha,
    ]

    def call():
        return front(
            output=torch.empty_like(static["x"]),
            input=static["x"],
            token_selected_experts=static["ids"],
            token_final_scales=static["tw"],
            fc1_expert_weights=weights.w13.view(torch.long),
            fc2_expert_weights=weights.w2.view(torch.long),
            output_dtype=torch.bfloat16,
            input_sf=None,
            quant_scales=scales,
            activation_type=_ActivationType.Swiglu,
        )[0]

    graph, static_out = _capture(call)
    fresh = []
    for routing in ("padded", "random"):  # made on the device before the no-sync region
        ids, tw = verify.moe_routing(tokens, top_k, experts, routing, gen)
        fresh.append(
            (
                routing,
                torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device),
                ids.to(device),
                tw.to(device),
            )
        )
    for routing, x, ids, tw in fresh:
        static["x"].copy_(x)
        static["ids"].copy_(ids)
        static["tw"].copy_(tw)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        mine = static["ids"] >= 0  # the oracle's convention for the others: expert 0 with weight 0 (they add nothing)
        ref = nvfp4.reference_moe_fp4(
            static["x"],
            torch.where(mine, static["ids"], 0),
            torch.where(mine, static["tw"], 0),
            kept.w13,
            kept.w13_sf,
            kept.w13_alpha * kept.a1_gscale,
            kept.w2,
            kept.w2_sf,
            kept.w2_alpha * kept.a2_gscale,
            None,
            None,
            quantize_activations=False,
        )
        assert float((eager.float() - ref.float()).norm() / ref.float().norm()) < 1e-2, routing
        dropped = (~mine).all(dim=1)
        if routing == "padded":
            assert bool(dropped.any()) and bool((eager[dropped] == 0).all())  # rows of -1 slots only: nothing added


@pytest.mark.gpu
@ON_GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_dequantization_kernel_is_bitwise_the_oracles_decode(dtype, monkeypatch):
    """The served path (the CUDA C kernel where NVRTC builds it, else torch's decode, its reason reported) and
    the kernel directly, on NaN-poisoned outputs, codes at an odd byte offset included."""
    from sm120_fp4.backends.humming import adapter
    from sm120_fp4.backends.humming import cuda as _humming_cuda

    device = torch.device("cuda", torch.cuda.current_device())
    _humming_cuda.load(device)  # NVRTC is there wherever Humming compiles with it (the H200's image)
    for m, k in ((1, 160), (7, 480), (129, 1056), (300, 8192), (1000, 28672)):
        _, _, (qx, _, sx, _, _) = verify.quantized_inputs((m, 32, k), device, m)
        want = nvfp4.dequantize_unscaled(qx, sx, torch.float32).to(dtype)
        got = humming.dequantize_activations(qx, sx.view(torch.uint8), dtype)
        assert torch.equal(got, want), (m, k)
        kp = nvfp4.swizzled_scale_shape(m, k)[1]
        odd = torch.empty(qx.numel() + 1, dtype=torch.uint8, device=device)[1:].view(qx.shape).copy_(qx)
        for codes in (qx, odd):
            out = torch.full((m, k), float("nan"), dtype=dtype, device=device)
            _humming_cuda.launch(codes, sx.view(torch.uint8), out, kp)
            assert torch.equal(out, want), (m, k, codes.data_ptr() % 8)
    assert humming.startup()["configurations"]["dequant"]["engine"] == "cuda"

    def no_nvrtc(device):
        raise RuntimeError("NVRTC could not compile the dequantization kernel (injected)")

    humming.clear()
    monkeypatch.setattr(adapter, "load", no_nvrtc)
    _, _, (qx, _, sx, _, _) = verify.quantized_inputs((129, 32, 1056), device, 3)
    got = humming.dequantize_activations(qx, sx.view(torch.uint8), dtype)
    assert torch.equal(got, nvfp4.dequantize_unscaled(qx, sx, torch.float32).to(dtype))
    record = humming.startup()["configurations"]["dequant"]
    assert record["engine"] == "torch" and "injected" in record["fallback_reason"]
    humming.clear()


@pytest.mark.gpu
@ON_GPU
def test_real_humming_layer_check_and_recheck_pass_through_the_routed_front():
    """A dense layer's check as the weights hook makes it (its own weights, every power-of-two bucket
    up to 2048, two passes), converted in place first, then the re-check after "warm-up"."""
    from sm120_fp4.dispatch import Router
    from sm120_fp4.serving import policy

    settings = Settings(simulate="12.0", backends="humming")
    router = Router(settings)
    router.ensure(0)
    dispatch = router.make_dispatch(lambda *a, **k: pytest.fail("original called"))
    n, k = 1280, 1024
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    calibration = (torch.randn(64, k, generator=gen) * 2).to(torch.bfloat16).cuda()
    gw, gx = nvfp4.global_scale(w), nvfp4.global_scale(calibration)
    weight, weight_sf = nvfp4.quantize(w, gw)
    kept = weight.clone()
    alpha = (1.0 / (gx * gw)).reshape(1)
    layer = torch.nn.Module()
    layer.params_dtype = torch.bfloat16

    def serve(x):  # SGLang's apply: quantize (nvfp4 stands in for FlashInfer's SM100+ quantizer), then the alias
        qx, sx = nvfp4.quantize(x, gx)
        return dispatch(qx, weight.T, sx.view(torch.uint8), weight_sf.T, alpha, torch.bfloat16, backend="cutlass")

    watched, sizes = (weight, weight_sf, alpha, gx.reshape(1)), policy.Sizes(512, 2048, 2048)
    check = policy.dense_check(sizes, "test layer", serve, layer, watched, n, k)
    report = serving.verify_layer(0, check, settings)
    assert report is not None and report.passed, report and report.reason
    assert not torch.equal(weight, kept)  # served from SGLang's storage, converted in place
    assert torch.equal(backends.original(weight), kept)
    rechecked = serving.recheck(settings, [3, 77, 160])
    assert rechecked and all(r.passed for r in rechecked)
    [decision] = serving.decisions()
    print(
        f"layer check {report.duration_s:.1f} s over {len(report.shapes)} calls-per-M, max rel {report.max_rel_err:.2e}; "
        f"memory {decision.backend_info['memory']}"
    )
