"""Run one backend on one device over several shapes and compare it with the nvfp4 oracle.

"Verified" means numbers, not "no exception": for each shape the inputs are quantized with
:mod:`sm120_fp4.nvfp4` (seeded, never zeros), ``out`` is poisoned with NaN, the backend is called,
and its output is checked against ``nvfp4.reference_mm_fp4`` of the same quantized inputs.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import BaseModel, Field

from . import backends, nvfp4
from .devices import Device
from .errors import SelfTestError

__all__ = [
    "quantized_inputs", "Shape", "ShapeResult", "QuantizerCheck", "SelfTestReport", "Bounds", "DEFAULT_SHAPES",
    "Case", "sweep", "run", "report_for",
]

Shape = tuple[int, int, int]  # (M, N, K)

# M: one token, an odd count, just above one 128-row tile, a prefill of a few thousand.
# N and K: multiples of 32 but not of 128, so partial tiles and padded scales are exercised.
DEFAULT_SHAPES: tuple[Shape, ...] = ((1, 96, 1056), (7, 224, 160), (129, 160, 480), (2500, 96, 160))


class Bounds(BaseModel):
    """Acceptance bounds; bf16 output rounding alone gives a relative error near 2e-3."""

    max_rel_err: float = 1e-2
    max_row_rel_err: float = 5e-2
    norm_ratio: tuple[float, float] = (0.97, 1.03)
    # The whole self-test of one candidate (every call of every pass) must finish within this:
    # a first FlashInfer call JIT-compiles its kernels (minutes on a cold cache). A call still
    # running at the deadline is reported as hung and the candidate is rejected; its thread cannot
    # be killed and keeps running in the background (a daemon thread: it never blocks exit).
    timeout_s: float = 900.0


class ShapeResult(BaseModel):
    """One M (and N, K) of a self-test: every call made for it, and the first failure."""

    m: int
    n: int
    k: int
    passed: bool
    calls: int = 0
    reason: str | None = None
    rel_err: float | None = None
    max_row_rel_err: float | None = None
    max_abs_err: float | None = None
    norm_ratio: float | None = None
    nonfinite: int | None = None
    zero_rows: int | None = None
    duration_s: float = 0.0


class QuantizerCheck(BaseModel):
    """The activation quantizer under test compared with nvfp4.quantize on the same input."""

    name: str
    passed: bool
    reason: str | None = None
    code_mismatch: float | None = None
    scale_mismatch: float | None = None


class SelfTestReport(BaseModel):
    """One backend on one device: over the default shapes, or over one layer configuration (`config`)."""

    backend: str
    device: str
    config: str | None = None
    capability: str
    simulated: bool
    passed: bool
    reason: str | None = None
    shapes: list[ShapeResult] = Field(default_factory=list)
    quantizer: QuantizerCheck | None = None
    max_rel_err: float | None = None
    duration_s: float = 0.0
    torch_version: str = torch.__version__
    flashinfer_version: str | None = None


def _row_ranges(rows: list[int], limit: int = 4) -> str:
    spans: list[list[int]] = []
    for r in rows:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    return text + (", ..." if len(spans) > limit else "")


def quantized_inputs(shape: Shape, device: torch.device, seed: int):
    """Seeded bf16 activations and weights of `shape`, quantized with nvfp4: (x, gsf_x, mm_fp4 args).

    The activation scales are uint8 bytes, as SGLang's quantizer returns them; the weight's are
    float8_e4m3fn, as SGLang stores them: a kernel must read both as E4M3 bytes."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    # Random signs and magnitudes spanning a few octaves; never zeros, never a zero row.
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=gen).float())
    w = torch.randn(n, k, generator=gen) * 0.02
    x, w = x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device)
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    alpha = (1.0 / (gx * gw)).reshape(1).to(torch.float32)
    return x, gx, (qx, qw.T, sx.view(torch.uint8), sw.T, alpha)


def _compare(out: torch.Tensor, ref: torch.Tensor, bounds: Bounds, result: ShapeResult) -> str | None:
    out32, ref32 = out.float(), ref.float()
    finite = torch.isfinite(out32)
    result.nonfinite = int((~finite).sum())
    if result.nonfinite == out.numel():
        return "output left unwritten or all non-finite (every element is still the NaN poison or inf)"
    if result.nonfinite:
        r, c = (~finite).nonzero()[0].tolist()
        return f"{result.nonfinite} non-finite element(s), first at row {r}, column {c}"
    out_zero_rows = (out32 == 0).all(dim=1)
    ref_zero_rows = (ref32 == 0).all(dim=1)
    if bool(out_zero_rows.all()):
        result.zero_rows = out.shape[0]
        return "output is all zeros"
    bad_rows = (out_zero_rows & ~ref_zero_rows).nonzero().flatten().tolist()
    result.zero_rows = len(bad_rows)
    diff = out32 - ref32
    ref_norm = ref32.norm()
    result.rel_err = float(diff.norm() / ref_norm)
    row_norms = ref32.norm(dim=1).clamp_min(1e-30)
    result.max_row_rel_err = float((diff.norm(dim=1) / row_norms).max())
    result.max_abs_err = float(diff.abs().max())
    result.norm_ratio = float(out32.norm() / ref_norm)
    if bad_rows:
        return f"{len(bad_rows)} row(s) all zero where the reference is not (rows {_row_ranges(bad_rows)})"
    lo, hi = bounds.norm_ratio
    if not lo <= result.norm_ratio <= hi:
        return f"output norm is {result.norm_ratio:.3g}x the reference's (accepted {lo}..{hi}): a scale error"
    if result.rel_err > bounds.max_rel_err:
        return f"relative error {result.rel_err:.3g} above {bounds.max_rel_err}"
    if result.max_row_rel_err > bounds.max_row_rel_err:
        worst = int((diff.norm(dim=1) / row_norms).argmax())
        return f"row {worst} relative error {result.max_row_rel_err:.3g} above {bounds.max_row_rel_err}"
    return None


class _Hung:
    pass


def _call_with_timeout(fn: Callable, args: tuple, device: torch.device, timeout_s: float) -> object:
    """fn(*args) (synchronised), its exception, or _Hung when it outlives `timeout_s`."""
    box: list = []

    def call() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            value = fn(*args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            box.append(value)
        except BaseException as exc:  # noqa: BLE001 - reported as the self-test's finding
            box.append(exc)

    worker = threading.Thread(target=call, name="sm120_fp4-selftest-call", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    return box[0] if box else _Hung()


@dataclass
class Case:
    """One M of a sweep: how to make the call, what it must equal, and what it must leave alone.

    `invoke()` makes the call and returns what the caller would get; `out` is the tensor the call
    must write and return (backend convention), or None where any (M, N) tensor may come back (a
    served layer call). `inputs` must be bitwise unchanged after every call.
    """

    m: int
    n: int
    k: int
    invoke: Callable[[], object]
    reference: torch.Tensor
    inputs: tuple[torch.Tensor, ...] = ()
    out: torch.Tensor | None = None


def _check_call(case: Case, result: ShapeResult, bounds: Bounds, deadline: float, device: torch.device) -> str | None:
    if case.out is not None:
        case.out.fill_(float("nan"))  # poison: an unwritten out is caught, not read as a result
    snapshots = [t.clone() for t in case.inputs]
    start = time.perf_counter()
    outcome = _call_with_timeout(case.invoke, (), device, deadline - start)
    result.duration_s += time.perf_counter() - start
    result.calls += 1
    if isinstance(outcome, _Hung):
        return f"call {result.calls} did not return within the self-test's time bound (a hung kernel?)"
    if isinstance(outcome, BaseException):
        return f"call {result.calls} raised {type(outcome).__name__}: {outcome}".strip()
    if case.out is not None and outcome is not case.out:
        what = "None" if outcome is None else "a tensor other than `out`"
        return f"call {result.calls} returned {what} (backends must write into out and return it)"
    if case.out is None and (not isinstance(outcome, torch.Tensor) or tuple(outcome.shape) != (case.m, case.n)):
        return f"call {result.calls} returned {outcome!r:.80} instead of a ({case.m}, {case.n}) tensor"
    reason = _compare(outcome, case.reference, bounds, result)
    if reason is not None:
        return f"call {result.calls}: {reason}"
    changed = [i for i, (t, before) in enumerate(zip(case.inputs, snapshots)) if not torch.equal(t, before)]
    if changed:
        return f"call {result.calls} changed its input(s) {changed} in place (every later call would be wrong)"
    return None


def sweep(cases: list[Case], bounds: Bounds, device: torch.device, passes: int = 2) -> list[ShapeResult]:
    """Call every case `passes` times (pass after pass, so each M is called again after all others)
    and check every call; stop at the deadline of `bounds.timeout_s` for the whole sweep."""
    results = [ShapeResult(m=c.m, n=c.n, k=c.k, passed=True) for c in cases]
    deadline = time.perf_counter() + bounds.timeout_s
    for _ in range(passes):
        for case, result in zip(cases, results):
            if not result.passed:
                continue  # its first failure is the finding
            reason = _check_call(case, result, bounds, deadline, device)
            if reason is not None:
                result.passed, result.reason = False, reason
                if "did not return" in reason:
                    return results  # a hung call: no more calls into this backend
    return results


def _backend_cases(fn: Callable, shapes: tuple[Shape, ...], device: torch.device, seed: int, dtype: torch.dtype) -> list[Case]:
    cases = []
    for i, (m, n, k) in enumerate(shapes):
        _, _, args = quantized_inputs((m, n, k), device, seed + i)
        ref = nvfp4.reference_mm_fp4(*args, out_dtype=torch.float32)
        out = torch.empty((m, n), dtype=dtype, device=device)
        cases.append(Case(m, n, k, functools.partial(fn, *args, dtype, out), ref, inputs=args, out=out))
    return cases


def check_quantizer(name: str, quantizer: Callable, device: torch.device, seed: int = 0) -> QuantizerCheck:
    """Compare `quantizer(x, global_scale) -> (packed, swizzled scales)` with nvfp4.quantize."""
    x, gx, _ = quantized_inputs((129, 64, 480), device, seed)
    want_q, want_s = nvfp4.quantize(x, gx)
    try:
        got_q, got_s = quantizer(x, gx)
    except Exception as exc:
        return QuantizerCheck(name=name, passed=False, reason=f"raised {type(exc).__name__}: {exc}")
    got_q, got_s = got_q.view(torch.uint8), got_s.view(torch.uint8)
    if got_q.shape != want_q.shape or got_s.numel() != want_s.numel():
        return QuantizerCheck(name=name, passed=False, reason=f"shapes {tuple(got_q.shape)}/{tuple(got_s.shape)} differ from nvfp4's")
    codes = nvfp4.unpack_nibbles(got_q) != nvfp4.unpack_nibbles(want_q)
    scales = got_s.reshape(-1) != want_s.view(torch.uint8).reshape(-1)
    code_mm, scale_mm = float(codes.float().mean()), float(scales.float().mean())
    # FlashInfer's fast-math reciprocals may move a boundary value by one code: allow a trace.
    ok = code_mm <= 1e-3 and scale_mm <= 1e-3
    reason = None if ok else f"{code_mm:.2%} of codes and {scale_mm:.2%} of scales differ from nvfp4.quantize"
    return QuantizerCheck(name=name, passed=ok, reason=reason, code_mismatch=code_mm, scale_mismatch=scale_mm)


def report_for(backend: str, device: Device, config: str | None = None) -> SelfTestReport:
    """An empty report of `backend` on `device` (for `config`), to fill in."""
    return SelfTestReport(
        backend=backend,
        device=device.label(),
        config=config,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        simulated=device.simulated,
        passed=False,
        flashinfer_version=backends.flashinfer_version(),
    )


def finish(report: SelfTestReport, results: list[ShapeResult], start: float) -> SelfTestReport:
    """Fill `report` from the sweep `results`: passed, the first failure (with its M), the worst error."""
    report.shapes = results
    for r in results:
        if not r.passed and report.reason is None:
            report.reason = f"M={r.m} N={r.n} K={r.k}: {r.reason}"
    if report.quantizer is not None and not report.quantizer.passed and report.reason is None:
        report.reason = f"activation quantizer {report.quantizer.name}: {report.quantizer.reason}"
    errors = [r.rel_err for r in results if r.rel_err is not None]
    report.max_rel_err = max(errors) if errors else None
    report.passed = report.reason is None
    report.duration_s = time.perf_counter() - start
    return report


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
    """Self-test `backend` on `device` over `shapes` (default DEFAULT_SHAPES); never raises for a bad kernel.

    Two passes over the shapes, every call checked: it returns `out` itself, `out` matches the
    oracle (after NaN poisoning), and its inputs are bitwise unchanged.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError("sm120_fp4 self-test asked for inside CUDA-graph capture; run it before capturing")
    bounds = bounds or Bounds()
    shapes = tuple(shapes or DEFAULT_SHAPES)
    for shape in shapes:
        if len(shape) != 3 or any(int(v) <= 0 for v in shape) or shape[2] % 32 or shape[1] % 8:
            raise SelfTestError(f"self-test shape {shape!r} is not (M, N, K) with N % 8 == 0 and K % 32 == 0")
    report = report_for(backend, device)
    start = time.perf_counter()
    try:
        fn = backends.resolve(backend)
    except Exception as exc:
        report.reason = f"could not load backend {backend!r}: {type(exc).__name__}: {exc}"
        return report
    tdev = device.torch_device
    results = sweep(_backend_cases(fn, shapes, tdev, seed, out_dtype), bounds, tdev)
    if quantizer is not None:
        report.quantizer = check_quantizer(quantizer[0], quantizer[1], tdev, seed)
    return finish(report, results, start)
