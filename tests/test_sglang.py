"""Against the real SGLang (the pinned release in the test environment): patch, serve, refuse, undo.

No fake SGLang: the layer is SGLang's ModelOptFp4LinearMethod, the patched names are its modules'.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading

import pytest
import torch
from helpers import children, faults
from helpers.cases import case
from helpers.common import (
    SIM,
    SIM_ENV,
    alias_name,
    alias_spec_name,
    assert_not_patched,
    assert_patched_once,
    mm_fp4_operands,
    patch_state,
    run_concurrently,
    sglang_alias,
    slow_but_one,
)
from helpers.procs import REPO, Spawned, background, clean_env, python, with_repo_pth

import sm120_fp4
from sm120_fp4 import backends, engines
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.demo import synthetic
from sm120_fp4.errors import ConfigError, RefusedToServe
from sm120_fp4.sglang import layers, release
from sm120_fp4.sglang import targets as sglang_targets

mq = pytest.importorskip(
    "sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)"
)
import flashinfer  # noqa: E402  (installed with SGLang's pin)

try:  # the runner enum: 0.5.8+ (scripts/sglang_matrix.py runs this file on every era)
    from sglang.srt.layers.quantization import fp4_utils
except ImportError:
    fp4_utils = None
ENUM = getattr(fp4_utils, "Fp4GemmRunnerBackend", None)
REPINNED = ("AUTO", "FLASHINFER_CUDNN")  # targets.pin_runner_backend: only these become FLASHINFER_CUTLASS
needs_enum = pytest.mark.skipif(
    ENUM is None, reason=f"SGLang {release.sglang_version()} has no Fp4GemmRunnerBackend (0.5.8+)"
)


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched (see conftest.sglang_unpatched)."""


# ---- the real linear path in simulation ---------------------------------------------------


@pytest.mark.parametrize("n, k, m", [(96, 160, 7), (40, 64, 1), (256, 512, 130)])
def test_modelopt_layer_runs_through_the_patch_and_matches_the_reference(caplog, n, k, m):
    caplog.set_level(logging.INFO, "sm120_fp4")
    status = sm120_fp4.install(**SIM)
    assert status.installed and patch_state(alias_spec_name()) == "applied"
    ckpt = synthetic.make_checkpoint(n, k, seed=n)
    method, layer = layers.build_modelopt_layer(ckpt)
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    out = method.apply(layer, x)
    want = synthetic.reference_output(ckpt, x)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.equal(out, want)
    rel = ((out.float() - x.float() @ ckpt.dense.float().T).norm() / want.float().norm()).item()
    assert rel < 0.3, "quantized output tracks the dense bf16 layer"
    decided = [r.getMessage() for r in caplog.records if "using emulated" in r.getMessage()]
    assert len(decided) == 1 and "sm_120, simulated" in decided[0]
    assert sm120_fp4.status().routes == {-1: "emulated"}


def test_a_misbehaving_backend_stops_process_weights_after_loading():
    backends.register("band", faults.zeroes_row_band)
    sm120_fp4.install(simulate="12.0", backends="band")
    with pytest.raises(RefusedToServe, match=r"band: self-test failed: M=129 .*rows 64-127"):
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))


def test_compressed_tensors_w4a4_weights_hook_decides_first():
    ct = pytest.importorskip(
        release.CT,
        reason=f"SGLang {release.sglang_version()} has no compressed-tensors W4A4 NVFP4 linear scheme (0.5.7+)",
    )
    backends.register("nan", faults.single_nan)
    sm120_fp4.install(simulate="12.0", backends="nan")
    assert patch_state("compressed-tensors-w4a4-weights-hook") == "applied"
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(RefusedToServe, match="nan: self-test failed"):
        ct.CompressedTensorsW4A4Fp4.process_weights_after_loading(object.__new__(ct.CompressedTensorsW4A4Fp4), layer)


@pytest.mark.parametrize("mode", ["strict", "warn"])
def test_an_nvfp4_moe_layer_on_a_release_without_the_moe_seam_is_refused_before_sglang_processes_it(
    monkeypatch, caplog, mode
):
    """Before 0.5.15 (no fused-MoE seam) the experts cannot be routed or verified: strict refuses
    before SGLang touches the weights; warn serves them with one warning. On a newer release the
    installed version is made to read as 0.5.14 (the check is the version range, not the module)."""
    from sm120_fp4.sglang import moe, wiring
    from sm120_fp4.versions import version_in

    installed = release.sglang_version()
    if version_in(installed, moe.SEAM_VERSIONS):
        monkeypatch.setattr(wiring, "sglang_version", lambda: "0.5.14")
        monkeypatch.setattr(moe, "sglang_version", lambda: "0.5.14")
    sm120_fp4.install(simulate="12.0", backends="emulated", moe_backends="emulated", selftest=mode)
    assert patch_state("modelopt-nvfp4-moe-weights-hook") == "applied"
    hook = mq.ModelOptNvFp4FusedMoEMethod.__dict__["process_weights_after_loading"]
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 8, 8, dtype=torch.uint8), requires_grad=False)
    method = object.__new__(mq.ModelOptNvFp4FusedMoEMethod)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    if mode == "strict":
        with pytest.raises(RefusedToServe, match=r"NVFP4 MoE layer .*cannot route or verify") as err:
            hook(method, layer)  # a dummy layer: SGLang's own processing would fail differently
        assert "0.5.14" in str(err.value) or installed in str(err.value)
    else:
        try:
            hook(method, layer)
        except RefusedToServe:
            raise
        except Exception:
            pass
        assert any("UNVERIFIED" in r.getMessage() for r in caplog.records)


# ---- the runner enum ----------------------------------------------------------------------


@needs_enum
@pytest.mark.parametrize("start", [*REPINNED, None])
def test_enum_is_pinned_to_cutlass_from_auto_or_cudnn_and_restored(start):
    if start is not None and start not in ENUM.__members__:
        pytest.skip(f"SGLang {release.sglang_version()}'s enum has no {start}")
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = None if start is None else ENUM[start]
    before = fp4_utils.FP4_GEMM_RUNNER_BACKEND
    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is ENUM.FLASHINFER_CUTLASS
    assert patch_state("fp4-runner-backend-pin") == "applied"
    sm120_fp4.uninstall()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is before


@needs_enum
@case(
    "backend faults",
    "SGLang's runner enum with a member this library does not know ({member}, as a later SGLang adds "
    "it), chosen for the dense FP4 GEMM on a 12.x GPU",
    "refused at the first NVFP4 layer's weights, before SGLang processes them: the message names the member and the "
    "flag to use instead (--fp4-gemm-backend flashinfer_cutlass); the enum is left as SGLang set it",
)
@pytest.mark.parametrize(
    "member, value", [("FLASHINFER_B12X", "flashinfer_b12x"), ("FLASHINFER_NEXT", "flashinfer_next")]
)
def test_an_unknown_runner_enum_member_is_refused_by_name(monkeypatch, member, value):
    from helpers.common import extend_enum

    new = extend_enum(monkeypatch, ENUM, member, value)
    assert ENUM(value) is new and new.get_flashinfer_backend() == value.removeprefix("flashinfer_")
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", new)
    sm120_fp4.install(**SIM)
    with pytest.raises(RefusedToServe, match=rf"(?s){member}.*does not know.*--fp4-gemm-backend flashinfer_cutlass"):
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is new, "never pinned to another layout behind the operator's back"


@case(
    "backend faults",
    "an FP4 GEMM call with backend={backend!r} (a FlashInfer backend this library does not route) on a "
    "verified 12.x device",
    "refused by name with the flag to use instead; never the unverified original",
)
@pytest.mark.parametrize("backend", ["b12x", "cutlass_v2"])
def test_a_call_naming_an_unknown_backend_is_refused_not_served_unverified(backend):
    import sglang.srt.layers.quantization.modelopt_quant as mq

    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))  # the device is decided and verified
    alias = getattr(mq, alias_name())
    a, b, a_sf, b_sf, alpha = mm_fp4_operands(8)
    with pytest.raises(
        RefusedToServe, match=rf"backend={backend!r} on device -1.*--fp4-gemm-backend flashinfer_cutlass"
    ):
        alias(a, b, a_sf, b_sf, alpha, torch.bfloat16, backend=backend)
    for passed in ("auto", "cudnn", "cutlass"):  # the names it routes still serve
        assert alias(a, b, a_sf, b_sf, alpha, torch.bfloat16, backend=passed).shape == (8, 32)


@case(
    "backend faults",
    "a routed FP4 GEMM call with {kwargs} (an argument the verified backend was not verified for) on a "
    "verified 12.x device",
    "refused by name, naming the argument and its value; never the unverified original",
)
@pytest.mark.parametrize(
    "kwargs",
    slow_but_one(
        [
            {"block_size": 32},
            {"use_8x4_sf_layout": True},
            {"batch_invariant": True},
            {"use_nvfp4": False},
            {"enable_pdl": True, "tactic": 3},
        ]
    ),
)
def test_a_routed_call_with_an_argument_not_verified_is_refused_by_name(kwargs):
    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))  # the device is decided and verified
    alias = getattr(mq, alias_name())
    a, b, a_sf, b_sf, alpha = mm_fp4_operands(8)
    name, value = next((k, v) for k, v in kwargs.items() if k != "enable_pdl")
    with pytest.raises(
        RefusedToServe, match=rf"mm_fp4 with {name}={value!r} on device -1: .*verified.*SM120_FP4_SELFTEST=warn"
    ):
        alias(a, b, a_sf, b_sf, alpha, torch.bfloat16, backend="cutlass", **kwargs)
    want = emulated_mm_fp4(a, b, a_sf, b_sf, alpha, torch.bfloat16, torch.empty(8, 32, dtype=torch.bfloat16))
    served = alias(a, b, a_sf, b_sf, alpha, torch.bfloat16, backend="cutlass", enable_pdl=True, batch_invariant=False)
    assert torch.equal(served, want), "keywords that leave the numbers as verified are routed"


@needs_enum
@pytest.mark.skipif(
    not hasattr(mq.ModelOptFp4LinearMethod, "create_weights")
    or "quant_mode" not in __import__("inspect").getsource(mq.ModelOptFp4LinearMethod.__init__),
    reason="ModelOptFp4LinearMethod has no quant_mode before 0.5.19",
)
@case(
    "backend faults",
    "a ModelOpt NVFP4 layer SGLang serves with quant_mode='w4a16' (SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16 "
    "with the flashinfer_cutedsl runner: FlashInfer's mm_bf16_fp4, past the routed alias) on a 12.x GPU",
    "refused at the layer's load, before SGLang processes its weights, naming the quant mode, the knob and what to do",
)
def test_a_w4a16_quant_mode_layer_is_refused_at_load(monkeypatch):
    monkeypatch.setenv("SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16", "1")
    monkeypatch.setattr(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", ENUM.FLASHINFER_CUTEDSL)
    sm120_fp4.install(**SIM)
    with pytest.raises(
        RefusedToServe, match=r"(?s)quant_mode='w4a16'.*mm_bf16_fp4.*Unset SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"
    ):
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))


needs_kda = pytest.mark.skipif(
    not release.sglang_version()
    or not __import__("sm120_fp4.versions").versions.version_in(release.sglang_version(), ">=0.5.20"),
    reason="SGLang's KDA NVFP4 GEMM fast path exists from 0.5.20",
)


@pytest.fixture
def kda_fires(monkeypatch):
    """SGLang's own KDA NVFP4 GEMM gate made to fire on the CPU for every shape, with a stand-in kernel that
    returns garbage (the real gate, its `_supports` answering yes, its SM120 kernel module a stand-in)."""
    import sys
    import types

    import sglang.kernels.ops.gemm  # noqa: F401  (the gate the op imports at call time)
    from sglang.kernels.kda_kernels import qwen3x_nvfp4_gemm as kda

    calls = []

    def garbage(input, weight, input_sf, weight_sf, alpha):
        calls.append(input.shape[0])
        return torch.full((input.shape[0], weight.shape[1]), 7.0, dtype=torch.bfloat16)

    monkeypatch.setattr(kda, "_supports", lambda *args: True)
    monkeypatch.setitem(
        sys.modules,
        "sglang.kernels.kda_kernels.qwen3x_nvfp4_gemm_sm120",
        types.SimpleNamespace(_run_qwen3x_nvfp4_gemm=garbage),
    )
    return calls


@needs_kda
@case(
    "backend faults",
    "SGLang's own KDA NVFP4 GEMM fast path (try_qwen3x_nvfp4_gemm, 0.5.20+) firing for a layer on a "
    "12.x device, its kernel returning garbage",
    "never serves there: the gate declines (logged once), the layer's "
    "output is the oracle's through the routed alias; SGLang's gate is back after uninstall",
)
def test_sglangs_kda_fast_path_never_serves_on_a_served_device(kda_fires, caplog):
    import sglang.kernels.ops.gemm as ops_gemm

    gate = ops_gemm.try_qwen3x_nvfp4_gemm
    a, b, a_sf, b_sf, alpha = mm_fp4_operands(4)
    # The op itself runs on a CPU only under install()'s simulation: the gate it calls stands for it here.
    assert torch.all(gate(a, b, a_sf, b_sf, alpha, torch.bfloat16, 32) == 7), "the stand-in fires without us"
    caplog.set_level(logging.INFO, "sm120_fp4")
    sm120_fp4.install(**SIM)
    assert patch_state("kda-nvfp4-gemm-fast-path-declined") == "applied"
    ckpt = synthetic.make_checkpoint(32, 64)
    method, layer = layers.build_modelopt_layer(ckpt)  # the layer check runs through the op as well
    for m in (1, 4, 8, 9):
        x = torch.randn(m, 64).to(torch.bfloat16)
        assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))
    assert kda_fires == [4], "only the call made without the library"
    said = [r.getMessage() for r in caplog.records if "KDA NVFP4 GEMM fast path" in r.getMessage()]
    assert len(said) == 1 and "device -1" in said[0]
    sm120_fp4.uninstall()
    assert ops_gemm.try_qwen3x_nvfp4_gemm is gate
    assert torch.all(ops_gemm.try_qwen3x_nvfp4_gemm(a, b, a_sf, b_sf, alpha, torch.bfloat16, 32) == 7)
    assert kda_fires == [4, 4]


@needs_kda
def test_sglangs_kda_fast_path_stays_on_a_device_not_served(kda_fires):
    import sglang.kernels.ops.gemm as ops_gemm

    sm120_fp4.install(simulate="9.0", backends="emulated")
    a, b, a_sf, b_sf, alpha = mm_fp4_operands(2)
    assert torch.all(
        ops_gemm.try_qwen3x_nvfp4_gemm(a, b, a_sf, b_sf, alpha, torch.bfloat16, 32) == 7
    ) and kda_fires == [2]


@needs_enum
def test_enum_values_chosen_for_other_layouts_are_never_touched():
    kept = [m for m in ENUM if m.name not in REPINNED]  # whatever this release's enum has besides
    assert ENUM.FLASHINFER_CUTLASS in kept
    for member in kept:
        fp4_utils.FP4_GEMM_RUNNER_BACKEND = member
        sm120_fp4.install(**SIM)
        sglang_targets.pin_runner_backend(sm120_fp4.api._state.patcher)
        assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is member, member.name
        sm120_fp4.uninstall()


# ---- idempotence, undo, threads -----------------------------------------------------------


def test_install_install_uninstall_install_leaves_one_layer_and_restores_identity(caplog):
    original_hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    sm120_fp4.install(**SIM)
    assert_patched_once()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    sm120_fp4.install(**SIM)
    assert any("already installed" in r.getMessage() for r in caplog.records)
    assert_patched_once()
    sm120_fp4.uninstall()
    assert_not_patched()
    assert mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"] is original_hook
    sm120_fp4.install(**SIM)
    assert_patched_once()


def test_installs_from_eight_threads_patch_exactly_once():
    barrier = threading.Barrier(8)
    errors = []

    def go():
        barrier.wait()
        try:
            sm120_fp4.install(**SIM)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_concurrently(go, [()] * 8)
    assert errors == []
    assert_patched_once()
    sm120_fp4.uninstall()
    assert_not_patched()


def test_uninstall_restores_the_environment_it_exported(monkeypatch):
    sm120_fp4.install(**SIM)
    assert os.environ["SM120_FP4"] == "1" and os.environ["SM120_FP4_SIMULATE"] == "12.0"
    sm120_fp4.uninstall()
    assert "SM120_FP4" not in os.environ and "SM120_FP4_SIMULATE" not in os.environ


def test_status_is_json_with_every_target_and_the_decision():
    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    data = json.loads(sm120_fp4.status().model_dump_json())
    states = {p["name"]: p["state"] for p in data["patches"]}
    assert states[alias_spec_name()] == "applied"
    assert data["decisions"][0]["backend"] == "emulated" and data["settings"]["simulate"] == "12.0"
    assert data["setting_sources"]["simulate"] == "keyword"


# ---- fail closed ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.2", "0.5.7", "0.5.24", "0.5.24.dev0", "0.6.0"])
@case(
    "own failures",
    "install() with the toggle on, a 12.x GPU and SGLang {version} installed (outside the supported range)",
    "nothing patched; one WARNING says the NVFP4 layers are served UNVERIFIED, naming the version, the supported range "
    "and how to proceed; with SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified it says so as asked",
)
def test_a_release_outside_the_range_is_left_untouched_with_one_warning(monkeypatch, caplog, version):
    monkeypatch.setattr(release.RELEASE, "version", lambda: version)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    status = sm120_fp4.install(**SIM)
    assert not status.installed and f"SGLang {version} is installed, outside the releases" in status.message
    assert_not_patched()
    [warning] = [r.getMessage() for r in caplog.records if "outside the releases" in r.getMessage()]
    assert "NVFP4 layers on a 12.x GPU are served UNVERIFIED" in warning and release.SUPPORTED in warning
    floor = release.SUPPORTED.split(",")[0].removeprefix(">=")
    below = version in ("0.5.2", "0.5.7")  # no later sm120_fp4 serves it: the remedy is SGLang's upgrade
    remedy = f"supports no release before {floor}" if below else "pip install -U sm120-fp4"
    assert remedy in warning and engines.OPT_OUT in warning, warning
    sm120_fp4.install(**SIM)
    assert sum("outside the releases" in r.getMessage() for r in caplog.records) == 1, "once per process"
    status = sm120_fp4.install(**SIM, unsupported_release="serve-unverified")
    assert (
        not status.installed
        and "served UNVERIFIED" in status.message
        and f"{engines.OPT_OUT}: as asked" in status.message
    )


def test_no_12x_gpu_means_nothing_is_patched():
    status = sm120_fp4.install(simulate="9.0", backends="emulated")
    assert not status.installed and "no compute-capability 12.x GPU" in status.message
    assert_not_patched()


def test_toggle_off_makes_install_a_no_op(monkeypatch):
    monkeypatch.setenv("SM120_FP4", "0")
    status = sm120_fp4.install(**SIM)
    assert not status.installed and "disabled" in status.message
    assert_not_patched()


def test_bad_settings_fail_at_install_not_at_serve_time(monkeypatch):
    with pytest.raises(ConfigError, match="SM120_FP4_BACKENDS names unknown backend"):
        sm120_fp4.install(simulate="12.0", backends="cutlas")
    monkeypatch.setenv("SM120_FP4_SELFTEST", "Strict")
    with pytest.raises(ConfigError, match="SM120_FP4_SELFTEST='Strict'"):
        sm120_fp4.install(simulate="12.0")
    assert_not_patched()


@pytest.mark.parametrize(
    "version, message",
    [
        (None, "sglang is not installed"),
        ("not-a-version", "SGLang 'not-a-version' is installed, a version sm120_fp4 cannot read"),
        ("0.5.24rc1", "outside the releases"),
    ],
)
@case(
    "own failures",
    "SGLang version {version}",
    "install() changes nothing and says why in its status message, without raising",
)
def test_a_missing_or_unreadable_sglang_version_is_left_untouched(monkeypatch, version, message):
    monkeypatch.setattr(release.RELEASE, "version", lambda: version)
    status = sm120_fp4.install(**SIM)
    assert not status.installed and message in status.message
    assert_not_patched()


def sglang_plugin():
    """Our plugin as SGLang loads it: the `sglang.srt.plugins` entry point named sm120_fp4."""
    from importlib.metadata import entry_points

    [point] = [p for p in entry_points(group="sglang.srt.plugins") if p.name == "sm120_fp4"]
    return point.load()


@case(
    "own failures",
    "plugin entry point with SM120_FP4=1 when SGLang's metadata is missing",
    "the entry point returns without raising; nothing patched",
)
def test_the_plugin_entry_point_never_raises_without_sglang(monkeypatch):
    monkeypatch.setenv("SM120_FP4", "1")
    for name, value in SIM_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(release.RELEASE, "version", lambda: None)
    sglang_plugin()()
    assert not sm120_fp4.status().installed
    assert_not_patched()


def test_the_plugin_entry_point_does_nothing_without_the_toggle(monkeypatch):
    for name, value in SIM_ENV.items():
        monkeypatch.setenv(name, value)
    sglang_plugin()()
    assert not sm120_fp4.status().installed
    assert_not_patched()
    monkeypatch.setenv("SM120_FP4", "1")
    sglang_plugin()()
    assert sm120_fp4.status().installed
    assert_patched_once()


# ---- faults at serve time, and the library's own failures ----------------------------------------


def _raises_at_m6(a, b, a_sf, b_sf, alpha, dtype, out):
    if a.shape[0] == 6:  # a batch size neither the self-test nor the layer check tries: it shows only at serve time
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)


@case(
    "backend faults",
    "verified backend raises at serve time (M=6, outside the self-test shapes and the layer's batch sizes)",
    "the original exception reaches SGLang's caller unchanged; no output, never zeros",
)
def test_a_serve_time_exception_propagates_and_is_never_turned_into_zeros():
    backends.register("flaky", _raises_at_m6)
    sm120_fp4.install(simulate="12.0", backends="flaky")
    ckpt = synthetic.make_checkpoint(32, 64)
    method, layer = layers.build_modelopt_layer(ckpt)
    x = (torch.randn(4, 64) * 2).to(torch.bfloat16)
    assert torch.equal(method.apply(layer, x), synthetic.reference_output(ckpt, x))  # M=4 serves
    with pytest.raises(RuntimeError, match="illegal memory access") as err:
        method.apply(layer, torch.randn(6, 64).to(torch.bfloat16))
    frames = [f.name for f in err.traceback]
    assert "_raises_at_m6" in frames and "flashinfer_fp4_gemm" in frames, (
        "the backend's own frame, through our dispatch"
    )


@case(
    "backend faults",
    "serve-time exception from the decided backend",
    "the exception carries context: which sm120_fp4 backend on which device raised",
)
def test_a_serve_time_exception_names_the_backend_and_device():
    backends.register("flaky", _raises_at_m6)
    sm120_fp4.install(simulate="12.0", backends="flaky", selftest="off")  # the serve-time path is under test
    method, layer = layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    with pytest.raises(RuntimeError) as err:
        method.apply(layer, torch.randn(6, 64).to(torch.bfloat16))
    context = str(err.value) + "\n".join(getattr(err.value, "__notes__", []))
    assert "flaky" in context and "sm120_fp4" in context


# ---- 4. the library's own failures never break the host ----------------------------------


@case(
    "own failures",
    "a post-import hook raises inside the patch engine (alias check)",
    "install() returns; the alias is left as SGLang's; ledger says 'internal error'; one warning line; layers still load",
)
def test_an_exception_inside_a_post_import_hook_leaves_that_target_unpatched(monkeypatch, caplog):
    def boom(original):
        raise RuntimeError("boom in a hook")

    monkeypatch.setattr(sglang_targets, "is_mm_fp4", boom)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    status = sm120_fp4.install(**SIM)  # modelopt_quant is imported already: its hooks run now
    assert sglang_alias() is flashinfer.mm_fp4
    entry = {p.name: p for p in status.patches}[alias_spec_name()]
    assert entry.state == "skipped" and entry.reason == "internal error: RuntimeError: boom in a hook"
    lines = [r.getMessage() for r in caplog.records if alias_spec_name() in r.getMessage()]
    assert lines == [f"sm120_fp4: patch {alias_spec_name()} failed, SGLang left unpatched there: boom in a hook"]
    # SGLang's load path still runs, and the layer check finds that what would serve (the unpatched
    # alias: FlashInfer's CUDA kernel, on this CPU) does not work: refused, not served unverified.
    with pytest.raises(
        RefusedToServe, match=r"(?s)for ModelOptFp4LinearMethod N=32 K=64.*M=1 N=32 K=64: call 1 raised"
    ):
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))


# ---- concurrency --------------------------------------------------------------------------------

# ---- 5. concurrency ----------------------------------------------------------------------


@case(
    "concurrency",
    "8 threads x 15 seeded random install/uninstall/status calls",
    "no exception; afterwards patched exactly once or not at all, matching status(); uninstall restores every original",
)
def test_install_uninstall_status_from_many_threads_stay_consistent():
    original_hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    barrier, errors = threading.Barrier(8), []

    def worker(seed):
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(15):
            try:
                op = rng.choice(("install", "uninstall", "status"))
                result = sm120_fp4.install(**SIM) if op == "install" else getattr(sm120_fp4, op)()
                json.loads(result.model_dump_json())
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

    run_concurrently(worker, [(seed,) for seed in range(8)])
    assert errors == []
    if sm120_fp4.status().installed:
        assert_patched_once()
        sm120_fp4.uninstall()
    assert_not_patched()
    assert mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"] is original_hook
    assert not any(k.startswith("SM120_FP4") for k in os.environ), "the exported environment is restored"


# ---- new interpreters (background jobs started at session start, see conftest.py) ---------------


@case(
    "backend faults",
    "spawned scheduler (SM120_FP4=1, SIMULATE=12.0, SELFTEST=strict, BACKENDS=zeros) imports SGLang and loads an NVFP4 layer",
    "the child patched itself from the inherited environment; RefusedToServe: it exits non-zero and its stderr names the backend and the fault",
)
@background(
    lambda folder: Spawned(
        children.scheduler_with_broken_backend,
        clean_env(SM120_FP4="1", SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="zeros", SM120_FP4_SELFTEST="strict"),
        folder,
    )
)
def test_strict_worker_with_a_broken_backend_refuses_to_serve_with_a_nonzero_exit(background):
    exitcode, _, stderr = background
    assert f"child: alias patch {alias_spec_name()}" in stderr, stderr
    assert exitcode not in (0, None), stderr
    assert "RefusedToServe" in stderr and "refusing to serve NVFP4 on cpu" in stderr, stderr
    assert "zeros: self-test failed: M=1 N=96 K=1056: call 1: output is all zeros" in stderr
    assert "the layer loaded" not in stderr


MISSING_FLASHINFER = """
import json, logging, sys
# A dependency may reconfigure logging with its own line format (xgrammar 0.1.25 adds a timestamp):
# our records are counted by logger name, whatever the format of the lines
logging.basicConfig(format="[%(asctime)s] %(levelname)s %(name)s: %(message)s", force=True)
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.getMessage()])
logging.getLogger("sm120_fp4").addHandler(Keep())
sys.modules["flashinfer"] = None  # import flashinfer -> ImportError, as when it is not installed
import sm120_fp4
installed = sm120_fp4.install(simulate="12.0", backends="emulated").installed
import sglang.srt.layers.quantization.modelopt_quant as mq
from sm120_fp4.demo import synthetic
from sm120_fp4.sglang import layers
try:
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    refused = None
except sm120_fp4.RefusedToServe as exc:
    refused = str(exc)
status = sm120_fp4.status()
print(json.dumps({"installed": installed, "sglang_has_mm_fp4": getattr(mq, "enable_flashinfer_fp4_gemm", None),
                  "patches": {p.name: [p.state, p.reason] for p in status.patches},
                  "decision": status.decisions[0].backend, "refused": refused,
                  "ours": [message for name, message in records if name.split(".")[0] == "sm120_fp4"]}))
"""


@case(
    "own failures",
    "FlashInfer not importable, real SGLang import after install()",
    "install() and SGLang's import succeed; the alias is skipped with one warning line; the layer check refuses the layer, whose served call cannot run",
)
@background(lambda folder: python(MISSING_FLASHINFER, folder, cwd=folder))
def test_missing_flashinfer_leaves_sglang_importing_unpatched_with_one_warning(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    assert "Traceback" not in stderr
    data = json.loads(stdout)
    assert data["installed"] and data["sglang_has_mm_fp4"] in (False, None) and data["decision"] == "emulated"
    state, reason = data["patches"][alias_spec_name()]
    # SGLang binds the alias only when FlashInfer imports
    assert state == "skipped" and (f"{alias_name()} not found" in reason or "found None" in reason), reason
    # The served call fails as this release fails without FlashInfer (SGLang's own error, the kernel-less op
    # or its unbound fallback in 0.5.8-0.5.10): refused either way
    assert re.search(r"NVFP4 GEMM requires flashinfer's mm_fp4|call 1 raised", data["refused"]), data["refused"]
    assert len([message for message in data["ours"] if alias_spec_name() in message]) == 1, data["ours"]


# ---- the activation quantizer stand-ins ---------------------------------------------------------


def test_the_activation_quantizer_stand_ins_replace_fp4_quantize_and_uninstall_restores_it(sglang_unpatched):
    """install(simulate): the fp4_quantize that ModelOpt's and compressed-tensors' linear paths call (module
    globals in every supported release) is the stand-in, doctor finds nothing wrong; uninstall() restores both."""
    import sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 as ct
    import sglang.srt.layers.quantization.modelopt_quant as mq

    from sm120_fp4 import doctor

    originals = [mq.__dict__["fp4_quantize"], ct.__dict__["fp4_quantize"]]
    status = sm120_fp4.install(simulate="12.0", backends="emulated", enable="on")
    states = {p.name: p.state for p in status.patches if p.name.startswith("sim-activation-quantizer")}
    assert states == {"sim-activation-quantizer": "applied", "sim-activation-quantizer-ct": "applied"}, states
    assert [mq.fp4_quantize.__wrapped__, ct.fp4_quantize.__wrapped__] == originals
    assert not [p for p in doctor.collect()["problems"] if "sim-activation-quantizer" in p]
    sm120_fp4.uninstall()
    assert [mq.__dict__["fp4_quantize"], ct.__dict__["fp4_quantize"]] == originals


# ---- install() after the start-up hook; reloads ----------------------------------------------

AFTER_HOOK = """
import json, os, logging
logging.basicConfig(level=logging.WARNING)
import sglang.srt.layers.quantization.modelopt_quant  # the start-up hook installs from the environment here
import sm120_fp4
from helpers.common import assert_patched_once
before = sm120_fp4.status().settings['fallback']
after = sm120_fp4.install(fallback='emulated')  # the launcher's own install(), after the hook
assert_patched_once()
sm120_fp4.decide()
try:
    sm120_fp4.install(select='fastest')
    refused = None
except sm120_fp4.ConfigError as exc:
    refused = str(exc)
print(json.dumps([before, after.settings['fallback'], os.environ.get('SM120_FP4_FALLBACK'), refused, sm120_fp4.status().settings['select']]))
"""


@case(
    "own failures",
    "`install(fallback='emulated')` in a worker the SM120_FP4=1 start-up hook already installed from the environment, then `install(select='fastest')` after a decision",
    "the first applies the keyword (installed again, exported to the environment, patched once, a warning says so); the second raises ConfigError naming the setting, the values and SM120_FP4_SELECT: never ignored silently",
)
@background(
    lambda folder: with_repo_pth(
        AFTER_HOOK, folder, cwd=folder, SM120_FP4="1", **SIM_ENV, PYTHONPATH=f"{REPO}:{REPO / 'tests'}"
    )
)
def test_install_after_the_start_up_hook_applies_or_refuses_the_keywords(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    before, after, exported, refused, select = json.loads(stdout.strip().splitlines()[-1])
    assert (before, after, exported) == ("none", "emulated", "emulated"), stderr
    assert "re-installing with them" in stderr and "installed by the environment" in stderr
    assert (
        refused is not None and "select: 'first' in force, 'fastest' asked" in refused and "SM120_FP4_SELECT" in refused
    )
    assert select == "first"


RELOAD = """
import importlib, json
import sm120_fp4
from helpers.common import SIM, alias_name
from sm120_fp4.demo import synthetic
from sm120_fp4.sglang import layers
sm120_fp4.install(**SIM)
import sglang.srt.layers.quantization.modelopt_quant as mq
original = getattr(mq, alias_name()).__wrapped__
importlib.reload(mq)
alias = getattr(mq, alias_name())
states = {e.name: [e.state, e.reason] for e in sm120_fp4.status().patches if e.module == mq.__name__}
layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
verified = [len(d.layers) for d in sm120_fp4.status().decisions]
setattr(mq, alias_name(), original)  # other code puts the original back
replaced = {e.name: e.state for e in sm120_fp4.status().patches if e.module == mq.__name__}
sm120_fp4.uninstall()
print(json.dumps([getattr(alias, '__sm120_fp4_patch__', None), states, verified, replaced,
                  getattr(getattr(mq, alias_name()), '__sm120_fp4_patch__', None)]))
"""


@case(
    "own failures",
    "`importlib.reload()` of SGLang's real modelopt_quant after install(), then a layer loads; then other code puts the original alias back",
    "the reload is patched again (alias and weights hooks; status() says so) and the layer is verified; the put-back original shows as `replaced` in status(), never `applied`",
)
@background(lambda folder: python(RELOAD, folder, cwd=folder, PYTHONPATH=f"{REPO}:{REPO / 'tests'}"))
def test_a_reload_of_modelopt_quant_is_patched_again_and_status_tells_the_truth(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    alias, states, verified, replaced, after_uninstall = json.loads(stdout.strip().splitlines()[-1])
    assert alias == alias_spec_name()
    for name in (alias_spec_name(), "modelopt-fp4-weights-hook"):
        assert states[name] == ["applied", f"patched again after a reload of {mq.__name__}"], states
    assert verified == [1], "the layer loaded after the reload went through the (re-applied) weights hook"
    assert replaced[alias_spec_name()] == "replaced" and replaced["modelopt-fp4-weights-hook"] == "applied"
    assert after_uninstall is None


@case(
    "configuration",
    "an NVFP4 weight-only (W4A16) layer of SGLang's CompressedTensorsW4A16Fp4 (FP4 Marlin, called directly) on a "
    "served device, SM120_FP4_SELFTEST={selftest}",
    "strict: refused at process_weights_after_loading naming the class and W4A16; warn: status().unverified names "
    "it (doctor lists the target that says so)",
)
@pytest.mark.parametrize("selftest", ["strict", "warn"])
def test_a_w4a16_layer_is_refused_or_shown_unverified(selftest):
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_w4a16_nvfp4 as w4a16

    sm120_fp4.install(simulate="12.0", backends="emulated", selftest=selftest)
    scheme, layer = w4a16.CompressedTensorsW4A16Fp4(), torch.nn.Module()
    scheme.create_weights(layer, [64], 128, torch.bfloat16, weight_loader=None)
    ckpt = synthetic.make_checkpoint(64, 128, seed=0)
    with torch.no_grad():
        layer.weight_packed.copy_(ckpt.weight)
        layer.weight_scale.copy_(ckpt.weight_scale)
        layer.weight_global_scale.copy_(1.0 / ckpt.weight_scale_2.reshape(1))
    said = (
        r"CompressedTensorsW4A16Fp4 weight-only \(W4A16\) with FP4 Marlin.*no W4A16 NVFP4 kernel is routed or verified"
    )
    if selftest == "strict":
        with pytest.raises(
            RefusedToServe, match=rf"the NVFP4 layer \(CompressedTensorsW4A16Fp4\): SGLang serves {said}"
        ):
            scheme.process_weights_after_loading(layer)
        return
    try:
        scheme.process_weights_after_loading(layer)
    except RefusedToServe:  # pragma: no cover - warn serves it
        raise
    except Exception:
        pass  # FP4 Marlin's weight repack needs CUDA: the layer would be served unverified on a GPU
    [entry] = sm120_fp4.status().unverified
    assert "CompressedTensorsW4A16Fp4" in entry.what and re.search(said, entry.reason)
    assert patch_state("compressed-tensors-w4a16-nvfp4-refused") == "applied"
