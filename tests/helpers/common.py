"""Settings, mocked devices, a thread runner and the SGLang patch assertions used across test files."""

from __future__ import annotations

import importlib.util
import threading
from typing import Callable, Iterable

import pytest
import torch
from hypothesis import HealthCheck

from sm120_fp4 import devices
from sm120_fp4.devices import Device

SIM = dict(simulate="12.0", backends="emulated")  # install() keywords: simulation, the oracle backend
SIM_ENV = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated"}
HYPOTHESIS = dict(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class CpuGpu(Device):
    """A mocked CUDA ordinal whose tensors live on the CPU (several 'GPUs' without a GPU)."""

    @property
    def torch_device(self):
        return torch.device("cpu")


def fake_devices(*specs: tuple[str, tuple[int, int]]):
    """devices.use_probe() with one mocked GPU per (name, capability)."""
    return devices.use_probe(lambda: [Device(i, name, cc) for i, (name, cc) in enumerate(specs)])


def run_concurrently(target: Callable, argument_tuples: Iterable[tuple]) -> None:
    """Start one thread per argument tuple, then wait for all of them."""
    threads = [threading.Thread(target=target, args=args) for args in argument_tuples]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def mm_fp4_operands(m: int, n: int = 32, k: int = 64):
    """mm_fp4's positional operands (a, b, a_descale, b_descale, alpha) for random (m, k) x (n, k)
    data, quantized with nvfp4 (the global torch RNG: tests seed it)."""
    from sm120_fp4 import nvfp4

    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.1
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    return qx, qw.T, sx, sw.T, (1 / (gx * gw)).reshape(1)


# ---- the real SGLang's patch targets (imported lazily: only tests that use SGLang pay for it) ----


def _targets():
    import flashinfer
    import sglang.srt.layers.quantization.modelopt_quant as mq

    return mq, flashinfer


def release_specs() -> dict:
    """The ledger's runtime specs whose version range holds the installed SGLang, by name."""
    from importlib.metadata import version

    from sm120_fp4.sglang import release, targets
    from sm120_fp4.versions import version_in

    installed = version(release.DISTRIBUTION)  # the real one, also where a test fakes sglang_version()
    return {
        s.name: s
        for s in targets.ledger_rows()
        if s.make is not None and version_in(installed, s.versions or release.SUPPORTED)
    }


def alias_name() -> str:
    """The installed release's name for FlashInfer's mm_fp4 in modelopt_quant."""
    return release_specs()["flashinfer-fp4-gemm-alias"].attribute


def alias_spec_name() -> str:
    return "flashinfer-fp4-gemm-alias"


def sglang_alias():
    """What modelopt_quant's mm_fp4 alias is bound to now (patched or not)."""
    mq, _ = _targets()
    return getattr(mq, alias_name())


def assert_not_patched() -> None:
    mq, flashinfer = _targets()
    assert getattr(mq, alias_name()) is flashinfer.mm_fp4
    assert not hasattr(mq.ModelOptFp4LinearMethod.process_weights_after_loading, "__sm120_fp4_patch__")


def assert_patched_once() -> None:
    mq, flashinfer = _targets()
    alias = getattr(mq, alias_name())
    assert alias.__sm120_fp4_patch__ == alias_spec_name()
    assert alias.__wrapped__ is flashinfer.mm_fp4, "exactly one layer of patching"
    hook = mq.ModelOptFp4LinearMethod.__dict__["process_weights_after_loading"]
    assert hook.__sm120_fp4_patch__ == "modelopt-fp4-weights-hook"
    assert not hasattr(hook.__wrapped__, "__sm120_fp4_patch__")


def module_installed(name: str) -> bool:
    """Whether `name` can be imported here, found without importing it (its parent packages are)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def simulated_moe_skip_reason() -> str | None:
    """Why the installed SGLang cannot run a simulated NVFP4 MoE layer here, or None: no fused-MoE
    seam (its MoE layers are refused instead: test_sglang.py tests that on every release), or not
    the scoped runtime seams a simulated FusedMoE needs (moe_layers.builder_problem)."""
    from sm120_fp4.sglang import moe, moe_layers, release
    from sm120_fp4.versions import version_in

    installed = release.sglang_version()
    if installed is None:
        return None  # the test files' importorskip lines say SGLang is missing
    if not version_in(installed, moe.SEAM_VERSIONS):
        return (
            f"SGLang {installed} has no fused-MoE seam ({moe.SEAM_VERSIONS}): its NVFP4 MoE layers are refused, "
            "tested in test_sglang.py (refused_before_sglang_processes_it)"
        )
    return moe_layers.builder_problem()


def patch_state(name: str) -> str:
    import sm120_fp4

    return {p.name: p.state for p in sm120_fp4.status().patches}[name]


def extend_enum(monkeypatch, enum: type, name: str, value: str):
    """Add member `name` = `value` to the real enum class `enum` for one test (as a later release of
    the library that defines it would), with the class's own methods; monkeypatch removes it again."""
    member = object.__new__(enum)
    member._name_, member._value_ = name, value
    # Attributes only, so that monkeypatch undoes them in reverse: the maps first, then the member
    # (Enum refuses to set or delete an attribute named in its member map).
    monkeypatch.setattr(enum, name, member, raising=False)
    monkeypatch.setattr(enum, "_member_map_", {**enum._member_map_, name: member})
    monkeypatch.setattr(enum, "_value2member_map_", {**enum._value2member_map_, value: member})
    monkeypatch.setattr(enum, "_member_names_", [*enum._member_names_, name])
    return member


def slow_but_one(values: Iterable, keep: int = 0) -> list:
    """A sweep's cases for pytest.mark.parametrize, every case but `values[keep]` marked `slow`: the inner loop
    (docs/development.md) runs one case of the sweep, the full suite runs them all. A case is one argument, a
    tuple (the arguments of a parametrize of several names) or a pytest.param (its marks and id kept)."""

    def slow(value):
        if isinstance(value, type(pytest.param())):  # pytest's ParameterSet
            return pytest.param(*value.values, marks=[*value.marks, pytest.mark.slow], id=value.id)
        return pytest.param(*value, marks=pytest.mark.slow) if isinstance(value, tuple) else slow(pytest.param(value))

    return [value if i == keep else slow(value) for i, value in enumerate(values)]
