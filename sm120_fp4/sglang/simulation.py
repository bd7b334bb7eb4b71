"""Every stand-in that lets SGLang's real FP4 linear path run without an SM120 GPU, in one place.

Inert unless ``SM120_FP4_SIMULATE`` is set. Each stand-in is recorded in the patch ledger and
undone by ``uninstall()``:

* the activation quantizer SGLang calls (FlashInfer's, SM100+ only) -> :func:`nvfp4.quantize`;
* SGLang's platform facts (``override_platform``, 0.5.19+) report a Blackwell SM12x device;
* without CUDA: a CPU kernel for the CUDA-only custom op ``sglang::fp4_gemm`` (the op's own
  Python body, so the patched FlashInfer alias is still what runs), and, scoped to
  ``process_weights_after_loading`` only, ``Tensor.cuda()`` returning the tensor unchanged.

Everything is logged as simulated: nothing here may ever run on a real deployment.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from ..kernels import fp4_quantize_stand_in
from ..patching import PatchSpec, Patcher
from .release import CT, FP4_UTILS, MQ, RUNTIME_CONTEXT

_LOG = logging.getLogger("sm120_fp4")
_WHY = "simulation only (SM120_FP4_SIMULATE): lets SGLang's FP4 linear path run without an SM120 GPU"
_NEVER = "never used outside simulation"
_cuda_lock = threading.Lock()


def specs() -> list[PatchSpec]:
    """Attribute stand-ins: SGLang's activation quantizer, in every module that imported it, and
    the Blackwell check of releases older than SGLang's own override_platform seam."""
    where = [
        ("sim-activation-quantizer", MQ, "FlashInfer's FP4 quantizer needs an SM100+ GPU"),
        ("sim-activation-quantizer-ct", CT, "the compressed-tensors scheme imported the quantizer by name"),
    ]
    return [
        PatchSpec(name, module, "fp4_quantize", f"{_WHY}; {why}", "-", _NEVER, make=fp4_quantize_stand_in)
        for name, module, why in where
    ] + [
        PatchSpec(
            "sim-blackwell-check", MQ, "is_blackwell_supported",
            f"{_WHY}; 0.5.13-0.5.18 check is_blackwell_supported() and have no override_platform", "-", _NEVER,
            make=lambda original: lambda *args, **kwargs: True,
            distribution="sglang", versions=">=0.5.13,<0.5.19", check=_callable_check("is_blackwell_supported"),
        )
    ]


def _callable_check(name: str):
    return lambda original: None if callable(original) else f"{name} is {original!r}, not callable"


class Simulation:
    """The non-attribute stand-ins of one install (platform facts, the CPU op kernel)."""

    def __init__(self, capability: tuple[int, int], patcher: Patcher) -> None:
        self.capability = capability
        self.patcher = patcher
        self._undo: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def arm(self) -> None:
        """Run the non-attribute stand-ins when (or if) SGLang imports their modules."""
        self.patcher.when_imported(RUNTIME_CONTEXT, self.on_runtime_context)
        self.patcher.when_imported(MQ, self.on_modelopt)

    def on_runtime_context(self, module: Any) -> None:
        """Make SGLang's platform checks see the simulated Blackwell SM12x device (0.5.19+)."""
        override = getattr(module, "override_platform", None)
        spec = PatchSpec("sim-platform-facts", RUNTIME_CONTEXT, "override_platform", _WHY, "-", _NEVER)
        if override is None:
            self.patcher.note(spec, "skipped", "this SGLang release has no override_platform")
            return
        major, minor = self.capability
        facts = {
            "is_blackwell": major in (10, 11, 12),
            "is_sm120": major == 12,
            "is_sm100": major == 10,
            "is_sm100_or_sm110": major in (10, 11),
            "is_sm110": major == 11,
            "device_capability": (major, minor),
            "device_sm": major * 10 + minor,
        }
        known = set(getattr(module, "_PLATFORM_PROBES", {})) | set(getattr(module, "_PLATFORM_VALUES", {}))
        scope = override(**{k: v for k, v in facts.items() if not known or k in known})
        scope.install()
        with self._lock:
            self._undo.append(scope.restore)
        self.patcher.note(spec, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: SGLang's platform facts now report sm_%d%d", major, minor)

    def on_modelopt(self, module: Any) -> None:
        """Without CUDA, give the CUDA-only op sglang::fp4_gemm a CPU kernel (its own Python body)."""
        spec = PatchSpec("sim-fp4-gemm-cpu-kernel", MQ, "fp4_gemm", _WHY + "; sglang::fp4_gemm has only a CUDA kernel", "-", _NEVER)
        if torch.cuda.is_available():
            self.patcher.note(spec, "skipped", "CUDA is available: the op's own CUDA kernel runs")
            return
        body = _op_body(module)
        if body is None:
            self.patcher.note(spec, "skipped", "no sglang::fp4_gemm custom op in this release")
            return
        library = torch.library.Library("sglang", "IMPL")
        library.impl("fp4_gemm", body, "CPU")
        with self._lock:
            self._undo.append(library._destroy)
        self.patcher.note(spec, "applied", None)
        _LOG.warning("sm120_fp4: SIMULATION: registered a CPU kernel for sglang::fp4_gemm")

    def undo(self) -> None:
        with self._lock:
            undo, self._undo = self._undo, []
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()


def _op_body(module: Any) -> Callable | None:
    """The Python function behind sglang::fp4_gemm in `module` (several wrappers across releases)."""
    if not hasattr(torch.ops.sglang, "fp4_gemm"):
        return None
    handle = getattr(module, "fp4_gemm", None)
    seen = set()
    while handle is not None and id(handle) not in seen:
        seen.add(id(handle))
        code = getattr(handle, "__code__", None)
        if code is not None and "flashinfer_fp4_gemm" in code.co_names:
            return handle
        handle = getattr(handle, "__wrapped__", None) or getattr(handle, "op_func", None) or getattr(handle, "func", None)
    if hasattr(module, "flashinfer_fp4_gemm"):
        return _op_body_stand_in(module)
    return None


def _op_body_stand_in(module: Any) -> Callable:
    """0.5.8-0.5.22 keep only the op handle: the same body (w4a4), calling the module's alias."""

    def fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, out_features, quant_mode="w4a4"):
        if quant_mode != "w4a4":
            raise NotImplementedError(f"sm120_fp4 simulation: quant_mode {quant_mode!r} is not simulated")
        fp4_utils = sys.modules.get(FP4_UTILS)
        backend = fp4_utils.get_fp4_gemm_runner_backend().get_flashinfer_backend() if fp4_utils else "auto"
        return module.flashinfer_fp4_gemm(input, weight, input_sf, weight_sf, alpha, out_dtype, backend=backend)

    return fp4_gemm


@contextlib.contextmanager
def cuda_moves_stay_on_cpu(active: bool) -> Iterator[None]:
    """Scoped: ``Tensor.cuda()`` returns the tensor itself (simulation without CUDA only)."""
    if not active or torch.cuda.is_available():
        yield
        return
    with _cuda_lock:
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        try:
            yield
        finally:
            torch.Tensor.cuda = original

