"""Against the real SGLang (the pinned release in the test environment): patch, serve, refuse, undo.

No fake SGLang: the layer is SGLang's ModelOptFp4LinearMethod, the patched names are its modules'.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading

import pytest
import torch

import faults
from threads import run_concurrently
import spawn_target
import sm120_fp4
from sm120_fp4 import backends
from sm120_fp4.sglang import layers, release
from sm120_fp4.sglang import targets as sglang_targets
from sm120_fp4.errors import ConfigError, RefusedToServe

mq = pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang (scripts/setup_env.sh)")
fp4_utils = pytest.importorskip("sglang.srt.layers.quantization.fp4_utils")
import flashinfer  # noqa: E402  (installed with SGLang's pin)

SIM = dict(simulate="12.0", backends="emulated")


@pytest.fixture(autouse=True)
def _uninstalled(sglang_unpatched):
    """Every test here starts and ends with SGLang unpatched (see conftest.sglang_unpatched)."""


def patch_state(name: str) -> str:
    return {p.name: p.state for p in sm120_fp4.status().patches}[name]


def assert_not_patched():
    assert mq.flashinfer_fp4_gemm is flashinfer.mm_fp4
    assert not hasattr(mq.ModelOptFp4LinearMethod.process_weights_after_loading, "__sm120_fp4_patch__")


def assert_patched_once():
    alias = mq.flashinfer_fp4_gemm
    assert alias.__sm120_fp4_patch__ == "flashinfer-fp4-gemm-alias"
    assert alias.__wrapped__ is flashinfer.mm_fp4, "exactly one layer of patching"
    hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    assert hook.__sm120_fp4_patch__ == "modelopt-fp4-weights-hook"
    assert not hasattr(hook.__wrapped__, "__sm120_fp4_patch__")


# ---- the real linear path in simulation ---------------------------------------------------

@pytest.mark.parametrize("n, k, m", [(96, 160, 7), (40, 64, 1), (256, 512, 130)])
def test_modelopt_layer_runs_through_the_patch_and_matches_the_reference(caplog, n, k, m):
    caplog.set_level(logging.INFO, "sm120_fp4")
    status = sm120_fp4.install(**SIM)
    assert status.installed and patch_state("flashinfer-fp4-gemm-alias") == "applied"
    ckpt = layers.make_checkpoint(n, k, seed=n)
    method, layer = layers.build_modelopt_layer(ckpt)
    x = (torch.randn(m, k) * 2).to(torch.bfloat16)
    out = method.apply(layer, x)
    want = layers.reference_output(ckpt, x)
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
        layers.build_modelopt_layer(layers.make_checkpoint(32, 64))


def test_compressed_tensors_w4a4_weights_hook_decides_first():
    ct = pytest.importorskip(release.CT)
    backends.register("nan", faults.single_nan)
    sm120_fp4.install(simulate="12.0", backends="nan")
    assert patch_state("compressed-tensors-w4a4-weights-hook") == "applied"
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(RefusedToServe, match="nan: self-test failed"):
        ct.CompressedTensorsW4A4Fp4.process_weights_after_loading(object.__new__(ct.CompressedTensorsW4A4Fp4), layer)


# ---- the runner enum ----------------------------------------------------------------------

@pytest.mark.parametrize("start", ["AUTO", "FLASHINFER_CUDNN", None])
def test_enum_is_pinned_to_cutlass_from_auto_or_cudnn_and_restored(start):
    enum = fp4_utils.Fp4GemmRunnerBackend
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = None if start is None else enum[start]
    before = fp4_utils.FP4_GEMM_RUNNER_BACKEND
    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(layers.make_checkpoint(32, 64))
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is enum.FLASHINFER_CUTLASS
    assert patch_state("fp4-runner-backend-pin") == "applied"
    sm120_fp4.uninstall()
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is before


@pytest.mark.parametrize("kept", ["FLASHINFER_TRTLLM", "MARLIN", "FLASHINFER_CUTEDSL"])
def test_enum_values_chosen_for_other_layouts_are_never_touched(kept):
    enum = fp4_utils.Fp4GemmRunnerBackend
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = enum[kept]
    sm120_fp4.install(**SIM)
    sglang_targets.pin_runner_backend(sm120_fp4.api._state.patcher)
    assert fp4_utils.FP4_GEMM_RUNNER_BACKEND is enum[kept]


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
    import os

    assert os.environ["SM120_FP4"] == "1" and os.environ["SM120_FP4_SIMULATE"] == "12.0"
    sm120_fp4.uninstall()
    assert "SM120_FP4" not in os.environ and "SM120_FP4_SIMULATE" not in os.environ


def test_status_is_json_with_every_target_and_the_decision():
    import json

    sm120_fp4.install(**SIM)
    layers.build_modelopt_layer(layers.make_checkpoint(32, 64))
    data = json.loads(sm120_fp4.status().model_dump_json())
    states = {p["name"]: p["state"] for p in data["patches"]}
    assert states["flashinfer-fp4-gemm-alias"] == "applied"
    assert states["fp4-gemm-alias-legacy"] == "skipped"  # 0.5.3-0.5.7 only
    assert data["decisions"][0]["backend"] == "emulated" and data["settings"]["simulate"] == "12.0"
    assert data["setting_sources"]["simulate"] == "keyword"


# ---- fail closed ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.5.2", "0.5.24", "0.6.0"])
def test_a_release_outside_the_range_is_left_untouched_with_one_warning(monkeypatch, caplog, version):
    monkeypatch.setattr(release, "sglang_version", lambda: version)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    status = sm120_fp4.install(**SIM)
    assert not status.installed and f"sglang {version} is outside the supported range" in status.message
    assert_not_patched()
    assert sum("outside the supported range" in r.getMessage() for r in caplog.records) <= 1


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


# ---- spawned workers -----------------------------------------------------------------------

def test_a_spawned_child_patches_itself_from_the_environment_toggle_and_only_with_it(monkeypatch):
    ctx = multiprocessing.get_context("spawn")  # how SGLang starts its schedulers
    children = {}
    for toggle in ("1", None):  # both children run at once; each takes the environment of its start
        if toggle is None:
            for name in ("SM120_FP4", "SM120_FP4_SIMULATE", "SM120_FP4_BACKENDS"):
                monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv("SM120_FP4", toggle)
            monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
            monkeypatch.setenv("SM120_FP4_BACKENDS", "emulated")
        queue = ctx.Queue()
        child = ctx.Process(target=spawn_target.report_alias_patch, args=(queue,))
        child.start()
        children[toggle] = (child, queue)
    results = {toggle: queue.get(timeout=240) for toggle, (_, queue) in children.items()}
    for child, _ in children.values():
        child.join(timeout=60)
        assert child.exitcode == 0
    assert results == {"1": "flashinfer-fp4-gemm-alias", None: None}


def test_an_sglang_that_already_contains_the_fix_is_left_alone(monkeypatch):
    monkeypatch.setattr(release, "fix_marker", lambda root: release.MARKER.search("# sm120-fp4: sglang-0.5.23-sm120-fp4"))
    status = sm120_fp4.install(**SIM)
    assert not status.installed and "already contains the fix" in status.message
    assert_not_patched()
