"""Capability detection, backend support, the self-test and the refusal to serve (CPU, mocked GPUs)."""

from __future__ import annotations

import json
import logging
import threading

import pytest

import faults
from threads import run_concurrently
from sm120_fp4 import backends, devices, selection, selftest
from sm120_fp4.config import Settings
from sm120_fp4.devices import Device
from sm120_fp4.errors import ConfigError, InvalidArgument, RefusedToServe

SIM = Settings(simulate="12.0")
FAULTS = {
    "returns_zeros": (faults.returns_zeros, "output is all zeros"),
    "leaves_out_unwritten": (faults.leaves_out_unwritten, "unwritten"),
    "zeroes_row_band": (faults.zeroes_row_band, r"64 row\(s\) all zero where the reference is not \(rows 64-127\)"),
    "wrong_for_large_m": (faults.wrong_for_large_m, r"M=2500 .*norm is 0.04x"),
    "scale_error_4x": (faults.scale_error_4x, r"M=1 .*norm is 4x the reference's.*scale error"),
    "single_nan": (faults.single_nan, r"1 non-finite element\(s\), first at row 0"),
    "raises": (faults.raises, r"raised TypeError: Expected DLTensor\* but got None"),
    "returns_new_tensor": (faults.returns_new_tensor, "other than `out`"),
    "garbage_rows": (faults.garbage_rows, r"M=7 N=224 K=160: relative error 0.[0-9]+ above 0.01"),
}


def fake(*specs: tuple[str, tuple[int, int]]):
    return devices.use_probe(lambda: [Device(i, name, cc) for i, (name, cc) in enumerate(specs)])


# ---- devices ------------------------------------------------------------------------------

@pytest.mark.parametrize("cc", [(12, 0), (12, 1), (9, 0), (10, 0)])
def test_mocked_capabilities_are_reported_as_probed(cc):
    with fake(("GPU", cc), ("GPU", cc)):
        found = devices.list_devices()
    assert [d.capability for d in found] == [cc, cc]
    assert [d.index for d in found] == [0, 1]
    assert all(not d.simulated for d in found)
    assert devices.is_sm12x(cc) == (cc[0] == 12)


def test_no_gpu_lists_nothing_and_simulation_supplies_a_cpu_device():
    with fake():
        assert devices.list_devices() == []
        sim = devices.list_devices((12, 1))
    assert len(sim) == 1 and sim[0].index == -1 and sim[0].capability == (12, 1) and sim[0].simulated
    assert "sm_121, simulated" in sim[0].label()


def test_simulation_overrides_every_real_capability():
    with fake(("NVIDIA H200", (9, 0)), ("NVIDIA H200", (9, 0))):
        sim = devices.list_devices((12, 0))
    assert [(d.index, d.capability, d.simulated) for d in sim] == [(0, (12, 0), True), (1, (12, 0), True)]


def test_nvml_numbering_follows_cuda_visible_devices(monkeypatch):
    class FakeNvml:
        gpus = [("GPU-A", (12, 0)), ("GPU-B", (9, 0)), ("GPU-C", (12, 1))]

        def nvmlInit(self): pass
        def nvmlShutdown(self): pass
        def nvmlDeviceGetCount(self): return len(self.gpus)
        def nvmlDeviceGetHandleByIndex(self, i): return i
        def nvmlDeviceGetName(self, h): return self.gpus[h][0]
        def nvmlDeviceGetCudaComputeCapability(self, h): return self.gpus[h][1]

    monkeypatch.setitem(__import__("sys").modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    found = devices.list_devices(refresh=True)
    assert [(d.index, d.name, d.capability, d.source) for d in found] == [
        (0, "GPU-C", (12, 1), "nvml"),
        (1, "GPU-A", (12, 0), "nvml"),
    ]


# ---- backends -----------------------------------------------------------------------------

@pytest.mark.parametrize("cc", [(12, 0), (12, 1), (9, 0), (10, 0)])
def test_flashinfer_backends_are_unsupported_without_a_usable_gpu(cc):
    cpu_like = Device(-1, "simulated", cc, simulated=True)
    for name in backends.FLASHINFER_BACKENDS:
        ok, why = backends.is_supported(name, cpu_like)
        assert not ok and "simulated" in why
    real = Device(0, "GPU", cc)
    ok, why = backends.is_supported("cutlass", real)
    assert not ok and why  # no FlashInfer, or no CUDA here: either way a reason
    assert backends.is_supported("emulated", real) == (True, None)


def test_register_validates_its_arguments_and_refuses_silent_replacement():
    with pytest.raises(InvalidArgument, match=r"name='Bad Name'"):
        backends.register("Bad Name", faults.healthy)
    with pytest.raises(InvalidArgument, match="fn=3"):
        backends.register("x", 3)
    backends.register("mine", faults.healthy)
    with pytest.raises(InvalidArgument, match="already registered"):
        backends.register("mine", faults.raises)
    backends.register("mine", faults.raises, replace=True)
    assert backends.get("mine").fn is faults.raises


def test_a_support_check_that_raises_is_a_reason_not_a_crash():
    def boom(device):
        raise RuntimeError("driver exploded")

    backends.register("fragile", faults.healthy, boom)
    ok, why = backends.is_supported("fragile", Device(0, "GPU", (12, 0)))
    assert not ok and "driver exploded" in why


# ---- self-test ----------------------------------------------------------------------------

def test_healthy_emulated_backend_passes_with_every_metric_reported():
    device = devices.list_devices((12, 0))[0]
    report = selftest.run("emulated", device)
    assert report.passed and report.reason is None
    assert [(s.m, s.n, s.k) for s in report.shapes] == list(selftest.DEFAULT_SHAPES)
    ms = [s.m for s in report.shapes]
    assert 1 in ms and any(m % 2 for m in ms if m > 1) and any(128 < m < 256 for m in ms) and max(ms) >= 2000
    for s in report.shapes:
        assert s.n % 32 == 0 and s.k % 32 == 0 and (s.n % 128 or s.k % 128)
        assert s.passed and s.nonfinite == 0 and s.zero_rows == 0
        assert 0 < s.rel_err < 5e-3 and 0.99 < s.norm_ratio < 1.01
    assert json.loads(report.model_dump_json())["backend"] == "emulated"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_misbehaving_backend_is_refused_for_the_right_reason(fault):
    fn, reason = FAULTS[fault]
    backends.register(fault, fn)
    report = selftest.run(fault, devices.list_devices((12, 0))[0])
    assert not report.passed
    assert report.reason and __import__("re").search(reason, report.reason), report.reason


def test_selftest_refuses_bad_shapes():
    from sm120_fp4.errors import SelfTestError

    with pytest.raises(SelfTestError, match="K % 32"):
        selftest.run("emulated", devices.list_devices((12, 0))[0], shapes=[(4, 32, 48)])


def test_quantizer_check_detects_a_wrong_activation_quantizer():
    import torch
    from sm120_fp4 import nvfp4

    device = devices.list_devices((12, 0))[0]

    def off_by_scale(x, g):
        return nvfp4.quantize(x, g * 2)

    good = selftest.run("emulated", device, shapes=[(1, 32, 64)], quantizer=("nvfp4", nvfp4.quantize))
    bad = selftest.run("emulated", device, shapes=[(1, 32, 64)], quantizer=("x2", off_by_scale))
    assert good.passed and good.quantizer.passed and good.quantizer.code_mismatch == 0
    assert not bad.passed and "activation quantizer x2" in bad.reason
    assert torch.float32  # the check ran on real tensors


# ---- decide() -----------------------------------------------------------------------------

def test_decide_in_simulation_skips_flashinfer_and_verifies_emulated(caplog):
    caplog.set_level(logging.INFO, "sm120_fp4")
    d = selection.decide(candidates=["cutlass", "b12x", "emulated"], settings=SIM)
    assert d.backend == "emulated" and d.verified
    assert set(d.rejected) == {"cutlass", "b12x"} and all("not supported" in r for r in d.rejected.values())
    lines = [r.getMessage() for r in caplog.records if "using emulated" in r.getMessage()]
    assert len(lines) == 1 and "sm_120, simulated" in lines[0] and "self-test max rel error" in lines[0]


def test_decision_is_cached_per_device_and_process():
    calls = []

    def counting(*args):
        calls.append(1)
        return faults.healthy(*args)

    backends.register("counting", counting)
    first = selection.decide(candidates=["counting"], settings=SIM)
    again = selection.decide(candidates=["counting"], settings=SIM)
    assert first is again and len(calls) == len(selftest.DEFAULT_SHAPES)


def test_first_passing_candidate_wins_and_rejections_keep_their_reasons():
    backends.register("zeros", faults.returns_zeros)
    backends.register("good", faults.healthy)
    d = selection.decide(candidates=["zeros", "good", "emulated"], settings=SIM)
    assert d.backend == "good" and d.rejected == {"zeros": d.rejected["zeros"]}
    assert "all zeros" in d.rejected["zeros"] and [r.backend for r in d.reports] == ["zeros", "good"]


def test_refusal_names_device_candidates_reasons_and_remedies():
    backends.register("band", faults.zeroes_row_band)
    with pytest.raises(RefusedToServe) as info:
        selection.decide(candidates=["cutlass", "band"], settings=SIM)
    text = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert f"{devices.list_devices((12, 0))[0].label()}: no FP4 GEMM backend passed verification" in text
    assert "(sm_120, simulated)" in text
    assert "cutlass: not supported" in text and "band: self-test failed: M=129" in text
    for remedy in ("SM120_FP4_BACKENDS=", "SM120_FP4_FALLBACK=emulated", "FlashInfer", "SM120_FP4=0"):
        assert remedy in text


def test_fallback_emulated_serves_loudly_instead_of_refusing(caplog):
    backends.register("nan", faults.single_nan)
    d = selection.decide(candidates=["nan"], settings=Settings(simulate="12.0", fallback="emulated"))
    assert d.backend == "emulated" and "fallback" in d.reason
    assert any("FALLBACK=emulated" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_selftest_warn_serves_the_first_supported_candidate_unverified(caplog):
    backends.register("zeros", faults.returns_zeros)
    d = selection.decide(candidates=["zeros"], settings=Settings(simulate="12.0", selftest="warn"))
    assert d.backend == "zeros" and not d.verified
    assert any("refusing to serve" in r.getMessage() for r in caplog.records)


def test_selftest_off_skips_the_test():
    backends.register("raises", faults.raises)
    d = selection.decide(candidates=["raises"], settings=Settings(simulate="12.0", selftest="off"))
    assert d.backend == "raises" and not d.verified and d.reports == []


def test_unknown_candidate_is_a_config_error_before_any_test():
    with pytest.raises(ConfigError, match=r"unknown backend\(s\) \['cutlas'\]"):
        selection.decide(candidates=["cutlas"], settings=SIM)


def test_concurrent_decides_on_one_device_share_one_selftest():
    calls = []
    lock = threading.Lock()

    def counting(*args):
        with lock:
            calls.append(1)
        return faults.healthy(*args)

    backends.register("counting", counting)
    results = []
    run_concurrently(lambda: results.append(selection.decide(None, ["counting"], settings=SIM)), [()] * 8)
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert len(calls) == len(selftest.DEFAULT_SHAPES)


def test_report_file_is_written_atomically_without_following_symlinks(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    selection.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(link)))
    assert target.read_text() == "keep" and not link.is_symlink()
    data = json.loads(link.read_text())
    assert data["decisions"][0]["backend"] == "emulated"
    assert oct(link.stat().st_mode & 0o777) == "0o644"


def test_select_fastest_times_every_verified_candidate_and_records_it():
    import time

    def slow(*args):
        time.sleep(0.005)
        return faults.healthy(*args)

    backends.register("slow", slow)
    backends.register("fast", faults.healthy)
    backends.register("zeros", faults.returns_zeros)
    d = selection.decide(candidates=["zeros", "slow", "fast"], settings=Settings(simulate="12.0", select="fastest"))
    assert d.backend == "fast" and set(d.timings_ms) == {"slow", "fast"}
    assert d.timings_ms["slow"] > d.timings_ms["fast"] and "zeros" in d.rejected
    assert "fastest of 2 verified candidates" in d.reason


def test_a_backend_that_hangs_is_reported_after_the_bound_not_waited_on_forever():
    import time

    def hangs(*args):
        time.sleep(2)
        return faults.healthy(*args)

    backends.register("hangs", hangs)
    start = time.perf_counter()
    report = selftest.run("hangs", devices.list_devices((12, 0))[0], shapes=[(1, 32, 64)], bounds=selftest.Bounds(call_timeout_s=0.2))
    assert time.perf_counter() - start < 1.5
    assert not report.passed and "did not return within 0.2 s (a hung kernel?)" in report.reason
