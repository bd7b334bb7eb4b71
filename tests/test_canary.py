"""The serving canary (sm120_fp4.canary): in-process, through SGLang's real layers, driven at the
serving loop's idle point (`canary.idle()`, what the scheduler's idle hook calls) with a controlled
clock (when runs are due and what a run costs; where the slice bound is under test, the kernel advances it).

A kernel that goes wrong only after the process has verified and started serving (after a number of
served calls, at one configuration, at large M only, in rows 64-127, ...) must be caught by the next
re-check of the configuration it breaks; `exit` refuses with the reason in the report file, `log`
counts and keeps serving. Healthy kernels pass every run.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from helpers.cases import case
from helpers.common import slow_but_one

import sm120_fp4
from sm120_fp4 import backends, canary, graphs, serving
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.demo import synthetic
from sm120_fp4.errors import ConfigError, RefusedToServe
from sm120_fp4.sglang import layers

pytest.importorskip(
    "sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)"
)
PERIOD = 30.0


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test starts and ends with SGLang unpatched (and so with no canary)."""


class Clock:
    """The canary's clock: time moves when the test says so, and a microsecond at each read (a run costs time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


class Wear:
    """Kernel state a test flips once the process is serving: from then on `fault` applies."""

    def __init__(self, fault, after: int = 0):
        self.fault, self.after, self.armed, self.calls = fault, after, False, 0

    def __call__(self, a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if self.armed:
            self.calls += 1
            if self.calls > self.after:
                self.fault(a, b, out)
        return out


def serve(kernel, *shapes, **settings):
    """install() with the canary on and `kernel` as the dense backend, layers of `shapes` built and
    verified (the process is now serving); the canary armed at its first idle point."""
    backends.register("wear", kernel)
    settings.setdefault("canary_slice_ms", "1000")  # every CPU run fits: the rotation under test, not the slice bound
    sm120_fp4.install(simulate="12.0", backends="wear", canary=str(settings.pop("period", PERIOD)), **settings)
    built = [layers.build_modelopt_layer(synthetic.make_checkpoint(n, k, seed=i)) for i, (n, k) in enumerate(shapes)]
    c = serving.STATE.canary
    c.clock = Clock()
    canary.idle()  # the first idle point arms it
    return c, built


def next_run(c, idle_points: int = 50) -> canary.CanaryRun | None:
    """Move one period on and call the idle point until the run(s) of that period are done."""
    c.clock.now += c.period
    runs = c.runs
    for _ in range(idle_points):
        canary.idle()
        if c.runs > runs and not c._queue:
            break
    return c.status().last_run


def scale(factor):
    return lambda a, b, out: out.mul_(factor)


@case(
    "concurrency",
    "the report's lock held for 10 s (another writer of the report directory) while the canary runs on the serving "
    "thread between served calls",
    "the serving thread's calls are delayed by no more than the canary's own measured run (busy_ms): the report is "
    "written by its own thread, after the holder lets go, and then holds the run",
)
@pytest.mark.slow
def test_the_serving_thread_never_waits_on_the_report_lock(tmp_path):
    import fcntl
    import os
    import threading

    path = tmp_path / "report.json"
    c, [(method, layer)] = serve(emulated_mm_fp4, (96, 160), report=str(path))
    x = torch.randn(8, 160, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    method.apply(layer, x)  # warm
    released = threading.Event()
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the report directory's lock, as another writer holds it: for 10 s at most

    def hold() -> None:
        released.wait(10.0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        c.clock.now += c.period
        began = time.perf_counter()
        method.apply(layer, x)
        canary.idle()  # the run, at the serving loop's idle point
        method.apply(layer, x)
        took = time.perf_counter() - began
        run = c.status().last_run
        assert run is not None and run.passed and c.runs == 1
        served = time.perf_counter()
        method.apply(layer, x)
        one_call = time.perf_counter() - served
        # The delay beyond two served calls is the run's own time; a wait on the report's lock is not in it.
        assert took - 2 * one_call <= run.busy_ms / 1e3 + 0.25, (took, one_call, run.busy_ms)
        assert not path.exists() or json.loads(path.read_text())["processes"][-1].get("canary", {}).get("runs") != 1
    finally:
        released.set()
        holder.join()
    serving.STATE.report.request(c.settings)
    assert serving.STATE.report.flush()
    assert json.loads(path.read_text())["processes"][-1]["canary"]["runs"] == 1


@case(
    "configuration",
    "SM120_FP4_CANARY on with SM120_FP4_SELFTEST=warn and a kernel that fails at load (nothing verified, served unverified)",
    "status().canary.state says the canary has nothing to re-check, and why; the idle points run nothing",
)
def test_the_canary_says_when_it_has_nothing_to_recheck():
    wear = Wear(scale(4.0))
    wear.armed = True  # wrong from the start: the layer is served unverified under warn
    c, _ = serve(wear, (96, 160), selftest="warn")
    state = sm120_fp4.status().canary.state
    assert "nothing to re-check" in state and "SM120_FP4_SELFTEST=warn" in state, state
    assert next_run(c) is None and c.runs == 0


@case(
    "configuration",
    "SGLang's weight-update session begun (WeightUpdater.begin_weight_update) and never ended, the canary on",
    "status().canary says for how long the update is open and that fingerprints are not compared meanwhile; past "
    "canary.models.WEIGHT_UPDATE_LIMIT_S one warning says the session may never have ended; after end_weight_update, compared again",
)
def test_a_weight_update_that_never_ends_is_said_in_status(monkeypatch, caplog):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    c, [(method, layer)] = serve(emulated_mm_fp4, (96, 160))
    updater = WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: layer,
        update_model_fields=lambda **kw: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    assert sm120_fp4.status().canary.weights_update is None
    updater.begin_weight_update()
    shown = sm120_fp4.status().canary
    assert "weight update has been open for" in shown.weights_update and shown.fingerprints.startswith(
        "not compared"
    ), shown
    monkeypatch.setattr(canary.models, "WEIGHT_UPDATE_LIMIT_S", 0.0)  # the limit, reached without waiting minutes
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert next_run(c).passed and next_run(c).passed
    told = [r for r in caplog.records if "never ended" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "never ended" in sm120_fp4.status().canary.weights_update
    try:
        updater.end_weight_update(run_post_load=False)
    except Exception as exc:  # SGLang's own postprocess may need more than this CPU stand-in has
        pytest.skip(f"SGLang's end_weight_update cannot run on this CPU stand-in: {type(exc).__name__}: {exc}")
    assert sm120_fp4.status().canary.weights_update is None


# ---- the Must-show, in-process: wrong after N served calls, caught by the next run -------------


@case(
    "backend faults",
    "a dense kernel right at start-up and after warm-up that returns results {factor}x too large after 20 calls made while serving, SM120_FP4_CANARY on, action exit",
    "the first canary run after the fault raises RefusedToServe 'while serving' out of the idle point, naming the configuration and M; the report file holds the refusal with the numbers; every later idle point raises again",
)
@pytest.mark.parametrize("factor", slow_but_one([1.06, 4.0]))
def test_a_kernel_that_turns_wrong_while_serving_is_refused_at_the_next_run(tmp_path, factor):
    wear = Wear(scale(factor), after=20)
    report = tmp_path / "report.json"
    c, [(method, layer)] = serve(wear, (96, 160), report=str(report))
    assert next_run(c).passed, "healthy while not yet worn"
    wear.armed = True
    for _ in range(21):  # served calls: forward passes of the layer
        method.apply(layer, torch.randn(3, 160).to(torch.bfloat16))
    c.clock.now += PERIOD
    with pytest.raises(
        RefusedToServe,
        match=r"(?s)while serving: wear failed the serving canary's re-check of "
        r"ModelOptFp4LinearMethod N=96 K=160 .*M=2 .*norm is",
    ):
        for _ in range(10):
            canary.idle()
    data = json.loads(report.read_text())
    refusal = data["refusals"][-1]
    assert refusal["config"].endswith("(while serving)") and "while serving" in refusal["message"]
    shape = refusal["reports"][0]["shapes"][0]
    assert shape["m"] == 2 and not shape["passed"] and shape["norm_ratio"] == pytest.approx(factor, rel=0.01)
    mine = data["processes"][-1]["canary"]  # this process's section of the report
    assert mine["failures"] == 1 and mine["state"].startswith("stopped the process")
    assert sm120_fp4.status().refusals[-1].config == refusal["config"]
    with pytest.raises(RefusedToServe, match="while serving"):
        canary.idle()


@case(
    "backend faults",
    "the same kernel turning wrong while serving with SM120_FP4_CANARY_ACTION=log",
    "no exception: every failing run is counted, one warning per configuration, the next runs go on",
)
def test_with_action_log_a_failure_is_logged_once_per_configuration_and_counted(caplog):
    wear = Wear(scale(0.5))
    c, _ = serve(wear, (96, 160), (64, 160), canary_action="log")
    wear.armed = True
    with caplog.at_level(logging.WARNING, logger="sm120_fp4"):
        runs = [next_run(c) for _ in range(4)]
    assert [r.passed for r in runs] == [False] * 4
    assert {r.config.split(" (")[0] for r in runs} == {
        "ModelOptFp4LinearMethod N=96 K=160 bfloat16",
        "ModelOptFp4LinearMethod N=64 K=160 bfloat16",
    }
    status = c.status()
    assert status.failures == 4 and sorted(f.count for f in status.failed) == [2, 2]
    warned = [r.getMessage() for r in caplog.records if "while serving" in r.getMessage()]
    assert len(warned) == 2 and all("SM120_FP4_CANARY_ACTION=log" in w for w in warned), warned
    assert sm120_fp4.status().refusals == [], "log never refuses"


# ---- faults that only a re-check of the right configuration or batch size can see --------------


def zero_rows_64_127(a, b, out):
    out[64:128] = 0


def nan_in_one_row(a, b, out):
    out[out.shape[0] // 2, 0] = float("nan")


def swap_two_rows(a, b, out):
    if out.shape[0] > 3:
        out[[1, 3]] = out[[3, 1]].clone()


def zeros_above_1000_rows(a, b, out):
    if out.shape[0] > 1000:
        out.zero_()


def wrong_at_n_64(a, b, out):
    if b.shape[1] == 64:
        out.mul_(0.9)


LATE_FAULTS = {
    "rows 64-127 zeroed": (zero_rows_64_127, r"M=128 .*rows 64-127"),
    "one NaN in one row": (nan_in_one_row, r"M=1 .*non-finite"),
    "two rows swapped (no zeros, no NaN)": (swap_two_rows, r"M=128 .*relative error"),
    "zeros above M=1000 only": (zeros_above_1000_rows, r"M=1024 .*all zeros"),
    "wrong at one of two configurations (N=64)": (wrong_at_n_64, r"N=64 K=160 .*norm is 0.9"),
}


@case(
    "backend faults",
    "a dense kernel that goes wrong after start-up in one way: {fault}, canary on (two layer configurations)",
    "caught by the first run that reaches the broken configuration and batch size (M > 1000: the 13th here), refused while serving, naming them",
)
@pytest.mark.parametrize(
    "fault",
    slow_but_one(
        [pytest.param(f, marks=pytest.mark.default_prefill) if "M=1000" in f else f for f in LATE_FAULTS],
        keep=list(LATE_FAULTS).index("wrong at one of two configurations (N=64)"),
    ),
)
def test_each_way_of_going_wrong_later_is_caught_by_the_rotation(fault):
    fn, reason = LATE_FAULTS[fault]
    wear = Wear(lambda a, b, out: fn(a, b, out))
    c, _ = serve(wear, (96, 160), (64, 160))
    wear.armed = True
    with pytest.raises(RefusedToServe, match=r"(?s)while serving: .*" + reason):
        for _ in range(13):  # N=96 and N=64 in turn, each at (1, 128), (2, 191), ..., (7, 767), (8, 1024)
            next_run(c)


@case(
    "properties",
    "a healthy kernel with the canary on for 8 periods (two dense layer configurations)",
    "every run passes; the rotation alternates the configurations and walks each one's decode and larger batch sizes",
)
def test_a_healthy_kernel_passes_every_run_and_the_rotation_covers_configurations_and_batch_sizes():
    c, _ = serve(emulated_mm_fp4, (96, 160), (64, 160))
    runs = [next_run(c) for _ in range(8)]
    assert all(r.passed for r in runs)
    n96 = [r.ms for r in runs if "N=96" in r.config]
    n64 = [r.ms for r in runs if "N=64" in r.config]
    assert len(n96) == len(n64) == 4, "one configuration per period, in turn"
    assert n96 == [[1, 128], [2, 191], [3, 256], [4, 383]], "a decode M and a larger M, rotating"
    status = c.status()
    assert status.runs == 8 and status.failures == 0 and status.busy_s > 0 and status.longest_slice_ms > 0
    assert status.recent[-1] == runs[-1] and status.state.startswith("next run in")


def test_captured_graph_sizes_join_the_rotation():
    c, _ = serve(emulated_mm_fp4, (96, 160))
    canary.on_warmup([6, 300])
    ms = [next_run(c).ms for _ in range(6)]
    assert ms == [[1, 128], [2, 191], [3, 256], [4, 300], [5, 383], [6, 512]]


@pytest.mark.slow
def test_each_kernel_family_on_each_device_is_rechecked_every_period():
    from sm120_fp4.sglang import moe_layers

    problem = moe_layers.builder_problem()
    if problem is not None:
        pytest.skip(problem)
    c, _ = serve(emulated_mm_fp4, (96, 160), moe_backends="emulated")
    moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(8, 128, 64, seed=2), top_k=2)
    c.clock.now += PERIOD
    for _ in range(40):
        canary.idle()
        if c.runs >= 2:
            break
    assert {r.family for r in c.status().recent} == {"dense", "moe"}, "one run per family in one period"
    assert all(r.passed for r in c.status().recent)


def serve_moe(name: str, kernel) -> canary.Canary:
    """serve() a dense layer with the emulated kernel and an NVFP4 MoE layer with `kernel` (the MoE
    backend `name`); the canary's first run is due."""
    from sm120_fp4.sglang import moe_layers

    problem = moe_layers.builder_problem()
    if problem is not None:
        pytest.skip(problem)
    backends.register_moe(name, kernel)
    c, _ = serve(emulated_mm_fp4, (96, 160), moe_backends=name)
    moe_layers.build_modelopt_moe_layer(synthetic.make_moe_checkpoint(8, 128, 64, seed=2), top_k=2)
    c.clock.now += PERIOD
    return c


@case(
    "backend faults",
    "an NVFP4 fused-MoE kernel (register_moe) that drops the second routed expert of every token once the process serves, canary on, a dense layer served too",
    "the MoE kernel's next run (every period re-checks each family) refuses while serving, naming the MoE configuration; the dense run passes",
)
@pytest.mark.slow
def test_a_moe_kernel_that_goes_wrong_while_serving_is_caught_by_its_familys_run():
    state = {"worn": False}

    def drops_second_slot(x, ids, weights, *rest):
        if state["worn"]:
            weights = weights.clone()
            weights[:, 1:] = 0
        return backends.emulated_moe(x, ids, weights, *rest)

    c = serve_moe("moe-wear", drops_second_slot)
    state["worn"] = True
    with pytest.raises(
        RefusedToServe,
        match=r"(?s)while serving: moe-wear failed the serving canary's re-check of "
        r"ModelOptNvFp4FusedMoEMethod E=8 .*T=1 random",
    ):
        for _ in range(40):
            canary.idle()
    assert [r.passed for r in c.status().recent if r.family == "dense"] == [True]


@case(
    "backend faults",
    "an MoE kernel that, once serving, returns the right result and then doubles a row of its input activations x in place (the caller's hidden states)",
    "the canary's MoE run still compares the call's activations and routing bit for bit (only the layer's weights go by their fingerprint): refused, naming the changed input",
)
@pytest.mark.slow
def test_an_moe_kernel_that_writes_into_its_activations_fails_the_canary_step():
    state = {"worn": False}

    def scales_x(x, ids, weights, *rest):
        out = backends.emulated_moe(x, ids, weights, *rest)  # the right result ...
        if state["worn"]:
            x[0].mul_(2)  # ... then the caller's hidden state of token 0 doubled: only the inputs' check sees it
        return out

    serve_moe("moe-x", scales_x)
    state["worn"] = True
    with pytest.raises(
        RefusedToServe, match=r"(?s)while serving: moe-x failed .*changed its input\(s\) \[0\] in place"
    ):
        for _ in range(40):
            canary.idle()


# ---- slices: one run per idle point, bounded by the slice; saturation; capture ---------------------


class StepClock(Clock):
    """The canary's clock, advanced by the kernel alone while it runs: a call with M rows costs 1 + M/128 ms."""

    def __call__(self) -> float:
        return self.now

    def kernel(self, a, b, a_sf, b_sf, alpha, dtype, out):
        self.now += (1.0 + a.shape[0] / 128) / 1e3
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


def _timed(slice_ms: str, periods: int) -> tuple[canary.Canary, list[canary.CanaryRun], list[int]]:
    clock = StepClock()
    c, _ = serve(clock.kernel, (96, 160), canary_slice_ms=slice_ms)
    clock.now, c.clock = c.clock.now, clock  # from the armed canary's time on, the kernel's calls cost time
    [served] = serving.served_configurations()
    sizes = sorted(set(served.check.ms) | set(served.check.recheck_ms))
    return c, [next_run(c) for _ in range(periods)], sizes


@case(
    "properties",
    "the serving canary with SM120_FP4_CANARY_SLICE_MS=10 and a kernel whose call at M rows takes 1 + M/128 ms (controlled timer; a run is two passes at a decode size and a larger one), 16 periods",
    "one run per idle point; the larger sizes climb until a run is over the slice (M=383: 10.05 ms), once: from then on M>=383 is not re-checked while serving, every later run fits the slice, status lists the cap and the longest pause",
)
def test_a_run_over_the_slice_caps_the_larger_sizes_and_every_later_run_fits():
    c, runs, sizes = _timed("10", 16)
    assert all(r.passed and len(r.ms) == 2 and r.ms[0] < canary.SMALL_M <= r.ms[1] for r in runs), runs
    over = [i for i, r in enumerate(runs) if r.busy_ms > 10.0]
    assert len(over) == 1 and runs[over[0]].ms[1] == 383, [(r.ms, r.busy_ms) for r in runs]
    assert all(r.ms[1] < 383 and r.busy_ms <= 10.0 for r in runs[over[0] + 1 :]), runs
    assert {r.ms[0] for r in runs} == {m for m in sizes if m < canary.SMALL_M}, "every decode size is reached"
    status = c.status()
    assert status.runs == 16 and status.longest_slice_ms == pytest.approx(runs[over[0]].busy_ms), status
    [beyond] = status.beyond_slice
    assert "N=96 K=160" in beyond and "M>=383 is not re-checked while serving" in beyond, beyond


@case(
    "properties",
    "the same kernel and timer with SM120_FP4_CANARY_SLICE_MS=1: even a configuration's smallest run (a decode size and M=128, over 6 ms) is over the slice; 6 periods",
    "every run still checks a decode size and the smallest larger size (M=128: a canary that checks nothing guarantees nothing); status says its smallest run is over the slice and runs anyway",
)
def test_a_configuration_whose_smallest_run_is_over_the_slice_is_still_checked_and_status_says_so():
    c, runs, _ = _timed("1", 6)
    assert all(r.passed and r.ms[1] == 128 for r in runs), runs
    assert len({r.ms[0] for r in runs}) > 1, "the decode size still rotates"
    [beyond] = c.status().beyond_slice
    assert "that is its smallest run (a decode size and M=128): it runs anyway" in beyond, beyond


@case(
    "properties",
    "the same kernel and timer with SM120_FP4_CANARY_SLICE_MS=1000, 24 periods",
    "the larger size rotates through every verified size up to the largest prefill size; nothing is listed as beyond the slice",
)
def test_a_larger_slice_re_checks_the_prefill_sizes_too():
    c, runs, sizes = _timed("1000", 24)
    assert all(r.passed for r in runs)
    assert {r.ms[1] for r in runs} == {m for m in sizes if m >= canary.SMALL_M}
    assert c.status().beyond_slice == []


@case(
    "configuration",
    "SGLang updates a verified layer's weights (its weight-update path) between two canary runs",
    "the next run checks the layer with its new weights (verified again by the update, fingerprinted again): it passes, no failure is reported",
)
def test_a_weight_update_between_runs_is_checked_with_the_new_weights():
    c, [(_, layer)] = serve(emulated_mm_fp4, (96, 160), canary_action="log")
    assert next_run(c).passed
    serving.weights_update_begin()  # as SGLang's weight updates write: in place
    layer.weight.data.copy_(layer.weight.data.flip(0))  # other valid NVFP4 weights: rows reversed, scales kept
    serving.weights_update_end(c.settings)
    run = next_run(c)
    assert c.runs == 2 and run.passed and c.failures == 0, run


def test_the_first_idle_point_only_arms_and_the_first_run_is_one_period_later():
    c, _ = serve(emulated_mm_fp4, (96, 160))
    for _ in range(5):
        canary.idle()
    assert c.runs == 0 and c.status().state == f"next run in {PERIOD:.1f} s"
    c.clock.now += PERIOD - 1
    canary.idle()
    assert c.runs == 0


@case(
    "concurrency",
    "the serving loop saturated (no idle point) for 2.5 periods while a run is due",
    "status says the run is skipped for want of an idle point; the next idle point runs it, 1.5 periods late, and counts the period it skipped",
)
def test_a_saturated_loop_skips_periods_and_status_says_so():
    c, _ = serve(emulated_mm_fp4, (96, 160))
    c.clock.now += 2.5 * PERIOD  # no idle point meanwhile: the loop is running batches back to back
    assert "no idle point for 75 s (saturated)" in c.status().state
    for _ in range(10):
        canary.idle()
        if c.runs:
            break
    run = c.status().last_run
    assert run.passed and run.late_s == pytest.approx(1.5 * PERIOD)
    assert c.status().skipped_saturated == 1 and c.status().longest_wait_s == pytest.approx(1.5 * PERIOD)


def test_no_step_runs_while_a_cuda_graph_is_being_captured(monkeypatch):
    c, _ = serve(emulated_mm_fp4, (96, 160))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    c.clock.now += PERIOD
    for _ in range(3):
        canary.idle()
    assert c.runs == 0 and c.status().skipped_capturing == 3
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for _ in range(10):
        canary.idle()
    assert c.runs == 1


def test_a_canary_step_never_captures_a_graph_of_the_checks_own():
    """A graph capture costs several eager calls: the start-up checks may capture, a canary run may not."""
    allowed = []

    def kernel(*args):
        allowed.append(graphs.captures_allowed())
        return emulated_mm_fp4(*args)

    c, _ = serve(kernel, (96, 160))
    assert allowed and all(allowed), "the start-up checks may capture"
    del allowed[:]
    assert next_run(c).passed
    assert allowed and not any(allowed), "every call of a canary run runs inside graphs.no_capture()"
    assert graphs.captures_allowed(), "and only inside it"


def test_the_idle_point_runs_inside_the_serving_stream_it_is_given():
    entered = []

    class Stream:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    c, _ = serve(emulated_mm_fp4, (96, 160))
    canary.idle(Stream)
    assert entered == [], "nothing due: the serving stream is not even entered"
    c.clock.now += PERIOD
    canary.idle(Stream)
    assert entered == ["in", "out"] and c.runs == 1


# ---- what the canary re-checks, and where it cannot ---------------------------------------------


def test_with_nothing_verified_the_canary_runs_nothing_and_says_so():
    sm120_fp4.install(simulate="12.0", backends="emulated", canary="5")
    c = serving.STATE.canary
    c.clock = Clock()
    canary.idle()
    c.clock.now += 5
    canary.idle()
    assert c.runs == 0 and sm120_fp4.status().canary.enabled


def test_a_weight_fingerprint_mismatch_from_serving_fails_the_run(monkeypatch):
    """The canary asks serving.fingerprints at every run: a reason fails the run."""
    c, _ = serve(emulated_mm_fp4, (96, 160), canary_action="log")
    monkeypatch.setattr(serving, "fingerprints", lambda served, start, count: ("weight bytes 17-18 differ", 0))
    run = next_run(c)
    assert not run.passed and "weights changed since they were verified: weight bytes 17-18 differ" in run.reason
    assert c.status().fingerprints.startswith("compared")


@case(
    "backend faults",
    "a verified layer's weight bytes flipped in GPU memory while serving (not through SGLang's weight updates)",
    "every canary run compares the layer's fingerprint and fails the run naming the layer: the oracle alone would read the same corrupted weight",
)
def test_a_weight_corrupted_in_memory_while_serving_fails_the_next_run():
    c, [(_, layer)] = serve(emulated_mm_fp4, (96, 160), canary_action="log")
    assert c.status().fingerprints.startswith("compared")
    assert next_run(c).passed
    layer.weight.data[3, 5] ^= 0x11  # two codes of one byte: what a stray write does
    run = next_run(c)
    assert not run.passed and "weights changed after they were verified" in run.reason, run.reason


@case(
    "backend faults",
    "a dense kernel that, once serving, writes into the weight it is given during its call (an out-of-bounds write into its own operand)",
    "the canary's run compares the layer's fingerprint after its calls (no copy of the weights) and fails naming the in-place change",
)
def test_a_kernel_that_writes_into_its_own_weight_fails_the_step_that_called_it():
    def scribble(a, b, out):
        b.T[0, 0] += 1  # b is the (K/2, N) view of the layer's own packed weight

    wear = Wear(scribble)
    c, _ = serve(wear, (96, 160), canary_action="log")
    assert next_run(c).passed
    wear.armed = True
    run = next_run(c)
    assert not run.passed and "changed this layer's own weights in place" in run.reason, run.reason


@case(
    "backend faults",
    "a dense kernel that goes wrong while serving with the weights of one layer only (the third of four layers of one configuration)",
    "the canary's runs walk the configuration's layers, each with its own weights: exactly one run of a walk over the four layers fails",
)
def test_a_kernel_wrong_with_one_layers_weights_only_is_caught_by_the_walk_over_layers():
    state = {"weight": None}

    def wrong_for_one_layer(a, b, out):
        if state["weight"] is not None and b.data_ptr() == state["weight"]:
            out.mul_(0.5)

    wear = Wear(wrong_for_one_layer)
    c, built = serve(wear, *[(96, 160)] * 4, canary_action="log")
    wear.armed = True
    state["weight"] = built[2][1].weight.data_ptr()
    runs = [next_run(c) for _ in range(4)]
    failed = [r for r in runs if not r.passed]
    # One run in four: each used another layer's weights (always the first layer's: none would fail).
    assert len(failed) == 1 and "norm is 0.5x" in failed[0].reason, [(r.layer, r.reason) for r in runs]


@case(
    "backend faults",
    "the weight bytes of a verified layer other than the configuration's first changed in memory while serving (six layers, one configuration)",
    "a run compares the re-checked layer's fingerprint and more layers' in rotation: within two runs one fails, saying the weights changed",
)
def test_a_later_layers_weights_corrupted_in_memory_fail_a_run_within_the_sweep():
    c, built = serve(emulated_mm_fp4, *[(96, 160)] * 6, canary_action="log")
    assert next_run(c).passed
    built[4][1].weight.data[3, 5] ^= 0x11
    runs = [next_run(c) for _ in range(2)]
    failed = [r for r in runs if not r.passed]
    assert failed and "weights changed after they were verified" in failed[0].reason, [r.reason for r in runs]
    assert c.status().fingerprints.startswith("compared at every run")


def test_a_check_that_cannot_run_is_a_failure_never_a_silent_pass(monkeypatch):
    c, _ = serve(emulated_mm_fp4, (96, 160), canary_action="log")

    def broken(served, m):
        raise KeyError("no such serving entry")

    monkeypatch.setattr(serving, "check_served", broken)
    run = next_run(c)
    assert not run.passed and "the canary could not run the check: KeyError" in run.reason


def test_unverified_configurations_are_not_rechecked():
    def wide_zeros(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if b.shape[1] == 64:
            out.zero_()
        return out

    backends.register("wide", wide_zeros)
    sm120_fp4.install(simulate="12.0", backends="wide", selftest="warn", canary="5")
    layers.build_modelopt_layer(synthetic.make_checkpoint(96, 160))
    layers.build_modelopt_layer(synthetic.make_checkpoint(64, 160))  # fails, served UNVERIFIED under warn
    assert [s.check.label.split(" (")[0] for s in serving.served_configurations()] == [
        "ModelOptFp4LinearMethod N=96 K=160 bfloat16"
    ]


# ---- settings and status ----------------------------------------------------------------------


@case(
    "configuration",
    "SM120_FP4_CANARY=60 with SM120_FP4_SELFTEST=off at install()",
    "ConfigError: the canary re-verifies verified configurations and none would be; nothing patched",
)
def test_the_canary_with_selftest_off_is_refused_at_install():
    with pytest.raises(ConfigError, match=r"SM120_FP4_CANARY=60 re-verifies .* SM120_FP4_SELFTEST=off verifies none"):
        sm120_fp4.install(simulate="12.0", backends="emulated", canary="60", selftest="off")
    assert not sm120_fp4.status().installed


@pytest.mark.slow
def test_status_and_the_report_show_the_canary(tmp_path):
    report = tmp_path / "r.json"
    c, _ = serve(emulated_mm_fp4, (96, 160), report=str(report), canary_slice_ms="2.5")
    next_run(c)
    assert serving.STATE.report.flush()  # the report's own thread has written the run
    shown = sm120_fp4.status().canary
    assert (shown.enabled, shown.period_s, shown.action, shown.slice_ms, shown.runs) == (True, PERIOD, "exit", 2.5, 1)
    assert shown.idle_point.endswith("on_idle") or shown.idle_point.endswith("self_check_during_idle")
    section = json.loads(report.read_text())["processes"][-1]["canary"]
    assert section["runs"] == 1 and section["last_run"]["passed"] and section["busy_s"] > 0
    assert json.loads(sm120_fp4.status().model_dump_json())["canary"]["runs"] == 1


def test_off_by_default_and_after_uninstall():
    status = sm120_fp4.install(simulate="12.0", backends="emulated")
    assert not status.canary.enabled and status.canary.state.startswith("off") and serving.STATE.canary is None
    assert "scheduler-idle-canary" not in {p.name for p in status.patches}, "nothing patched for it when off"
    sm120_fp4.uninstall()
    sm120_fp4.install(simulate="12.0", backends="emulated", canary="5")
    assert serving.STATE.canary is not None
    sm120_fp4.uninstall()
    assert serving.STATE.canary is None and "canary" not in serving.STATE.report.sections


@pytest.mark.slow
def test_doctor_shows_the_canary_and_what_each_serving_process_reported(tmp_path, monkeypatch):
    from sm120_fp4 import doctor

    c, _ = serve(emulated_mm_fp4, (96, 160), report=str(tmp_path))
    next_run(c)
    assert serving.STATE.report.flush()  # this process's report file now has a canary section
    for name, value in {
        "SM120_FP4_CANARY": "60",
        "SM120_FP4_REPORT": str(tmp_path),
        "SM120_FP4_SIMULATE": "12.0",
    }.items():
        monkeypatch.setenv(name, value)
    shown = doctor.collect(deep=False)["canary"]
    assert shown["enabled"] and shown["period_s"] == 60 and shown["action"] == "exit" and shown["problem"] is None
    assert shown["idle_point"].startswith("sglang.srt.managers.")
    [process] = shown["processes"]
    assert process["runs"] == 1 and process["failures"] == 0 and process["last_run"]["passed"]
    monkeypatch.setenv("SM120_FP4_SELFTEST", "off")
    report = doctor.collect(deep=False)
    assert any("serving canary: SM120_FP4_CANARY=60 re-verifies" in p for p in report["problems"])
    assert "### Serving canary" in doctor._markdown(report)
