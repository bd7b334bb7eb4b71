"""Everything this library knows about FlashInfer (imported lazily): its backends' default orders, how ``mm_fp4``
and ``cutlass_fused_moe`` are called and routed, support checks, its kernels' toolchain, the activation quantizer."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

import torch

from .. import nvfp4
from ..devices import Device
from ..errors import say_once
from ..versions import installed_version
from .convention import (
    MOE_ACTIVATIONS,
    check_mm_fp4_args,
    check_moe_args,
    global_scale,
    is_nvfp4_moe_call,
    moe_call_to_convention,
    unmodeled_moe_problem,
)

__all__ = ["check_mm_fp4_args", "check_moe_args", "global_scale", "moe_call_to_convention"]  # re-exported
__all__ += ["is_nvfp4_moe_call", "unmodeled_moe_problem"]

GemmFn = Callable[..., object]

# FlashInfer backends that read the non-shuffled 128x4 layout SGLang prepares for cutlass (not trtllm:
# shuffled weights; not cutedsl_low_latency: SM100 only).
BACKENDS = ("cutlass", "b12x", "cudnn", "cute-dsl")
# FlashInfer's fused-MoE kernels that take NVFP4 weights in the layout SGLang prepares for them
# (w13 rows [up; gate], 128x4 swizzled block scales per expert, alphas per expert).
MOE_BACKENDS = ("cutlass",)
# Backend names SGLang may pass for that layout, served by the decided backend ("cutlass": the runner
# enum is pinned to FLASHINFER_CUTLASS). Passed through on purpose: trtllm (shuffled weights), cute-dsl
# (the operator's choice). Any other name is refused by name on a served device (dispatch's `unknown`).
ROUTED_BACKENDS = frozenset({None, "auto", "cudnn", "cutlass"})
PASSED_THROUGH_BACKENDS = frozenset({"trtllm", "cute-dsl"})
# mm_fp4 keywords that never change the numbers, with the values that leave them so (None: any value).
NEUTRAL_MM_FP4_KEYWORDS = {"enable_pdl": None, "use_nvfp4": (True,), "batch_invariant": (False,)}
# SM120_FP4_BACKENDS=auto per capability (each candidate still self-tested; docs/operations.md has the
# sources). sm_121 lacks b12x: FlashInfer #3170, an illegal memory access that poisons the CUDA context.
# humming (JIT, bf16-activation kernels on the FP4 weights) is the verified fallback on 12.x. The b12x
# MoE is in no default MoE order: named, or timed after it with SELECT=fastest on sm_120 (#5446, #3170).
_Orders = dict[tuple[int, int], tuple[str, ...]]  # capability -> backend names
DEFAULT_ORDER: tuple[str, ...] = ("cutlass", "b12x")
ORDER_BY_CAPABILITY: _Orders = {(12, 0): ("cutlass", "b12x", "humming"), (12, 1): ("cutlass", "humming")}
DEFAULT_MOE_ORDER: tuple[str, ...] = ("cutlass",)
MOE_ORDER_BY_CAPABILITY: _Orders = {(12, 0): ("cutlass", "humming"), (12, 1): ("cutlass", "humming")}
FASTEST_MOE_EXTRA: _Orders = {(12, 0): ("b12x",)}  # timed with SELECT=fastest
# mm_fp4's leading positional parameters in every release this library knows (0.2.11 - 0.7.x).
MM_FP4_HEAD = ("a", "b", "a_descale", "b_descale", "alpha", "out_dtype")
# (K, N) alignment per backend; off it, kernels return silent garbage (vLLM #48898). cute-dsl on SM12x: 64.
_ALIGN = {"cutlass": (32, 8), "b12x": (32, 8), "cudnn": (32, 8), "cute-dsl": (64, 64)}
_NO_QUANTIZER = (
    "sm120_fp4: FlashInfer %s's activation quantizer (flashinfer.fp4_quantize) does not import "
    "(%s: %s): self-tests run without it, so the quantizer SGLang calls is not checked by them"
)
# FlashInfer's b12x GEMM (0.7.2-0.7.4) raises below CUDA 12.9 (nvcc's, else torch's) and needs the CuTe DSL.
B12X_MIN_CUDA = (12, 9)
# nvcc's crt/math_functions.h up to CUDA 13.0 clashes with glibc 2.41's rsqrt/cospi: JIT builds fail.
GLIBC_CLASH = (2, 41)
CUDA_HEADERS_CLASH = (13, 0)


def default_order(capability: tuple[int, int]) -> tuple[str, ...]:
    """Return the candidate order SM120_FP4_BACKENDS=auto means on a GPU of `capability`."""
    return ORDER_BY_CAPABILITY.get(tuple(capability), DEFAULT_ORDER)


def default_moe_order(capability: tuple[int, int], fastest: bool = False) -> tuple[str, ...]:
    """Return the MoE candidate order auto means on `capability` (`fastest`: with FASTEST_MOE_EXTRA)."""
    order = MOE_ORDER_BY_CAPABILITY.get(tuple(capability), DEFAULT_MOE_ORDER)
    return order + FASTEST_MOE_EXTRA.get(tuple(capability), ()) if fastest else order


def neutral_mm_fp4_keywords(kwargs: dict) -> bool:
    """Return whether every keyword of an mm_fp4 call (beyond its head) leaves the numbers as verified."""
    for name, value in kwargs.items():
        allowed = NEUTRAL_MM_FP4_KEYWORDS.get(name, ())
        if allowed is not None and not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            return False
    return True


def unrouted_mm_fp4_argument(block_size: object, use_8x4_sf_layout: object, kwargs: dict) -> tuple[str, object] | None:
    """Return the first (name, value) of a routed mm_fp4 call the backend was not verified for, or None."""
    if block_size != 16:
        return "block_size", block_size
    if use_8x4_sf_layout:
        return "use_8x4_sf_layout", use_8x4_sf_layout
    return next(((name, value) for name, value in kwargs.items() if not neutral_mm_fp4_keywords({name: value})), None)


def version() -> str | None:
    """Return the installed flashinfer-python version, without importing it."""
    return installed_version("flashinfer-python", "flashinfer")


def autotuning() -> contextlib.AbstractContextManager:
    """Run the block with FlashInfer's autotuner tuning (a shape's first call profiles its tactics)."""
    from flashinfer.autotuner import autotune  # heavy: only where a FlashInfer backend runs

    return autotune(True)


@functools.lru_cache(maxsize=1)
def _mm_fp4() -> GemmFn:
    from flashinfer import mm_fp4  # heavy: only when a FlashInfer backend is considered

    return mm_fp4


def _unusable(device: Device) -> str | None:
    """Return why no FlashInfer kernel can run on `device`, or None."""
    if device.simulated:
        return "FlashInfer kernels need a real GPU; this device is simulated"
    if not device.is_cuda:
        return "FlashInfer kernels need a CUDA device"
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        return f"torch {torch.__version__} cannot use CUDA device {device.index} (no driver, or a CPU build)"
    if version() is None:
        return "flashinfer-python is not installed"
    return None


@dataclass(frozen=True)
class Toolchain:
    """What JIT builds here would use: CUDA (and where it was read), glibc, why the CuTe DSL is missing."""

    cuda: tuple[int, int] | None
    cuda_source: str
    glibc: tuple[int, int] | None
    cute_dsl_problem: str | None


def _major_minor(text: str | None) -> tuple[int, int] | None:
    match = re.search(r"([0-9]+)\.([0-9]+)", text or "", re.ASCII)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _cuda_toolkit() -> tuple[tuple[int, int] | None, str]:
    """Return the CUDA version FlashInfer's get_cuda_version() would read: nvcc's, else torch's."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates = [os.path.join(h, "bin", "nvcc") for h in homes if h] + [shutil.which("nvcc")]
    for nvcc in [*candidates, "/usr/local/cuda/bin/nvcc"]:
        if not nvcc or not os.path.isfile(nvcc):
            continue
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        release = re.search(r"release ([0-9]+\.[0-9]+)", out, re.ASCII)
        if release:
            return _major_minor(release.group(1)), f"nvcc {nvcc}"
    source = "torch.version.cuda" if torch.version.cuda else "none found (no nvcc, CPU torch)"
    return _major_minor(torch.version.cuda), source


def _glibc() -> tuple[int, int] | None:
    # platform.libc_ver() asks the same first; where it fails this is no glibc (musl), whose headers do not clash.
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.41"
    except (AttributeError, ValueError, OSError):
        text = None
    return _major_minor(text)


def _cute_dsl() -> str | None:
    try:
        if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cutlass.cute") is None:
            return "nvidia-cutlass-dsl is not installed (`cutlass.cute` not found)"
    except (ImportError, ValueError) as exc:
        return f"nvidia-cutlass-dsl cannot be imported: {type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """Return this machine's toolchain for FlashInfer's kernels (probed once per process)."""
    cuda, source = _cuda_toolkit()
    return Toolchain(cuda, source, _glibc(), _cute_dsl())


def _shown_version(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else f"{version[0]}.{version[1]}"


def jit_problem(tc: Toolchain | None = None) -> str | None:
    """Return why JIT-compiled kernels (FlashInfer's, SGLang's) will fail to build here, where known."""
    tc = tc or toolchain()
    if tc.glibc is not None and tc.glibc >= GLIBC_CLASH and tc.cuda is not None and tc.cuda <= CUDA_HEADERS_CLASH:
        return (
            f"glibc {_shown_version(tc.glibc)} with CUDA {_shown_version(tc.cuda)} headers ({tc.cuda_source}): nvcc's "
            "crt/math_functions.h clashes with glibc >= 2.41's rsqrt/cospi declarations, so FlashInfer's and SGLang's "
            "JIT kernels fail to build; use a CUDA toolkit newer than 13.0, or a system with glibc < 2.41"
        )
    return None


def toolchain_problem(what: str, min_cuda: tuple[int, int], tc: Toolchain | None = None) -> str | None:
    """Return why `what` (a CuTe DSL kernel of FlashInfer's, needing CUDA >= `min_cuda`) cannot run here, or None."""
    tc = tc or toolchain()
    if tc.cuda is None or tc.cuda < min_cuda:
        return f"{what} needs CUDA >= {_shown_version(min_cuda)}; found {_shown_version(tc.cuda)} ({tc.cuda_source})"
    if tc.cute_dsl_problem is not None:
        return f"{what} needs the CuTe DSL: {tc.cute_dsl_problem}"
    return None


def b12x_problem(tc: Toolchain | None = None) -> str | None:
    """Return why FlashInfer's b12x NVFP4 GEMM cannot run here (CUDA toolkit, CuTe DSL), or None."""
    return toolchain_problem("b12x", B12X_MIN_CUDA, tc)


def supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Return whether FlashInfer backend `name` can run on `device`, and why not."""
    problem = _unusable(device)
    if name == "b12x" and not device.simulated and version() is not None:  # a real reason, not a failing call
        problem = b12x_problem() or problem
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


def mm_fp4_backend(name: str) -> GemmFn:
    """Return FlashInfer's `name` kernel in the convention (explicit backend=, alpha a tensor, out given)."""
    mm_fp4 = _mm_fp4()
    align = _ALIGN.get(name, (32, 8))

    def flashinfer_backend(a, b, a_descale, b_descale, alpha, out_dtype, out):
        check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, out, align)
        return mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, backend=name)

    flashinfer_backend.__name__ = f"flashinfer_{name.replace('-', '_')}"
    return flashinfer_backend


def is_mm_fp4(original: object) -> str | None:
    """Return None when `original` is FlashInfer's mm_fp4 with the expected head, else why not."""
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
    """Return FlashInfer's activation quantizer for `device` where it can run (sm_100+, real GPU)."""
    if device.simulated or not device.is_cuda or device.capability[0] < 10 or version() is None:
        return None
    try:
        from flashinfer import fp4_quantize
    except Exception as exc:  # ImportError, or a broken install raising anything
        say_once(logging.WARNING, _NO_QUANTIZER, version(), type(exc).__name__, exc)
        return None

    def quantize(x, global_scale):
        return fp4_quantize(x, global_scale.reshape(1), 16, False, True)

    return "flashinfer.fp4_quantize", quantize


def fp4_quantize_stand_in(original: Callable | None) -> Callable:
    """Return ``fp4_quantize`` computed by nvfp4.quantize (simulation); other cases go to `original` or raise."""
    # `original` may be None: SGLang binds None where its CUDA import failed.

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


@functools.lru_cache(maxsize=1)
def fused_moe_kernel() -> tuple[Callable, type]:
    """Return FlashInfer's (cutlass_fused_moe, ActivationType), imported on first use."""
    from flashinfer.fused_moe import ActivationType, cutlass_fused_moe  # heavy: only when asked about

    return cutlass_fused_moe, ActivationType


def moe_supported(name: str, device: Device) -> tuple[bool, str | None]:
    """Return whether FlashInfer's fused-MoE kernel `name` can run NVFP4 on `device`, and why not."""
    problem = _unusable(device)
    if problem is not None:
        return False, problem
    if device.capability[0] not in (10, 11, 12):
        return False, f"FlashInfer's NVFP4 fused MoE needs sm_100/sm_110/sm_120 (found sm_{device.sm})"
    try:
        fused_moe_kernel()
    except Exception as exc:
        return False, f"flashinfer {version()} fused_moe does not import: {type(exc).__name__}: {exc}"
    return True, None


def _encode_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(()) if scale.numel() == 1 else scale


def moe_backend(name: str) -> Callable:
    """Return FlashInfer's fused-MoE kernel `name` in the MoE convention, called the way SGLang calls it."""
    cutlass_fused_moe, activation_type = fused_moe_kernel()

    def flashinfer_moe(*args):
        c = check_moe_args(*args)
        fc1 = [_encode_scale(c.a1_gscale), c.w13_sf.view(torch.int32), c.w13_alpha]
        fc2 = [_encode_scale(c.a2_gscale), c.w2_sf.view(torch.int32), c.w2_alpha]
        tokens = dict(output=c.out, input=c.x, output_dtype=c.out_dtype, input_sf=None, quant_scales=fc1 + fc2)
        routing = dict(token_selected_experts=c.topk_ids.to(torch.int32), token_final_scales=c.topk_weights)
        weights = dict(fc1_expert_weights=c.w13.view(torch.long), fc2_expert_weights=c.w2.view(torch.long))
        activation = getattr(activation_type, MOE_ACTIVATIONS[c.activation])
        # use_fused_finalize: SGLang's default (SGLANG_FLASHINFER_MOE_FUSED_FINALIZE unset); FlashInfer's is True.
        cutlass_fused_moe(**tokens, **routing, **weights, activation_type=activation, use_fused_finalize=False)
        return c.out

    flashinfer_moe.__name__ = f"flashinfer_{name}_fused_moe"
    return flashinfer_moe
