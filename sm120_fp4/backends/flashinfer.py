"""Everything this library knows about FlashInfer, in one place.

* ``mm_fp4``: how it is called (positional head, keywords, ``backend=``), which of its backends
  read the 128x4 non-shuffled layout SGLang prepares for cutlass, their alignment, the argument
  checks made from tensor metadata before any kernel runs (the hot-path fronts that use them are
  in :mod:`sm120_fp4.dispatch`).
* ``fp4_quantize``: the activation quantizer (checked against :mod:`sm120_fp4.nvfp4`), and the
  stand-in with its calling convention that simulation uses where the CUDA one cannot run.
* Support checks: whether a FlashInfer backend can run on a device, and why not.

FlashInfer itself is imported lazily, only when one of its kernels is asked about.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .. import nvfp4
from ..devices import Device
from ..errors import InvalidArgument, not_accepted, say_once
from ..versions import installed_version

__all__ = [
    "BACKENDS",
    "ROUTED_BACKENDS",
    "PASSED_THROUGH_BACKENDS",
    "NEUTRAL_MM_FP4_KEYWORDS",
    "neutral_mm_fp4_keywords",
    "unrouted_mm_fp4_argument",
    "MM_FP4_HEAD",
    "DEFAULT_ORDER",
    "ORDER_BY_CAPABILITY",
    "default_order",
    "DEFAULT_MOE_ORDER",
    "MOE_ORDER_BY_CAPABILITY",
    "default_moe_order",
    "version",
    "supported",
    "Toolchain",
    "toolchain",
    "use_toolchain",
    "jit_problem",
    "b12x_problem",
    "mm_fp4_backend",
    "check_mm_fp4_args",
    "is_mm_fp4",
    "quantizer",
    "fp4_quantize_stand_in",
    "MOE_BACKENDS",
    "MOE_ACTIVATIONS",
    "moe_supported",
    "check_moe_args",
    "moe_backend",
    "moe_call_to_convention",
    "fused_moe_kernel",
    "global_scale",
]

GemmFn = Callable[..., object]

# FlashInfer backends that read the same non-shuffled 128x4 layout SGLang prepares for cutlass.
# trtllm (shuffled weights) and cutedsl_low_latency (SM100 only) are deliberately absent.
BACKENDS = ("cutlass", "b12x", "cudnn", "cute-dsl")
# The default candidate order per compute capability (SM120_FP4_BACKENDS=auto, the default), from
# public reports; a capability not listed gets DEFAULT_ORDER. Each candidate is still self-tested.
#   sm_121 (DGX Spark, GB10): b12x is absent -- FlashInfer #3170 reports the b12x GEMM crashing on
#     SM121 with an illegal memory access, which poisons the CUDA context of the process (a crash,
#     not a wrong answer the self-test could reject); name it explicitly to try it.
#   sm_120 (RTX PRO 6000 / RTX 50xx): cutlass first, b12x second.
# The b12x MoE (backends/b12x_moe.py) is in no default MoE order until an SM120 measurement puts it
# there: it is tried when named in SM120_FP4_MOE_BACKENDS, or after the order with SELECT=fastest on
# sm_120 (FlashInfer #5446: 512 experts crash it; #3170: sm_121). docs/operations.md lists the sources.
#   Last on 12.x: humming (humming-kernels, JIT-compiled, bf16-activation kernels on the FP4
#     weights; sm120_fp4/backends/humming/): the verified fallback that keeps a GPU serving when no FP4
#     kernel verifies. Off 12.x the order is unchanged (nothing is served there unless enabled).
DEFAULT_ORDER: tuple[str, ...] = ("cutlass", "b12x")
ORDER_BY_CAPABILITY: dict[tuple[int, int], tuple[str, ...]] = {
    (12, 0): ("cutlass", "b12x", "humming"),
    (12, 1): ("cutlass", "humming"),
}
# The fused-MoE order SM120_FP4_MOE_BACKENDS=auto means: FlashInfer's cutlass, then Humming's
# grouped W4A16 kernel on 12.x.
DEFAULT_MOE_ORDER: tuple[str, ...] = ("cutlass",)
MOE_ORDER_BY_CAPABILITY: dict[tuple[int, int], tuple[str, ...]] = {
    (12, 0): ("cutlass", "humming"),
    (12, 1): ("cutlass", "humming"),
}


def default_order(capability: tuple[int, int]) -> tuple[str, ...]:
    """The candidate order SM120_FP4_BACKENDS=auto means on a GPU of `capability`."""
    return ORDER_BY_CAPABILITY.get(tuple(capability), DEFAULT_ORDER)


# With SELECT=fastest, candidates timed after the default MoE order (each still verified first).
FASTEST_MOE_EXTRA: dict[tuple[int, int], tuple[str, ...]] = {(12, 0): ("b12x",)}


def default_moe_order(capability: tuple[int, int], fastest: bool = False) -> tuple[str, ...]:
    """The candidate order SM120_FP4_MOE_BACKENDS=auto means on a GPU of `capability` (`fastest`:
    with SM120_FP4_SELECT=fastest, which also times FASTEST_MOE_EXTRA)."""
    order = MOE_ORDER_BY_CAPABILITY.get(tuple(capability), DEFAULT_MOE_ORDER)
    return order + FASTEST_MOE_EXTRA.get(tuple(capability), ()) if fastest else order


# Backend names SGLang may pass that read that layout: the decided backend serves them. "cutlass"
# is among them because the runner enum is pinned to FLASHINFER_CUTLASS, after which SGLang passes
# backend="cutlass". trtllm, cute-dsl, marlin and others go to the original.
ROUTED_BACKENDS = frozenset({None, "auto", "cudnn", "cutlass"})
# Backend names known to read another layout or path and left to the original on purpose (trtllm:
# shuffled weights; cute-dsl: the operator's explicit choice). Any other name (a backend added after
# this library, such as b12x through SGLang's runner enum) is not served unverified on a served
# device: the front refuses it by name (dispatch.mm_fp4_front's `unknown`).
PASSED_THROUGH_BACKENDS = frozenset({"trtllm", "cute-dsl"})
# mm_fp4 keywords that never change the numbers, with the values that leave them so (None: any value):
# a routed call carrying them is served by the routed backend. Any other keyword or value, block_size != 16
# or use_8x4_sf_layout=True asks for something the routed backend was not verified for.
NEUTRAL_MM_FP4_KEYWORDS: dict[str, tuple | None] = {
    "enable_pdl": None,
    "use_nvfp4": (True,),
    "batch_invariant": (False,),
}


def neutral_mm_fp4_keywords(kwargs: dict) -> bool:
    """Whether every keyword of an mm_fp4 call (beyond its named head) leaves the numbers as verified."""
    for name, value in kwargs.items():
        allowed = NEUTRAL_MM_FP4_KEYWORDS.get(name, ())
        if allowed is not None and not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            return False
    return True


def unrouted_mm_fp4_argument(block_size: object, use_8x4_sf_layout: object, kwargs: dict) -> tuple[str, object] | None:
    """The first argument of an mm_fp4 call naming a routed backend that the routed backend was not verified
    for, as (name, value); None when it can be routed."""
    if block_size != 16:
        return "block_size", block_size
    if use_8x4_sf_layout:
        return "use_8x4_sf_layout", use_8x4_sf_layout
    for name, value in kwargs.items():
        if not neutral_mm_fp4_keywords({name: value}):
            return name, value
    return None


# mm_fp4's leading positional parameters in every release this library knows (0.2.11 - 0.7.x).
MM_FP4_HEAD = ("a", "b", "a_descale", "b_descale", "alpha", "out_dtype")
# Alignment each backend needs on (K, N); off it, kernels return silent garbage (vLLM #48898:
# K not a multiple of 32). cute-dsl on SM12x needs both multiples of 64.
_ALIGN = {"cutlass": (32, 8), "b12x": (32, 8), "cudnn": (32, 8), "cute-dsl": (64, 64)}
_SCALE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def version() -> str | None:
    """The installed flashinfer-python version, without importing it."""
    return installed_version("flashinfer-python", "flashinfer")


@contextlib.contextmanager
def autotuning() -> Iterator[None]:
    """FlashInfer's autotuner in tuning mode: a tunable op's first call of a shape profiles its tactics
    (the calls after it, inside or outside, use the pick), as an engine's warm-up does."""
    from flashinfer.autotuner import autotune  # heavy: only where a FlashInfer backend runs

    with autotune(True):
        yield


@functools.lru_cache(maxsize=1)
def _mm_fp4() -> GemmFn:
    from flashinfer import mm_fp4  # heavy: only when a FlashInfer backend is considered

    return mm_fp4


def _unusable(device: Device) -> str | None:
    """Why no FlashInfer kernel can run on `device`, or None."""
    if device.simulated:
        return "FlashInfer kernels need a real GPU; this device is simulated"
    if not device.is_cuda:
        return "FlashInfer kernels need a CUDA device"
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        return f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
    if version() is None:
        return "flashinfer-python is not installed"
    return None


# ---- the toolchain FlashInfer's kernels are built with ---------------------------------------

# FlashInfer's b12x NVFP4 GEMM (_b12x_gemm_fp4_requirement, 0.7.2 to 0.7.4) raises below CUDA 12.9 (its
# get_cuda_version(): nvcc, else torch.version.cuda), and needs the CuTe DSL (nvidia-cutlass-dsl:
# `cutlass` and `cutlass.cute` importable); its b12x MoE needs CUDA 13.
B12X_MIN_CUDA = (12, 9)
# nvcc's crt/math_functions.h up to CUDA 13.0 declares rsqrt/cospi (and friends) in a way that
# clashes with glibc 2.41's own declarations: FlashInfer's and SGLang's JIT modules fail to build.
GLIBC_CLASH = (2, 41)
CUDA_HEADERS_CLASH = (13, 0)  # the newest toolkit whose headers clash


@dataclass(frozen=True)
class Toolchain:
    """What JIT builds here would use: the CUDA toolkit's version and where it was read, the C
    library's version, and why the CuTe DSL cannot be imported (None: it can)."""

    cuda: tuple[int, int] | None
    cuda_source: str
    glibc: tuple[int, int] | None
    cute_dsl_problem: str | None


def _major_minor(text: str | None) -> tuple[int, int] | None:
    match = re.search(r"([0-9]+)\.([0-9]+)", text or "", re.ASCII)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _cuda_toolkit() -> tuple[tuple[int, int] | None, str]:
    """The CUDA version FlashInfer's get_cuda_version() would read: nvcc (CUDA_HOME, CUDA_PATH, PATH,
    /usr/local/cuda), else torch.version.cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    found = shutil.which("nvcc")
    candidates = (
        [os.path.join(h, "bin", "nvcc") for h in homes if h] + ([found] if found else []) + ["/usr/local/cuda/bin/nvcc"]
    )
    for nvcc in candidates:
        if os.path.isfile(nvcc):
            try:
                out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            release = re.search(r"release ([0-9]+\.[0-9]+)", out, re.ASCII)
            version = _major_minor(release.group(1)) if release else None
            if version is not None:
                return version, f"nvcc {nvcc}"
    return _major_minor(
        torch.version.cuda
    ), "torch.version.cuda" if torch.version.cuda else "none found (no nvcc, CPU torch)"


def _glibc() -> tuple[int, int] | None:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.41"
    except (AttributeError, ValueError, OSError):
        text = None
    if not text:
        lib, ver = platform.libc_ver()
        text = ver if lib == "glibc" else None
    return _major_minor(text)


def _cute_dsl() -> str | None:
    try:
        if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cutlass.cute") is None:
            return "nvidia-cutlass-dsl is not installed (`cutlass.cute` not found)"
    except (ImportError, ValueError) as exc:
        return f"nvidia-cutlass-dsl cannot be imported: {type(exc).__name__}: {exc}"
    return None


def _probe_toolchain() -> Toolchain:
    cuda, source = _cuda_toolkit()
    return Toolchain(cuda, source, _glibc(), _cute_dsl())


_toolchain_probe: Callable[[], Toolchain] = _probe_toolchain


@functools.lru_cache(maxsize=4)
def _cached_toolchain(probe: Callable[[], Toolchain]) -> Toolchain:
    return probe()


def toolchain() -> Toolchain:
    """This machine's toolchain for FlashInfer's kernels (probed once per process)."""
    return _cached_toolchain(_toolchain_probe)


@contextlib.contextmanager
def use_toolchain(probe: Callable[[], Toolchain]) -> Iterator[None]:
    """Answer toolchain() with `probe` inside the block (the seam tests use; nvcc and glibc as given)."""
    global _toolchain_probe
    previous, _toolchain_probe = _toolchain_probe, probe
    try:
        yield
    finally:
        _toolchain_probe = previous
        _cached_toolchain.cache_clear()


def _shown_version(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else f"{version[0]}.{version[1]}"


def jit_problem(tc: Toolchain | None = None) -> str | None:
    """Why JIT-compiled kernels (FlashInfer's, SGLang's) will fail to build here, where that is known."""
    tc = tc or toolchain()
    if tc.glibc is not None and tc.glibc >= GLIBC_CLASH and tc.cuda is not None and tc.cuda <= CUDA_HEADERS_CLASH:
        return (
            f"glibc {_shown_version(tc.glibc)} with CUDA {_shown_version(tc.cuda)} headers ({tc.cuda_source}): nvcc's "
            "crt/math_functions.h clashes with glibc >= 2.41's rsqrt/cospi declarations, so FlashInfer's and SGLang's "
            "JIT kernels fail to build; use a CUDA toolkit newer than 13.0, or a system with glibc < 2.41"
        )
    return None


def b12x_problem(tc: Toolchain | None = None) -> str | None:
    """Why FlashInfer's b12x NVFP4 GEMM cannot run here (CUDA toolkit, CuTe DSL), or None."""
    tc = tc or toolchain()
    if tc.cuda is None or tc.cuda < B12X_MIN_CUDA:
        return f"b12x needs CUDA >= {_shown_version(B12X_MIN_CUDA)}; found {_shown_version(tc.cuda)} ({tc.cuda_source})"
    if tc.cute_dsl_problem is not None:
        return f"b12x needs the CuTe DSL: {tc.cute_dsl_problem}"
    return None


def supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether FlashInfer backend `name` can run on `device`, and why not."""
    if device.simulated or version() is None:
        return False, _unusable(device) or "flashinfer-python is not installed"
    if name == "b12x":  # its toolchain first: a real reason, not a self-test call that fails
        problem = b12x_problem()
        if problem is not None:
            return False, problem
    problem = _unusable(device)
    if problem is not None:
        return False, problem
    found = version()
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
    return not_accepted("mm_fp4", param, value, accepted)


def _transposed_contiguous(t: torch.Tensor) -> bool:
    """``t.T.is_contiguous()`` for a 2-D `t`, by PyTorch's own rule, without making the view (the
    check runs at every call: a view costs microseconds of host time)."""
    (n0, n1), (s0, s1) = t.shape, t.stride()
    if n0 == 0 or n1 == 0:
        return True
    return (n0 == 1 or s0 == 1) and (n1 == 1 or s1 == n0)


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
            raise _bad(
                name, sf, f"128x4 swizzled E4M3 scales (uint8 or float8_e4m3fn) of {rows_padded * cols_padded} elements"
            )
    if not isinstance(alpha, torch.Tensor) or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise _bad("alpha", alpha, "a one-element float32 tensor (the SM120 kernel requires alpha)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise _bad("out_dtype", out_dtype, "torch.bfloat16 or torch.float16")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.dtype != out_dtype
        or tuple(out.shape) != (m, n)
        or not out.is_contiguous()
    ):
        raise _bad("out", out, f"a contiguous ({m}, {n}) {out_dtype} tensor")
    if not a.is_contiguous():
        raise _bad("a", a, "a contiguous tensor (row-major packed activations)")
    if not a_descale.is_contiguous():
        raise _bad("a_descale", a_descale, "a contiguous tensor (the swizzled scale bytes in order)")
    if b_descale.dim() != 2 or not _transposed_contiguous(b_descale):
        raise _bad("b_descale", b_descale, "the .T view of a contiguous swizzled (ceil128(N), ceil4(K/16)) tensor")
    index = a.get_device()
    others = (("b", b), ("a_descale", a_descale), ("b_descale", b_descale), ("alpha", alpha)) + (
        (("out", out),) if out is not None else ()
    )
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
    except Exception as exc:  # ImportError, or a broken install raising anything
        say_once(
            logging.WARNING,
            "sm120_fp4: FlashInfer %s's activation quantizer (flashinfer.fp4_quantize) does not import "
            "(%s: %s): self-tests run without it, so the quantizer SGLang calls is not checked by them",
            version(),
            type(exc).__name__,
            exc,
        )
        return None

    def quantize(x, global_scale):
        return fp4_quantize(x, global_scale.reshape(1), 16, False, True)

    return "flashinfer.fp4_quantize", quantize


def fp4_quantize_stand_in(original: Callable | None) -> Callable:
    """``fp4_quantize``'s calling convention computed by nvfp4.quantize (simulation only).

    `original` may be None: SGLang binds None where its CUDA import failed. Arguments outside the
    simulated case (another block size, UE8M0 scales, a linear layout) go to `original`, or raise.
    """

    def fp4_quantize(
        input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, *args, **kwargs
    ):
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


# ---- fused MoE: flashinfer.fused_moe.cutlass_fused_moe ------------------------------------------

# FlashInfer's fused-MoE kernels that take NVFP4 weights in the layout SGLang prepares for them
# (w13 rows [up; gate], 128x4 swizzled block scales per expert, alphas per expert).
MOE_BACKENDS = ("cutlass",)
MOE_ACTIVATIONS = {"swiglu": "Swiglu", "relu2": "Relu2"}


@functools.lru_cache(maxsize=1)
def fused_moe_kernel() -> tuple[Callable, type]:
    """FlashInfer's (cutlass_fused_moe, ActivationType), imported on first use."""
    from flashinfer.fused_moe import ActivationType, cutlass_fused_moe  # heavy: only when asked about

    return cutlass_fused_moe, ActivationType


def moe_supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Whether FlashInfer's fused-MoE kernel `name` can run NVFP4 on `device`, and why not."""
    problem = _unusable(device)
    if problem is not None:
        return False, problem
    found = version()
    if device.capability[0] not in (10, 11, 12):
        return False, f"FlashInfer's NVFP4 fused MoE needs sm_100/sm_110/sm_120 (found sm_{device.sm})"
    try:
        fused_moe_kernel()
    except Exception as exc:
        return False, f"flashinfer {found} fused_moe does not import: {type(exc).__name__}: {exc}"
    return True, None


def _bad_moe(param: str, value: object, accepted: str) -> InvalidArgument:
    return not_accepted("fused MoE", param, value, accepted)


def check_moe_args(
    x,
    topk_ids,
    topk_weights,
    w13,
    w13_sf,
    w13_alpha,
    w2,
    w2_sf,
    w2_alpha,
    a1_gscale,
    a2_gscale,
    activation,
    out_dtype,
    out,
) -> None:
    """Validate fused-MoE arguments (the backend convention: reference_moe_fp4's, with -1 for a slot
    that is not this rank's) from metadata only; no host sync."""
    if activation not in MOE_ACTIVATIONS:
        raise _bad_moe("activation", activation, f"one of {', '.join(MOE_ACTIVATIONS)}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        raise _bad_moe("x", x, "a 2-D bf16 or fp16 tensor (T, H)")
    t, h = x.shape
    if (
        not isinstance(topk_ids, torch.Tensor)
        or topk_ids.dtype not in (torch.int32, torch.int64)
        or topk_ids.dim() != 2
        or topk_ids.shape[0] != t
    ):
        raise _bad_moe("topk_ids", topk_ids, f"an int32 (T={t}, k) tensor")
    k = topk_ids.shape[1]
    if (
        not isinstance(topk_weights, torch.Tensor)
        or topk_weights.dtype != torch.float32
        or tuple(topk_weights.shape) != (t, k)
    ):
        raise _bad_moe("topk_weights", topk_weights, f"a float32 ({t}, {k}) tensor")
    if not isinstance(w13, torch.Tensor) or w13.dtype != torch.uint8 or w13.dim() != 3 or w13.shape[2] * 2 != h:
        raise _bad_moe("w13", w13, f"packed FP4 (E, 2I or I, H/2={h // 2}) uint8")
    e, rows = w13.shape[0], w13.shape[1]
    inter = rows // 2 if activation == "swiglu" else rows
    if not isinstance(w2, torch.Tensor) or w2.dtype != torch.uint8 or tuple(w2.shape) != (e, h, inter // 2):
        raise _bad_moe("w2", w2, f"packed FP4 ({e}, {h}, {inter // 2}) uint8")
    for name, sf, r, cols in (("w13_sf", w13_sf, rows, h), ("w2_sf", w2_sf, h, inter)):
        rp, cp = nvfp4.swizzled_scale_shape(r, cols)
        if (
            not isinstance(sf, torch.Tensor)
            or sf.dtype not in _SCALE_DTYPES
            or sf.numel() != e * rp * cp
            or not sf.is_contiguous()
        ):
            raise _bad_moe(name, sf, f"contiguous 128x4 swizzled E4M3 scales of ({e}, {rp}, {cp})")
    for name, alpha in (("w13_alpha", w13_alpha), ("w2_alpha", w2_alpha)):
        if not isinstance(alpha, torch.Tensor) or alpha.dtype != torch.float32 or alpha.numel() != e:
            raise _bad_moe(name, alpha, f"a float32 tensor of E={e} elements")
    for name, scale in (("a1_gscale", a1_gscale), ("a2_gscale", a2_gscale)):
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() not in (1, e):
            raise _bad_moe(name, scale, f"a float32 tensor of 1 or E={e} elements (global encode scales)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise _bad_moe("out_dtype", out_dtype, "torch.bfloat16 or torch.float16")
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != out_dtype
        or tuple(out.shape) != (t, h)
        or not out.is_contiguous()
    ):
        raise _bad_moe("out", out, f"a contiguous ({t}, {h}) {out_dtype} tensor")


def moe_backend(name: str) -> Callable:
    """FlashInfer's fused-MoE kernel `name` in the MoE backend convention, called the way SGLang calls it."""
    cutlass_fused_moe, activation_type = fused_moe_kernel()

    def flashinfer_moe(
        x,
        topk_ids,
        topk_weights,
        w13,
        w13_sf,
        w13_alpha,
        w2,
        w2_sf,
        w2_alpha,
        a1_gscale,
        a2_gscale,
        activation,
        out_dtype,
        out,
    ):
        check_moe_args(
            x,
            topk_ids,
            topk_weights,
            w13,
            w13_sf,
            w13_alpha,
            w2,
            w2_sf,
            w2_alpha,
            a1_gscale,
            a2_gscale,
            activation,
            out_dtype,
            out,
        )
        cutlass_fused_moe(
            output=out,
            input=x,
            token_selected_experts=topk_ids.to(torch.int32),
            token_final_scales=topk_weights,
            fc1_expert_weights=w13.view(torch.long),
            fc2_expert_weights=w2.view(torch.long),
            output_dtype=out_dtype,
            input_sf=None,
            quant_scales=[
                a1_gscale.reshape(()) if a1_gscale.numel() == 1 else a1_gscale,
                w13_sf.view(torch.int32),
                w13_alpha,
                a2_gscale.reshape(()) if a2_gscale.numel() == 1 else a2_gscale,
                w2_sf.view(torch.int32),
                w2_alpha,
            ],
            activation_type=getattr(activation_type, MOE_ACTIVATIONS[activation]),
            # SGLang's default (SGLANG_FLASHINFER_MOE_FUSED_FINALIZE unset); FlashInfer's own default is True.
            use_fused_finalize=False,
        )
        return out

    flashinfer_moe.__name__ = f"flashinfer_{name}_fused_moe"
    return flashinfer_moe


def moe_call_to_convention(kwargs: dict, activation_type: type) -> tuple | None:
    """Map one ``cutlass_fused_moe(**kwargs)`` call to the MoE backend convention's arguments, or None
    when it is not an NVFP4 call this library serves (another quantization, biases, swiglu clamps,
    alltoall, per-token input scales): those go to the original unchanged.

    The ids SGLang passes are global under expert parallelism (this rank's experts start at
    ep_rank * E) and -1 for a slot it dropped (padding rows). The convention's ids are this rank's
    local ones, and -1 for every slot that is not this rank's: a backend skips such a slot (as
    FlashInfer's kernel skips ids outside its experts), so it costs no work on any local expert and
    no row of it, finite or not, reaches the sum. Weights are passed unchanged.
    """
    scales = kwargs.get("quant_scales")
    w13, w2, x = kwargs.get("fc1_expert_weights"), kwargs.get("fc2_expert_weights"), kwargs.get("input")
    names = {getattr(activation_type, v): k for k, v in MOE_ACTIVATIONS.items()}
    activation = names.get(kwargs.get("activation_type", getattr(activation_type, "Swiglu")))
    if (
        activation is None
        or not isinstance(scales, (list, tuple))
        or len(scales) != 6
        or not isinstance(w13, torch.Tensor)
        or w13.dtype != torch.int64
        or scales[1].dtype != torch.int32
        or kwargs.get("input_sf") is not None
        or kwargs.get("enable_alltoall")
        or any(
            kwargs.get(k) is not None
            for k in ("fc1_expert_biases", "fc2_expert_biases", "swiglu_alpha", "swiglu_beta", "swiglu_limit")
        )
        or kwargs.get("cluster_size", 1) != 1
        or kwargs.get("min_latency_mode")
    ):
        return None
    w13_u8, w2_u8 = w13.view(torch.uint8), w2.view(torch.uint8)
    ids, weights = kwargs["token_selected_experts"], kwargs["token_final_scales"]
    ep_size, ep_rank = kwargs.get("ep_size", 1), kwargs.get("ep_rank", 0)
    local = w13_u8.shape[0]
    ids = ids.to(torch.int32)
    if ep_size > 1:
        ids = torch.where(ids >= 0, ids - ep_rank * local, ids)
    ids = torch.where((ids >= 0) & (ids < local), ids, torch.full_like(ids, -1))  # not this rank's: skipped
    out_dtype = kwargs.get("output_dtype", x.dtype)
    out = kwargs.get("output")
    if out is None:
        out = torch.empty((x.shape[0], w2_u8.shape[1]), dtype=out_dtype, device=x.device)
    return (
        x,
        ids,
        weights,
        w13_u8,
        scales[1].view(torch.float8_e4m3fn),
        scales[2],
        w2_u8,
        scales[4].view(torch.float8_e4m3fn),
        scales[5],
        global_scale(scales[0]),
        global_scale(scales[3]),
        activation,
        out_dtype,
        out,
    )


def global_scale(scale: torch.Tensor) -> torch.Tensor:
    """A global encode scale as the convention has it: (1,) for one scale, (E,) for one per expert."""
    return scale.reshape(1) if scale.numel() == 1 else scale.reshape(-1)
