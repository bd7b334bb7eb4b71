"""Serving (sm120_fp4.serving): the decision cache per device and process, concurrent decides,
refusals kept for status, SELECT=fastest settled on the served layer configurations. Devices are
simulated or mocked (several 'GPUs' whose tensors live on the CPU)."""

from __future__ import annotations

import pathlib
import re
import threading

import pytest
from helpers import fastest, faults
from helpers.cases import case
from helpers.common import CpuGpu, run_concurrently

import sm120_fp4
from sm120_fp4 import backends, serving, verify
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.config import Settings
from sm120_fp4.errors import RefusedToServe
from sm120_fp4.serving import policy

SIM = Settings(simulate="12.0")


def test_decision_is_cached_per_device_and_process():
    calls = []

    def counting(*args):
        calls.append(1)
        return faults.healthy(*args)

    backends.register("counting", counting)
    first = serving.decide(candidates=["counting"], settings=SIM)
    again = serving.decide(candidates=["counting"], settings=SIM)
    assert first is again and len(calls) == 3 * len(verify.DEFAULT_SHAPES), (
        "two passes (each shape twice in a row in the first), once per process"
    )


def test_concurrent_decides_on_one_device_share_one_selftest():
    calls = []
    lock = threading.Lock()

    def counting(*args):
        with lock:
            calls.append(1)
        return faults.healthy(*args)

    backends.register("counting", counting)
    results = []
    run_concurrently(lambda: results.append(serving.decide(None, ["counting"], settings=SIM)), [()] * 8)
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert len(calls) == 3 * len(verify.DEFAULT_SHAPES)


@case(
    "concurrency",
    "decide() for 3 devices from 12 threads at once",
    "one self-test per device, one Decision per device shared by all its callers, none lost",
)
def test_decide_for_several_devices_at_once_tests_each_device_once():
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def counted_support(device):
        with lock:
            calls[device.index] = calls.get(device.index, 0) + 1
        return True, None

    backends.register("counted", emulated_mm_fp4, counted_support)
    gpus = [CpuGpu(i, f"mocked GPU {i}", (12, 0)) for i in range(3)]
    barrier, results, errors = threading.Barrier(12), {}, []
    settings = Settings(backends="counted")

    def worker(n):
        barrier.wait()
        try:
            results[n] = serving.decide(gpus[n % 3], settings=settings)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    run_concurrently(worker, [(n,) for n in range(12)])
    assert errors == []
    assert calls == {0: 1, 1: 1, 2: 1}
    for index in range(3):
        mine = {id(results[n]) for n in range(12) if n % 3 == index}
        assert len(mine) == 1 and results[index].device_index == index and results[index].verified
    assert sorted(d.device_index for d in serving.decisions()) == [0, 1, 2]


@case(
    "own failures",
    "decide() refuses (every candidate fails its self-test)",
    "status().refusals lists the refusal with the device, the family and each candidate's reason (decisions stay empty)",
)
def test_a_refusal_from_decide_is_in_status_with_its_reasons():
    import sm120_fp4

    backends.register("zeros", faults.returns_zeros)
    backends.register("band", faults.zeroes_row_band)
    with pytest.raises(RefusedToServe):
        sm120_fp4.decide(candidates=["zeros", "band"], settings=SIM)
    status = sm120_fp4.status()
    assert status.decisions == [] and len(status.refusals) == 1
    refusal = status.refusals[0]
    assert refusal.family == "dense" and "sm_120" in refusal.device
    assert "all zeros" in refusal.rejected["zeros"] and "row(s) all zero" in refusal.rejected["band"]
    assert [r.backend for r in refusal.reports] == ["zeros", "band"]


@case(
    "configuration",
    "FLASHINFER_NVFP4_4OVER6=1 set after install(), before the first layer's decision",
    "ConfigError naming the variable and its value, before any candidate runs (none is blamed, nothing cached); "
    "once it is unset the decision verifies",
)
def test_a_flashinfer_fp4_knob_set_after_install_is_named_at_the_decision(monkeypatch):
    import sm120_fp4
    from sm120_fp4.errors import ConfigError

    calls = []
    backends.register("counting", lambda *args: calls.append(1) or faults.healthy(*args))
    monkeypatch.setenv("FLASHINFER_NVFP4_4OVER6", "1")
    with pytest.raises(
        ConfigError, match=r"FLASHINFER_NVFP4_4OVER6='1' set: this changes FlashInfer's FP4 quantization recipe"
    ):
        sm120_fp4.decide(candidates=["counting"], settings=SIM)
    assert calls == [] and sm120_fp4.status().refusals == [], "no candidate ran, none was blamed"
    monkeypatch.delenv("FLASHINFER_NVFP4_4OVER6")
    assert sm120_fp4.decide(candidates=["counting"], settings=SIM).verified


@case(
    "configuration",
    "SELECT=fastest with two verified kernels: one fast on the self-test's shapes but 1000x slower at a prefill M, one steady",
    "the layer configuration's served calls are timed at its serving batch sizes (decode and the prefill chunk): the "
    "steady kernel serves the prefill range, the other only the sizes where it is faster; each time recorded",
)
@pytest.mark.default_prefill
@pytest.mark.slow
def test_select_fastest_times_the_served_layer_configurations_at_their_serving_batch_sizes(monkeypatch):
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")
    import sm120_fp4
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import hooks, layers

    clock = fastest.use_clock(monkeypatch)  # the self-test's and the served calls' timings

    def costing(cost):
        def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
            clock[0] += cost(a.shape[0])
            return faults.healthy(a, b, a_sf, b_sf, alpha, dtype, out)

        return gemm

    backends.register("prefill-slow", costing(lambda m: 1.0 if m >= 4096 else 0.001))
    backends.register("steady", costing(lambda m: 0.01))
    sm120_fp4.install(simulate="12.0", backends="prefill-slow,steady", select="fastest")
    try:
        layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160))
        [decision] = serving.decisions()
        sizes = policy.recheck_ms(hooks.sizes())
        below, slow = max(m for m in sizes if m < 4096), sum(m >= 4096 for m in sizes)
        assert decision.ranges == [(below, "prefill-slow"), (None, "steady")]
        assert sm120_fp4.status().routes == {-1: f"prefill-slow (M<={below}), steady (M>{below})"}
        assert "served layer configurations at their serving batch sizes" in decision.reason
        assert 8192 in sizes and decision.timings_ms == pytest.approx(
            {"steady": 10.0 * len(sizes), "prefill-slow": 1000.0 * slow + 1.0 * (len(sizes) - slow)}
        )
    finally:
        sm120_fp4.uninstall()


def test_both_engines_take_their_verified_sizes_from_the_one_policy():
    """The engine homes read sizes and tensors; which M are verified is decided in serving.policy alone."""
    root = pathlib.Path(sm120_fp4.__file__).parent
    for home in ("sglang", "vllm"):
        code = re.sub(r"\s+", "", "".join(p.read_text() for p in (root / home).glob("*.py")))
        assert "dense_layer_check(sizes()," in code and "policy.moe_check(sizes()," in code, home
        assert "LayerCheck(" not in code and "def batch_sizes" not in code and "recheck_ms" not in code, home
    assert "LayerCheck(" in (root / "serving" / "policy.py").read_text()


def test_the_verified_sizes_cover_every_power_of_two_bucket_with_an_odd_m_and_the_boundaries():
    for max_batch, chunk in ((1, 2048), (8, 8192), (160, 8192), (512, 8192), (1024, 3000), (512, 256)):
        sizes = policy.Sizes(max_batch, chunk, chunk)
        top = max(max_batch, chunk)
        for ms in (policy.load_ms(sizes), policy.recheck_ms(sizes)):
            assert {m.bit_length() for m in ms} == set(range(1, top.bit_length() + 1)), (sizes, ms)
            odd = {m.bit_length() for m in ms if m % 2}  # an odd M in every bucket that holds one below `top`
            assert odd >= {b for b in range(1, top.bit_length() + 1) if (1 << (b - 1)) + 1 <= top or b == 1}, ms
            assert {max_batch, chunk} <= set(ms) and max(ms) == top, (sizes, ms)
    # SGLang's and vLLM's defaults: every bucket between the largest graph batch and the chunk is verified.
    between = [m for m in policy.load_ms(policy.Sizes(512, 8192, 8192)) if 512 < m < 8192]
    assert between == [767, 1024, 1535, 2048, 3071, 4096, 6143]


def test_uninstall_resets_the_one_owner_of_the_process_state_and_install_works_again(tmp_path):
    """install -> a layer served in simulation (a refusal, the canary and the report too) -> uninstall: status() and
    the one owner of the serving state (serving.STATE) show nothing left; the same again works."""
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import layers

    backends.register("zeros", faults.returns_zeros)
    for _ in range(2):
        sm120_fp4.install(simulate="12.0", backends="emulated", canary="60", report=str(tmp_path / "r.json"))
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
        with pytest.raises(RefusedToServe):
            sm120_fp4.decide(candidates=["zeros"], settings=Settings(simulate="12.0"))
        status = sm120_fp4.status()
        assert status.routes and status.decisions and status.refusals and status.canary.enabled, status
        assert serving.served_configurations() and "canary" in serving.STATE.report.sections

        status = sm120_fp4.uninstall()
        assert not status.installed and status.message == "uninstalled", status.message
        assert (status.routes, status.moe_routes, status.decisions, status.refusals, status.unverified) == ({},) * 2 + (
            [],
        ) * 3
        assert not status.canary.enabled and status.patches == [] and not serving.served_configurations()
        state = serving.STATE
        assert (state.records, state.route_tables, state.refusals, state.verifying, state.groups) == (
            {},
            {"dense": {}, "moe": {}},
            [],
            {},
            [],
        )
        assert state.canary is None and state.report.sections == {} and state.updating == 0
