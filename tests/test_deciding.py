"""Deciding (sm120_fp4.deciding, through the public decide()): which backend serves a device, in
which order the candidates are tried, the refusal and its text, FALLBACK / SELFTEST / SELECT=fastest on
the self-test. Devices are simulated or mocked (a 'GPU' whose tensors live on the CPU)."""

from __future__ import annotations

import logging
import time
import types

import pytest
from helpers import faults
from helpers.cases import case
from helpers.common import CpuGpu

import sm120_fp4
from sm120_fp4 import backends, deciding, devices, verify
from sm120_fp4.config import Settings
from sm120_fp4.devices import Device
from sm120_fp4.errors import ConfigError, RefusedToServe

SIM = Settings(simulate="12.0")


def test_decide_in_simulation_skips_flashinfer_and_verifies_emulated(caplog):
    caplog.set_level(logging.INFO, "sm120_fp4")
    d = sm120_fp4.decide(candidates=["cutlass", "b12x", "emulated"], settings=SIM)
    assert d.backend == "emulated" and d.verified
    assert set(d.rejected) == {"cutlass", "b12x"} and all("not supported" in r for r in d.rejected.values())
    lines = [r.getMessage() for r in caplog.records if "using emulated" in r.getMessage()]
    assert len(lines) == 1 and "sm_120, simulated" in lines[0] and "self-test max rel error" in lines[0]


def test_first_passing_candidate_wins_and_rejections_keep_their_reasons():
    backends.register("zeros", faults.returns_zeros)
    backends.register("good", faults.healthy)
    d = sm120_fp4.decide(candidates=["zeros", "good", "emulated"], settings=SIM)
    assert d.backend == "good" and d.rejected == {"zeros": d.rejected["zeros"]}
    assert "all zeros" in d.rejected["zeros"] and [r.backend for r in d.reports] == ["zeros", "good"]
    assert d.timings_ms == {}, "SELECT=first times nothing"


def test_refusal_names_device_candidates_reasons_and_remedies():
    backends.register("band", faults.zeroes_row_band)
    with pytest.raises(RefusedToServe) as info:
        sm120_fp4.decide(candidates=["cutlass", "band"], settings=SIM)
    text = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert f"{devices.list_devices((12, 0))[0].label()}: no FP4 GEMM backend passed verification" in text
    assert "(sm_120, simulated)" in text
    assert "cutlass: not supported" in text and "band: self-test failed: M=129" in text
    for remedy in ("SM120_FP4_BACKENDS=", "SM120_FP4_FALLBACK=emulated", "FlashInfer", "SM120_FP4=0"):
        assert remedy in text


def test_fallback_emulated_serves_loudly_instead_of_refusing(caplog):
    backends.register("nan", faults.single_nan)
    d = sm120_fp4.decide(candidates=["nan"], settings=Settings(simulate="12.0", fallback="emulated"))
    assert d.backend == "emulated" and "fallback" in d.reason
    assert any("FALLBACK=emulated" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_selftest_warn_serves_the_first_supported_candidate_unverified(caplog):
    backends.register("zeros", faults.returns_zeros)
    d = sm120_fp4.decide(candidates=["zeros"], settings=Settings(simulate="12.0", selftest="warn"))
    assert d.backend == "zeros" and not d.verified
    assert any("refusing to serve" in r.getMessage() for r in caplog.records)


def test_selftest_off_skips_the_test():
    backends.register("raises", faults.raises)
    d = sm120_fp4.decide(candidates=["raises"], settings=Settings(simulate="12.0", selftest="off"))
    assert d.backend == "raises" and not d.verified and d.reports == []


def test_unknown_candidate_is_a_config_error_before_any_test():
    with pytest.raises(ConfigError, match=r"unknown backend\(s\) \['cutlas'\]"):
        sm120_fp4.decide(candidates=["cutlas"], settings=SIM)


@case(
    "properties",
    "SELECT=fastest on the CPU device path (time_call's eager timing, which reads perf_counter), on any machine",
    "each verified candidate timed once per self-test shape; the fastest serves (CUDA's path: tests/test_gpu.py)",
)
def test_select_fastest_times_every_verified_candidate_and_records_it(monkeypatch):
    # An injected clock: each call of "slow" costs 1000 ms and of "fast" 1 ms, whatever the machine's load.
    # The device is the simulated CPU one, also on a GPU machine: a CUDA device is timed by events instead.
    clock = [0.0]
    monkeypatch.setattr(deciding, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def costing(seconds):
        done = {}  # the timing passes repeat the same inputs: compute each output once (speed only)

        def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
            clock[0] += seconds
            key = (a.data_ptr(), b.data_ptr(), a.shape, b.shape, out.data_ptr())
            if key not in done:
                done[key] = faults.healthy(a, b, a_sf, b_sf, alpha, dtype, out).clone()
            return out.copy_(done[key])

        return gemm

    backends.register("slow", costing(1.0))
    backends.register("fast", costing(0.001))
    backends.register("zeros", faults.returns_zeros)
    cpu = Device(-1, "simulated (no GPU)", (12, 0), simulated=True, source="simulate")
    d = sm120_fp4.decide(
        cpu, candidates=["zeros", "slow", "fast"], settings=Settings(simulate="12.0", select="fastest")
    )
    shapes = len(verify.DEFAULT_SHAPES)
    assert d.backend == "fast" and d.timings_ms == pytest.approx({"slow": 1000.0 * shapes, "fast": 1.0 * shapes})
    assert "zeros" in d.rejected and "fastest of 2 verified candidates" in d.reason


@case(
    "properties",
    "SM120_FP4_BACKENDS unset (auto) on a GPU of compute capability {cc}",
    "the candidates are the per-capability order of flashinfer.ORDER_BY_CAPABILITY: {order}",
)
@pytest.mark.parametrize(
    "cc, order", [("12.0", "cutlass,b12x,humming"), ("12.1", "cutlass,humming (b12x absent: FlashInfer #3170)")]
)
def test_the_default_candidates_follow_the_capability(cc, order):
    major, minor = map(int, cc.split("."))
    gpu = CpuGpu(0, f"mocked sm_{major}{minor}", (major, minor))
    settings = Settings(fallback="emulated")
    decision = sm120_fp4.decide(gpu, settings=settings)
    assert decision.candidates == order.split(" ")[0].split(",")


@case(
    "backend faults",
    "SM120_FP4_SELFTEST_TIMEOUT=1 and a kernel that takes 0.4 s per call (every call under the bound, 8 calls)",
    "the bound is on the whole candidate: rejected as hung after about 1 s; the next candidate serves",
)
def test_the_selftest_timeout_bounds_a_whole_candidate(monkeypatch):
    calls = []

    def slow(*args):
        calls.append(1)
        time.sleep(0.4)
        return faults.healthy(*args)

    backends.register("slow", slow)
    monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
    monkeypatch.setenv("SM120_FP4_SELFTEST_TIMEOUT", "1")
    decision = sm120_fp4.decide(candidates=["slow", "emulated"])
    assert decision.backend == "emulated" and "did not return within" in decision.rejected["slow"]
    assert len(calls) <= 3, f"{len(calls)} calls of 0.4 s: the bound is on the whole candidate, not per call"


@case(
    "own failures",
    "a candidate recorded as crashed in the verdict store (a file), and one passed in as crashed by the caller",
    "choose() skips what the caller passes with its reason and reads no file (the caller reads the store); "
    "decide() reads the store and skips the recorded one",
)
def test_choose_takes_the_crashed_candidates_from_its_caller(tmp_path, monkeypatch):
    from sm120_fp4 import verdicts

    backends.register("crashy", faults.healthy)
    device = devices.get_device(None, (12, 0))
    store = tmp_path / "verdicts.json"
    verdicts.record(store, verdicts.device_key(device), "dense", "crashy", verdicts.CRASHED, "SIGSEGV")
    settings = Settings(simulate="12.0", verdicts=str(store))
    read: list = []
    monkeypatch.setattr(verdicts, "load", lambda path: read.append(path) or [])
    choice = deciding.choose(
        device, ["crashy", "emulated"], settings, deciding.DENSE, crashed={"crashy": "skipped: it crashed"}
    )
    assert choice.decision.backend == "emulated" and choice.decision.rejected == {"crashy": "skipped: it crashed"}
    assert read == [], "choose() reads no verdict file"
    monkeypatch.undo()
    d = sm120_fp4.decide(device, ["crashy", "emulated"], settings=settings)
    assert d.backend == "emulated" and "SIGSEGV" in d.rejected["crashy"]
