"""Everything this library knows about FlashInfer, in one place.

* ``mm_fp4``: how it is called (positional head, keywords, ``backend=``), which of its backends
  read the 128x4 non-shuffled layout SGLang prepares for cutlass, their alignment, the argument
  checks made from tensor metadata before any kernel runs, and the front function with its
  signature that replaces SGLang's alias of it (:func:`mm_fp4_front`).
* ``fp4_quantize``: the activation quantizer (checked against :mod:`sm120_fp4.nvfp4`), and the
  stand-in with its calling convention that simulation uses where the CUDA one cannot run.
* Support checks: whether a FlashInfer backend can run on a device, and why not.

FlashInfer itself is imported lazily, only when one of its kernels is asked about.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from . import nvfp4
from .devices import Device
from .errors import InvalidArgument, describe
from .versions import installed_version

__all__ = [
    "BACKENDS",
    "ROUTED_BACKENDS",
    "MM_FP4_HEAD",
    "version",
    "supported",
    "mm_fp4_backend",
    "check_mm_fp4_args",
    "is_mm_fp4",
    "quantizer",
    "fp4_quantize_stand_in",
    "mm_fp4_front",
]

GemmFn = Callable[..., object]

# FlashInfer backends that read the same non-shuffled 128x4 layout SGLang prepares for cutlass.
# trtllm (shuffled weights) and cutedsl_low_latency (SM100 only) are deliberately absent.
BACKENDS = ("cutlass", "b12x", "cudnn", "cute-dsl")
# Backend names SGLang may pass that read that layout: the decided backend serves them. "cutlass"
# is among them because the runner enum is pinned to FLASHINFER_CUTLASS, after which SGLang passes
# backend="cutlass". trtllm, cute-dsl, marlin and others go to the original.
ROUTED_BACKENDS = frozenset({None, "auto", "cudnn", "cutlass"})
# mm_fp4's leading positional parameters in every release this library knows (0.2.11 - 0.7.x).
MM_FP4_HEAD = ("a", "b", "a_descale", "b_descale", "alpha", "out_dtype")
# Alignment each backend needs on (K, N); off it, kernels return silent garbage (vLLM #48898:
# K not a multiple of 32). cute-dsl on SM12x needs both multiples of 64.
_ALIGN = {"cutlass": (32, 8), "b12x": (32, 8), "cudnn": (32, 8), "cute-dsl": (64, 64)}
_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def version() -> str | None:
    """The installed flashinfer-python version, without importing it."""
    return installed_version("flashinfer-python", "flashinfer")


@functools.lru_cache(maxsize=1)
def _mm_fp4() -> GemmFn:
    from flashinfer import mm_fp4  # heavy: only when a FlashInfer backend is considered

    return mm_fp4


def supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether FlashInfer backend `name` can run on `device`, and why not."""
    if device.simulated:
        return False, "FlashInfer kernels need a real GPU; this device is simulated"
    if not device.is_cuda:
        return False, "FlashInfer kernels need a CUDA device"
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        return False, f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
    found = version()
    if found is None:
        return False, "flashinfer-python is not installed"
    try:
        mm_fp4 = _mm_fp4()
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"flashinfer {found} does not import: {type(exc).__name__}: {exc}"
    if "backend" not in inspect.signature(mm_fp4).parameters:
        return False, f"flashinfer {found} mm_fp4 has no backend= parameter (needs >= 0.2.11)"
    check = getattr(mm_fp4, "is_backend_supported", None)
    if check is not None:
        try:
            ok = check(name, device.sm)
        except Exception as exc:
            return False, f"flashinfer {found} could not check {name!r}: {exc}"
        if not ok:
            return False, f"flashinfer {found} has no {name!r} backend for sm_{device.sm}"
    return True, None


def _bad(param: str, value: object, accepted: str) -> InvalidArgument:
    return InvalidArgument(f"mm_fp4: {param}={describe(value)} is not accepted; expected {accepted}")


def check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, out, align=(32, 8)) -> None:
    """Validate mm_fp4 arguments from tensor metadata only (no host sync); raise InvalidArgument.

    `out` None skips the check of `out`; `align` is the (K, N) alignment the kernel needs.
    """
    if not isinstance(a, torch.Tensor) or a.dtype != torch.uint8 or a.dim() != 2:
        raise _bad("a", a, "packed FP4 activations: a 2-D uint8 tensor (M, K/2)")
    m, k = a.shape[0], a.shape[1] * 2
    if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.dim() != 2 or b.shape[0] != a.shape[1]:
        raise _bad("b", b, f"packed FP4 weights: a 2-D uint8 (K/2={a.shape[1]}, N) view")
    n = b.shape[1]
    if b.stride(0) != 1 or b.stride(1) != a.shape[1]:
        raise _bad("b", b, "the column-major view w.T of a contiguous (N, K/2) weight (strides (1, K/2))")
    if k % align[0] or n % align[1]:
        raise _bad("b", b, f"K % {align[0]} == 0 and N % {align[1]} == 0 for this kernel (got K={k}, N={n})")
    for name, sf, rows in (("a_descale", a_descale, m), ("b_descale", b_descale, n)):
        rows_padded, cols_padded = nvfp4.swizzled_scale_shape(rows, k)
        if not isinstance(sf, torch.Tensor) or sf.dtype not in _SCALE_DTYPES or sf.numel() != rows_padded * cols_padded:
            raise _bad(name, sf, f"128x4 swizzled E4M3 scales (uint8 or float8_e4m3fn) of {rows_padded * cols_padded} elements")
    if not isinstance(alpha, torch.Tensor) or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise _bad("alpha", alpha, "a one-element float32 tensor (the SM120 kernel requires alpha)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise _bad("out_dtype", out_dtype, "torch.bfloat16 or torch.float16")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (m, n) or not out.is_contiguous()):
        raise _bad("out", out, f"a contiguous ({m}, {n}) {out_dtype} tensor")
    if not a.is_contiguous():
        raise _bad("a", a, "a contiguous tensor (row-major packed activations)")
    if not a_descale.is_contiguous():
        raise _bad("a_descale", a_descale, "a contiguous tensor (the swizzled scale bytes in order)")
    if b_descale.dim() != 2 or not b_descale.T.is_contiguous():
        raise _bad("b_descale", b_descale, "the .T view of a contiguous swizzled (ceil128(N), ceil4(K/16)) tensor")
    index = a.get_device()
    others = (("b", b), ("a_descale", a_descale), ("b_descale", b_descale), ("alpha", alpha)) + ((("out", out),) if out is not None else ())
    for name, t in others:
        if t.get_device() != index:
            raise _bad(name, t, f"a tensor on the same device as a ({a.device})")


def mm_fp4_backend(name: str) -> GemmFn:
    """FlashInfer's `name` kernel in the backend convention, called the verified way: explicit
    ``backend=``, ``alpha`` always a float32 device tensor, a preallocated contiguous ``out``."""
    mm_fp4 = _mm_fp4()
    align = _ALIGN.get(name, (32, 8))
    check = check_mm_fp4_args

    def flashinfer_backend(a, b, a_descale, b_descale, alpha, out_dtype, out):
        check(a, b, a_descale, b_descale, alpha, out_dtype, out, align)
        return mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, backend=name)

    flashinfer_backend.__name__ = f"flashinfer_{name.replace('-', '_')}"
    return flashinfer_backend


def is_mm_fp4(original: object) -> str | None:
    """None when `original` is FlashInfer's mm_fp4 with the expected leading parameters, else why not."""
    name, module = getattr(original, "__name__", None), getattr(original, "__module__", "") or ""
    if name != "mm_fp4" or not module.startswith("flashinfer"):
        return f"expected FlashInfer's mm_fp4 here, found {original!r} (FlashInfer missing or another kernel)"
    try:
        params = tuple(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return "cannot read mm_fp4's signature"
    if params[: len(MM_FP4_HEAD)] != MM_FP4_HEAD or "backend" not in params:
        return f"mm_fp4 has another signature {params}; expected it to start {MM_FP4_HEAD} and take backend="
    return None


def quantizer(device: Device) -> tuple[str, GemmFn] | None:
    """FlashInfer's activation quantizer for `device`, when it can run there (sm_100+, real GPU)."""
    if device.simulated or not device.is_cuda or device.capability[0] < 10 or version() is None:
        return None
    try:
        from flashinfer import fp4_quantize
    except Exception:
        return None

    def quantize(x, global_scale):
        return fp4_quantize(x, global_scale.reshape(1), 16, False, True)

    return "flashinfer.fp4_quantize", quantize


def fp4_quantize_stand_in(original: Callable | None) -> Callable:
    """``fp4_quantize``'s calling convention computed by nvfp4.quantize (simulation only).

    `original` may be None: SGLang binds None where its CUDA import failed. Arguments outside the
    simulated case (another block size, UE8M0 scales, a linear layout) go to `original`, or raise.
    """

    def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, *args, **kwargs):
        if sf_vec_size != 16 or sf_use_ue8m0 or not is_sf_swizzled_layout or args or kwargs.get("is_sf_8x4_layout"):
            if original is None:
                raise NotImplementedError(
                    "sm120_fp4 simulation: fp4_quantize is simulated for 16-element blocks, E4M3 scales and the "
                    f"128x4 layout only (sf_vec_size={sf_vec_size}, sf_use_ue8m0={sf_use_ue8m0}, "
                    f"is_sf_swizzled_layout={is_sf_swizzled_layout}); SGLang's own quantizer is unavailable here"
                )
            return original(input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout, *args, **kwargs)
        rows = input.reshape(-1, input.shape[-1])
        packed, scales = nvfp4.quantize(rows, global_scale.float().reshape(()), check_finite=False)
        return packed.reshape(*input.shape[:-1], packed.shape[-1]), scales.view(torch.uint8)

    fp4_quantize.__wrapped__ = original
    return fp4_quantize


def mm_fp4_front(original: GemmFn, route: Callable[[int], GemmFn | None], ensure: Callable[[int], GemmFn | None],
                 name_of: Callable[[int], str]) -> GemmFn:
    """A function with mm_fp4's signature that serves routable calls with the routed backend.

    `route(index)` is the hot-path lookup of the backend decided for a device (None: not decided
    yet, or not ours); `ensure(index)` decides on first use (and returns None for a device this
    library does not serve). Calls it cannot serve the same way (another backend, another scale
    layout or block size, keywords it does not know) go to `original` unchanged. It always returns
    the tensor the backend wrote, never what the backend returned; an empty batch gives an empty
    result. A failure is explained: bad arguments raise InvalidArgument naming the parameter, a
    backend's own error gets a note naming the backend (never replaced by zeros).
    """
    routed = ROUTED_BACKENDS
    bf16 = torch.bfloat16
    empty = torch.empty

    def explain(exc, a, b, a_descale, b_descale, alpha, out_dtype) -> None:
        try:  # only on failure: validation costs nothing on the served path
            check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, None, align=(2, 1))
        except InvalidArgument as bad:
            raise bad from exc
        index = a.get_device()
        exc.add_note(f"sm120_fp4: raised by FP4 GEMM backend {name_of(index)!r} on device {index} "
                     f"(M={a.shape[0]}); never replaced by zeros")

    def serve(fn, a, b, a_descale, b_descale, alpha, out_dtype, out):
        try:
            result = out if out is not None and out.is_contiguous() else empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
            if a.shape[0]:
                fn(a, b, a_descale, b_descale, alpha, out_dtype, result)
        except Exception as exc:
            explain(exc, a, b, a_descale, b_descale, alpha, out_dtype)
            raise
        if out is None or out is result:
            return result
        out.copy_(result)  # a non-contiguous out: the kernels need a contiguous one
        return out

    def flashinfer_fp4_gemm(
        a, b, a_descale, b_descale, alpha=None, out_dtype=bf16, out=None,
        block_size=16, use_8x4_sf_layout=False, backend="auto", **kwargs,
    ):
        try:
            index = a.get_device()
        except AttributeError:
            raise _bad("a", a, "packed FP4 activations: a 2-D uint8 tensor (M, K/2)") from None
        fn = route(index)
        if fn is not None and backend in routed and alpha is not None and block_size == 16 and not use_8x4_sf_layout and not kwargs:
            if out is None:
                # SGLang never passes out: allocate it here (FlashInfer then skips its own allocation).
                try:
                    out = empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
                    if a.shape[0]:
                        fn(a, b, a_descale, b_descale, alpha, out_dtype, out)
                except Exception as exc:
                    explain(exc, a, b, a_descale, b_descale, alpha, out_dtype)
                    raise
                return out
            return serve(fn, a, b, a_descale, b_descale, alpha, out_dtype, out)
        fn = ensure(index)  # first call on this device: decide (self-test) once
        if fn is None or backend not in routed or block_size != 16 or use_8x4_sf_layout or kwargs:
            return original(
                a, b, a_descale, b_descale, alpha, out_dtype, out,
                block_size=block_size, use_8x4_sf_layout=use_8x4_sf_layout, backend=backend, **kwargs,
            )
        if alpha is None:
            alpha = _alpha_one(a.device)  # the SM120 kernel requires alpha; None means 1.0
        return serve(fn, a, b, a_descale, b_descale, alpha, out_dtype, out)

    flashinfer_fp4_gemm.__wrapped__ = original
    flashinfer_fp4_gemm.__qualname__ = "sm120_fp4.kernels.flashinfer_fp4_gemm"
    return flashinfer_fp4_gemm


_alpha_cache: dict[torch.device, torch.Tensor] = {}


def _alpha_one(device: torch.device) -> torch.Tensor:
    alpha = _alpha_cache.get(device)
    if alpha is None:
        alpha = _alpha_cache.setdefault(device, torch.ones(1, dtype=torch.float32, device=device))
    return alpha
