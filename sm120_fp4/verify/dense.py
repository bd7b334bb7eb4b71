"""The dense self-test: one backend on one device over several GEMM shapes, against the oracle."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import torch

from .. import backends, nvfp4
from ..devices import Device
from ..errors import SelfTestError
from .data import Shape, quantized_inputs
from .engine import (
    Bounds,
    Case,
    QuantizerCheck,
    SelfTestReport,
    finish,
    load_backend,
    refuse_inside_capture,
    report_for,
    sweep,
)

__all__ = ["DEFAULT_SHAPES", "run", "served_cases"]


def served_cases(
    ms: list[int], n_out: int, k: int, serve: Callable, x: torch.Tensor, reference: torch.Tensor, watched: tuple
) -> list[Case]:
    """Return one served dense layer's cases: each M of `ms` through `serve` on the first M rows of `x`.

    `x` (and `reference`) hold at least max(ms) + 1 rows: each case's twin (other data, right after it) is the
    next M rows, views of the same tensors (no rolled copy of the reference)."""
    # A twin is made from its case when called (it holds no reference to it: no cycle keeps the oracle's
    # gigabytes alive after the check, until the garbage collector runs).
    cases = []
    for m in ms:
        case = Case(m, n_out, k, functools.partial(serve, x[:m]), reference[:m], inputs=watched)
        case.twin = functools.partial(_next_rows, functools.partial(serve, x[1 : m + 1]), reference[1 : m + 1])
        cases.append(case)
    return cases


def _next_rows(invoke: Callable, reference: torch.Tensor, case: Case) -> Case:
    return dataclasses.replace(case, invoke=invoke, reference=reference, twin=None)


# M: one token, an odd count, just above one 128-row tile, a prefill. N, K: multiples of 32, not of 128.
DEFAULT_SHAPES: tuple[Shape, ...] = ((1, 96, 1056), (7, 224, 160), (129, 160, 480), (2500, 96, 160))


def _backend_cases(
    fn: Callable, shapes: tuple[Shape, ...], device: torch.device, seed: int, dtype: torch.dtype
) -> list[Case]:
    cases = []
    for i, (m, n, k) in enumerate(shapes):
        _, _, args = quantized_inputs((m, n, k), device, seed + i)
        ref = nvfp4.reference_mm_fp4(*args, out_dtype=torch.float32)
        out = torch.empty((m, n), dtype=dtype, device=device)
        twin = functools.partial(_negated, fn)
        cases.append(Case(m, n, k, functools.partial(fn, *args, dtype, out), ref, inputs=args, out=out, twin=twin))
    return cases


def _negated(fn: Callable, case: Case) -> Case:
    """Return `case`'s call with the activation negated (every FP4 code's sign bit flipped): exactly -reference."""
    a, *rest = case.inputs
    a = a ^ 0x88
    call = functools.partial(fn, a, *rest, case.out.dtype, case.out)
    return Case(case.m, case.n, case.k, call, -case.reference, inputs=(a, *rest), out=case.out)


def check_quantizer(name: str, quantizer: Callable, device: torch.device, seed: int = 0) -> QuantizerCheck:
    """Return `quantizer(x, global_scale) -> (packed, swizzled scales)` compared with nvfp4.quantize."""
    x, gx, _ = quantized_inputs((129, 64, 480), device, seed)
    want_q, want_s = nvfp4.quantize(x, gx)
    try:
        got_q, got_s = quantizer(x, gx)
    except Exception as exc:
        return QuantizerCheck(name=name, passed=False, reason=f"raised {type(exc).__name__}: {exc}")
    got_q, got_s = got_q.view(torch.uint8), got_s.view(torch.uint8)
    if got_q.shape != want_q.shape or got_s.numel() != want_s.numel():
        reason = f"shapes {tuple(got_q.shape)}/{tuple(got_s.shape)} differ from nvfp4's"
        return QuantizerCheck(name=name, passed=False, reason=reason)
    codes = nvfp4.unpack_nibbles(got_q) != nvfp4.unpack_nibbles(want_q)
    scales = got_s.reshape(-1) != want_s.view(torch.uint8).reshape(-1)
    code_mm, scale_mm = float(codes.float().mean()), float(scales.float().mean())
    # FlashInfer's fast-math reciprocals may move a boundary value by one code: allow a trace.
    ok = code_mm <= 1e-3 and scale_mm <= 1e-3
    reason = None if ok else f"{code_mm:.2%} of codes and {scale_mm:.2%} of scales differ from nvfp4.quantize"
    return QuantizerCheck(name=name, passed=ok, reason=reason, code_mismatch=code_mm, scale_mismatch=scale_mm)


def run(
    backend: str,
    device: Device,
    shapes: tuple[Shape, ...] | list[Shape] | None = None,
    *,
    seed: int = 0,
    bounds: Bounds | None = None,
    quantizer: tuple[str, Callable] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> SelfTestReport:
    """Return the self-test of dense `backend` on `device` over `shapes`; never raise for a bad kernel."""
    refuse_inside_capture("self-test", "before")
    bounds = bounds or Bounds()
    shapes = tuple(shapes or DEFAULT_SHAPES)
    for shape in shapes:
        if len(shape) != 3 or any(int(v) <= 0 for v in shape) or shape[2] % 32 or shape[1] % 8:
            raise SelfTestError(f"self-test shape {shape!r} is not (M, N, K) with N % 8 == 0 and K % 32 == 0")
    report = report_for(backend, device)
    start = time.perf_counter()
    fn = load_backend(report, backends.resolve, f"backend {backend!r}", backend)
    if fn is None:
        return report
    tdev = device.torch_device
    where = f" of backend {backend!r} on {device.label()}"
    results = sweep(_backend_cases(fn, shapes, tdev, seed, out_dtype), bounds, tdev, where=where)
    if quantizer is not None:
        report.quantizer = check_quantizer(quantizer[0], quantizer[1], tdev, seed)
    return finish(report, results, start)
