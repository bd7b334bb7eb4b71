"""FP4 GEMM backends behind ``flashinfer.mm_fp4``'s calling convention.

Every backend is called as ``fn(a, b, a_descale, b_descale, alpha, out_dtype, out)`` and must
write the result into `out` (contiguous, preallocated by the caller) and return it.

* FlashInfer backends (``cutlass``, ``b12x``, ``cudnn``, ``cute-dsl``) are called the verified
  way: explicit ``backend=``, ``alpha`` always a float32 device tensor, a preallocated ``out``.
  FlashInfer is imported only when a FlashInfer backend is asked about.
* ``emulated``: :mod:`sm120_fp4.nvfp4` dequantize + float32 matmul; slow, exact, runs anywhere.
* ``register()`` adds user or test backends (a fault-injecting one, another kernel library).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from . import nvfp4
from .devices import Device
from .errors import ConfigError, InvalidArgument, describe

__all__ = [
    "Backend",
    "FLASHINFER_BACKENDS",
    "register",
    "unregister",
    "get",
    "names",
    "is_supported",
    "resolve",
    "flashinfer_version",
    "emulated_mm_fp4",
]

GemmFn = Callable[..., object]
SupportFn = Callable[[Device], "tuple[bool, str | None]"]

# FlashInfer backends that read the same non-shuffled 128x4 layout SGLang prepares for cutlass.
# trtllm (shuffled weights) and cutedsl_low_latency (SM100 only) are deliberately absent.
FLASHINFER_BACKENDS = ("cutlass", "b12x", "cudnn", "cute-dsl")
EMULATED = "emulated"
EMULATED_CACHED = "emulated-cached"


@dataclass(frozen=True)
class Backend:
    """A named GEMM with its support check; `fn` is None until resolved (FlashInfer: lazily)."""

    name: str
    kind: str  # "flashinfer" | "emulated" | "registered"
    fn: GemmFn | None
    supported: SupportFn


def flashinfer_version() -> str | None:
    """The installed flashinfer-python version, without importing it."""
    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _mm_fp4() -> GemmFn:
    from flashinfer import mm_fp4  # heavy: only when a FlashInfer backend is considered

    return mm_fp4


def _flashinfer_supported(name: str, device: Device) -> tuple[bool, str | None]:
    if device.simulated:
        return False, "FlashInfer kernels need a real GPU; this device is simulated"
    if not device.is_cuda:
        return False, "FlashInfer kernels need a CUDA device"
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        return False, f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
    version = flashinfer_version()
    if version is None:
        return False, "flashinfer-python is not installed"
    try:
        mm_fp4 = _mm_fp4()
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"flashinfer {version} does not import: {type(exc).__name__}: {exc}"
    if "backend" not in inspect.signature(mm_fp4).parameters:
        return False, f"flashinfer {version} mm_fp4 has no backend= parameter (needs >= 0.2.11)"
    check = getattr(mm_fp4, "is_backend_supported", None)
    if check is not None:
        try:
            ok = check(name, device.sm)
        except Exception as exc:
            return False, f"flashinfer {version} could not check {name!r}: {exc}"
        if not ok:
            return False, f"flashinfer {version} has no {name!r} backend for sm_{device.sm}"
    return True, None


# Alignment each FlashInfer backend needs on (K, N); off it, kernels return silent garbage
# (vLLM #48898: K not a multiple of 32). cute-dsl on SM12x needs both multiples of 64.
_ALIGN = {"cutlass": (32, 8), "b12x": (32, 8), "cudnn": (32, 8), "cute-dsl": (64, 64)}
_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def _bad(param: str, value: object, accepted: str) -> InvalidArgument:
    return InvalidArgument(f"mm_fp4: {param}={describe(value)} is not accepted; expected {accepted}")


def check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, out, align=(32, 8)) -> None:
    """Validate mm_fp4 arguments from tensor metadata only (no host sync); raise InvalidArgument."""
    if a.dtype != torch.uint8 or a.dim() != 2:
        raise _bad("a", a, "packed FP4 activations: a 2-D uint8 tensor (M, K/2)")
    m, k = a.shape[0], a.shape[1] * 2
    if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise _bad("b", b, f"packed FP4 weights: a 2-D uint8 (K/2={a.shape[1]}, N) view")
    n = b.shape[1]
    if b.stride(0) != 1 or b.stride(1) != a.shape[1]:
        raise _bad("b", b, "the column-major view w.T of a contiguous (N, K/2) weight (strides (1, K/2))")
    if k % align[0] or n % align[1]:
        raise _bad("b", b, f"K % {align[0]} == 0 and N % {align[1]} == 0 for this kernel (got K={k}, N={n})")
    for name, sf, rows in (("a_descale", a_descale, m), ("b_descale", b_descale, n)):
        rows_padded, cols_padded = nvfp4.swizzled_scale_shape(rows, k)
        if sf.dtype not in _SCALE_DTYPES or sf.numel() != rows_padded * cols_padded:
            raise _bad(name, sf, f"128x4 swizzled E4M3 scales (uint8 or float8_e4m3fn) of {rows_padded * cols_padded} elements")
    if alpha is None or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise _bad("alpha", alpha, "a one-element float32 tensor (the SM120 kernel requires alpha)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise _bad("out_dtype", out_dtype, "torch.bfloat16 or torch.float16")
    if out.dtype != out_dtype or tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise _bad("out", out, f"a contiguous ({m}, {n}) {out_dtype} tensor")
    index = a.get_device()
    for name, t in (("b", b), ("a_descale", a_descale), ("b_descale", b_descale), ("alpha", alpha), ("out", out)):
        if t.get_device() != index:
            raise _bad(name, t, f"a tensor on the same device as a ({a.device})")


def _flashinfer_fn(name: str) -> GemmFn:
    mm_fp4 = _mm_fp4()
    align = _ALIGN.get(name, (32, 8))
    check = check_mm_fp4_args

    def flashinfer_backend(a, b, a_descale, b_descale, alpha, out_dtype, out):
        check(a, b, a_descale, b_descale, alpha, out_dtype, out, align)
        return mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, backend=name)

    flashinfer_backend.__name__ = f"flashinfer_{name.replace('-', '_')}"
    return flashinfer_backend


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
        _registry[name] = Backend(name, "flashinfer", None, functools.partial(_flashinfer_supported, name))
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
    return backend.fn if backend.fn is not None else _flashinfer_fn(name)


def flashinfer_quantizer(device: Device) -> tuple[str, GemmFn] | None:
    """FlashInfer's activation quantizer for `device`, when it can run there (sm_100+, real GPU)."""
    if device.simulated or not device.is_cuda or device.capability[0] < 10 or flashinfer_version() is None:
        return None
    try:
        from flashinfer import fp4_quantize
    except Exception:
        return None

    def quantize(x, global_scale):
        return fp4_quantize(x, global_scale.reshape(1), 16, False, True)

    return "flashinfer.fp4_quantize", quantize
