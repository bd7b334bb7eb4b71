"""Misbehaving NVFP4 fused-MoE backends, each reproducing a reported SM12x failure, built on the oracle."""

from __future__ import annotations

import torch

from sm120_fp4 import nvfp4
from sm120_fp4.backends import emulated_moe


def _ref(x, ids, w, w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1, a2, activation, out_dtype, **kw):
    skipped = ids < 0  # the convention's -1: a slot that is not this rank's adds nothing
    # computed (weight 0) on an expert the call routes to, never on an expert nothing routes to (its
    # rows may be non-finite: 0 x inf = NaN)
    stand_in = ids.max().clamp_min(0)
    ids, w = torch.where(skipped, stand_in, ids), torch.where(skipped, torch.zeros_like(w), w)
    return nvfp4.reference_moe_fp4(
        x, ids, w, w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1, a2, activation=activation, out_dtype=out_dtype, **kw
    )


def rounds_intermediate_first(
    x, ids, w, w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1, a2, activation, out_dtype, out
):
    """Healthy: FlashInfer's own rounding (the intermediate rounded to the output dtype before it is
    re-quantized, and each slot's row rounded before the sum)."""
    original = nvfp4.expert_activation
    nvfp4.expert_activation = lambda fc1, act, inter: original(fc1, act, inter).to(out_dtype).float()
    try:
        out.copy_(
            _ref(x, ids, w, w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1, a2, activation, torch.float32).to(
                out_dtype
            )
        )
    finally:
        nvfp4.expert_activation = original
    return out


def drops_tile_rows_64_127(x, ids, w, *rest):
    """FlashInfer PR 3533: rows 64-127 of an expert's tile are zero when the expert gets > 64 rows."""
    keep = torch.ones_like(w)
    flat = ids.reshape(-1).long() + 1  # -1 (a slot that is not this rank's) sorts first, as its own group
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=int(flat.max()) + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    dropped = ((rank_in_expert % 128) >= 64).reshape(ids.shape)
    keep[dropped] = 0
    return emulated_moe(x, ids, w * keep, *rest)


def drops_one_expert(x, ids, w, *rest):
    """One expert's output never reaches the sum (expert 5)."""
    return emulated_moe(x, ids, torch.where(ids == 5, torch.zeros_like(w), w), *rest)


def ignores_routing_weights(x, ids, w, *rest):
    return emulated_moe(x, ids, torch.ones_like(w), *rest)


def swaps_gate_and_up(x, ids, w, w13, w13_sf, w13_alpha, *rest):
    """Reads w13 as [gate; up] (relu2 layers have no halves: unchanged)."""
    activation = rest[5]
    if activation != "swiglu":
        return emulated_moe(x, ids, w, w13, w13_sf, w13_alpha, *rest)
    inter = w13.shape[1] // 2
    swapped = torch.cat((w13[:, inter:], w13[:, :inter]), dim=1)
    sf = torch.stack(
        [
            nvfp4.swizzle_scales(torch.cat((s[inter:], s[:inter])))
            for s in (nvfp4.unswizzle_scales(e.contiguous(), 2 * inter, w13.shape[2] * 2) for e in w13_sf)
        ]
    )
    return emulated_moe(x, ids, w, swapped, sf, w13_alpha, *rest)


def drops_second_slot(x, ids, w, *rest):
    if w.shape[1] < 2:
        return emulated_moe(x, ids, w, *rest)
    keep = torch.ones_like(w)
    keep[:, 1] = 0
    return emulated_moe(x, ids, w * keep, *rest)


def make_stale_workspace(mode: str = "previous"):
    """faults.make_stale_workspace for the MoE convention: wrong from the second call in a row of one shape."""
    from helpers.faults import make_stale_workspace as dense

    return dense(emulated_moe, mode)


def fast(kernel=emulated_moe):
    """`kernel`, each output computed once per distinct input and then copied (a CPU call as fast as a GPU's)."""
    done = {}

    def once(x, ids, w, w13, w13_sf, w13_alpha, *rest):
        key = tuple(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (x, ids, w, w13_alpha)) + (
            tuple(w13.shape),
            rest[-3],
        )
        if key not in done:
            done[key] = kernel(x, ids, w, w13, w13_sf, w13_alpha, *rest).clone()
        return rest[-1].copy_(done[key])

    return once


def loses_in_a_row(at=(37, 81)):
    """Loses one 8-column group of row 0 at the 37th and 81st call in a row of the same inputs (2 in 100)."""
    fast_kernel, last = fast(), {"key": None, "run": 0}

    def kernel(x, ids, *rest):
        key = tuple(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (x, ids))  # an engine may copy them
        last["run"] = last["run"] + 1 if last["key"] == key else 1
        last["key"] = key
        out = fast_kernel(x, ids, *rest)
        if last["run"] % 100 in at:
            out[0, 8:16] = 0
        return out

    return kernel


def after_generic(fault):
    """`fault` on every call after the generic MoE self-test's (so only the layer check can see it)."""
    from sm120_fp4 import verify

    calls = {"n": 0}
    generic = 3 * (
        len(verify.SIMULATION_MOE_CONFIG.cases) + 1
    )  # two passes (the first calling each case twice in a row) of its cases and the expert-0 poison probe

    def kernel(*args):
        calls["n"] += 1
        return (emulated_moe if calls["n"] <= generic else fault)(*args)

    return kernel


def kernel_faults() -> list:
    """One of each wrong MoE kernel above (a fresh stale-workspace kernel each call)."""
    return [
        drops_tile_rows_64_127,
        drops_one_expert,
        ignores_routing_weights,
        swaps_gate_and_up,
        drops_second_slot,
        make_stale_workspace(),
    ]
