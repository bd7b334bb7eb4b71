"""Every stand-in that lets SGLang's real FP4 path run without an SM120 GPU (``SM120_FP4_SIMULATE`` only).

Each is in the patch ledger, logged as simulated and undone by ``uninstall()``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

import torch

from .. import engines
from ..backends.flashinfer import fp4_quantize_stand_in
from ..devices import cpu_thread_binding, ranks_in
from ..patching import PatchSpec
from .cpu_engine import KERNEL_PACKAGE, cpu_engine_selected, kernel_package_stand_in
from .cpu_engine import OPS as CPU_ENGINE_OPS
from .release import CT, CT_CONFIG, FP4_UTILS, MQ, RUNTIME_CONTEXT, platform_facts, sglang_version, supported

_LOG = logging.getLogger("sm120_fp4")
_WHY = "simulation only (SM120_FP4_SIMULATE): lets SGLang's FP4 linear path run without an SM120 GPU"
_NEVER = "never used outside simulation"
OP_NAME = "sglang::fp4_gemm"


def _sim(name: str, module: str, attribute: str, why: str, **fields) -> PatchSpec:
    """Declare one stand-in, in the ledger as never used outside simulation."""
    return PatchSpec(name, module, attribute, f"{_WHY}; {why}", "-", _NEVER, **fields)


PLATFORM_FACTS = _sim(
    "sim-platform-facts",
    RUNTIME_CONTEXT,
    "override_platform",
    "SGLang's platform facts (0.5.19+) report the simulated Blackwell SM12x device",
)
FP4_GEMM_CPU_KERNEL = _sim(
    "sim-fp4-gemm-cpu-kernel",
    MQ,
    "fp4_gemm",
    "without CUDA, SGLang's op sglang::fp4_gemm, registered for the GPU only (0.5.8+), gets a CPU kernel: its own "
    "Python body, which calls the patched alias",
    versions=supported(">=0.5.8"),
)
# The activation quantizer each linear path calls: the module global fp4_quantize in every supported release
# (scripts/sglang_matrix.py checks each release's caller against it).
QUANTIZER_CALLERS = {MQ: "ModelOptFp4LinearMethod.apply", CT: "CompressedTensorsW4A4Fp4.apply_weights"}
QUANTIZER = _sim(
    "sim-activation-quantizer",
    MQ,
    "fp4_quantize",
    "ModelOptFp4LinearMethod.apply quantizes with fp4_quantize (FlashInfer's, SM100+ only; or sgl_kernel's "
    "scaled_fp4_quant under that name)",
    make=fp4_quantize_stand_in,
    distribution="sglang",
    versions=supported(">=0.5.8"),
)
QUANTIZER_CT = _sim(
    "sim-activation-quantizer-ct",
    CT,
    "fp4_quantize",
    "CompressedTensorsW4A4Fp4.apply_weights quantizes with fp4_quantize, imported by name",
    make=fp4_quantize_stand_in,
    distribution="sglang",
    versions=supported(">=0.5.8"),
)
QUANTIZERS = (QUANTIZER, QUANTIZER_CT)
KERNEL_PACKAGE_STAND_IN = _sim(
    "sim-kernel-package",
    KERNEL_PACKAGE,
    "*",
    f"without CUDA, an installed {KERNEL_PACKAGE} that cannot load (0.5.8-0.5.10.post1 may import it on the way to "
    "the FP4 module) is replaced at import by a stand-in whose functions raise when called; with SGLang's CPU engine "
    "selected also a missing one, serving in pure PyTorch the one op a request calls",
)


PYNCCL = "sglang.srt.distributed.device_communicators.pynccl"
NCCL_PATH_VAR = "SGLANG_NCCL_SO_PATH"  # SGLang's own: which NCCL library its communicator loads


def cpu_tp_specs() -> list[PatchSpec]:
    """Return the stand-in that turns SGLang's NCCL communicator off for its CPU engine (several CPU ranks)."""
    return [
        _sim(
            "sim-cpu-engine-nccl-off",
            PYNCCL,
            "NCCLLibrary",
            "with SGLang's CPU engine selected, its NCCL communicator does not load (a CUDA-build torch finds libnccl, "
            "then fails 'Expected a cuda device, but got: cpu' at TP>1), so SGLang takes its own non-GPU branch "
            "and its ranks all-reduce over gloo",
            make=_nccl_off,
            distribution="sglang",
            versions=supported(">=0.5.8"),
            check=_nccl_off_check,
        )
    ]


def _nccl_off_check(original: Any) -> str | None:
    """Return why NCCL stays as it is (a GPU engine, CUDA present, the operator's SGLANG_NCCL_SO_PATH), or None."""
    if not cpu_engine_selected():
        return "not needed: SGLang's CPU engine is not selected (SGLANG_USE_CPU_ENGINE)"
    if torch.cuda.is_available():
        return "not needed: CUDA is available, NCCL serves the ranks"
    if os.environ.get(NCCL_PATH_VAR):
        return f"not needed: the operator's {NCCL_PATH_VAR} is left as set"
    return None if callable(original) else f"NCCLLibrary is {original!r}, not callable"


def _nccl_off(original: Callable) -> Callable:
    """Return an NCCLLibrary that never loads: PyNcclCommunicator catches it and stays disabled (SGLang's own branch)."""

    def NCCLLibrary(*args, **kwargs):  # the name SGLang calls
        raise OSError("sm120_fp4 simulation: NCCL is off for SGLang's CPU engine (its ranks all-reduce over gloo)")

    NCCLLibrary.__wrapped__ = original
    return NCCLLibrary


THREADS_BIND_VAR = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's CPU engine: each rank's cores, "|" between ranks
PARALLEL_FLAGS = {
    "tp": ("--tp", "--tp-size", "--tensor-parallel-size"),
    "pp": ("--pp", "--pp-size", "--pipeline-parallel-size"),
    "dp": ("--dp", "--dp-size", "--data-parallel-size"),
}


def cpu_tp_env(command: list[str]) -> dict[str, str]:
    """Return what SGLang's CPU engine needs for `command`'s ranks here: this process's cores split over them.

    Empty for one rank, without the CPU engine, or where the operator set SGLANG_CPU_OMP_THREADS_BIND (left alone).
    """
    ranks = ranks_in(command, PARALLEL_FLAGS)
    if ranks < 2 or not cpu_engine_selected() or os.environ.get(THREADS_BIND_VAR):
        return {}
    return {THREADS_BIND_VAR: cpu_thread_binding(ranks)}


def specs(capability: tuple[int, int] = (12, 0)) -> list[PatchSpec]:
    """Return the stand-ins guarded by version: the activation quantizers, compressed-tensors' capability check, the
    Blackwell check, NCCL off."""
    return [
        *QUANTIZERS,
        *cpu_tp_specs(),
        _sim(
            "sim-ct-capability-check",
            CT_CONFIG,
            "CompressedTensorsConfig._check_scheme_supported",
            "compressed-tensors asks torch.cuda.get_device_capability() when it picks a layer's scheme (no NVIDIA "
            "driver: the scheduler dies before any layer loads); answered from the simulated capability",
            make=lambda original: _scheme_check_stand_in(original, capability),
            distribution="sglang",
            versions=supported(">=0.5.8"),
            check=_callable_check("_check_scheme_supported"),
        ),
        _sim(
            "sim-blackwell-check",
            MQ,
            "is_blackwell_supported",
            "0.5.13-0.5.18 check is_blackwell_supported() and have no override_platform",
            make=lambda original: lambda *args, **kwargs: True,
            distribution="sglang",
            versions=">=0.5.13,<0.5.19",
            check=_callable_check("is_blackwell_supported"),
        ),
    ]


def ledger_rows() -> list[PatchSpec]:
    """Return every simulation stand-in, attribute or not, for the ledger (patches/LEDGER.md, doctor)."""
    return [*specs(), PLATFORM_FACTS, FP4_GEMM_CPU_KERNEL, KERNEL_PACKAGE_STAND_IN]


def _scheme_check_stand_in(original: Callable, capability: tuple[int, int]) -> Callable:
    """Return CompressedTensorsConfig._check_scheme_supported, answered for the simulated capability."""

    def _check_scheme_supported(self, min_capability: int, error: bool = True) -> bool:
        current = capability[0] * 10 + capability[1]
        supported = current >= min_capability
        if error and not supported:
            raise RuntimeError(
                f"Quantization scheme is not supported for the current GPU. Min capability: "
                f"{min_capability}. Current capability: {current} (simulated)."
            )
        return supported

    _check_scheme_supported.__wrapped__ = original
    return _check_scheme_supported


def _callable_check(name: str):
    return lambda original: None if callable(original) else f"{name} is {original!r}, not callable"


class Simulation(engines.Simulation):
    """Hold the non-attribute stand-ins of one install (platform facts, the CPU op kernel) and their undo."""

    def arm(self) -> None:
        """Run the non-attribute stand-ins when (or if) SGLang imports their modules."""
        self.arm_kernel_package()
        self.patcher.when_imported(RUNTIME_CONTEXT, self.on_runtime_context)
        self.patcher.when_imported(MQ, self.fp4_gemm_cpu_kernel)

    def on_runtime_context(self, module: Any) -> None:
        """Make SGLang's platform checks see the simulated Blackwell SM12x device (0.5.19+)."""
        override = getattr(module, "override_platform", None)
        if override is None:
            self.patcher.note(PLATFORM_FACTS, "skipped", "this SGLang release has no override_platform")
            return
        scope = override(**platform_facts(module, self.capability))
        scope.install()
        self.keep(scope.restore)
        self.patcher.note(PLATFORM_FACTS, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: SGLang's platform facts now report sm_%d%d", *self.capability)

    def fp4_gemm_cpu_kernel(self, module: Any) -> None:
        """Without CUDA, give the op sglang::fp4_gemm a CPU kernel (its own Python body) when it has none."""
        spec = FP4_GEMM_CPU_KERNEL
        if torch.cuda.is_available():
            self.patcher.note(spec, "skipped", "CUDA is available: the op's own CUDA kernel runs")
            return
        if not hasattr(torch.ops.sglang, "fp4_gemm"):
            self.patcher.note(spec, "skipped", "not needed: this release has no sglang::fp4_gemm custom op")
            return
        body = _op_body(module)
        if body is None:
            reason = (
                f"cannot take effect: {OP_NAME} has no CPU kernel and {module.__name__} has no Python body for it "
                "(neither the op's function nor flashinfer_fp4_gemm): a simulated GEMM fails in the dispatcher"
            )
            self.patcher.note(spec, "skipped", reason)
            _LOG.warning("sm120_fp4: SIMULATION: %s %s (sglang %s)", spec.name, reason, sglang_version())
            return
        library = torch.library.Library("sglang", "IMPL")
        library.impl("fp4_gemm", body, "CPU")
        self.keep(library._destroy)
        self.patcher.note(spec, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: registered a CPU kernel for sglang::fp4_gemm")

    def arm_kernel_package(self) -> None:
        """Without CUDA: `import sgl_kernel` loads the real package if it can, else the stand-in."""
        spec = KERNEL_PACKAGE_STAND_IN
        if torch.cuda.is_available():
            self.patcher.note(spec, "skipped", "CUDA is available: the real kernel package loads")
            return
        if KERNEL_PACKAGE in sys.modules:
            self.patcher.note(spec, "skipped", f"{KERNEL_PACKAGE} was imported before install()")
            return
        serve = CPU_ENGINE_OPS if cpu_engine_selected() else None
        remove = kernel_package_stand_in(lambda reason: self._kernel_stand_in_used(spec, reason, serve), serve)
        self.keep(remove)

    def _kernel_stand_in_used(self, spec: PatchSpec, reason: str, serve: dict | None) -> None:
        self.patcher.note(spec, "applied", None)
        served = f"; it serves the CPU engine's {', '.join(sorted(serve))} in pure PyTorch" if serve else ""
        _LOG.warning(
            "sm120_fp4: SIMULATION: %s cannot load here (%s); SGLang imports a stand-in whose "
            "other functions raise when called%s",
            KERNEL_PACKAGE,
            reason,
            served,
        )


def _op_body(module: Any) -> Callable | None:
    """Return the Python function behind sglang::fp4_gemm in `module` (several wrappers across releases)."""
    handle = getattr(module, "fp4_gemm", None)
    seen = set()
    while handle is not None and id(handle) not in seen:
        seen.add(id(handle))
        code = getattr(handle, "__code__", None)
        if code is not None and "flashinfer_fp4_gemm" in code.co_names:
            return handle
        handle = (
            getattr(handle, "__wrapped__", None) or getattr(handle, "op_func", None) or getattr(handle, "func", None)
        )
    if hasattr(module, "flashinfer_fp4_gemm"):
        return _op_body_stand_in(module)
    return None


def _op_body_stand_in(module: Any) -> Callable:
    """Return the op's body (w4a4) calling the module's alias, for 0.5.8-0.5.22, which keep only the op handle."""

    def fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, out_features, quant_mode="w4a4"):
        if quant_mode != "w4a4":
            raise NotImplementedError(f"sm120_fp4 simulation: quant_mode {quant_mode!r} is not simulated")
        fp4_utils = sys.modules.get(FP4_UTILS)
        backend = fp4_utils.get_fp4_gemm_runner_backend().get_flashinfer_backend() if fp4_utils else "auto"
        return module.flashinfer_fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, backend=backend)

    return fp4_gemm
