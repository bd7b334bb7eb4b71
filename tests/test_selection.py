"""decide(): which backend serves a device, the refusal, the decision cache, SELECT=fastest, and
the JSON report file. Devices are simulated or mocked (several 'GPUs' whose tensors live on the CPU)."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
import types
from pathlib import Path

import pytest

from helpers import faults
from helpers.cases import case
from helpers.common import CpuGpu, run_concurrently
from sm120_fp4 import backends, devices, selection, selftest
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.config import Settings
from sm120_fp4.errors import ConfigError, RefusedToServe

SIM = Settings(simulate="12.0")


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
    assert first is again and len(calls) == 2 * len(selftest.DEFAULT_SHAPES), "two passes, once per process"


def test_first_passing_candidate_wins_and_rejections_keep_their_reasons():
    backends.register("zeros", faults.returns_zeros)
    backends.register("good", faults.healthy)
    d = selection.decide(candidates=["zeros", "good", "emulated"], settings=SIM)
    assert d.backend == "good" and d.rejected == {"zeros": d.rejected["zeros"]}
    assert "all zeros" in d.rejected["zeros"] and [r.backend for r in d.reports] == ["zeros", "good"]
    assert d.timings_ms == {}, "SELECT=first times nothing"


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
    assert len(calls) == 2 * len(selftest.DEFAULT_SHAPES)


def test_select_fastest_times_every_verified_candidate_and_records_it(monkeypatch):
    # An injected clock: each call of "slow" costs 1000 ms and of "fast" 1 ms, whatever the machine's load.
    clock = [0.0]
    monkeypatch.setattr(selection, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

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
    d = selection.decide(candidates=["zeros", "slow", "fast"], settings=Settings(simulate="12.0", select="fastest"))
    shapes = len(selftest.DEFAULT_SHAPES)
    assert d.backend == "fast" and d.timings_ms == pytest.approx({"slow": 1000.0 * shapes, "fast": 1.0 * shapes})
    assert "zeros" in d.rejected and "fastest of 2 verified candidates" in d.reason



# ---- concurrency (issue item 5) ---------------------------------------------------------------

@case("concurrency", "decide() for 3 devices from 12 threads at once", "one self-test per device, one Decision per device shared by all its callers, none lost")
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
            results[n] = selection.decide(gpus[n % 3], settings=settings)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    run_concurrently(worker, [(n,) for n in range(12)])
    assert errors == []
    assert calls == {0: 1, 1: 1, 2: 1}
    for index in range(3):
        mine = {id(results[n]) for n in range(12) if n % 3 == index}
        assert len(mine) == 1 and results[index].device_index == index and results[index].verified
    assert sorted(d.device_index for d in selection.decisions()) == [0, 1, 2]


# ---- reports (issue item 7) --------------------------------------------------------------------------

def _decide_with_report(path) -> Path:
    # SELFTEST=off: the report, not the self-test, is under test here (and it is faster).
    selection.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(path), selftest="off"))
    return Path(str(path).replace("{pid}", str(os.getpid())))


@case("reports", "report written under umask {umask}", "mode 0600 exactly (owner-only); valid JSON; no temporary file left next to it")
@pytest.mark.parametrize("umask", ["000", "022", "077", "777"])
def test_report_mode_is_0600_whatever_the_umask(tmp_path, umask):
    previous = os.umask(int(umask, 8))
    try:
        path = _decide_with_report(tmp_path / "report-{pid}.json")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # fchmod, whatever the umask
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@case("reports", "symlink planted at a file report path after start-up (to a file, to a directory, dangling)",
      "the link is neither followed nor replaced (a warning names it); its target is never written or created; the decision stands")
@pytest.mark.parametrize("target_kind", ["file", "directory", "dangling"])
def test_report_never_follows_or_replaces_a_planted_symlink(tmp_path, target_kind, caplog):
    victim = tmp_path / "victim"
    if target_kind == "file":
        victim.write_text("precious")
    elif target_kind == "directory":
        victim.mkdir()
    link = tmp_path / "report.json"
    settings = Settings(simulate="12.0", report=str(link), selftest="off")  # read while the path is no link
    link.symlink_to(victim)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert selection.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert link.is_symlink() and os.readlink(link) == str(victim)
    assert any("is a symbolic link" in r.getMessage() for r in caplog.records)
    if target_kind == "file":
        assert victim.read_text() == "precious"
    elif target_kind == "directory":
        assert list(victim.iterdir()) == []
    else:
        assert not victim.exists()


@case("reports", "a report write that fails half-way (unserialisable payload)", "the previous report is intact; no temporary file is left")
def test_a_failed_report_write_leaves_the_previous_report_and_no_temp_file(tmp_path):
    path = _decide_with_report(tmp_path / "report.json")
    before = path.read_text()
    with pytest.raises(TypeError):
        selection.write_report(path, {"bad": object()})
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["report.json"]


@case("reports", "secrets in the environment (HF_TOKEN, AWS_SECRET_ACCESS_KEY, any other variable)", "the report holds no environment value except the library's own settings")
def test_report_contains_no_environment_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-456")
    text = _decide_with_report(tmp_path / "report.json").read_text()
    leaked = [k for k, v in os.environ.items() if not k.startswith("SM120_FP4") and len(v) >= 8 and v in text]
    assert leaked == []


@case("reports", "report directory removed after install(), then the first layer loads", "the decision stands (one warning says the report was not written); the worker does not crash")
def test_an_unwritable_report_does_not_stop_a_worker(tmp_path, caplog):
    folder = tmp_path / "reports"
    folder.mkdir()
    settings = Settings(simulate="12.0", report=str(folder / "r.json"), selftest="off")
    folder.rmdir()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert selection.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert any("report" in r.getMessage() for r in caplog.records)


@case("reports", "two decisions finish at once in one process, writers interleave", "the report lists both decisions (the last writer writes the latest state)")
def test_concurrent_report_writes_never_lose_a_decision(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    first_dumping, second_decided = threading.Event(), threading.Event()
    real_dump = json.dump

    def ordered_dump(payload, handle, **kwargs):
        if len(payload["decisions"]) == 1:  # the first writer is held mid-write until the second decision exists
            first_dumping.set()
            second_decided.wait(60)
        return real_dump(payload, handle, **kwargs)

    monkeypatch.setattr(json, "dump", ordered_dump)  # the json module every writer uses (verdicts.write_json)
    decide = lambda index: selection.decide(CpuGpu(index, f"gpu{index}", (12, 0)), ["emulated"], settings=settings)  # noqa: E731
    first = threading.Thread(target=decide, args=(0,))
    first.start()
    assert first_dumping.wait(60)
    second = threading.Thread(target=decide, args=(1,))
    second.start()
    deadline = time.monotonic() + 60
    while len(selection.decisions()) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    second_decided.set()  # the second decision is made; its writer now queues behind the first
    first.join()
    second.join()
    assert len(json.loads(path.read_text())["decisions"]) == 2


@case("reports", "SM120_FP4_REPORT is a symlink to a directory (/logs -> /mnt/vol/logs), two processes write",
      "the link is kept and is that directory: one sm120_fp4-PID.json per process inside the target")
def test_a_report_link_to_a_directory_is_that_directory(tmp_path, monkeypatch):
    target = tmp_path / "vol" / "logs"
    target.mkdir(parents=True)
    link = tmp_path / "logs"
    link.symlink_to(target)
    monkeypatch.setenv("SM120_FP4_REPORT", str(link))
    settings = Settings(simulate="12.0", selftest="off")
    selection.decide(candidates=["emulated"], settings=settings)
    selection.write_report(link, {"pid": 1}, directory=settings.report_is_dir)  # as another worker's write lands
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [p.name for p in target.iterdir()] == [f"sm120_fp4-{os.getpid()}.json"]


@case("reports", "report directory (or the link to it) removed after start-up, then a decision is written",
      "a warning; no file is created at the directory's name; the decision stands")
@pytest.mark.parametrize("kind", ["directory", "link to a directory"])
def test_a_vanished_report_directory_is_not_replaced_by_a_file(tmp_path, caplog, kind):
    target = tmp_path / "logs"
    target.mkdir()
    path = target
    if kind != "directory":
        path = tmp_path / "link"
        path.symlink_to(target)
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    target.rmdir()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert selection.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert not target.exists() and any("report" in r.getMessage() and "no longer exists" in r.getMessage() for r in caplog.records)


@case("properties", "SM120_FP4_BACKENDS unset (auto) on a GPU of compute capability {cc}",
      "the candidates are the per-capability order of kernels.ORDER_BY_CAPABILITY: {order}")
@pytest.mark.parametrize("cc, order", [("12.0", "cutlass,b12x,humming"), ("12.1", "cutlass,humming (b12x absent: FlashInfer #3170)")])
def test_the_default_candidates_follow_the_capability(cc, order):
    major, minor = map(int, cc.split("."))
    gpu = CpuGpu(0, f"mocked sm_{major}{minor}", (major, minor))
    settings = Settings(fallback="emulated")
    decision = selection.decide(gpu, settings=settings)
    assert decision.candidates == order.split(" ")[0].split(",")


@case("own failures", "decide() refuses (every candidate fails its self-test)",
      "status().refusals lists the refusal with the device, the family and each candidate's reason (decisions stay empty)")
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


@case("backend faults", "SM120_FP4_SELFTEST_TIMEOUT=1 and a kernel that takes 0.4 s per call (every call under the bound, 8 calls)",
      "the bound is on the whole candidate: rejected as hung after about 1 s; the next candidate serves")
def test_the_selftest_timeout_bounds_a_whole_candidate(monkeypatch):
    calls = []

    def slow(*args):
        calls.append(1)
        time.sleep(0.4)
        return faults.healthy(*args)

    backends.register("slow", slow)
    monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
    monkeypatch.setenv("SM120_FP4_SELFTEST_TIMEOUT", "1")
    decision = selection.decide(candidates=["slow", "emulated"])
    assert decision.backend == "emulated" and "did not return within" in decision.rejected["slow"]
    assert len(calls) <= 3, f"{len(calls)} calls of 0.4 s: the bound is on the whole candidate, not per call"


@case("configuration", "SELECT=fastest with two verified kernels: one fast on the self-test's shapes but 1000x slower at a prefill M, one steady",
      "the layer configuration's served calls are timed at its serving batch sizes (decode and the prefill chunk): the steady kernel serves, its time per configuration recorded")
def test_select_fastest_times_the_served_layer_configurations_at_their_serving_batch_sizes(monkeypatch):
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")
    import sm120_fp4
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import hooks, layers

    clock = [0.0]
    monkeypatch.setattr(selection, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

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
        [decision] = selection.decisions()
        assert decision.backend == "steady" and sm120_fp4.status().routes == {-1: "steady"}
        assert "served layer configurations at their serving batch sizes" in decision.reason
        sizes = hooks.recheck_sizes(hooks.max_capture_batch())
        assert 8192 in sizes and decision.timings_ms == pytest.approx({"steady": 10.0 * len(sizes),
                                                                       "prefill-slow": 1000.0 + 1.0 * (len(sizes) - 1)})
    finally:
        sm120_fp4.uninstall()
