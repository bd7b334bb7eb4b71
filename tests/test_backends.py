"""The backend registry (sm120_fp4.backends) and FlashInfer's argument checks (sm120_fp4.backends.flashinfer)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch
from helpers import faults
from helpers.cases import case
from helpers.common import mm_fp4_operands
from helpers.procs import background

from sm120_fp4 import backends
from sm120_fp4.backends import flashinfer
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


@case(
    "own failures",
    "FlashInfer not importable, FlashInfer backend asked about on a (mocked) CUDA 12.0 GPU",
    "not supported, with the reason 'flashinfer X does not import: ModuleNotFoundError ...'; no exception",
)
def test_missing_flashinfer_makes_flashinfer_backends_unsupported_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    flashinfer._mm_fp4.cache_clear()
    able = flashinfer.Toolchain((13, 0), "nvcc", (2, 39), None)  # b12x's own requirements met: the import is the reason
    monkeypatch.setattr(flashinfer, "toolchain", lambda: able)
    try:
        for name in backends.FLASHINFER_BACKENDS:
            ok, reason = backends.is_supported(name, Device(0, "mocked RTX PRO 6000", (12, 0)))
            # installed but unimportable (this environment), or not installed at all (the H200 image)
            assert not ok and re.search(
                r"does not import: (ModuleNotFound|Import)Error|flashinfer-python is not installed", reason
            ), reason
    finally:
        flashinfer._mm_fp4.cache_clear()


# ---- argument checks before a FlashInfer kernel (metadata only) ---------------------------------


def operands(m=4, n=32, k=64):
    a, b, a_descale, b_descale, alpha = mm_fp4_operands(m, n, k)
    return dict(
        a=a,
        b=b,
        a_descale=a_descale,
        b_descale=b_descale,
        alpha=alpha,
        out_dtype=torch.bfloat16,
        out=torch.empty(m, n, dtype=torch.bfloat16),
    )


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
    "out non-contiguous": (
        lambda g: {**g, "out": torch.empty(32, 4, dtype=torch.bfloat16).T},
        r"out=.*contiguous \(4, 32\)",
    ),
    "out wrong shape": (lambda g: {**g, "out": torch.empty(4, 40, dtype=torch.bfloat16)}, r"out=.*\(4, 32\)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_mm_fp4_input_is_named_from_metadata_alone(case):
    make, message = BAD_INPUTS[case]
    with pytest.raises(InvalidArgument, match=message):
        flashinfer.check_mm_fp4_args(**make(operands()))


def test_good_mm_fp4_input_passes_the_check():
    flashinfer.check_mm_fp4_args(**operands())  # raises on any problem


def test_flashinfer_backends_check_their_input_before_any_kernel():
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed here (the H200 run)")
    with pytest.raises(InvalidArgument, match=r"mm_fp4: b=.*column-major view"):
        backends.resolve("cutlass")(**{**operands(), "b": operands()["b"].contiguous()})
    with pytest.raises(InvalidArgument, match=r"K % 64 == 0 and N % 64 == 0"):
        backends.resolve("cute-dsl")(**operands(n=96, k=128))


@case(
    "own failures",
    "mm_fp4 arguments with {what}",
    "InvalidArgument naming {param}, from metadata alone, before any kernel",
)
@pytest.mark.parametrize(
    "what, param",
    [
        ("a non-contiguous a", "a"),
        ("a non-contiguous a_descale", "a_descale"),
        ("b_descale contiguous itself instead of the .T view of a contiguous tensor", "b_descale"),
    ],
)
def test_contiguity_and_scale_layout_are_checked(what, param):
    g = operands()
    if param == "a":
        g["a"] = torch.cat([g["a"], g["a"]], 1)[:, ::2]
    elif param == "a_descale":
        g["a_descale"] = torch.cat([g["a_descale"], g["a_descale"]], 1)[:, ::2]
    else:
        g["b_descale"] = g["b_descale"].contiguous()
    assert g[param].numel() == operands()[param].numel()
    with pytest.raises(InvalidArgument, match=rf"mm_fp4: {param}="):
        flashinfer.check_mm_fp4_args(**g)


# ---- entry-point backends (groups sm120_fp4.backends / sm120_fp4.moe_backends) ------------------


@pytest.fixture
def plugins_on_path(tmp_path, monkeypatch):
    from helpers.plugins import plugin_site

    monkeypatch.syspath_prepend(str(plugin_site(tmp_path / "plugins")))
    import importlib

    importlib.invalidate_caches()
    for registry in (backends.registry._dense, backends.registry._moe):
        monkeypatch.setattr(registry, "_looked_up", set())


@case("own failures", "a backend name nobody registered, installed as an entry point ({which})", "{outcome}")
@pytest.mark.parametrize(
    "which, outcome",
    [
        ("a GEMM function", "found and registered on first use, in any process"),
        (
            "a function with an is_supported attribute",
            "its support check is used: not supported on sm_120, with its reason",
        ),
        ("an entry point whose module does not import", "ConfigError naming the entry point, its group and the error"),
        ("a MoE backend in sm120_fp4.moe_backends", "found for the MoE family only"),
    ],
)
def test_entry_point_backends_are_loaded_when_asked_for(plugins_on_path, which, outcome):
    from sm120_fp4 import deciding
    from sm120_fp4.config import Settings
    from sm120_fp4.errors import ConfigError

    if which.startswith("a GEMM"):
        assert "zeros" not in backends.names()
        assert deciding.candidate_names(Settings(backends="zeros,emulated")) == ["zeros", "emulated"]
        assert backends.get("zeros").kind == "registered"
    elif "is_supported" in which:
        assert backends.is_supported("good121", Device(0, "mocked", (12, 0))) == (False, "only on sm_121")
        assert backends.is_supported("good121", Device(0, "mocked", (12, 1)))[0]
    elif "does not import" in which:
        with pytest.raises(
            ConfigError,
            match=r"entry point 'missing' .* of group sm120_fp4.backends failed to load: ModuleNotFoundError",
        ):
            deciding.candidate_names(Settings(backends="missing"))
    else:
        assert deciding.candidate_names(Settings(moe_backends="moe-crash"), family=deciding.MOE) == ["moe-crash"]
        with pytest.raises(ConfigError, match="unknown backend"):
            deciding.candidate_names(Settings(backends="moe-crash"))


ENTRY_POINT_WORKER = """
import json
import sglang.srt.layers.quantization.modelopt_quant as mq  # the .pth bootstrap installs here
import sm120_fp4
from sm120_fp4.demo import synthetic
from sm120_fp4.sglang import layers
layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
d = sm120_fp4.status().decisions[0]
alias = mq.flashinfer_fp4_gemm
print(json.dumps([getattr(alias, '__sm120_fp4_patch__', None), d.backend, d.rejected]))
"""


def _entry_point_worker(folder):
    from helpers.plugins import plugin_site
    from helpers.procs import REPO, python

    return python(
        ENTRY_POINT_WORKER,
        folder,
        cwd=folder,
        PYTHONPATH=f"{plugin_site(folder / 'plugins')}:{REPO}",
        SM120_FP4="1",
        SM120_FP4_SIMULATE="12.0",
        SM120_FP4_BACKENDS="zeros,good",
    )


@case(
    "own failures",
    "a new worker process (SM120_FP4=1, `.pth` bootstrap, real SGLang import) asked for backends that exist only as entry points (BACKENDS=zeros,good)",
    "the worker finds both without anyone calling register(): zeros is rejected by its self-test, good serves the layer",
)
@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="the worker imports the real SGLang (not installed here)"
)
@background(_entry_point_worker)
def test_entry_point_backends_reach_spawned_workers(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    patch, backend, rejected = json.loads(stdout.strip().splitlines()[-1])
    assert patch == "flashinfer-fp4-gemm-alias" and backend == "good"
    assert "all zeros" in rejected["zeros"] and "unknown" not in stderr


@case(
    "own failures",
    "FlashInfer's activation quantizer does not import (ImportError) where it would be checked (sm_120, a FlashInfer backend), asked four times",
    "no quantizer (the self-test runs without it) and one warning naming the error: never skipped silently, never repeated",
)
def test_a_quantizer_that_does_not_import_is_said_once(monkeypatch, caplog):
    import logging
    import types

    from sm120_fp4 import errors

    monkeypatch.setattr(errors, "_said", set())  # "once per process": this test's process starts now
    monkeypatch.setitem(
        sys.modules, "flashinfer", types.ModuleType("flashinfer")
    )  # an install whose fp4_quantize does not import
    monkeypatch.setattr(
        flashinfer, "version", lambda: "0.7.2"
    )  # installed, as its metadata says (also where it is not: the H200 run)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    gpus = [Device(0, "NVIDIA RTX PRO 6000", (12, 0)), Device(1, "NVIDIA RTX PRO 6000", (12, 0))]
    assert [backends.quantizer_for("cutlass", gpu) for gpu in gpus + gpus] == [None] * 4
    said = [r.getMessage() for r in caplog.records if "fp4_quantize" in r.getMessage()]
    assert len(said) == 1 and "ImportError" in said[0] and "not checked" in said[0], said
