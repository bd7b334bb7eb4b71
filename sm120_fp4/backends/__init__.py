"""The registry of FP4 GEMM backends, all behind ``flashinfer.mm_fp4``'s calling convention.

Every backend is called as ``fn(a, b, a_descale, b_descale, alpha, out_dtype, out)`` and must
write the result into `out` (contiguous, preallocated by the caller) and return it.

* FlashInfer backends (``cutlass``, ``b12x``, ``cudnn``, ``cute-dsl``): :mod:`.flashinfer`
  calls them the verified way; FlashInfer is imported only when one is asked about.
* ``emulated``: :mod:`sm120_fp4.nvfp4` dequantize (:mod:`.emulated`) + float32 matmul; slow, exact, runs anywhere.
  ``emulated-cached`` keeps the dequantized weight (decode-speed emulation, more memory).
* ``register()`` adds user or test backends (a fault-injecting one, another kernel library).
* Entry points: a name no process registered is looked up in the entry-point group
  ``sm120_fp4.backends`` (``sm120_fp4.moe_backends`` for MoE) of the installed distributions, so a
  backend reaches spawned SGLang workers too (``register()`` in a launcher does not). The entry
  point's name is the backend's name; its object is the backend function, with an optional
  ``is_supported`` attribute (docs/operations.md has an example).

NVFP4 fused-MoE backends have a registry of their own (``register_moe()``, ...) with the convention
of :func:`sm120_fp4.nvfp4.reference_moe_fp4`; built-ins: ``cutlass`` (FlashInfer's
``cutlass_fused_moe``, called as SGLang calls it) and ``emulated`` (the oracle's arithmetic, capture-safe).
"""

from . import emulated as _emulated
from . import registry as _registry
from .emulated import *  # noqa: F403
from .registry import *  # noqa: F403

__all__ = [*_registry.__all__, *_emulated.__all__]
