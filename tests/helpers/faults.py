"""Misbehaving GEMM backends, each reproducing a failure reported on SM12x, built on the oracle."""

from __future__ import annotations

import torch

from sm120_fp4.backends import emulated_mm_fp4


def healthy(*args):
    return emulated_mm_fp4(*args)


def returns_zeros(a, b, a_sf, b_sf, alpha, dtype, out):  # FlashInfer 2577: cutlass all zeros
    out.zero_()
    return out


def leaves_out_unwritten(a, b, a_sf, b_sf, alpha, dtype, out):  # a plain sm_120 build returns early
    return out


def zeroes_row_band(a, b, a_sf, b_sf, alpha, dtype, out):  # PR 3533: rows 64-127 zero
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    out[64:128] = 0
    return out


def wrong_for_large_m(a, b, a_sf, b_sf, alpha, dtype, out):  # FlashInfer 3398: zeros at some M only
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if out.shape[0] > 1000:
        out.mul_(0.04)  # 25x too small
    return out


def scale_error_4x(a, b, a_sf, b_sf, alpha, dtype, out):  # a bf16 global scale read as float32
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha * 4, dtype, out)
    return out


def single_nan(a, b, a_sf, b_sf, alpha, dtype, out):  # SGLang PR 20047: NaN rows
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    out[out.shape[0] // 2, out.shape[1] // 2] = float("nan")
    return out


def raises(a, b, a_sf, b_sf, alpha, dtype, out):  # alpha=None on the SM120 cutlass kernel
    raise TypeError("Expected DLTensor* but got None")


def returns_new_tensor(a, b, a_sf, b_sf, alpha, dtype, out):
    return emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, None)


def garbage_rows(a, b, a_sf, b_sf, alpha, dtype, out):  # wrong values in a few rows, not zeros
    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    if out.shape[0] > 3:
        out[3] = torch.flip(out[3], dims=[0])
    return out


def make_stale_workspace(kernel=emulated_mm_fp4, mode: str = "previous"):
    """A kernel with a per-thread workspace kept from one call to the next of the same shape, never
    cleared: right on every call whose shape differs from the thread's previous call, and from the
    second call in a row of one shape on wrong -- the previous call's result returned again
    (``mode="previous"``), or its partial sums added to this one's (``"accumulates"``).
    `kernel` is the healthy call (dense: mm_fp4's arguments; MoE: the MoE convention's)."""
    import threading

    state = threading.local()

    def stale_workspace(*args):
        out = args[-1]
        key = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
        if getattr(state, "key", None) == key:
            if mode == "previous":
                return out.copy_(state.result)
            kernel(*args)
            return out.add_(state.result)
        kernel(*args)
        state.key, state.result = key, out.clone()
        return out

    return stale_workspace


def wrong_rows_between(low: int, high: int):
    """A kernel right at every M but `low`..`high` (a tactic wrong inside one autotuner bucket), where it negates
    every other output row."""

    def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if low <= a.shape[0] <= high:
            out[1::2] = -out[1::2]
        return out

    return gemm
