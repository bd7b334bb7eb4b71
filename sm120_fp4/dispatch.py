"""The hot path: a plain function with ``flashinfer.mm_fp4``'s signature that routes to the decision.

Per call: one dict lookup keyed by ``a.get_device()`` (cached capability + decision), a few
comparisons, and the backend call with ``alpha`` and a contiguous preallocated ``out``. No host
sync, no allocation but ``out``, nothing that breaks CUDA-graph capture. The first call on a
device that has no decision yet takes the slow path once (``decide()``, which self-tests).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from . import devices, selection
from .config import Settings

__all__ = ["Router", "ROUTED_BACKENDS"]

# Backends SGLang may pass that read the 128x4, non-shuffled layout the decided backend reads.
# "cutlass" is included because the runner enum is pinned to FLASHINFER_CUTLASS, after which
# SGLang passes backend="cutlass". trtllm, cute-dsl, marlin and others go to the original.
ROUTED_BACKENDS = frozenset({None, "auto", "cudnn", "cutlass"})
_PASS = object()  # route marker: this device is not ours, call the original


class Router:
    """Routing state of one install: settings, the route table, and the dispatch factory."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._routes: dict[int, Callable] = {}  # device index -> decided backend (ours only)
        self._passed: set[int] = set()  # device indices that are not ours: the original runs
        self._names: dict[int, str] = {}  # device index -> decided backend's name (error context)
        self._alpha_one: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def ours(self, device: devices.Device) -> bool:
        return self.settings.enable == "on" or devices.is_sm12x(device.capability)

    def ensure(self, index: int) -> Callable | None:
        """Decide (self-test) for CUDA ordinal `index` (-1: CPU in simulation) and cache the route."""
        route = self._routes.get(index)
        if route is not None or index in self._passed:
            return route
        with self._lock:
            if index not in self._routes and index not in self._passed:
                route = self._route_for(index)
                if route is _PASS:
                    self._passed.add(index)
                else:
                    self._routes[index] = route
        return self._routes.get(index)

    def _route_for(self, index: int) -> object:
        simulate = self.settings.simulated_capability
        if index < 0 and simulate is None:
            return _PASS  # a CPU tensor outside simulation: not a GPU we fix
        device = devices.get_device(index, simulate)
        if not self.ours(device):
            return _PASS
        decision = selection.decide(device, settings=self.settings)
        self._names[index] = decision.backend
        return decision.fn

    def routes(self) -> dict[int, str]:
        """Device index -> the backend it is routed to, or "original" (not a device this install fixes)."""
        return {**{i: self._names.get(i, "?") for i in self._routes}, **{i: "original" for i in self._passed}}

    def make_dispatch(self, original: Callable) -> Callable:
        """Build the replacement for a module-level ``mm_fp4`` alias."""
        route = self._routes.get
        ensure = self.ensure
        alpha_one = self._alpha_one
        routed = ROUTED_BACKENDS
        bf16 = torch.bfloat16
        empty = torch.empty
        names = self._names

        def describe(a, fn) -> str:
            index = a.get_device()
            return (f"sm120_fp4: raised by FP4 GEMM backend {names.get(index, getattr(fn, '__name__', fn))!r} "
                    f"on device {index} (M={a.shape[0]}); never replaced by zeros")

        def slow_path(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout, backend, kwargs):
            fn = ensure(a.get_device())  # first call on this device: decide (self-test) once
            if fn is None or backend not in routed or block_size != 16 or use_8x4_sf_layout or kwargs:
                return original(
                    a, b, a_descale, b_descale, alpha, out_dtype, out,
                    block_size=block_size, use_8x4_sf_layout=use_8x4_sf_layout, backend=backend, **kwargs,
                )
            if alpha is None:
                # The SM120 kernel requires alpha; None means 1.0. Cached: no per-call allocation.
                index = a.get_device()
                alpha = alpha_one.get(index)
                if alpha is None:
                    alpha = alpha_one.setdefault(index, torch.ones(1, dtype=torch.float32, device=a.device))
            result = empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
            try:
                fn(a, b, a_descale, b_descale, alpha, out_dtype, result)
            except Exception as exc:
                exc.add_note(describe(a, fn))
                raise
            if out is None:
                return result
            out.copy_(result)  # a non-contiguous out: the kernels need a contiguous one
            return out

        def flashinfer_fp4_gemm(
            a, b, a_descale, b_descale, alpha=None, out_dtype=bf16, out=None,
            block_size=16, use_8x4_sf_layout=False, backend="auto", **kwargs,
        ):
            fn = route(a.get_device())
            if fn is not None and backend in routed and alpha is not None and block_size == 16 and not use_8x4_sf_layout and not kwargs:
                try:  # free in Python 3.11+ when nothing is raised
                    if out is None:
                        # SGLang never passes out: allocate it here (FlashInfer then skips its own allocation).
                        return fn(a, b, a_descale, b_descale, alpha, out_dtype, empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device))
                    if out.is_contiguous():
                        return fn(a, b, a_descale, b_descale, alpha, out_dtype, out)
                except Exception as exc:
                    exc.add_note(describe(a, fn))
                    raise
            return slow_path(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout, backend, kwargs)

        flashinfer_fp4_gemm.__wrapped__ = original
        flashinfer_fp4_gemm.__qualname__ = "sm120_fp4.dispatch.flashinfer_fp4_gemm"
        return flashinfer_fp4_gemm
