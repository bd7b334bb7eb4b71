"""The verification engine: bounds, judging an output against the oracle's, cases and the sweep
that calls and checks them, and the reports a check fills in.

"Verified" means numbers, not "no exception": for each case ``out`` is poisoned with NaN, the call is
made (on the calling thread: :mod:`.watchdog`), and its output is checked against the oracle of the
same quantized inputs, its inputs bitwise unchanged.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
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
    "rolled",
    "COPY_LIMIT",
    "refuse_inside_capture",
    "lost_column_group",
]


class Bounds(BaseModel):
    """Acceptance bounds; bf16 output rounding alone gives a relative error near 2e-3."""

    max_rel_err: float = 1e-2
    max_row_rel_err: float = 5e-2
    norm_ratio: tuple[float, float] = (0.97, 1.03)
    # The whole self-test of one candidate (every call of every pass) must finish within this:
    # a first FlashInfer call JIT-compiles its kernels (minutes on a cold cache). A call still
    # running at the deadline is reported as hung and the candidate is rejected; its thread cannot
    # be killed and keeps running in the background (a daemon thread: see `calls_still_running`).
    timeout_s: float = 900.0
    # Columns checked together within each row (None: not checked): a group whose error is at least
    # half its reference's norm, where the reference group carries a fair share of the row, is a
    # lost group (a kernel that drops 8 output columns in one call moves a wide row by less than its
    # row bound: H=7168 by sqrt(8/7168) = 3%); rounding and bf16 sums of the k slots stay far below.
    column_group: int | None = None


class ShapeResult(BaseModel):
    """One M (and N, K) of a self-test: every call made for it, and the first failure."""

    m: int
    n: int
    k: int
    passed: bool
    label: str | None = None  # what m, n, k do not say (a MoE case: T, top-k, E, H, I, routing)
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


_COMPARE_ELEMENTS = 1 << 24  # rows compared at a time: a large prefill M never needs more than this in float32


def _resolution(dtype: torch.dtype, n: int) -> float:
    """The norm of a row of `n` values each off by the output dtype's smallest subnormal step: what
    rounding alone can leave of a row whose true values lie near the bottom of the dtype's range
    (fp16 outputs of tiny activations), so such a row is neither a "zero row" nor a relative error."""
    if not dtype.is_floating_point or dtype == torch.float32:
        return 0.0
    info = torch.finfo(dtype)
    return float(info.smallest_normal * info.eps) * n**0.5


def _row_stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of `out` against `ref` (float32): non-finite count (0-dim), all-zero, the reference's,
    the output's and the difference's norm, and the largest absolute difference (0-dim); a few
    thousand rows at a time, so a prefill-sized M costs no more memory than a chunk of it."""
    rows, cols = out.shape
    step = max(1, _COMPARE_ELEMENTS // max(cols, 1))
    parts = []
    for lo in range(0, rows, step):
        o, r = out[lo : lo + step].float(), ref[lo : lo + step].float()
        diff = o - r
        parts.append(
            (
                (~torch.isfinite(o)).sum(),
                (o == 0).all(dim=1),
                r.norm(dim=1),
                o.norm(dim=1),
                diff.norm(dim=1),
                diff.abs().amax(),
            )
        )
    if len(parts) == 1:
        return parts[0]
    nonfinite, zero, ref_n, out_n, diff_n, max_abs = zip(*parts)
    return (
        torch.stack(nonfinite).sum(),
        torch.cat(zero),
        torch.cat(ref_n),
        torch.cat(out_n),
        torch.cat(diff_n),
        torch.stack(max_abs).amax(),
    )


def _compare_stats(
    floor: float, max_row_rel_err: float, out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """The comparison's statistics, computed where the tensors live with no host synchronisation:
    (the 12 numbers _compare reads at once, as float64; then per row: zero where the reference is
    not, the output's norm, the reference's (clamped), its relative error, its allowed error)."""
    nonfinite, out_zero_rows, row_norms, out_norms, diff_norms, max_abs = _row_stats(out, ref)
    ref_zero_rows = row_norms <= floor  # rounding to the output dtype may leave nothing of such a row
    safe_norms = row_norms.clamp_min(1e-30)
    row_err = diff_norms / safe_norms
    allowed_rows = max_row_rel_err + 2 * floor / safe_norms
    if slack is not None:
        allowed_rows = allowed_rows + 2 * slack  # twice what the oracle cannot decide, on that row only
    excess = row_err - allowed_rows
    slack_norm = (slack * row_norms).norm() if slack is not None else torch.zeros((), device=out.device)
    zero_not_ref = out_zero_rows & ~ref_zero_rows  # a row of zeros where the reference has values
    counts = torch.stack(
        [nonfinite, zero_not_ref.sum(), excess.argmax(), (row_norms == 0).all().long(), out_zero_rows.all().long()]
    )
    norms = torch.stack(
        [
            row_norms.norm(),
            diff_norms.norm(),
            row_err.amax(),
            max_abs,
            out_norms.norm(),
            excess.amax(),
            slack_norm.float(),
        ]
    )
    return (
        torch.cat([counts.double(), norms.double()]),
        zero_not_ref,
        out_norms,
        safe_norms,
        row_norms,
        row_err,
        allowed_rows,
    )


def _compare(
    out: torch.Tensor, ref: torch.Tensor, bounds: Bounds, result: ShapeResult, slack: torch.Tensor | None = None
) -> str | None:
    """None when `out` matches `ref` within `bounds` (each row's bound widened by its `slack`), else why not.

    Every row is checked: finite, not zero where the reference is not, its relative error. The
    statistics are computed where the tensors live and read back at once (one host synchronisation
    for a passing call; at a decode batch size from a CUDA graph, :mod:`sm120_fp4.graphs`); only a
    failure reads more, to say where."""
    floor = _resolution(out.dtype, out.shape[1])
    inputs = (out, ref) if slack is None else (out, ref, slack)
    return graphs.run(
        "compare",
        functools.partial(_compare_stats, floor, bounds.max_row_rel_err),
        inputs,
        lambda stats: _judge(out, bounds, result, floor, *stats),
        extra=(floor, bounds.max_row_rel_err),
    )


def _judge(
    out: torch.Tensor,
    bounds: Bounds,
    result: ShapeResult,
    floor: float,
    stats: torch.Tensor,
    zero_not_ref: torch.Tensor,
    out_norms: torch.Tensor,
    safe_norms: torch.Tensor,
    row_norms: torch.Tensor,
    row_err: torch.Tensor,
    allowed_rows: torch.Tensor,
) -> str | None:
    """_compare's verdict from its statistics (read here, while they are valid)."""
    rows, cols = out.shape
    stats = stats.tolist()  # the one read-back of a passing call
    (
        nonfinite_n,
        bad_n,
        worst_excess,
        ref_all_zero,
        out_all_zero,
        ref_norm,
        diff_norm,
        max_row_err,
        max_abs_v,
        out_norm,
        max_excess,
        slack_n,
    ) = stats
    result.nonfinite = int(nonfinite_n)
    if result.nonfinite == out.numel():
        return "output left unwritten or all non-finite (every element is still the NaN poison or inf)"
    if result.nonfinite:
        step = max(1, _COMPARE_ELEMENTS // max(cols, 1))
        for lo in range(0, rows, step):  # the failure path: read where, a chunk at a time
            bad = (~torch.isfinite(out[lo : lo + step])).nonzero()
            if bad.numel():
                r, c = bad[0].tolist()
                return f"{result.nonfinite} non-finite element(s), first at row {lo + r}, column {c}"
    if ref_all_zero and out_all_zero:
        result.zero_rows = 0
        result.rel_err = result.max_row_rel_err = result.max_abs_err = 0.0
        result.norm_ratio = 1.0
        return None  # nothing routed here (every slot another rank's): zeros are the answer
    if out_all_zero:
        result.zero_rows = rows
        return "output is all zeros"
    result.zero_rows = int(bad_n)
    ref_norm = max(ref_norm, 1e-30)
    result.rel_err = diff_norm / ref_norm
    result.max_row_rel_err = max_row_err
    result.max_abs_err = max_abs_v
    result.norm_ratio = out_norm / ref_norm
    if result.zero_rows:
        bad_rows = zero_not_ref.nonzero().flatten().tolist()
        return f"{len(bad_rows)} row(s) all zero where the reference is not (rows {_row_ranges(bad_rows)})"
    lo_ratio, hi_ratio = bounds.norm_ratio
    if not lo_ratio <= result.norm_ratio <= hi_ratio:
        ratios = out_norms / safe_norms
        big = row_norms > floor
        if bool(big.any()) and float(ratios[big].max() - ratios[big].min()) <= 0.02:  # every row off by the same factor
            return f"output norm is {result.norm_ratio:.3g}x the reference's (accepted {lo_ratio}..{hi_ratio}): a scale error"
        worst = int(((ratios - 1).abs() * big).argmax())
        return (
            f"output norm is {result.norm_ratio:.3g}x the reference's (accepted {lo_ratio}..{hi_ratio}); "
            f"worst row {worst} at {float(ratios[worst]):.3g}x"
        )
    allowed_rel = bounds.max_rel_err + 2 * floor * rows**0.5 / ref_norm + 2 * slack_n / ref_norm
    if result.rel_err > allowed_rel:
        return f"relative error {result.rel_err:.3g} above {allowed_rel:.3g}"
    if max_excess > 0:
        worst = int(worst_excess)
        return f"row {worst} relative error {float(row_err[worst]):.3g} above {float(allowed_rows[worst]):.3g}"
    return None


def lost_column_group(
    out: torch.Tensor, ref: torch.Tensor, group: int, slack: torch.Tensor | None = None
) -> str | None:
    """None unless some row of `out` lost a group of `group` columns against `ref` (see Bounds.column_group).
    `slack`: per row, the relative error the oracle itself cannot decide; a row's whole share of it may sit in
    one group (a rounding of the intermediate the kernel did otherwise), so a group is lost only beyond it."""
    rows, cols = out.shape
    if cols % group or rows == 0:
        return None
    step = max(1, _COMPARE_ELEMENTS // max(cols, 1))
    floor = _resolution(out.dtype, group)
    for lo in range(0, rows, step):
        o = out[lo : lo + step].float().reshape(-1, cols // group, group)
        r = ref[lo : lo + step].float().reshape(-1, cols // group, group)
        ref_g = r.norm(dim=2)
        fair = r.reshape(r.shape[0], -1).norm(dim=1, keepdim=True) * (group / cols) ** 0.5
        undecided = 0.0
        if slack is not None:
            row_norm = r.reshape(r.shape[0], -1).norm(dim=1, keepdim=True)
            undecided = 2 * slack[lo : lo + step].float().reshape(-1, 1) * row_norm
        # A group the output dtype cannot resolve (values near its smallest subnormal) loses nothing it could keep.
        lost = ((o - r).norm(dim=2) >= 0.5 * ref_g + undecided + 2 * floor) & (ref_g >= 0.25 * fair) & (ref_g > 0)
        if bool(lost.any()):
            row, g = lost.nonzero()[0].tolist()
            return (
                f"{int(lost.sum())} group(s) of {group} columns lost (error >= half their norm), first at row {lo + row}, "
                f"columns {g * group}-{g * group + group - 1}"
            )
    return None


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
    label: str | None = None
    bounds: Bounds | None = None  # this case's own bounds (MoE), else the sweep's
    slack: torch.Tensor | None = None  # per output row, relative error the oracle itself cannot decide
    # The same shape with other data (the same out), called right after this case's first call: a
    # kernel that carries state from one call of a shape to the next (a workspace it never clears, a
    # cached previous result) is right on every first call and wrong from the second on, which is
    # all serving does. Made when called, so a sweep holds none of its tensors between passes.
    twin: Callable[[], "Case"] | None = None


def rolled(case: Case, invoke: Callable[[], object], inputs: tuple[torch.Tensor, ...]) -> Case:
    """The twin of `case` whose call computes `case`'s rows rolled by one (row i is row i-1's):
    `invoke` makes that call; the reference and the slack are rolled the same way (rows are
    independent: each is quantized and multiplied on its own)."""
    slack = case.slack.roll(1, 0) if case.slack is not None else None
    return replace(case, invoke=invoke, reference=case.reference.roll(1, 0), inputs=inputs, slack=slack, twin=None)


def _input_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


COPY_LIMIT = 16 << 20  # a call's input larger than this is watched by its fingerprint, not by a copy


@dataclass
class _Fingerprinted:
    """What a sweep keeps of a large input (a layer's weights): its fingerprint, not a copy of it."""

    value: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


def _kept(t: torch.Tensor) -> torch.Tensor | _Fingerprinted:
    """A copy of input `t`, or for one above COPY_LIMIT its fingerprint: a layer's experts are
    gigabytes (an MoE layer's at TP1: 5.6 GB), which a copy would double at load and every call
    would compare byte for byte; its fingerprint sees any changed byte (fingerprint's one blind
    spot, two words swapped exactly _FP_WIDTH words apart, is no write a kernel makes by mistake)."""
    return _Fingerprinted(fingerprint((t,))) if t.numel() * t.element_size() > COPY_LIMIT else t.clone()


def _unchanged(t: torch.Tensor, kept: torch.Tensor | _Fingerprinted) -> bool:
    if isinstance(kept, _Fingerprinted):
        return torch.equal(fingerprint((t,)), kept.value)
    return torch.equal(t, kept)


def _check_call(
    case: Case,
    result: ShapeResult,
    bounds: Bounds,
    deadline: float,
    grace: float,
    device: torch.device,
    snapshots: dict,
    where: str = "",
) -> str | None:
    if case.out is not None:
        case.out.fill_(float("nan"))  # poison: an unwritten out is caught, not read as a result
    start = time.perf_counter()
    what = f"call {result.calls + 1} ({case.label or f'M={case.m} N={case.n} K={case.k}'}){where}"
    outcome = _call(case.invoke, device, deadline, deadline + grace, what)
    end = time.perf_counter()
    result.duration_s += end - start
    result.calls += 1
    if end > deadline:
        return f"call {result.calls} did not return within the self-test's time bound (a hung kernel?)"
    if isinstance(outcome, BaseException):
        return f"call {result.calls} raised {type(outcome).__name__}: {outcome}".strip()
    if case.out is not None and outcome is not case.out:
        what = "None" if outcome is None else "a tensor other than `out`"
        return f"call {result.calls} returned {what} (backends must write into out and return it)"
    if case.out is None and (not isinstance(outcome, torch.Tensor) or tuple(outcome.shape) != (case.m, case.n)):
        return f"call {result.calls} returned {outcome!r:.80} instead of a ({case.m}, {case.n}) tensor"
    reason = _compare(outcome, case.reference, case.bounds or bounds, result, case.slack)
    if reason is None and (case.bounds or bounds).column_group:
        reason = lost_column_group(outcome, case.reference, (case.bounds or bounds).column_group, case.slack)
    if reason is not None:
        return f"call {result.calls}: {reason}"
    changed = [i for i, t in enumerate(case.inputs) if not _unchanged(t, snapshots[_input_key(t)])]
    if changed:
        return f"call {result.calls} changed its input(s) {changed} in place (every later call would be wrong)"
    return None


class Sweep:
    """A sweep over `cases` run one pass at a time (every case called once per pass, every call
    checked), for a caller that spreads the passes out (the serving canary runs a small check's two
    passes at two idle points, with the server's forward passes between them).

    A copy of each distinct input (a layer's weights are shared by all its cases; one above
    COPY_LIMIT: its fingerprint) is taken before the first call; after every call each input must
    still equal it bit for bit (match its fingerprint). A pass has the
    deadline it is given, else `bounds.timeout_s` from its start; the first failure ends the sweep."""

    def __init__(
        self, cases: list[Case], bounds: Bounds, device: torch.device, where: str = "", repeat: bool = True
    ) -> None:
        self.cases, self.bounds, self.device, self.where = cases, bounds, device, where
        self.results = [ShapeResult(m=c.m, n=c.n, k=c.k, label=c.label, passed=True) for c in cases]
        self.failed = False
        self.repeat = repeat  # the first pass calls each case's twin right after it
        self.passes = 0
        self._snapshots: dict = {}
        for case in cases:
            for t in case.inputs:
                if _input_key(t) not in self._snapshots:
                    self._snapshots[_input_key(t)] = _kept(t)

    def run_pass(self, deadline: float | None = None) -> bool:
        """One more pass; False once a call failed (no more calls into this backend: a hung one may
        still be running, a broken one only costs time)."""
        if self.failed:
            return False
        if deadline is None:
            deadline = time.perf_counter() + self.bounds.timeout_s
        grace = hang_grace(self.bounds.timeout_s)
        twins = self.repeat and self.passes == 0
        self.passes += 1
        for case, result in zip(self.cases, self.results):
            reason = _check_call(case, result, self.bounds, deadline, grace, self.device, self._snapshots, self.where)
            if reason is None and twins and case.twin is not None:
                reason = self._call_twin(case, result, deadline, grace)
            if reason is not None:
                result.passed, result.reason = False, reason
                self.failed = True
                return False
        return True

    def _call_twin(self, case: Case, result: ShapeResult, deadline: float, grace: float) -> str | None:
        """`case`'s twin, called and checked right after it (the same shape twice in a row, other data)."""
        try:
            twin = case.twin()
        except Exception as exc:
            return f"could not build the repeated call: {type(exc).__name__}: {exc}"
        added = []  # the twin's own inputs (its activations): watched for this one call
        for t in twin.inputs:
            if _input_key(t) not in self._snapshots:
                self._snapshots[_input_key(t)] = _kept(t)
                added.append(_input_key(t))
        try:
            reason = _check_call(twin, result, self.bounds, deadline, grace, self.device, self._snapshots, self.where)
        finally:
            for key in added:
                self._snapshots.pop(key, None)
        return (
            None if reason is None else f"{reason} (the same shape called again right after its first call, other data)"
        )

    def run(self, passes: int) -> list[ShapeResult]:
        """`passes` passes within one deadline of `bounds.timeout_s` for all of them; the outcome."""
        deadline = time.perf_counter() + self.bounds.timeout_s
        for _ in range(passes):
            if not self.run_pass(deadline):
                break
        return self.outcome()

    def outcome(self) -> list[ShapeResult]:
        """The results so far: every case, or after a failure the cases tried."""
        return [r for r in self.results if r.calls] if self.failed else self.results


def sweep(
    cases: list[Case], bounds: Bounds, device: torch.device, passes: int = 2, where: str = ""
) -> list[ShapeResult]:
    """Call every case `passes` times (pass after pass, so each M is called again after all others;
    in the first pass each case's twin right after it) and check every call, within the deadline
    of `bounds.timeout_s` for the whole sweep; stop at the first failure (the results then list the
    cases tried)."""
    return Sweep(cases, bounds, device, where).run(passes)


def report_for(backend: str, device: Device, config: str | None = None) -> SelfTestReport:
    """An empty report of `backend` on `device` (for `config`), to fill in."""
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
    """Fill `report` from the sweep `results`: passed, the first failure (with its M), the worst error."""
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


def refuse_inside_capture(what: str, when: str) -> None:
    """SelfTestError when the current CUDA stream is capturing a graph: a `what` ("self-test",
    "re-check") synchronises and allocates, so it runs `when` ("before", "after") capturing."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(f"sm120_fp4 {what} asked for inside CUDA-graph capture; run it {when} capturing")
