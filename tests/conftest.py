"""Shared fixtures: a fixed seed for every test, and the devices to run tensor tests on."""

from __future__ import annotations

import random

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# One intra-op thread: the tests run thousands of small tensor ops, which two threads (on two shared
# cores) make several times slower, and one thread makes every float reduction order the same.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(1234)
    torch.manual_seed(1234)
    yield


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each tensor test runs on the CPU, and on CUDA where a GPU is present (the H200 run)."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _clean_library_state(monkeypatch):
    """No SM120_FP4* variable leaks in from the shell; decisions and device caches start empty."""
    import os

    for name in list(os.environ):
        if name.startswith("SM120_FP4"):
            monkeypatch.delenv(name)
    from sm120_fp4 import backends, devices, selection

    registered, registered_moe = set(backends.names()), set(backends.moe_names())
    selection.clear()
    devices.clear_cache()
    yield
    for name in set(backends.names()) - registered:
        backends.unregister(name)
    for name in set(backends.moe_names()) - registered_moe:
        backends.unregister_moe(name)
    selection.clear()
    devices.clear_cache()


@pytest.fixture
def sglang_unpatched():
    """SGLang unpatched before and after the test, and its runner enum as SGLang left it."""
    fp4_utils = pytest.importorskip("sglang.srt.layers.quantization.fp4_utils")
    import sm120_fp4

    enum_before = fp4_utils.FP4_GEMM_RUNNER_BACKEND
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    yield
    if sm120_fp4.status().installed:
        sm120_fp4.uninstall()
    fp4_utils.FP4_GEMM_RUNNER_BACKEND = enum_before
