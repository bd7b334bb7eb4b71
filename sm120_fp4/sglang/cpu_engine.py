"""The import-time stand-in for SGLang's CUDA-only kernel package ``sgl_kernel`` (simulation only).

With SGLang's CPU engine selected (``SGLANG_USE_CPU_ENGINE=1``) a missing package is stood in for too, serving
in pure PyTorch the one op a request calls (:data:`OPS`); its other names raise when called.
"""

from __future__ import annotations

import os
from typing import Callable

from .. import engines

KERNEL_PACKAGE = "sgl_kernel"
ENGINE_FLAG = "SGLANG_USE_CPU_ENGINE"  # SGLang's own switch (srt/platforms: "1" selects the CPU engine)


def cpu_engine_selected() -> bool:
    """Return whether SGLang's CPU engine is selected in this process, as SGLang itself reads it."""
    return os.environ.get(ENGINE_FLAG, "0") == "1"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's run of ``out_cache_loc`` into its ``req_to_token`` row, as SGLang's Triton kernel."""
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"assign_req_to_token_pool_cpu: req_to_token {tuple(req_to_token.shape)} does not have "
            f"pool_len={pool_len} columns"
        )
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count < 0 or end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: slots [{start}, {end}) outside 0..{pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(req_to_token.dtype)
        offset += count
    if offset != out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {out_cache_loc.numel()} cache locations for {offset} slots")


OPS = {"assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu}


def kernel_package_stand_in(
    used: Callable[[str], None] = lambda reason: None, serve: dict[str, Callable] | None = None
) -> Callable[[], None]:
    """Insert the import-time stand-in for an installed ``sgl_kernel`` that cannot load; return its undo."""
    # `used(reason)`: it replaced the real package; with `serve` (OPS) it stands in for a missing one too.
    return engines.stand_in_finder((KERNEL_PACKAGE,), lambda name, why: used(why), serve, missing=serve is not None)
