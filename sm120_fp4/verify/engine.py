"""The verification engine: bounds, judging an output against the oracle's, and sweeps of checked calls.

Each call's ``out`` is poisoned with NaN, the call made on the calling thread (:mod:`.watchdog`), its
output checked against the oracle of the same quantized inputs and its inputs checked unchanged.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch
from pydantic import BaseModel, Field

from .. import backends, graphs
from ..devices import Device
from ..errors import SelfTestError
from .data import _row_ranges
from .fingerprint import fingerprint
from .watchdog import _call, hang_grace

__all__ = [
    "ShapeResult",
    "QuantizerCheck",
    "SelfTestReport",
    "Bounds",
    "Case",
    "Sweep",
    "sweep",
    "report_for",
    "finish",
    "COPY_LIMIT",
    "refuse_inside_capture",
    "free_memory",
    "lost_column_group",
]


class Bounds(BaseModel):
    """Acceptance bounds; bf16 output rounding alone gives a relative error near 2e-3."""

    max_rel_err: float = 1e-2
    max_row_rel_err: float = 5e-2
    norm_ratio: tuple[float, float] = (0.97, 1.03)
    # For every call of one candidate's self-test: a first FlashInfer call JIT-compiles (minutes cold).
    timeout_s: float = 900.0
    # Columns checked together per row (None: not): 8 dropped columns move a row of 7168 by only 3%.
    column_group: int | None = None
    # What the probes that repeat calls (the MoE repeat probe) may take together in one check, shared out
    # as they run: a quarter of a MoE layer check's 2 s target. A fast kernel gets every call, a slow one fewer.
    probe_s: float = 0.5


class ShapeResult(BaseModel):
    """One M (and N, K) of a self-test: every call made for it, and the first failure."""

    m: int
    n: int
    k: int
    passed: bool
    label: str | None = None  # what m, n, k do not say (a MoE case: T, top-k, E, H, I, routing)
    calls: int = 0
    repeats: int | None = None  # a repeat probe's calls in a row within its time budget (its last run)
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
    # Why the check did not run (it could not get its GPU memory: freed, retried once); None when it ran.
    skipped: str | None = None
    torch_version: str = torch.__version__
    flashinfer_version: str | None = None


_COMPARE_ELEMENTS = 1 << 24  # rows compared at a time: a large prefill M never needs more than this in float32
# The numbers _compare_stats computes and _judge reads back at once.
_COUNTS = ("nonfinite", "zero_not_ref", "worst_row", "ref_all_zero", "out_all_zero")
_NORMS = ("ref", "diff", "max_row_err", "max_abs", "out", "max_excess", "slack")


def _resolution(dtype: torch.dtype, n: int) -> float:
    """Return the norm of `n` values each off by `dtype`'s smallest subnormal step (0 for float32)."""
    # What rounding alone leaves of a row near the bottom of the range: neither a "zero row" nor an error.
    if not dtype.is_floating_point or dtype == torch.float32:
        return 0.0
    info = torch.finfo(dtype)
    return float(info.smallest_normal * info.eps) * n**0.5


def _chunk_rows(cols: int) -> int:
    """Return how many rows of `cols` columns are compared at a time (a prefill costs no more memory)."""
    return max(1, _COMPARE_ELEMENTS // max(cols, 1))


def _row_stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Return per row the reference, output and difference norms, and the largest |difference|."""
    # Few passes over memory (a prefill M of a wide layer is gigabytes): the difference made once in float32, each
    # norm read straight from its tensor. A non-finite or all-zero row shows in its output norm (_compare_stats).
    rows, cols = out.shape
    step = _chunk_rows(cols)
    parts = []
    for lo in range(0, rows, step):
        o, r = out[lo : lo + step], ref[lo : lo + step].float()
        diff = torch.sub(o, r)  # float32: the reference's dtype
        norms = (torch.linalg.vector_norm(t, dim=1, dtype=torch.float32) for t in (r, o, diff))
        parts.append((*norms, torch.linalg.vector_norm(diff, float("inf"))))
    *rows, max_abs = zip(*parts)
    return *map(torch.cat, rows), torch.stack(max_abs).amax()


def _nonfinite(out: torch.Tensor) -> tuple[int, tuple[int, int] | None]:
    """Return how many elements of `out` are not finite and where the first is (a chunk at a time)."""
    step, count, first = _chunk_rows(out.shape[1]), 0, None
    for lo in range(0, out.shape[0], step):
        bad = ~torch.isfinite(out[lo : lo + step])
        count += int(bad.sum())
        if first is None and count:
            r, c = bad.nonzero()[0].tolist()
            first = (lo + r, c)
    return count, first


def _compare_stats(
    floor: float, max_row_rel_err: float, out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Return _COUNTS and _NORMS as one float64 tensor, then the per-row tensors _judge reads on a failure."""
    row_norms, out_norms, diff_norms, max_abs = _row_stats(out, ref)
    # A NaN or inf makes its row's norm one (so may finite values beyond the float32 square root of its range,
    # which _judge tells apart); a row's norm is 0 only where it is all zeros (or below float32's smallest square).
    nonfinite, out_zero_rows = (~torch.isfinite(out_norms)).sum(), out_norms == 0
    ref_zero_rows = row_norms <= floor  # rounding to the output dtype may leave nothing of such a row
    safe_norms = row_norms.clamp_min(1e-30)
    row_err = diff_norms / safe_norms
    allowed_rows = max_row_rel_err + 2 * floor / safe_norms
    if slack is not None:
        allowed_rows = allowed_rows + 2 * slack  # twice what the oracle cannot decide, on that row only
    excess = row_err - allowed_rows
    slack_norm = (slack * row_norms).norm() if slack is not None else torch.zeros((), device=out.device)
    zero_not_ref = out_zero_rows & ~ref_zero_rows  # a row of zeros where the reference has values
    counts = [nonfinite, zero_not_ref.sum(), excess.argmax(), (row_norms == 0).all().long(), out_zero_rows.all().long()]
    norms = [row_norms.norm(), diff_norms.norm(), row_err.amax(), max_abs, out_norms.norm(), excess.amax()]
    numbers = torch.cat([torch.stack(counts).double(), torch.stack([*norms, slack_norm.float()]).double()])
    return numbers, zero_not_ref, out_norms, safe_norms, row_norms, row_err, allowed_rows


def _compare(
    out: torch.Tensor, ref: torch.Tensor, bounds: Bounds, result: ShapeResult, slack: torch.Tensor | None = None
) -> str | None:
    """Return why `out` does not match `ref` within `bounds` (each row widened by its `slack`), or None."""
    # Statistics of every row, computed on the device (a CUDA graph at decode sizes), read back at once.
    floor = _resolution(out.dtype, out.shape[1])
    inputs = (out, ref) if slack is None else (out, ref, slack)
    return graphs.run(
        "compare",
        functools.partial(_compare_stats, floor, bounds.max_row_rel_err),
        inputs,
        lambda stats: _judge(out, bounds, result, floor, *stats),
        extra=(floor, bounds.max_row_rel_err),
    )


def _judge(out, bounds: Bounds, result: ShapeResult, floor: float, numbers, *rows) -> str | None:
    """Return _compare's verdict from its statistics (read here, while they are valid)."""
    zero_not_ref, out_norms, safe_norms, row_norms, row_err, allowed_rows = rows
    n = dict(zip(_COUNTS + _NORMS, numbers.tolist()))  # the one read-back of a passing call
    result.nonfinite = 0
    if n["nonfinite"]:  # rows whose output norm is not finite: count the elements (the failure path)
        result.nonfinite, first = _nonfinite(out)
        if result.nonfinite == out.numel():
            return "output left unwritten or all non-finite (every element is still the NaN poison or inf)"
        if first is not None:
            return f"{result.nonfinite} non-finite element(s), first at row {first[0]}, column {first[1]}"
    if n["ref_all_zero"] and n["out_all_zero"]:
        result.zero_rows = 0
        result.rel_err = result.max_row_rel_err = result.max_abs_err = 0.0
        result.norm_ratio = 1.0
        return None  # nothing routed here (every slot another rank's): zeros are the answer
    if n["out_all_zero"]:
        result.zero_rows = out.shape[0]
        return "output is all zeros"
    result.zero_rows = int(n["zero_not_ref"])
    ref_norm = max(n["ref"], 1e-30)
    result.rel_err, result.max_row_rel_err = n["diff"] / ref_norm, n["max_row_err"]
    result.max_abs_err, result.norm_ratio = n["max_abs"], n["out"] / ref_norm
    if result.zero_rows:
        bad_rows = zero_not_ref.nonzero().flatten().tolist()
        return f"{len(bad_rows)} row(s) all zero where the reference is not (rows {_row_ranges(bad_rows)})"
    lo_ratio, hi_ratio = bounds.norm_ratio
    if not lo_ratio <= result.norm_ratio <= hi_ratio:
        ratios, big = out_norms / safe_norms, row_norms > floor
        text = f"output norm is {result.norm_ratio:.3g}x the reference's (accepted {lo_ratio}..{hi_ratio})"
        if bool(big.any()) and float(ratios[big].max() - ratios[big].min()) <= 0.02:  # every row off alike
            return f"{text}: a scale error"
        worst = int(((ratios - 1).abs() * big).argmax())
        return f"{text}; worst row {worst} at {float(ratios[worst]):.3g}x"
    allowed_rel = bounds.max_rel_err + 2 * floor * out.shape[0] ** 0.5 / ref_norm + 2 * n["slack"] / ref_norm
    if result.rel_err > allowed_rel:
        return f"relative error {result.rel_err:.3g} above {allowed_rel:.3g}"
    if n["max_excess"] > 0:
        worst = int(n["worst_row"])
        return f"row {worst} relative error {float(row_err[worst]):.3g} above {float(allowed_rows[worst]):.3g}"
    return None


def lost_column_group(
    out: torch.Tensor, ref: torch.Tensor, group: int, slack: torch.Tensor | None = None
) -> str | None:
    """Return where some row of `out` lost a group of `group` columns against `ref`, or None."""
    # Lost: error >= half the reference group's norm, that group a fair share of the row, beyond `slack`
    # (per row, what the oracle cannot decide, which may sit whole in one group).
    rows, cols = out.shape
    if cols % group or rows == 0:
        return None
    step = _chunk_rows(cols)
    floor = _resolution(out.dtype, group)
    for lo in range(0, rows, step):
        o = out[lo : lo + step].float().reshape(-1, cols // group, group)
        r = ref[lo : lo + step].float().reshape(-1, cols // group, group)
        ref_g, row_norm = r.norm(dim=2), r.reshape(r.shape[0], -1).norm(dim=1, keepdim=True)
        fair = row_norm * (group / cols) ** 0.5
        undecided = 0.0 if slack is None else 2 * slack[lo : lo + step].float().reshape(-1, 1) * row_norm
        # A group the output dtype cannot resolve (values near its smallest subnormal) loses nothing it could keep.
        lost = ((o - r).norm(dim=2) >= 0.5 * ref_g + undecided + 2 * floor) & (ref_g >= 0.25 * fair) & (ref_g > 0)
        if bool(lost.any()):
            row, g = lost.nonzero()[0].tolist()
            return (
                f"{int(lost.sum())} group(s) of {group} columns lost (error >= half their norm), "
                f"first at row {lo + row}, columns {g * group}-{g * group + group - 1}"
            )
    return None


@dataclass
class Case:
    """One call of a sweep: how to make it, what it must equal, and what it must leave alone."""

    m: int
    n: int
    k: int
    invoke: Callable[[], object]  # makes the call, returns what the caller would get
    reference: torch.Tensor  # float32 (M, N)
    inputs: tuple[torch.Tensor, ...] = ()  # bitwise unchanged after every call
    out: torch.Tensor | None = None  # the tensor the call must write and return (None: any (M, N) result)
    label: str | None = None
    bounds: Bounds | None = None  # this case's own bounds (MoE), else the sweep's
    slack: torch.Tensor | None = None  # per output row, relative error the oracle itself cannot decide
    # The same shape with other data, called right after: catches state carried between calls of a shape. Made
    # from this case when called (`twin(case)`): a twin that held its case would make a cycle, and a cycle keeps
    # the oracle's result (gigabytes at a prefill M) on the GPU until the garbage collector runs.
    twin: Callable[["Case"], "Case"] | None = None
    once: bool = False  # a probe: called in the first pass only
    repeats: Callable[[], int] | None = None  # how many calls the last invoke made (a repeat probe)


def _input_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


COPY_LIMIT = 16 << 20  # a call's input larger than this is watched by its fingerprint, not by a copy


def _kept(t: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor]:
    """Return a copy of input `t`, or above COPY_LIMIT (a layer's experts: gigabytes) its fingerprint in a tuple."""
    return (fingerprint((t,)),) if t.numel() * t.element_size() > COPY_LIMIT else t.clone()


def _unchanged(t: torch.Tensor, kept: torch.Tensor | tuple[torch.Tensor]) -> bool:
    return torch.equal(fingerprint((t,)), kept[0]) if isinstance(kept, tuple) else torch.equal(t, kept)


class Sweep:
    """Cases called pass after pass, every call checked; the first failure ends the sweep."""

    def __init__(
        self, cases: list[Case], bounds: Bounds, device: torch.device, where: str = "", repeat: bool = True
    ) -> None:
        self.cases, self.bounds, self.device, self.where = cases, bounds, device, where
        self.results = [ShapeResult(m=c.m, n=c.n, k=c.k, label=c.label, passed=True) for c in cases]
        self.failed, self.repeat, self.passes = False, repeat, 0  # repeat: the first pass calls the twins
        self._snapshots: dict = {}  # each distinct input as before the first call (or its fingerprint)
        for case in cases:
            self._watch(case.inputs)

    def _watch(self, inputs: tuple[torch.Tensor, ...]) -> list[tuple]:
        """Keep each of `inputs` not kept yet (a copy or its fingerprint); return their keys."""
        added = []
        for t in inputs:
            key = _input_key(t)
            if key not in self._snapshots:
                self._snapshots[key] = _kept(t)
                added.append(key)
        return added

    def run(self, passes: int) -> list[ShapeResult]:
        """Return the results of `passes` passes within one deadline (after a failure: the cases tried)."""
        deadline = time.perf_counter() + self.bounds.timeout_s
        grace = hang_grace(self.bounds.timeout_s)
        for _ in range(passes):
            if self.failed:
                break  # no more calls into this backend: a hung one may still run, a broken one costs time
            twins = self.repeat and self.passes == 0
            self.passes += 1
            for case, result in zip(self.cases, self.results):
                if case.once and self.passes > 1:
                    continue
                reason = self._check_call(case, result, deadline, grace)
                if reason is None and twins and case.twin is not None:
                    reason = self._call_twin(case, result, deadline, grace)
                if reason is not None:
                    result.passed, result.reason = False, reason
                    self.failed = True
                    break
        return [r for r in self.results if r.calls] if self.failed else self.results

    def _call_twin(self, case: Case, result: ShapeResult, deadline: float, grace: float) -> str | None:
        """Return why `case`'s twin, called right after it, failed, or None."""
        try:
            twin = case.twin(case)
        except Exception as exc:
            return f"could not build the repeated call: {type(exc).__name__}: {exc}"
        added = self._watch(twin.inputs)  # the twin's own inputs (its activations): for this one call
        try:
            reason = self._check_call(twin, result, deadline, grace)
        finally:
            for key in added:
                self._snapshots.pop(key, None)
        return reason and f"{reason} (the same shape called again right after its first call, other data)"

    def _check_call(self, case: Case, result: ShapeResult, deadline: float, grace: float) -> str | None:
        """Return why one call of `case` failed, or None."""
        if case.out is not None:
            case.out.fill_(float("nan"))  # poison: an unwritten out is caught, not read as a result
        start = time.perf_counter()
        what = f"call {result.calls + 1} ({case.label or f'M={case.m} N={case.n} K={case.k}'}){self.where}"
        outcome = _call(case.invoke, self.device, deadline, deadline + grace, what)
        end = time.perf_counter()
        result.duration_s += end - start
        result.calls += 1
        if case.repeats is not None:
            result.repeats = case.repeats()
        if end > deadline:
            return f"call {result.calls} did not return within the self-test's time bound (a hung kernel?)"
        if isinstance(outcome, BaseException):
            return f"call {result.calls} raised {type(outcome).__name__}: {outcome}".strip()
        if case.out is not None and outcome is not case.out:
            what = "None" if outcome is None else "a tensor other than `out`"
            return f"call {result.calls} returned {what} (backends must write into out and return it)"
        if case.out is None and (not isinstance(outcome, torch.Tensor) or tuple(outcome.shape) != (case.m, case.n)):
            return f"call {result.calls} returned {outcome!r:.80} instead of a ({case.m}, {case.n}) tensor"
        bounds = case.bounds or self.bounds
        reason = _compare(outcome, case.reference, bounds, result, case.slack)
        if reason is None and bounds.column_group:
            reason = lost_column_group(outcome, case.reference, bounds.column_group, case.slack)
        if reason is not None:
            return f"call {result.calls}: {reason}" + (
                f" (the worst of {result.repeats} in a row)" if result.repeats else ""
            )
        changed = [i for i, t in enumerate(case.inputs) if not _unchanged(t, self._snapshots[_input_key(t)])]
        if changed:
            return f"call {result.calls} changed its input(s) {changed} in place (every later call would be wrong)"
        return None


def sweep(
    cases: list[Case], bounds: Bounds, device: torch.device, passes: int = 2, where: str = ""
) -> list[ShapeResult]:
    """Return the results of `passes` passes over `cases` (twins in the first), stopping at the first failure."""
    return Sweep(cases, bounds, device, where).run(passes)


def report_for(backend: str, device: Device, config: str | None = None) -> SelfTestReport:
    """Return an empty report of `backend` on `device` (for `config`), to fill in."""
    return SelfTestReport(
        backend=backend,
        device=device.label(),
        config=config,
        capability=f"{device.capability[0]}.{device.capability[1]}",
        simulated=device.simulated,
        passed=False,
        flashinfer_version=backends.flashinfer_version(),  # read once per process (versions.installed_version)
    )


def finish(report: SelfTestReport, results: list[ShapeResult], start: float) -> SelfTestReport:
    """Return `report` filled from sweep `results`: passed, the first failure (with its M), the worst error."""
    report.shapes = results
    for r in results:
        if not r.passed and report.reason is None:
            report.reason = f"{r.label or f'M={r.m} N={r.n} K={r.k}'}: {r.reason}"
    if report.quantizer is not None and not report.quantizer.passed and report.reason is None:
        report.reason = f"activation quantizer {report.quantizer.name}: {report.quantizer.reason}"
    errors = [r.rel_err for r in results if r.rel_err is not None]
    report.max_rel_err = max(errors) if errors else None
    report.passed = report.reason is None
    report.duration_s = time.perf_counter() - start
    return report


def load_backend(report: SelfTestReport, resolve: Callable, what: str, name: str) -> Callable | None:
    """Return `resolve(name)`, or None with `report.reason` saying why `what` could not be loaded."""
    try:
        return resolve(name)
    except Exception as exc:
        report.reason = f"could not load {what}: {type(exc).__name__}: {exc}"
        return None


def free_memory(device: torch.device) -> None:
    """Return what a check that ran out of memory held to the device (torch's cache included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def refuse_inside_capture(what: str, when: str) -> None:
    """Raise SelfTestError when the current CUDA stream is capturing: a `what` runs `when` capturing."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(f"sm120_fp4 {what} asked for inside CUDA-graph capture; run it {when} capturing")
