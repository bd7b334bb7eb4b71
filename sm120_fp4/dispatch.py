"""The hot path: route each FP4 GEMM call to the backend decided for its device.

:func:`make_dispatch` builds the replacement for a module-level ``mm_fp4`` alias: the front with
mm_fp4's signature comes from :mod:`sm120_fp4.kernels` (it alone knows FlashInfer's keywords);
the routes come from :mod:`sm120_fp4.selection` (the one decision cache). Per call: one dict
lookup keyed by ``a.get_device()``, a few comparisons and the backend call with ``alpha`` and a
contiguous preallocated ``out``. No host sync, no allocation but ``out``, nothing that breaks
CUDA-graph capture. The first call on a device without a decision decides once (a self-test).
"""

from __future__ import annotations

from typing import Callable

from . import kernels, selection
from .config import Settings

__all__ = ["Router"]


class Router:
    """The routing of one install: its settings, over selection's route table."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def ensure(self, index: int) -> Callable | None:
        """Decide (self-test) for CUDA ordinal `index` (-1: CPU in simulation) once; the backend, or
        None where this library does not serve the device."""
        return selection.route(index, self.settings)

    def routes(self) -> dict[int, str]:
        """Device index -> the backend it is routed to, or "original" (a device this install does not serve)."""
        return selection.routes()

    def make_dispatch(self, original: Callable) -> Callable:
        """Build the replacement for a module-level ``mm_fp4`` alias."""
        names = selection.routes
        return kernels.mm_fp4_front(original, selection.route_table().get, self.ensure, lambda i: names().get(i, "?"))
