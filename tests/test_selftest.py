"""The self-test (sm120_fp4.verify): the shapes it tries, the metrics it reports, every fault it
must name, the activation-quantizer check and the bound on a hung kernel."""

from __future__ import annotations

import gc
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from helpers import faults
from helpers.cases import case
from helpers.common import HYPOTHESIS
from helpers.procs import background, python, pythonpath
from hypothesis import assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from sm120_fp4 import backends, devices, nvfp4, verify
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.errors import SelfTestError


def cpu12():
    return devices.get_device(-1, (12, 0))


def test_healthy_emulated_backend_passes_with_every_metric_reported():
    report = verify.run("emulated", devices.list_devices((12, 0))[0])
    assert report.passed and report.reason is None
    assert [(s.m, s.n, s.k) for s in report.shapes] == list(verify.DEFAULT_SHAPES)
    ms = [s.m for s in report.shapes]
    assert 1 in ms and any(m % 2 for m in ms if m > 1) and any(128 < m < 256 for m in ms) and max(ms) >= 2000
    for s in report.shapes:
        assert s.n % 32 == 0 and s.k % 32 == 0 and (s.n % 128 or s.k % 128)
        assert s.passed and s.nonfinite == 0 and s.zero_rows == 0
        assert 0 < s.rel_err < 5e-3 and 0.99 < s.norm_ratio < 1.01
    assert json.loads(report.model_dump_json())["backend"] == "emulated"


# (fault, backend, what the reason must say) -- each fault reported on SM12x, run over the DEFAULT shapes
FAULTS = [
    ("raises", faults.raises, r"raised TypeError: Expected DLTensor\* but got None"),
    ("returns zeros", faults.returns_zeros, "output is all zeros"),
    ("writes one NaN", faults.single_nan, r"1 non-finite element\(s\), first at row 0"),
    (
        "zeroes rows 64-127 (partial rows)",
        faults.zeroes_row_band,
        r"M=129 .*64 row\(s\) all zero where the reference is not \(rows 64-127\)",
    ),
    ("is off by 4x (wrong scale)", faults.scale_error_4x, r"M=1 .*norm is 4x the reference's.*scale error"),
    ("is wrong only at large M", faults.wrong_for_large_m, r"M=2500 .*norm is 0.04x"),
    ("leaves out unwritten", faults.leaves_out_unwritten, "output left unwritten"),
    ("returns another tensor", faults.returns_new_tensor, "other than `out`"),
    (
        "garbles a few rows (not zeros)",
        faults.garbage_rows,
        r"M=7 N=224 K=160: call 1: relative error 0.[0-9]+ above 0.01",
    ),
    (
        "returns its previous result on the second call in a row of one shape (a stale workspace)",
        faults.make_stale_workspace(),
        r"M=1 N=\d+ K=\d+: call 2: .*the same shape called again right after its first call",
    ),
    (
        "adds its previous partial sums on the second call in a row of one shape",
        faults.make_stale_workspace(mode="accumulates"),
        r"M=1 N=\d+ K=\d+: call 2: .*the same shape called again right after its first call",
    ),
]


@case(
    "backend faults",
    "self-test (default shapes) of a backend that {fault}",
    "self-test fails and its reason names the fault",
)
@pytest.mark.parametrize("fault, fn, reason", FAULTS, ids=[f[0] for f in FAULTS])
def test_the_selftest_names_each_fault(fault, fn, reason):
    backends.register("faulty", fn)
    report = verify.run("faulty", cpu12())
    assert not report.passed and re.search(reason, report.reason), report.reason
    assert json.loads(report.model_dump_json())["reason"] == report.reason


def test_selftest_refuses_bad_shapes():
    with pytest.raises(SelfTestError, match="K % 32"):
        verify.run("emulated", cpu12(), shapes=[(4, 32, 48)])


def test_quantizer_check_detects_a_wrong_activation_quantizer():
    def off_by_scale(x, g):
        return nvfp4.quantize(x, g * 2)

    good = verify.run("emulated", cpu12(), shapes=[(1, 32, 64)], quantizer=("nvfp4", nvfp4.quantize))
    bad = verify.run("emulated", cpu12(), shapes=[(1, 32, 64)], quantizer=("x2", off_by_scale))
    assert good.passed and good.quantizer.passed and good.quantizer.code_mismatch == 0
    assert not bad.passed and not bad.quantizer.passed and "activation quantizer x2" in bad.reason


_HANGS = """
import threading, time
from sm120_fp4 import backends, devices, verify
from helpers import faults

def hangs(*args):
    threading.Event().wait(120)  # a kernel that never returns (the parent's timeout ends it first)
    return faults.healthy(*args)

def slow(*args):
    time.sleep(0.3)
    return faults.healthy(*args)

backends.register("hangs", hangs)
backends.register("slow", slow)
device = devices.get_device(-1, (12, 0))
report = verify.run("slow", device, shapes=[(1, 32, 64)] * 4, bounds=verify.Bounds(timeout_s=0.5))
print("slow:", report.passed, report.reason, [s.calls for s in report.shapes], flush=True)
verify.hang_hooks.append(lambda message: print("hook:", message, flush=True))
start = time.perf_counter()
verify.run("hangs", device, shapes=[(1, 32, 64), (7, 32, 64)], bounds=verify.Bounds(timeout_s=0.2))
print("returned after", time.perf_counter() - start, flush=True)
"""


@case(
    "backend faults",
    "a kernel that returns after the self-test's bound, and one that never returns (the call runs on the thread that will serve)",
    "the slow one is rejected when its call returns late; the hung one holds the serving thread, so past the bound and its grace the watchdog writes what it knows and ends the process with EXIT_HUNG, naming the call and the backend",
)
@background(
    lambda folder: python(_HANGS, folder, PYTHONPATH=pythonpath(Path(__file__).parent, Path(__file__).parents[1]))
)
def test_a_hung_call_ends_the_process_after_its_bound_and_a_late_one_is_rejected(background, background_job):
    returncode, stdout, stderr = background
    assert background_job.ended_at - background_job.started_at < 60, (
        "the bound plus its grace, not the kernel's two minutes"
    )
    assert returncode == verify.EXIT_HUNG, (returncode, stdout, stderr)
    lines = stdout.splitlines()
    assert re.fullmatch(
        r"slow: False M=1 N=32 K=64: call 2 did not return within the self-test's time bound .*\[2\]", lines[0]
    ), lines
    # 0.3 s a call, 0.5 s for all: the second call (the first shape's repeat) returns late, and no call follows it
    assert lines[1].startswith("hook: sm120_fp4: refusing to serve: call 1 (M=1 N=32 K=64) of backend 'hangs'"), lines
    assert not any(line.startswith("returned") for line in lines)
    assert "is still running past the self-test's time bound" in stderr and "exiting with code 4" in stderr


# ---- properties of the metrics -------------------------------------------------------------------


def _scaled_by(factor):
    def scaled(a, b, a_sf, b_sf, alpha, dtype, out):
        return emulated_mm_fp4(a, b, a_sf, b_sf, alpha * factor, dtype, out)

    return scaled


SMALL_SHAPES = [(1, 32, 64), (7, 96, 160), (129, 16, 32), (33, 40, 96)]


@case(
    "properties",
    "self-test of a backend off by a factor c in 0.5..2 over shapes",
    "norm_ratio == c and rel_err == |c-1| (to bf16 rounding); passes only when |c-1| <= 1%",
)
@hsettings(max_examples=25, **HYPOTHESIS)
@given(factor=st.floats(0.5, 2.0), shape=st.sampled_from(SMALL_SHAPES))
def test_selftest_metrics_measure_a_scale_error(factor, shape):
    assume(not 0.005 < abs(factor - 1) < 0.02)  # away from the acceptance bound, where bf16 rounding decides
    backends.register("scaled", _scaled_by(factor), replace=True)
    result = verify.run("scaled", cpu12(), shapes=[shape]).shapes[0]
    assert result.norm_ratio == pytest.approx(factor, rel=1e-2)
    assert result.rel_err == pytest.approx(abs(factor - 1), abs=5e-3)
    assert result.nonfinite == 0 and result.zero_rows == 0
    assert result.passed == (abs(factor - 1) <= 0.005)


@case(
    "properties",
    "self-test of a backend that zeroes a chosen set of rows, or puts NaN at a chosen element",
    "zero_rows counts exactly those rows; the NaN's position is reported",
)
@hsettings(max_examples=25, **HYPOTHESIS)
@given(data=st.data(), shape=st.sampled_from(SMALL_SHAPES))
def test_selftest_metrics_locate_zero_rows_and_nans(data, shape):
    m, n, _ = shape
    rows = sorted(data.draw(st.sets(st.integers(0, m - 1), min_size=1, max_size=m)))
    nan_at = (data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, n - 1)))

    def zeroes(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        out[rows] = 0
        return out

    def nan(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        out[nan_at] = float("nan")
        return out

    backends.register("zero-rows", zeroes, replace=True)
    backends.register("nan-at", nan, replace=True)
    zeroed = verify.run("zero-rows", cpu12(), shapes=[shape]).shapes[0]
    assert not zeroed.passed
    if len(rows) == m:
        assert zeroed.reason == "call 1: output is all zeros" and zeroed.zero_rows == m
    else:
        assert zeroed.zero_rows == len(rows) and zeroed.reason.startswith(f"call 1: {len(rows)} row(s) all zero"), (
            zeroed.reason
        )
    nanned = verify.run("nan-at", cpu12(), shapes=[shape]).shapes[0]
    assert nanned.nonfinite == 1 and f"first at row {nan_at[0]}, column {nan_at[1]}" in nanned.reason


def _divides_by_column_amax(a, b, a_sf, b_sf, alpha, dtype, out):
    """A kernel that rescales by each output column's weight amax (0/0 on a zeroed column)."""
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    amax = nvfp4.unpack_nibbles(b.T.contiguous()).amax(dim=1).float()
    out.mul_(amax / amax)
    return out


@case(
    "backend faults",
    "a kernel that divides by each output column's weight amax (NaN where a weight row is all zero: a zeroed output column)",
    "the generic self-test's weights have zeroed and subnormal-scaled rows, its activations every row kind: refused (non-finite)",
)
def test_the_selftest_data_has_zeroed_columns_subnormal_scales_and_structured_rows():
    x, _, (qx, qw, sx, sw, _) = verify.quantized_inputs((64, 96, 256), torch.device("cpu"), 0)
    act = nvfp4.unswizzle_scales(sx.view(torch.float8_e4m3fn), 64, 256).float()
    weight = nvfp4.unswizzle_scales(sw.T.contiguous(), 96, 256).float()
    for scales in (act, weight):
        assert bool(((scales > 0) & (scales < 2**-6)).any()), "E4M3 subnormal block scales"
    assert bool((weight == 0).all(dim=1).any()), "a zeroed weight row: a zero output column"
    assert bool((x >= 0).all(dim=1).any()) and bool(((x == 0).float().mean(dim=1) > 0.8).any()), (
        "one-signed and sparse rows"
    )
    ratio = x.abs().amax(dim=1) / x.abs().median(dim=1).values.clamp_min(1e-30)
    assert bool((ratio > 1e3).any()), "rows with outliers 1e3-1e4 times the rest"
    assert not bool((x == 0).all(dim=1).any()), "never an all-zero row"
    backends.register("column-amax", _divides_by_column_amax)
    report = verify.run("column-amax", cpu12())
    assert not report.passed and "non-finite" in report.reason


@case(
    "properties",
    "the fingerprint of a layer's weights after one byte changed, two words swapped, a value negated, or a tensor resized",
    "differs from the one taken before; equal for unchanged tensors (no host synchronisation on CUDA)",
)
@pytest.mark.parametrize("change", ["one byte", "two words swapped", "negated", "resized"])
def test_a_weight_fingerprint_sees_each_kind_of_change(device, change):
    gen = torch.Generator().manual_seed(7)
    weight = torch.randint(0, 256, (96, 200), dtype=torch.uint8, generator=gen).to(
        device
    )  # 4800 words: a row of 4096 and a tail
    scales = torch.randn(96, 16, generator=gen).to(torch.float8_e4m3fn).to(device)
    alpha = torch.tensor([0.25], device=device)
    before = verify.fingerprint((weight, scales, alpha))
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        again = verify.fingerprint((weight, scales, alpha))
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(before, again)
    if change == "one byte":
        weight[50, 3] ^= 1
    elif change == "two words swapped":
        words = weight.view(-1)[:16].view(torch.int32)
        words[[1, 2]] = words[[2, 1]].clone()
    elif change == "negated":
        alpha.neg_()
    else:
        alpha = torch.tensor([0.25, 0.0], device=device)
    after = verify.fingerprint((weight, scales, alpha))
    assert after.shape != before.shape or not torch.equal(before, after)


@pytest.mark.parametrize("where", ["first word", "last word", "a scale in the tail"])
def test_a_call_that_writes_into_a_large_input_is_caught_without_a_copy_of_it(where):
    # A layer's weights above COPY_LIMIT are watched by their fingerprint (no copy of gigabytes of
    # experts): a call that changes one word of them still fails, naming the input, at that call.
    big = torch.randint(0, 256, (verify.COPY_LIMIT // 1000 + 8, 1000), dtype=torch.uint8)
    small = torch.ones(3)
    x = torch.randn(4, 8)
    reference = (x * 2).float()
    calls = {"n": 0}

    def invoke():
        calls["n"] += 1
        if calls["n"] == 3:  # the second pass's first call
            if where == "first word":
                big.view(-1)[0] ^= 1
            elif where == "last word":
                big.view(-1)[-1] ^= 0x80
            else:
                small[2] = 1.5
        return x * 2

    cases = [
        verify.Case(4, 8, 16, invoke, reference, inputs=(x, big, small)),
        verify.Case(4, 8, 16, invoke, reference, inputs=(x, big, small)),
    ]
    run = verify.Sweep(cases, verify.Bounds(), torch.device("cpu"))
    kept = list(
        run._snapshots.values()
    )  # what the sweep holds between passes: x's and small's copies, big's fingerprint
    assert not any(isinstance(k, torch.Tensor) and k.numel() * k.element_size() > verify.COPY_LIMIT for k in kept)
    results = run.run(2)
    index = 2 if where == "a scale in the tail" else 1
    assert [r.passed for r in results] == [False, True]
    assert f"call 2 changed its input(s) [{index}] in place" in results[0].reason


@case(
    "properties",
    "the cases of a dense layer check and of a MoE check (each with its twin), dropped with the garbage collector off",
    "their oracle results are freed at once: no case holds itself through its twin (a cycle would keep a prefill "
    "M's reference, gigabytes on a GPU, until the collector runs)",
)
def test_checked_cases_hold_no_cycle_that_keeps_their_oracle_result():
    x, ref = torch.randn(9, 64), torch.randn(9, 32)
    dense = verify.served_cases([1, 4, 8], 32, 64, lambda a: a, x, ref, ())
    weights = verify.moe._moe_weights(4, 64, 32, "swiglu", torch.device("cpu"), 1)
    ids, tw = verify.moe_routing(6, 2, 4, "random", torch.Generator().manual_seed(0))
    plan = ("T=6", torch.randn(6, 64).to(torch.bfloat16), ids, tw)
    moe = verify.moe_cases(backends.emulated_moe, weights, "swiglu", [plan])
    assert all(c.twin is not None for c in dense + moe)
    twins = [c.twin(c) for c in dense + moe]  # made from their cases, as the sweep makes them
    assert [t.m for t in twins] == [c.m for c in dense + moe]
    kept = [weakref.ref(ref), weakref.ref(moe[0].reference)]
    gc.disable()
    try:
        del ref, dense, moe, twins
        assert [w() is None for w in kept] == [True, True]
    finally:
        gc.enable()
