"""Simulation only: the few kernel-package ops SGLang's CPU engine calls to serve a request, in pure PyTorch.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1 ... --device cpu``) imports the CPU build of its kernel
package ``sgl_kernel``, which the package index does not carry (only the CUDA ``sglang-kernel``). With
``--attention-backend torch_native --disable-cuda-graph`` a request needs one of its ops, the KV-slot
bookkeeping at every prefill and decode step. The simulation's stand-in package
(:mod:`sm120_fp4.sglang.simulation`) serves exactly the names in :data:`OPS`; every other name raises
when called. Nothing here computes a model's numbers: it only writes token-pool indices.
"""

from __future__ import annotations

import os

import torch

__all__ = ["OPS", "ENGINE_FLAG", "cpu_engine_selected"]

ENGINE_FLAG = "SGLANG_USE_CPU_ENGINE"  # SGLang's own switch (srt/platforms: "1" selects the CPU engine)


def cpu_engine_selected(environ=os.environ) -> bool:
    """Whether SGLang's CPU engine is selected in this process, as SGLang itself reads it."""
    return environ.get(ENGINE_FLAG, "0") == "1"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = its run of ``out_cache_loc``
    (the runs of all requests are concatenated in order), as SGLang's Triton kernel of the same name."""
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
