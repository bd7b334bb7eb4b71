"""Stand-ins letting vLLM's NVFP4 linear path run without an SM120 GPU (SM120_FP4_SIMULATE), undone by uninstall()."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any, Callable

import torch

from .. import engines, nvfp4
from ..devices import cpu_thread_binding, ranks_in
from ..patching import PatchSpec
from .release import CUSTOM_OPS, LINEAR_FLASHINFER, LINEAR_KERNELS, PLATFORMS, RELEASE, TARGET_VERSIONS

_LOG = logging.getLogger("sm120_fp4")
_WHY = "simulation only (SM120_FP4_SIMULATE): lets vLLM's NVFP4 linear path run without an SM120 GPU"
_NEVER = "never used outside simulation"
# vLLM's CUDA extension modules its import chain reaches on the way to the NVFP4 linear kernels (0.32-0.33).
EXTENSIONS = tuple(
    f"vllm.{m}" for m in "_C _moe_C _C_stable_libtorch _moe_C_stable_libtorch _qutlass_C vllm_flash_attn".split()
)
# torch.ops._C capability probes vLLM's kernel selection calls: the answer for an SM12x device.
CAPABILITY_PROBES = {
    "cutlass_scaled_mm_supports_fp4": True,
    "cutlass_scaled_mm_supports_fp8": False,
    "cutlass_scaled_mm_supports_block_fp8": False,
    "cutlass_group_gemm_supported": False,
    "mxfp4_experts_quant_supported": False,
}
CUBIN_ENV = "VLLM_HAS_FLASHINFER_CUBIN"
_STUB_SAYS = "sm120_fp4: SIMULATION: %s cannot load here (%s); vLLM imports a stand-in whose names raise when called"


def _stand_in(name: str, module: str, attribute: str, why: str, **fields) -> PatchSpec:
    return PatchSpec(name, module, attribute, f"{_WHY}; {why}", "-", _NEVER, **fields)


_PLATFORM_WHY = "vLLM's platform reports the simulated SM12x capability"
PLATFORM = _stand_in("vllm-sim-platform", PLATFORMS, "_current_platform", _PLATFORM_WHY)
_EXTENSIONS_WHY = "vLLM's CUDA extensions that cannot load are stand-ins that raise when called"
EXTENSION_STAND_INS = _stand_in("vllm-sim-extensions", "vllm", "*", _EXTENSIONS_WHY)
_PROBES_WHY = "the capability probes of vLLM's NVFP4 kernel selection"
PROBES = _stand_in("vllm-sim-capability-probes", "torch.ops._C", "*", _PROBES_WHY)
_CUBIN_WHY = f"vLLM's has_flashinfer() asks for the cubin package or {CUBIN_ENV}"
CUBIN = _stand_in("vllm-sim-flashinfer-cubin", "os.environ", CUBIN_ENV, _CUBIN_WHY)
_QUANT_WHY = "the FlashInfer NVFP4 linear kernels quantize activations with scaled_fp4_quant (a CUDA op), bound by name"
_OPS_WHY = "vllm._custom_ops.scaled_fp4_quant (a CUDA op) for its other callers"


THREADS_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU build: each rank's cores, "|" between ranks
PARALLEL_FLAGS = {"tp": ("-tp", "--tensor-parallel-size"), "pp": ("-pp", "--pipeline-parallel-size")}


def cpu_tp_env(command: list[str]) -> dict[str, str]:
    """Return what vLLM's CPU build needs for `command`'s ranks here: this process's cores split over them.

    Empty for one rank, outside vllm-cpu, or where the operator set VLLM_CPU_OMP_THREADS_BIND (left alone).
    """
    ranks = ranks_in(command, PARALLEL_FLAGS)
    if ranks < 2 or RELEASE.distribution() != "vllm-cpu" or os.environ.get(THREADS_BIND_VAR):
        return {}
    return {THREADS_BIND_VAR: cpu_thread_binding(ranks)}


def _quantizer_stand_in(original: Callable | None) -> Callable:
    """vLLM's ``scaled_fp4_quant`` computed by nvfp4.quantize (the 128x4 swizzled layout only)."""

    def scaled_fp4_quant(input, input_global_scale, is_sf_swizzled_layout=True, backend="none", padded_n=None):
        if not is_sf_swizzled_layout or "trtllm" in str(backend):
            raise NotImplementedError(
                "sm120_fp4 simulation: scaled_fp4_quant is simulated for the 128x4 swizzled layout only "
                f"(is_sf_swizzled_layout={is_sf_swizzled_layout!r}, backend={backend!r})"
            )
        rows = input.reshape(-1, input.shape[-1])
        if padded_n is not None and padded_n > rows.shape[-1]:
            rows = torch.nn.functional.pad(rows, (0, padded_n - rows.shape[-1]))  # zero blocks: zero codes and scales
        packed, scales = nvfp4.quantize(rows, input_global_scale.float().reshape(()), check_finite=False)
        return packed, scales.view(torch.float8_e4m3fn)

    scaled_fp4_quant.__wrapped__ = original
    return scaled_fp4_quant


def specs() -> list[PatchSpec]:
    """The attribute stand-ins: the activation quantizer where the FlashInfer linear kernel binds it, and vLLM's own."""
    quantizer = dict(make=_quantizer_stand_in, distribution=RELEASE.distribution(), versions=TARGET_VERSIONS)
    return [
        _stand_in("vllm-sim-activation-quantizer", LINEAR_FLASHINFER, "scaled_fp4_quant", _QUANT_WHY, **quantizer),
        _stand_in("vllm-sim-activation-quantizer-ops", CUSTOM_OPS, "scaled_fp4_quant", _OPS_WHY, **quantizer),
    ]


def ledger_rows() -> list[PatchSpec]:
    return specs() + [PLATFORM, EXTENSION_STAND_INS, PROBES, CUBIN]


class Simulation(engines.Simulation):
    """The non-attribute stand-ins of one install (platform, extension modules, probes, the cubin knob)."""

    def arm(self) -> None:
        if CUBIN_ENV not in os.environ:
            os.environ[CUBIN_ENV] = "1"
            self.keep(lambda: os.environ.pop(CUBIN_ENV, None))
            self.patcher.note(CUBIN, "applied", None)
        else:
            self.patcher.note(CUBIN, "skipped", f"{CUBIN_ENV} already set; left as is")
        if torch.cuda.is_available():
            for spec in (EXTENSION_STAND_INS, PROBES):
                self.patcher.note(spec, "skipped", "CUDA is available: the real extensions load")
        else:
            self.keep(
                engines.stand_in_finder(EXTENSIONS, lambda name, why: _LOG.warning(_STUB_SAYS, name, why), missing=True)
            )
            self.patcher.note(EXTENSION_STAND_INS, "applied", None)
            self.keep(_define_probes(self.capability))
            self.patcher.note(PROBES, "applied", None)
        self.patcher.when_imported(PLATFORMS, self.on_platforms)

    def on_platforms(self, module: Any) -> None:
        """Make vLLM's current platform (CUDA, or vLLM-cpu's CPU platform class) report the simulated capability."""
        from vllm.platforms.interface import DeviceCapability

        major, minor = self.capability
        cpu = RELEASE.distribution() == "vllm-cpu"
        if cpu:
            from vllm.platforms.cpu import CpuPlatform as Base

            self.patcher.when_imported(LINEAR_KERNELS, self.on_kernels)
        else:
            from vllm.platforms.cuda import NonNvmlCudaPlatform as Base

        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=major, minor=minor)

        def get_device_name(cls, device_id: int = 0) -> str:
            return f"sm120_fp4 simulated sm_{major}{minor}"

        methods = {"get_device_capability": get_device_capability, "get_device_name": get_device_name}
        if cpu:
            saved = {name: Base.__dict__.get(name) for name in methods}
            for name, fn in methods.items():
                setattr(Base, name, classmethod(fn))

            def undo() -> None:
                for name, fn in saved.items():
                    setattr(Base, name, fn) if fn is not None else delattr(Base, name)

        else:
            platform = type("SimulatedSm12xPlatform", (Base,), {k: classmethod(f) for k, f in methods.items()})
            previous = module.__dict__.get("_current_platform")
            module._current_platform = platform()
            undo = lambda: setattr(module, "_current_platform", previous)  # noqa: E731
        self.keep(undo)
        self.patcher.note(PLATFORM, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: vLLM's current platform now reports sm_%d%d", major, minor)

    def on_kernels(self, module: Any) -> None:
        """On vLLM's CPU platform: offer the NVFP4 linear kernels of its CUDA platform, in their order."""
        from vllm.platforms.interface import PlatformEnum

        from .release import FLASHINFER_UTILS, NVFP4_UTILS

        utils = importlib.import_module(NVFP4_UTILS)
        kernels, supported_fp4 = module._POSSIBLE_NVFP4_KERNELS, utils.cutlass_fp4_supported
        previous = kernels.get(PlatformEnum.CPU)
        kernels[PlatformEnum.CPU] = [*(previous or []), *kernels[PlatformEnum.CUDA]]
        utils.cutlass_fp4_supported = lambda: True  # it asks is_cuda() first; the probes answer the rest on a GPU
        cached = sys.modules.get(FLASHINFER_UTILS)  # asked (and cached) before the plugin set VLLM_HAS_FLASHINFER_CUBIN
        for name in ("has_flashinfer_cubin", "has_flashinfer"):
            getattr(getattr(cached, name, None), "cache_clear", lambda: None)()

        def undo() -> None:
            utils.cutlass_fp4_supported = supported_fp4
            kernels.pop(PlatformEnum.CPU) if previous is None else kernels.__setitem__(PlatformEnum.CPU, previous)

        self.keep(undo)


def _define_probes(capability: tuple[int, int]) -> Callable[[], None]:
    """The capability probes as torch ops in the ``_C`` namespace, where vLLM's own library has not defined them."""
    library = torch.library.Library("_C", "FRAGMENT")
    for name, answer in CAPABILITY_PROBES.items():
        if hasattr(torch.ops._C, name):
            continue  # vLLM's own extension defines it
        library.define(f"{name}(int cuda_device_capability) -> bool")
        library.impl(name, lambda c, _answer=answer: _answer and c >= 100, "CompositeExplicitAutograd")
    return library._destroy
