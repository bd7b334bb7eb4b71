"""The hot path: both fronts, each routing every FP4 call to the backend decided for its device.

* :func:`mm_fp4_front` (dense): the replacement for a module-level ``mm_fp4`` alias, with
  mm_fp4's signature. Per call: one dict lookup keyed by ``a.get_device()``, a few comparisons and
  the backend call with ``alpha`` and a contiguous preallocated ``out``.
* :func:`moe_front` (NVFP4 fused MoE): ``cutlass_fused_moe``'s keyword convention as SGLang calls
  it, mapped to the backend convention (:func:`sm120_fp4.backends.flashinfer.moe_call_to_convention`).

Both are wired the same way, by :class:`Router` over :mod:`sm120_fp4.serving`'s route tables (derived
from its one store of serving records); FlashInfer's conventions and argument checks come from :mod:`sm120_fp4.backends.flashinfer`.
No host sync, no allocation but ``out``, nothing that breaks CUDA-graph capture. The first call on a
device without a decision decides once (a self-test). A backend's error gets a note naming it and is
never replaced by zeros.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import serving
from .backends import flashinfer
from .config import Settings
from .errors import InvalidArgument, describe

__all__ = ["Router", "mm_fp4_front", "moe_front", "decline_front"]

GemmFn = Callable[..., object]


class Router:
    """The routing of one install: its settings, over serving's route tables (one per family)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def ensure(self, index: int, family: str = "dense") -> Callable | None:
        """Decide (self-test) `family` for CUDA ordinal `index` (-1: CPU in simulation) once; the
        backend, or None where this library does not serve the device."""
        return serving.route(index, self.settings, family)

    def routes(self, family: str = "dense") -> dict[int, str]:
        """Device index -> the backend it is routed to, or "original" (a device this install does not serve)."""
        return serving.routes(family)

    def make_dispatch(self, original: Callable, unknown: Callable[[int, str, object], None] | None = None) -> Callable:
        """The replacement for a module-level ``mm_fp4`` alias (dense); `unknown(index, name, value)`: a call
        on a served device naming a backend this library does not know, or an argument its routed backend
        was not verified for (it raises, or returns to let the original serve it)."""
        names = serving.routes
        return mm_fp4_front(original, serving.route_table().get, self.ensure, lambda i: names().get(i, "?"), unknown)

    def make_decline(self, original: Callable, declined: Callable[[int], None]) -> Callable:
        """The replacement for an engine's own "this kernel, or None" fast path in front of the dense alias:
        None on a device this install serves (the call goes on to the routed alias); `declined(index)` is
        told (it logs once)."""
        return decline_front(original, serving.route_table().get, self.ensure, declined)

    def make_moe_front(self, original: Callable, activation_type: type) -> Callable:
        """The front over FlashInfer's ``cutlass_fused_moe`` that SGLang's MoE seam hands out (MoE)."""
        names = serving.routes
        return moe_front(original, activation_type, lambda i: self.ensure(i, "moe"), lambda i: names("moe").get(i, "?"))


_alpha_cache: dict[torch.device, torch.Tensor] = {}


def _alpha_one(device: torch.device) -> torch.Tensor:
    alpha = _alpha_cache.get(device)
    if alpha is None:
        alpha = _alpha_cache.setdefault(device, torch.ones(1, dtype=torch.float32, device=device))
    return alpha


def mm_fp4_front(
    original: GemmFn,
    route: Callable[[int], GemmFn | None],
    ensure: Callable[[int], GemmFn | None],
    name_of: Callable[[int], str],
    unknown: Callable[[int, str, object], None] | None = None,
) -> GemmFn:
    """A function with mm_fp4's signature that serves routable calls with the routed backend.

    `route(index)` is the hot-path lookup of the backend decided for a device (None: not decided
    yet, or not ours); `ensure(index)` decides on first use (and returns None for a device this
    library does not serve). Keywords that never change the numbers (flashinfer.NEUTRAL_MM_FP4_KEYWORDS:
    enable_pdl, use_nvfp4=True, batch_invariant=False) are served by the routed backend. Calls naming a
    backend left to the engine on purpose (flashinfer.PASSED_THROUGH_BACKENDS) go to `original` unchanged.
    On a device it serves, a backend name it does not know, or a routed backend's call with a block size,
    scale layout or keyword (value) the routed backend was not verified for: `unknown(index, name, value)`
    is asked first, and refuses it by name (or returns: `original` serves it). It always returns
    the tensor the backend wrote, never what the backend returned; an empty batch gives an empty
    result. A failure is explained: bad arguments raise InvalidArgument naming the parameter, a
    backend's own error gets a note naming the backend (never replaced by zeros).
    """
    routed = flashinfer.ROUTED_BACKENDS
    passed = flashinfer.PASSED_THROUGH_BACKENDS
    neutral = flashinfer.neutral_mm_fp4_keywords
    unrouted = flashinfer.unrouted_mm_fp4_argument
    bf16 = torch.bfloat16
    empty = torch.empty

    def explain(exc, a, b, a_descale, b_descale, alpha, out_dtype) -> None:
        try:  # only on failure: validation costs nothing on the served path
            flashinfer.check_mm_fp4_args(a, b, a_descale, b_descale, alpha, out_dtype, None, align=(2, 1))
        except InvalidArgument as bad:
            raise bad from exc
        index = a.get_device()
        exc.add_note(
            f"sm120_fp4: raised by FP4 GEMM backend {name_of(index)!r} on device {index} "
            f"(M={a.shape[0]}); never replaced by zeros"
        )

    def serve(fn, a, b, a_descale, b_descale, alpha, out_dtype, out):
        try:
            result = (
                out
                if out is not None and out.is_contiguous()
                else empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
            )
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
        a,
        b,
        a_descale,
        b_descale,
        alpha=None,
        out_dtype=bf16,
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
        fn = route(index)
        if (
            fn is not None
            and backend in routed
            and alpha is not None
            and block_size == 16
            and not use_8x4_sf_layout
            and (not kwargs or neutral(kwargs))
        ):
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
        if fn is not None and unknown is not None:
            if backend not in routed and backend not in passed:
                unknown(index, "backend", backend)  # a backend added after this library: refused by name
            elif backend in routed:  # a block size, layout or keyword the routed backend was not verified for
                bad = unrouted(block_size, use_8x4_sf_layout, kwargs)
                if bad is not None:
                    unknown(index, *bad)  # refused by name (or SELFTEST says serve it: the original does)
        if (
            fn is None
            or backend not in routed
            or block_size != 16
            or use_8x4_sf_layout
            or (kwargs and not neutral(kwargs))
        ):
            return original(
                a,
                b,
                a_descale,
                b_descale,
                alpha,
                out_dtype,
                out,
                block_size=block_size,
                use_8x4_sf_layout=use_8x4_sf_layout,
                backend=backend,
                **kwargs,
            )
        if alpha is None:
            alpha = _alpha_one(a.device)  # the SM120 kernel requires alpha; None means 1.0
        return serve(fn, a, b, a_descale, b_descale, alpha, out_dtype, out)

    flashinfer_fp4_gemm.__wrapped__ = original
    flashinfer_fp4_gemm.__qualname__ = "sm120_fp4.dispatch.flashinfer_fp4_gemm"
    return flashinfer_fp4_gemm


def decline_front(
    original: Callable,
    route: Callable[[int], GemmFn | None],
    ensure: Callable[[int], GemmFn | None],
    declined: Callable[[int], None],
) -> Callable:
    """A function with the signature of `original`, an engine's "run my own FP4 GEMM, or return None"
    gate whose first argument is the activation tensor: None on a device this library serves, so the
    engine goes on to the FP4 GEMM alias, routed and verified; `original` everywhere else.

    `route(index)` is the hot-path lookup (a device already decided costs one dict lookup);
    `ensure(index)` decides on first use. A first argument that is not a tensor goes to `original`."""

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


def moe_front(
    original: Callable, activation_type: type, route: Callable[[int], Callable | None], name_of: Callable[[int], str]
) -> Callable:
    """A function with ``cutlass_fused_moe``'s keyword calling convention (as SGLang calls it) that serves
    NVFP4 calls with the MoE backend routed for the input's device; others go to `original`. Returns
    ``[output]`` as the kernel does."""

    def cutlass_fused_moe(**kwargs):
        x = kwargs.get("input")
        fn = route(x.get_device()) if isinstance(x, torch.Tensor) else None
        args = flashinfer.moe_call_to_convention(kwargs, activation_type) if fn is not None else None
        if args is None:
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
