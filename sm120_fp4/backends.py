"""The registry of FP4 GEMM backends, all behind ``flashinfer.mm_fp4``'s calling convention.

Every backend is called as ``fn(a, b, a_descale, b_descale, alpha, out_dtype, out)`` and must
write the result into `out` (contiguous, preallocated by the caller) and return it.

* FlashInfer backends (``cutlass``, ``b12x``, ``cudnn``, ``cute-dsl``): :mod:`sm120_fp4.kernels`
  calls them the verified way; FlashInfer is imported only when one is asked about.
* ``emulated``: :mod:`sm120_fp4.nvfp4` dequantize + float32 matmul; slow, exact, runs anywhere.
  ``emulated-cached`` keeps the dequantized weight (decode-speed emulation, more memory).
* ``register()`` adds user or test backends (a fault-injecting one, another kernel library).
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from . import kernels, nvfp4
from .devices import Device
from .errors import ConfigError, InvalidArgument

__all__ = [
    "Backend",
    "FLASHINFER_BACKENDS",
    "register",
    "unregister",
    "get",
    "names",
    "is_supported",
    "resolve",
    "quantizer_for",
    "flashinfer_version",
    "emulated_mm_fp4",
]

GemmFn = Callable[..., object]
SupportFn = Callable[[Device], "tuple[bool, str | None]"]

FLASHINFER_BACKENDS = kernels.BACKENDS
EMULATED = "emulated"
EMULATED_CACHED = "emulated-cached"
flashinfer_version = kernels.version


@dataclass(frozen=True)
class Backend:
    """A named GEMM with its support check; `fn` is None until resolved (FlashInfer: lazily)."""

    name: str
    kind: str  # "flashinfer" | "emulated" | "registered"
    fn: GemmFn | None
    supported: SupportFn


def emulated_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """The `emulated` backend: the nvfp4 reference GEMM (dequantize + float32 matmul)."""
    return nvfp4.reference_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out)


class _WeightCache:
    """Dequantized bf16 weights for `emulated-cached`, valid while the weight is alive and unchanged.

    Memory: 2 bytes per weight element, four times the packed FP4 weight (0.5 byte per element)
    plus its scales: opt in by naming the backend in SM120_FP4_BACKENDS.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def get(self, b, b_descale, dtype):
        base = b._base if b._base is not None else b
        key = id(base)
        version = (base._version, b_descale._version, b.data_ptr(), b_descale.data_ptr(), tuple(b.shape), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is base and entry[1] == version:
            return entry[2]
        weight = nvfp4.dequantize_unscaled(b.T, b_descale.T, dtype)
        with self._lock:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
            self._entries[key] = (weakref.ref(base), version, weight)
        return weight


_weight_cache = _WeightCache()


def emulated_cached_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """`emulated` with the weight's dequantization cached (decode-speed emulation, more memory).

    Only where the reference runs its bf16 GEMM (CUDA): the cached copy is the bf16 one.
    """
    dtype = nvfp4.gemm_operand_dtype(a)
    cached = _weight_cache.get(b, b_descale, dtype) if dtype == torch.bfloat16 else None
    return nvfp4.reference_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, dequantized_b=cached)


def _always(device: Device) -> tuple[bool, str | None]:
    return True, None


_lock = threading.Lock()
_registry: dict[str, Backend] = {}


def _builtins() -> None:
    for name in FLASHINFER_BACKENDS:
        _registry[name] = Backend(name, "flashinfer", None, functools.partial(kernels.supported, name))
    _registry[EMULATED] = Backend(EMULATED, "emulated", emulated_mm_fp4, _always)
    _registry[EMULATED_CACHED] = Backend(EMULATED_CACHED, "emulated", emulated_cached_mm_fp4, _always)


_builtins()


def register(name: str, fn: GemmFn, is_supported: SupportFn | None = None, *, replace: bool = False) -> None:
    """Add backend `name`: `fn` follows mm_fp4's convention; `is_supported(device) -> (ok, reason)`."""
    if not isinstance(name, str) or not name or name != name.strip().lower() or "," in name:
        raise InvalidArgument(f"register: name={name!r} is not accepted; expected a lower-case name without commas")
    if not callable(fn):
        raise InvalidArgument(f"register: fn={fn!r} is not accepted; expected a callable")
    if is_supported is not None and not callable(is_supported):
        raise InvalidArgument(f"register: is_supported={is_supported!r} is not accepted; expected a callable or None")
    with _lock:
        if name in _registry and not replace:
            raise InvalidArgument(f"register: name={name!r} is already registered; pass replace=True to replace it")
        _registry[name] = Backend(name, "registered", fn, is_supported or _always)


def unregister(name: str) -> None:
    """Remove a registered backend; built-ins are restored to their original definition."""
    with _lock:
        _registry.pop(name, None)
        if name in FLASHINFER_BACKENDS or name in (EMULATED, EMULATED_CACHED):
            _builtins()


def names() -> tuple[str, ...]:
    with _lock:
        return tuple(_registry)


def get(name: str) -> Backend:
    with _lock:
        backend = _registry.get(name)
    if backend is None:
        raise ConfigError(f"unknown FP4 GEMM backend {name!r}; known: {', '.join(names())}")
    return backend


def is_supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether backend `name` can run on `device`, and why not."""
    backend = get(name)
    try:
        ok, reason = backend.supported(device)
    except Exception as exc:
        return False, f"support check raised {type(exc).__name__}: {exc}"
    return bool(ok), (None if ok else reason or "not supported")


def resolve(name: str) -> GemmFn:
    """The callable to run for backend `name` (FlashInfer imported here, not before)."""
    backend = get(name)
    return backend.fn if backend.fn is not None else kernels.mm_fp4_backend(name)


def quantizer_for(name: str, device: Device) -> tuple[str, GemmFn] | None:
    """The activation quantizer that serves alongside backend `name` on `device`, where it can be
    checked there (FlashInfer's, for FlashInfer backends on sm_100+); None otherwise."""
    return kernels.quantizer(device) if get(name).kind == "flashinfer" else None
