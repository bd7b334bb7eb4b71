"""The checks' CUDA graphs (sm120_fp4.graphs): the same numbers as eager calls, new inputs every
replay, eager wherever a graph does not fit, and a fault after capture still caught."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from sm120_fp4 import backends, devices, graphs, nvfp4, serving, verify
from sm120_fp4.config import Settings
from sm120_fp4.errors import RefusedToServe
from sm120_fp4.serving import policy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _double_and_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.sum()


def test_cpu_tensors_run_eagerly_and_keep_no_graph():
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(graphs.CAPTURE_AT + 2):
        doubled, total = graphs.run("t", _double_and_sum, (x,), lambda o: (o[0].clone(), float(o[1])))
        assert torch.equal(doubled, x * 2) and total == 15.0
    assert graphs.stats() == {}


@cuda
def test_replays_compute_what_eager_calls_do_with_each_calls_own_inputs():
    graphs.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(graphs.CAPTURE_AT + 4):
        x = torch.randn(8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        gsf = torch.tensor(448.0 * 6 / (i + 1), device="cuda")
        quantize = functools.partial(nvfp4.quantize, check_finite=False)  # as the dense layer check quantizes
        got = graphs.run("quantize", quantize, (x, gsf), lambda q: (q[0].clone(), q[1].clone()))
        want = nvfp4.quantize(x, gsf, check_finite=False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    [stats] = graphs.stats().values()
    assert stats["captures"] == 1 and stats["replays"] == 5


@cuda
def test_the_comparison_from_a_graph_gives_the_eager_verdict_pass_or_fail():
    graphs.clear()
    gen = torch.Generator(device="cuda").manual_seed(1)
    bounds = verify.Bounds()
    for i in range(graphs.CAPTURE_AT + 5):
        ref = torch.randn(8, 1024, device="cuda", generator=gen)
        out = ref.to(torch.bfloat16)
        if i % 2:  # every other call wrong in one row: the replay must see this call's output
            out[i % 8].zero_()
        graphed, eager = (
            verify.ShapeResult(m=8, n=1024, k=64, passed=True),
            verify.ShapeResult(m=8, n=1024, k=64, passed=True),
        )
        reason = verify.engine._compare(out, ref, bounds, graphed)
        graphs.MAX_INPUT_BYTES, saved = 0, graphs.MAX_INPUT_BYTES  # the same call, eagerly
        try:
            assert verify.engine._compare(out, ref, bounds, eager) == reason
        finally:
            graphs.MAX_INPUT_BYTES = saved
        assert graphed == eager
        assert (reason is None) == (i % 2 == 0), reason
    assert graphs.stats()[0]["replays"] >= 5


@cuda
def test_what_cannot_be_captured_runs_eagerly_and_is_not_tried_again():
    graphs.clear()

    def syncs(x):
        return (x * float(x.sum()),)  # a host read: not capturable

    x = torch.ones(4, device="cuda")
    for _ in range(graphs.CAPTURE_AT + 2):
        assert graphs.run("syncs", syncs, (x,), lambda o: o[0].tolist()) == [4.0] * 4
    assert graphs.stats()[0]["captures"] == 0 and graphs.stats()[0]["graphs"] == 0


@cuda
def test_inside_no_capture_a_graph_replays_and_nothing_new_is_captured():
    graphs.clear()
    x, y = torch.ones(4, device="cuda"), torch.ones(8, device="cuda")
    for _ in range(graphs.CAPTURE_AT):
        graphs.run("t", _double_and_sum, (x,), lambda o: None)
    assert graphs.stats()[0]["captures"] == 1
    replays = graphs.stats()[0]["replays"]
    with graphs.no_capture():
        assert not graphs.captures_allowed()
        for i in range(graphs.CAPTURE_AT + 2):
            assert graphs.run("t", _double_and_sum, (x * i,), lambda o: float(o[1])) == 4.0 * i  # replayed
            assert graphs.run("t", _double_and_sum, (y * i,), lambda o: float(o[1])) == 8.0 * i  # eager
    assert graphs.stats()[0]["captures"] == 1 and graphs.stats()[0]["replays"] == replays + graphs.CAPTURE_AT + 2
    assert graphs.captures_allowed()
    graphs.run("t", _double_and_sum, (y,), lambda o: None)  # its uses were counted: captured at once outside
    assert graphs.stats()[0]["captures"] == 2


@cuda
def test_inside_the_engines_own_capture_nothing_is_captured_here():
    graphs.clear()
    x = torch.ones(4, device="cuda")
    outer = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _double_and_sum(x)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(outer):
        for _ in range(graphs.CAPTURE_AT + 1):
            kept = graphs.run("t", _double_and_sum, (x,), lambda o: o[0])
    outer.replay()
    torch.cuda.synchronize()
    assert kept.tolist() == [2.0] * 4 and graphs.stats() == {}


@cuda
def test_graphs_past_the_byte_budget_are_dropped_oldest_first(monkeypatch):
    graphs.clear()
    monkeypatch.setattr(graphs, "BUDGET_BYTES", 3 * 4096 * 4)
    for n in range(1, 6):
        x = torch.full((4096 + n,), float(n), device="cuda")
        for _ in range(graphs.CAPTURE_AT):
            assert graphs.run("t", _double_and_sum, (x,), lambda o: float(o[1])) == n * (4096 + n)
    stats = graphs.stats()[0]
    assert stats["captures"] == 5 and stats["graphs"] == 2 and stats["input_bytes"] <= graphs.BUDGET_BYTES


def _layer(n: int, k: int, wrong_row: int | None = None):
    """A dense NVFP4 layer served by `emulated`, wrong in one output row where `wrong_row` says."""
    weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    weight_sf = torch.randint(0x20, 0x48, nvfp4.swizzled_scale_shape(n, k), dtype=torch.uint8, device="cuda").view(
        torch.float8_e4m3fn
    )
    input_gsf = torch.tensor(448.0 * 6 / 8.0, device="cuda")
    alpha = (1.0 / (input_gsf * 448.0 * 6 / 0.05)).reshape(1).float()
    fn = backends.resolve("emulated")

    def serve(x):
        qx, sx = nvfp4.quantize(x, input_gsf, check_finite=False)
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device="cuda")
        fn(qx, weight.T, sx.view(torch.uint8), weight_sf.T, alpha, x.dtype, out)
        if wrong_row is not None:
            out[wrong_row] = -out[wrong_row]
        return out

    layer, watched = types.SimpleNamespace(params_dtype=torch.bfloat16), (weight, weight_sf, alpha, input_gsf)
    return policy.dense_check(policy.Sizes(512, 2048, 2048), "graphed", serve, layer, watched, n, k)


@cuda
def test_a_layer_wrong_after_its_light_checks_run_from_graphs_is_refused():
    settings = Settings(simulate="12.0", backends="emulated")
    device = devices.list_devices(settings.simulated_capability)[0]
    layers = [_layer(256, 512) for _ in range(6)]
    for check in layers:
        report = serving.verify_layer(device.index, check, settings)
        assert report is not None and report.passed, report and report.reason
    assert graphs.stats()[device.index]["replays"] >= 2  # the light checks' quantize and comparison replayed
    with pytest.raises(RefusedToServe, match="relative error|row"):
        serving.verify_layer(device.index, _layer(256, 512, wrong_row=3), settings)
