"""The hot path of both families: every FP4 call routed to the backend verified for its device; per call
one dict lookup (a bisect on M where split), no host sync, no allocation but ``out``; errors never zeroed."""

from __future__ import annotations

from typing import Callable

import torch

from . import serving
from .backends import flashinfer
from .config import Settings
from .errors import InvalidArgument, describe

GemmFn = Callable[..., object]


class Router:
    """The routing of one install: its settings, over serving's route tables (one per family)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def ensure(self, index: int, family: str = "dense") -> Callable | None:
        """Decide `family` for CUDA ordinal `index` once; return its backend, or None where not served."""
        return serving.route(index, self.settings, family)

    def make_dispatch(self, original: Callable, unknown: Callable[[int, str, object], None] | None = None) -> Callable:
        """Return the replacement for a module-level ``mm_fp4`` alias (dense), serving routable calls routed."""
        # route: the hot-path lookup; ensure: decides on first use; unknown(index, name, value): told of an
        # argument the routed backend was not verified for.
        route, ensure, names = serving.route_table().get, self.ensure, serving.routes

        def name_of(index: int) -> str:
            return names().get(index, "?")

        routed, neutral = flashinfer.ROUTED_BACKENDS, flashinfer.neutral_mm_fp4_keywords

        def flashinfer_fp4_gemm(
            a,
            b,
            a_descale,
            b_descale,
            alpha=None,
            out_dtype=torch.bfloat16,
            out=None,
            block_size=16,
            use_8x4_sf_layout=False,
            backend="auto",
            **kwargs,
        ):
            try:
                index = a.get_device()
            except AttributeError:
                raise InvalidArgument(
                    f"mm_fp4: a={describe(a)} is not accepted; expected packed FP4 activations: a 2-D uint8 tensor (M, K/2)"
                ) from None
            plain = backend in routed and block_size == 16 and not use_8x4_sf_layout and (not kwargs or neutral(kwargs))
            fn = route(index)
            if fn is not None and plain and alpha is not None:
                return _serve(fn, name_of, a, b, a_descale, b_descale, alpha, out_dtype, out)
            fn = ensure(index)  # first call on this device: decide (self-test) once
            if fn is not None and unknown is not None and not plain:
                _say_unknown(unknown, index, backend, block_size, use_8x4_sf_layout, kwargs)
            if fn is None or not plain:  # not served here, or an argument the routed backend was not verified for
                layout = {"block_size": block_size, "use_8x4_sf_layout": use_8x4_sf_layout, "backend": backend}
                return original(a, b, a_descale, b_descale, alpha, out_dtype, out, **layout, **kwargs)
            alpha = alpha if alpha is not None else _alpha_one(a.device)  # the SM120 kernel requires alpha; None: 1.0
            return _serve(fn, name_of, a, b, a_descale, b_descale, alpha, out_dtype, out)

        flashinfer_fp4_gemm.__wrapped__ = original
        flashinfer_fp4_gemm.__qualname__ = "sm120_fp4.dispatch.flashinfer_fp4_gemm"
        return flashinfer_fp4_gemm

    def make_decline(self, original: Callable, declined: Callable[[int], None]) -> Callable:
        """Return an engine's "my own FP4 GEMM, or None" gate answering None on a served device (the alias serves it)."""
        route, ensure = serving.route_table().get, self.ensure

        def declining(input, *args, **kwargs):
            try:
                index = input.get_device()
            except AttributeError:
                return original(input, *args, **kwargs)
            if route(index) is not None or ensure(index) is not None:
                declined(index)
                return None
            return original(input, *args, **kwargs)

        declining.__wrapped__ = original
        declining.__qualname__ = "sm120_fp4.dispatch.declining"
        return declining

    def make_moe_front(
        self, original: Callable, activation_type: type, unknown: Callable[[int, str], None] | None = None
    ) -> Callable:
        """Return the front over FlashInfer's ``cutlass_fused_moe`` that the engines' MoE seams hand out."""
        # unknown(index, problem): told of a served device's NVFP4 call with an argument the oracle does not model.
        route, name_of = lambda i: self.ensure(i, "moe"), lambda i: serving.routes("moe").get(i, "?")
        return moe_front(original, activation_type, route, name_of, unknown)


_alpha_cache: dict[torch.device, torch.Tensor] = {}


def _alpha_one(device: torch.device) -> torch.Tensor:
    if device not in _alpha_cache:
        _alpha_cache.setdefault(device, torch.ones(1, dtype=torch.float32, device=device))
    return _alpha_cache[device]


def _explain(exc: Exception, name: str, a, b, a_descale, b_descale, alpha, out_dtype) -> None:
    """Raise InvalidArgument for bad arguments (from `exc`), else note on `exc` the backend that raised it."""
    try:  # only on failure: validation costs nothing on the served path
        flashinfer.check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, None, align=(2, 1))
    except InvalidArgument as bad:
        raise bad from exc
    exc.add_note(
        f"sm120_fp4: raised by FP4 GEMM backend {name!r} on device {a.get_device()} (M={a.shape[0]}); "
        "never replaced by zeros"
    )


def _serve(fn: GemmFn, name_of: Callable[[int], str], a, b, a_descale, b_descale, alpha, out_dtype, out):
    """Call the routed backend `fn` into a contiguous out (allocated where none is given); return the result."""
    try:
        # SGLang never passes out: allocate it here (FlashInfer then skips its own allocation).
        given = out is not None and out.is_contiguous()
        result = out if given else torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
        if a.shape[0]:
            fn(a, b, a_descale, b_descale, alpha, out_dtype, result)
    except Exception as exc:
        _explain(exc, name_of(a.get_device()), a, b, a_descale, b_descale, alpha, out_dtype)
        raise
    if out is None or given:
        return result
    out.copy_(result)  # a non-contiguous out: the kernels need a contiguous one
    return out


def _say_unknown(unknown: Callable[[int, str, object], None], index: int, backend, block_size, use_8x4, kwargs):
    """Hand `unknown` the argument of a served device's call that its routed backend was not verified for."""
    if backend not in flashinfer.ROUTED_BACKENDS and backend not in flashinfer.PASSED_THROUGH_BACKENDS:
        unknown(index, "backend", backend)  # a backend added after this library: refused by name
    elif backend in flashinfer.ROUTED_BACKENDS:  # refused by name (or SELFTEST says serve it: the original does)
        unknown(index, *flashinfer.unrouted_mm_fp4_argument(block_size, use_8x4, kwargs))


def moe_front(
    original: Callable,
    activation_type: type,
    route: Callable[[int], Callable | None],
    name_of: Callable[[int], str],
    unknown: Callable[[int, str], None] | None = None,
) -> Callable:
    """Return ``cutlass_fused_moe`` (as SGLang calls it) serving NVFP4 calls with the routed MoE backend."""

    def cutlass_fused_moe(**kwargs):
        x = kwargs.get("input")
        fn = route(x.get_device()) if isinstance(x, torch.Tensor) else None
        args = flashinfer.moe_call_to_convention(kwargs, activation_type) if fn is not None else None
        if args is None:
            if fn is not None and unknown is not None and flashinfer.is_nvfp4_moe_call(kwargs):
                problem = flashinfer.unmodeled_moe_problem(kwargs, activation_type)
                if problem is not None:  # refused by name (SELFTEST=warn: the original serves it, unverified)
                    unknown(x.get_device(), problem)
            return original(**kwargs)
        out = args[-1]
        if x.shape[0]:
            try:
                fn(*args)
            except Exception as exc:
                index = x.get_device()
                exc.add_note(
                    f"sm120_fp4: raised by fused-MoE backend {name_of(index)!r} on device {index} "
                    f"(T={x.shape[0]}); never replaced by zeros"
                )
                raise
        return [out]

    cutlass_fused_moe.__wrapped__ = original
    cutlass_fused_moe.__qualname__ = "sm120_fp4.dispatch.cutlass_fused_moe"
    return cutlass_fused_moe
