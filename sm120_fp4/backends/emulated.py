"""The ``emulated`` backends: the oracle's arithmetic, exact and slow, on any device."""

from __future__ import annotations

import torch

from .. import nvfp4
from .convention import MoeArgs


def emulated_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out):
    """Run the nvfp4 reference GEMM (dequantize + float32 matmul)."""
    return nvfp4.reference_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out)


def emulated_moe(*args):
    """Run nvfp4.reference_moe_fp4's arithmetic into `out` (MoeArgs), with no host sync (capture-safe)."""
    # The oracle's rounding points, so its result is the oracle's (NVFP4 GEMM sums are exact in float32).
    # Every expert runs over all T tokens and each slot takes its own expert's row: E times the work, no
    # sync. A slot outside [0, E) (another rank's, or SGLang's -1) is never computed and adds exactly nothing.
    c = MoeArgs(*args)
    x, a1_gscale, a2_gscale, out_dtype = c.x, c.a1_gscale, c.a2_gscale, c.out_dtype
    tokens, hidden = x.shape
    experts, rows13 = c.w13.shape[0], c.w13.shape[1]
    inter = rows13 // 2 if c.activation == "swiglu" else rows13
    dtype = nvfp4.gemm_operand_dtype(x)
    ids = c.topk_ids.long()
    valid = (ids >= 0) & (ids < experts)
    routed = torch.zeros((tokens, ids.shape[1], hidden), dtype=out_dtype, device=x.device)
    per_expert_a1, per_expert_a2 = a1_gscale.numel() > 1, a2_gscale.numel() > 1
    acts = None if per_expert_a1 else nvfp4.requantized(x, a1_gscale, dtype)
    for e in range(experts):
        rows = nvfp4.requantized(x, a1_gscale.reshape(-1)[e], dtype) if per_expert_a1 else acts
        fc1 = nvfp4.expert_mm(rows, nvfp4.dequantize_unscaled(c.w13[e], c.w13_sf[e], dtype), c.w13_alpha[e])
        act = nvfp4.expert_activation(fc1.to(out_dtype).float(), c.activation, inter)
        act = nvfp4.requantized(act, a2_gscale.reshape(-1)[e] if per_expert_a2 else a2_gscale, dtype)
        row = nvfp4.expert_mm(act, nvfp4.dequantize_unscaled(c.w2[e], c.w2_sf[e], dtype), c.w2_alpha[e])
        routed = torch.where((ids == e).unsqueeze(-1), row.to(out_dtype).unsqueeze(1), routed)
    total = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
    for slot in range(ids.shape[1]):
        term = c.topk_weights[:, slot : slot + 1] * routed[:, slot].float()
        total = total + torch.where(valid[:, slot : slot + 1], term, torch.zeros_like(term))
    c.out.copy_(total)
    return c.out
