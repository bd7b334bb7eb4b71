"""The backend registry (sm120_fp4.backends) and FlashInfer's argument checks (sm120_fp4.kernels)."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from helpers import faults
from helpers.cases import case
from sm120_fp4 import backends, kernels, nvfp4
from sm120_fp4.devices import Device
from sm120_fp4.errors import InvalidArgument


# ---- the registry -------------------------------------------------------------------------------

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
    assert backends.get("mine").fn is faults.raises and "mine" in backends.names()
    backends.unregister("mine")
    assert "mine" not in backends.names()


def test_a_support_check_that_raises_is_a_reason_not_a_crash():
    def boom(device):
        raise RuntimeError("driver exploded")

    backends.register("fragile", faults.healthy, boom)
    ok, why = backends.is_supported("fragile", Device(0, "GPU", (12, 0)))
    assert not ok and "driver exploded" in why


@case("own failures", "FlashInfer not importable, FlashInfer backend asked about on a (mocked) CUDA 12.0 GPU", "not supported, with the reason 'flashinfer X does not import: ModuleNotFoundError ...'; no exception")
def test_missing_flashinfer_makes_flashinfer_backends_unsupported_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    kernels._mm_fp4.cache_clear()
    try:
        for name in backends.FLASHINFER_BACKENDS:
            ok, reason = backends.is_supported(name, Device(0, "mocked RTX PRO 6000", (12, 0)))
            assert not ok and re.search(r"does not import: (ModuleNotFound|Import)Error", reason), reason
    finally:
        kernels._mm_fp4.cache_clear()


# ---- argument checks before a FlashInfer kernel (metadata only) ---------------------------------

def operands(m=4, n=32, k=64):
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.1
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    return dict(a=qx, b=qw.T, a_descale=sx, b_descale=sw.T, alpha=(1 / (gx * gw)).reshape(1), out_dtype=torch.bfloat16,
                out=torch.empty(m, n, dtype=torch.bfloat16))


BAD_INPUTS = {
    "a is float": (lambda g: {**g, "a": g["a"].float()}, r"mm_fp4: a=.*2-D uint8"),
    "b row-major": (lambda g: {**g, "b": g["b"].contiguous()}, r"mm_fp4: b=.*column-major view"),
    "b wrong K": (lambda g: {**g, "b": g["b"][:16]}, r"mm_fp4: b=.*K/2=32"),
    "K off alignment": (lambda g: operands(k=48), r"K % 32 == 0 .*got K=48"),
    "N off alignment": (lambda g: operands(n=36), r"N % 8 == 0 .*N=36"),
    "scales wrong size": (lambda g: {**g, "a_descale": g["a_descale"][:64]}, r"a_descale=.*128x4 swizzled"),
    "scales wrong dtype": (lambda g: {**g, "b_descale": g["b_descale"].float()}, r"b_descale=.*uint8 or float8_e4m3fn"),
    "alpha missing": (lambda g: {**g, "alpha": None}, r"alpha=None .*requires alpha"),
    "alpha float16": (lambda g: {**g, "alpha": g["alpha"].half()}, r"alpha=.*float32"),
    "out_dtype fp32": (lambda g: {**g, "out_dtype": torch.float32}, r"out_dtype=torch.float32"),
    "out non-contiguous": (lambda g: {**g, "out": torch.empty(32, 4, dtype=torch.bfloat16).T}, r"out=.*contiguous \(4, 32\)"),
    "out wrong shape": (lambda g: {**g, "out": torch.empty(4, 40, dtype=torch.bfloat16)}, r"out=.*\(4, 32\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_mm_fp4_input_is_named_from_metadata_alone(case):
    make, message = BAD_INPUTS[case]
    with pytest.raises(InvalidArgument, match=message):
        kernels.check_mm_fp4_args(**make(operands()))


def test_good_mm_fp4_input_passes_the_check():
    kernels.check_mm_fp4_args(**operands())  # raises on any problem


def test_flashinfer_backends_check_their_input_before_any_kernel():
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed here (the H200 run)")
    with pytest.raises(InvalidArgument, match=r"mm_fp4: b=.*column-major view"):
        backends.resolve("cutlass")(**{**operands(), "b": operands()["b"].contiguous()})
    with pytest.raises(InvalidArgument, match=r"K % 64 == 0 and N % 64 == 0"):
        backends.resolve("cute-dsl")(**operands(n=96, k=128))
