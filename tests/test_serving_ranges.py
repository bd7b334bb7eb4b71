"""SELECT=fastest by batch size: one verified backend per M range (decode, prefill), through SGLang's
real layer on a simulated SM120. Timings come from a stand-in clock through the library's one timer
(deciding.timed); the fault backends are registered through sm120_fp4.backends.register."""

from __future__ import annotations

import contextlib
import re
import sys
import types

import pytest
import torch
from helpers import fastest
from helpers.cases import case
from helpers.fastest import kernel

import sm120_fp4
from sm120_fp4 import serving
from sm120_fp4.backends import humming
from sm120_fp4.config import Settings
from sm120_fp4.demo import synthetic
from sm120_fp4.errors import RefusedToServe
from sm120_fp4.serving import policy
from sm120_fp4.sglang import hooks, layers
from sm120_fp4.sglang.release import MODEL_RUNNER

pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")
from test_sglang_verify import _model_runner_stand_in, _warmup

BOUND = 512  # the largest decode size served (SGLang's default largest graph batch)


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    yield
    sm120_fp4.uninstall()


@pytest.fixture
def clock(monkeypatch):
    return fastest.use_clock(monkeypatch)


def decode_fast(m):
    return 1.0 if m <= BOUND else 10.0


def prefill_fast(m):
    return 2.0 if m <= BOUND else 5.0


def serve(calls, names="decode,prefill"):
    sm120_fp4.install(simulate="12.0", backends=names, select="fastest")
    built = layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160))
    assert BOUND in policy.recheck_ms(hooks.sizes())
    return built


def eager(built, calls, sizes):
    method, layer = built
    calls.clear()
    for m in sizes:
        method.apply(layer, torch.randn(m, 160).to(torch.bfloat16))
    return list(calls)


@case(
    "configuration",
    "SELECT=fastest with two verified kernels, one faster at decode sizes (M<=512), one at prefill sizes",
    "the device is routed per M range: each M goes to its range's backend (eager and under the stand-in graph "
    "runner), each backend verified at its range's boundary and boundary+1 through the routed call; status says so",
)
@pytest.mark.slow
def test_each_batch_size_range_is_served_by_its_fastest_verified_backend(clock, monkeypatch):
    calls, box, captured = [], {}, []

    def warmup():  # the stand-in graph runner's captures: forward passes at its sizes
        captured.extend(eager(box["built"], calls, [8, 1024]))

    monkeypatch.setitem(sys.modules, MODEL_RUNNER, _model_runner_stand_in(warmup))
    kernel("decode", clock, calls, decode_fast)
    kernel("prefill", clock, calls, prefill_fast)
    built = box["built"] = serve(calls)
    [decision] = serving.decisions()
    assert decision.ranges == [(BOUND, "decode"), (None, "prefill")]
    assert sm120_fp4.status().routes == {-1: f"decode (M<={BOUND}), prefill (M>{BOUND})"}
    assert "decode (M<=512), prefill (M>512)" in decision.reason
    [split] = [r for r in decision.layers if r.passed]
    assert {BOUND, BOUND + 1} <= {s.m for s in split.shapes}, "verified at the boundary and just above it"
    assert eager(built, calls, [1, BOUND, BOUND + 1, 2048]) == [
        ("decode", 1),
        ("decode", BOUND),
        ("prefill", BOUND + 1),
        ("prefill", 2048),
    ]
    calls.clear()
    _warmup(sys.modules[MODEL_RUNNER].ModelRunner())  # captures, then the re-check after warm-up
    assert captured == [("decode", 8), ("prefill", 1024)]
    rechecked = calls[len(captured) :]
    assert {n for n, m in rechecked if m <= BOUND} == {"decode"}
    assert {n for n, m in rechecked if m > BOUND} == {"prefill"}
    assert {("decode", BOUND), ("prefill", BOUND + 1)} <= set(rechecked), "the re-check spans every range"


@case(
    "own failures",
    "SELECT=fastest: the prefill-fast kernel is right up to M=512 and wrong above it (up to the served 2048)",
    "it is refused (it would serve beyond the boundary): the other serves every M, none above 512 by the faulty one",
)
@pytest.mark.slow
def test_a_backend_wrong_beyond_the_boundary_never_serves_beyond_it(clock):
    calls = []
    kernel("decode", clock, calls, decode_fast)
    kernel("prefill", clock, calls, prefill_fast, wrong=lambda m: BOUND < m <= 2048)  # the self-test's 2500 passes
    built = serve(calls)
    assert sm120_fp4.status().routes == {-1: "decode"}
    failed = serving.STATE.records[("dense", -1)].failed["prefill"]
    assert int(re.search(r"M=(\d+) ", failed).group(1)) > BOUND, failed
    assert {n for n, _ in eager(built, calls, [1, BOUND + 1, 2048])} == {"decode"}


@case(
    "own failures",
    "SELECT=fastest: the prefill-fast kernel is wrong only at M=513, the boundary + 1 (no layer check size)",
    "the split's check at the boundary + 1 through the routed call refuses it: one backend serves every M",
)
def test_a_backend_wrong_only_at_the_boundary_plus_one_is_refused(clock):
    calls = []
    kernel("decode", clock, calls, decode_fast)
    kernel("prefill", clock, calls, prefill_fast, wrong=lambda m: m == BOUND + 1)
    built = serve(calls)
    assert BOUND + 1 not in policy.load_ms(hooks.sizes())
    [decision] = serving.decisions()
    assert decision.ranges == [] and sm120_fp4.status().routes == {-1: "decode"}
    assert "M=513 " in serving.STATE.records[("dense", -1)].failed["prefill"]
    assert {n for n, _ in eager(built, calls, [BOUND + 1, 2048])} == {"decode"}


@case(
    "configuration",
    "SELECT=fastest: two kernels whose times differ by under 3% in every range",
    "no split (a difference within noise): one backend serves every M",
)
def test_no_split_without_a_measured_difference(clock):
    calls = []
    kernel("decode", clock, calls, lambda m: 1.0 if m <= BOUND else 1.02)
    kernel("prefill", clock, calls, lambda m: 1.02 if m <= BOUND else 1.0)
    serve(calls)
    [decision] = serving.decisions()
    assert decision.ranges == [] and sm120_fp4.status().routes[-1] in ("decode", "prefill")


@case(
    "configuration",
    "a device split between two backends: the serving canary's light check at one decode M",
    "it calls both backends, at the boundary and above it, through the routed call",
)
@pytest.mark.slow
def test_the_canary_check_calls_every_serving_backend(clock):
    calls = []
    kernel("decode", clock, calls, decode_fast)
    kernel("prefill", clock, calls, prefill_fast)
    serve(calls)
    [served] = serving.served_configurations()
    calls.clear()
    assert serving.check_served(served, 1).passed
    assert {("decode", 1), ("decode", BOUND), ("prefill", BOUND + 1)} <= set(calls)
    assert served.backend == f"decode (M<={BOUND}), prefill (M>{BOUND})"


def test_plan_splits_only_where_each_range_is_separated_from_the_single_fastest():
    times = {"a": {1: 1.0, 8: 1.0, 2048: 10.0}, "b": {1: 2.0, 8: 2.0, 2048: 5.0}}
    assert serving.fastest.plan(times) == [(8, "a"), (None, "b")]
    assert serving.fastest.plan({"b": times["b"]}) == [(None, "b")]
    close = {"a": {1: 1.0, 2048: 1.02}, "b": {1: 1.02, 2048: 1.0}}
    assert serving.fastest.plan(close) == [(None, "a")]


@case(
    "configuration",
    "SELECT=fastest: the prefill kernel is slower at load and faster at prefill sizes once its tactics are tuned",
    "at load one backend serves; SGLang's BaseRunner.warmup (where the autotune runs, before capture) ends with "
    "serving.retime(), which splits the route, verified at the boundary and boundary+1 through the routed call",
)
@pytest.mark.slow
def test_retime_after_autotune_splits_the_route(clock):
    calls, tuned = [], [False]
    kernel("decode", clock, calls, decode_fast)
    kernel("prefill", clock, calls, lambda m: 2.0 if m <= BOUND else (5.0 if tuned[0] else 20.0))
    serve(calls)
    assert sm120_fp4.status().routes == {-1: "decode"}
    tuned[0] = True
    calls.clear()
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    warmed = []  # SGLang's own warm-up (autotune) stands in here; the library's hook runs after it
    runner = types.SimpleNamespace(model_context=contextlib.nullcontext, _warmup=lambda: warmed.append(calls[:]))
    BaseRunner.warmup(runner)
    assert warmed == [[]], "retime runs after SGLang's warm-up, not before"
    [decision] = serving.decisions()
    assert decision.ranges == [(BOUND, "decode"), (None, "prefill")]
    assert {("decode", BOUND), ("prefill", BOUND + 1)} <= set(calls), "the split is verified at its boundary"


# ---- a converting candidate (humming, through its CPU stand-in) beside a non-converting one ----------------------


@pytest.fixture
def humming_clock(clock, monkeypatch):
    with fastest.timed_humming(clock, monkeypatch, decode_fast) as box:
        yield box


@case(
    "configuration",
    "SELECT=fastest with humming (converts each layer to its own layout) first and a registered non-converting "
    "kernel second, {faster} the faster",
    "the faster one serves; both verified on their own prepared weights from the checkpoint's bytes, neither refused",
)
@pytest.mark.parametrize("faster", ["humming", "other"])
@pytest.mark.slow
def test_fastest_with_a_converting_candidate_verifies_each_on_its_own_weights(clock, humming_clock, faster):
    calls = []
    humming_clock.cost = (lambda m: 1.0) if faster == "humming" else (lambda m: 10.0)
    kernel("other", clock, calls, lambda m: 5.0)
    ckpt = synthetic.make_checkpoint(256, 512)  # Humming's alignment: converted in SGLang's own storage
    sm120_fp4.install(simulate="12.0", backends="humming,other", select="fastest")
    method, layer = layers.build_modelopt_layer(ckpt)
    record = serving.STATE.records[("dense", -1)]
    assert record.failed == {}, record.failed
    [decision] = serving.decisions()
    assert decision.backend == ("humming" if faster == "humming" else "other") and decision.verified
    assert decision.layers and all(r.passed for r in decision.layers)
    assert set(decision.timings_ms) == {"humming", "other"}
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))
    assert humming.startup()["memory"], "both layouts held while both may serve"
    _autotune_warmup()  # the last decision before capture: humming's layout is freed where it does not serve
    assert bool(humming.startup()["memory"]) == (faster == "humming")
    assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))


def _autotune_warmup() -> None:
    """SGLang's BaseRunner.warmup, its own warm-up (the autotune) standing in: the library's hook retimes after it."""
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    BaseRunner.warmup(types.SimpleNamespace(model_context=contextlib.nullcontext, _warmup=lambda: None))


@case(
    "configuration",
    "SELECT=fastest with humming (converting) faster at decode sizes (M<=512) and a registered non-converting kernel "
    "faster at prefill sizes",
    "the route is split: humming below the boundary on its own layout next to the layer's (which keeps the "
    "checkpoint's bytes for the other), verified at the boundary and boundary+1; status shows humming's extra memory",
)
@pytest.mark.slow
def test_a_split_puts_a_converting_backend_on_one_side(clock, humming_clock):
    calls = []
    humming_clock.cost = decode_fast
    kernel("prefill", clock, calls, prefill_fast)
    ckpt = synthetic.make_checkpoint(256, 512)
    sm120_fp4.install(simulate="12.0", backends="humming,prefill", select="fastest")
    method, layer = layers.build_modelopt_layer(ckpt)
    [decision] = serving.decisions()
    assert decision.ranges == [(BOUND, "humming"), (None, "prefill")], decision.reason
    [split] = [r for r in decision.layers if r.passed]
    assert {BOUND, BOUND + 1} <= {s.m for s in split.shapes}, "verified at the boundary and just above it"
    assert torch.equal(layer.weight, ckpt.weight), "the layer keeps the checkpoint's bytes"
    humming_clock.calls.clear()
    calls.clear()
    for m in (BOUND, BOUND + 1):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))
    assert humming_clock.calls == [("humming", BOUND)] and calls == [("prefill", BOUND + 1)]
    status = sm120_fp4.status().model_dump(mode="json")
    [memory] = status["decisions"][0]["backend_info"]["humming"]["memory"].values()
    assert memory["layers"] == 1 and not memory["in_place"] and memory["extra_bytes"] > 0
    # Humming's layout was made at load: new weights written by SGLang's update path are refused, saying so.
    settings = Settings(simulate="12.0", backends="humming,prefill", select="fastest")
    with pytest.raises(RefusedToServe, match="humming serves every layer from its own layout made at load"):
        serving.weights_update_begin()
        layer.weight.data.copy_(layer.weight.data.flip(0))
        serving.weights_update_end(settings)
