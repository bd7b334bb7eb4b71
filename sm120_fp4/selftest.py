"""Run one backend on one device over several shapes and compare it with the nvfp4 oracle.

"Verified" means numbers, not "no exception": for each shape the inputs are quantized with
:mod:`sm120_fp4.nvfp4` (seeded, never zeros), ``out`` is poisoned with NaN, the backend is called,
and its output is checked against ``nvfp4.reference_mm_fp4`` of the same quantized inputs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch
from pydantic import BaseModel, Field

from . import backends, graphs, locks, nvfp4
from .devices import Device
from .errors import EXIT_HUNG, SelfTestError

__all__ = [
    "quantized_inputs", "structured_activations", "seeded_activations", "ROW_KINDS", "Shape", "ShapeResult", "QuantizerCheck", "SelfTestReport", "Bounds", "DEFAULT_SHAPES",
    "Case", "Sweep", "sweep", "run", "report_for", "finish", "calls_still_running", "fingerprint", "EXIT_HUNG", "hang_hooks",
    "MoeCase", "MoeConfig", "MOE_BOUNDS", "ExpertCache", "DEFAULT_MOE_CONFIG", "SIMULATION_MOE_CONFIG", "moe_routing", "moe_cases", "run_moe",
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
    # be killed and keeps running in the background (a daemon thread: see `calls_still_running`).
    timeout_s: float = 900.0


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


def _row_ranges(rows: list[int], limit: int = 4) -> str:
    spans: list[list[int]] = []
    for r in rows:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    return text + (", ..." if len(spans) > limit else "")


ROW_KINDS = ("gaussian", "gaussian, an octave apart", "ReLU^2 (non-negative, half zero)", "sparse (90% zero)",
             "sign-structured (one sign per 16-block)", "outliers (1e3-1e4 x the rest)",
             "tiny (subnormal E4M3 block scales)", "half tiny, half normal blocks")


def structured_activations(rows: int, cols: int, amax: float, generator: torch.Generator,
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 activations (rows, cols) in [-amax, amax] whose row i is of kind ROW_KINDS[i % 8]:
    what models feed a GEMM besides Gaussian noise (ReLU^2 MLPs, sparse and one-signed rows, rare
    outliers 1e3-1e4 times the rest of their row, rows so small that their NVFP4 block scales are
    E4M3 subnormals). Never an all-zero row. `generator` lives on `device` (no host copy)."""
    g = generator
    kind = torch.arange(rows, device=device).remainder(len(ROW_KINDS)).unsqueeze(1)
    base = torch.randn(rows, cols, generator=g, device=device)
    octave = torch.exp2(torch.randint(-2, 1, (rows, 1), generator=g, device=device).float())
    u = torch.rand(rows, cols, generator=g, device=device)
    block = torch.arange(cols, device=device).div(16, rounding_mode="floor").remainder(2).unsqueeze(0) * 2 - 1
    x = base * (amax / 4)
    x = torch.where(kind == 1, base * octave * (amax / 4), x)
    x = torch.where(kind == 2, torch.relu(base).square() * (amax / 16), x)
    x = torch.where(kind == 3, torch.where(u < 0.9, torch.zeros_like(base), base * (amax / 4)), x)
    x = torch.where(kind == 4, base.abs() * block * (amax / 4), x)
    outliers = torch.where(u < 1 / 64, torch.sign(base) * (amax / 2), base * (amax / 2) / (1e3 + 9e3 * u))
    x = torch.where(kind == 5, outliers, x)
    tiny = base * (amax * 4e-6)  # block amax ~1e-5 * amax: E4M3 scale ~0.005, below its smallest normal 2^-6
    x = torch.where(kind == 6, tiny, x)
    x = torch.where(kind == 7, torch.where(block > 0, tiny, base * (amax / 4)), x)
    x[:, 0] = torch.where(x[:, 0] == 0, torch.full_like(x[:, 0], amax / 8), x[:, 0])  # no all-zero row
    return x.clamp(-amax, amax)


_SEEDED_ELEMENTS = 1 << 22  # seeded activations kept per (device, shape, seed) up to this size (decode batch sizes)
_SEEDED_BUDGET = 1 << 24  # and this many in all (64 MB of float32 per process)
_seeded: dict[tuple, torch.Tensor] = {}
_seeded_lock = threading.Lock()


def seeded_activations(rows: int, cols: int, amax: float, seed: int, device: torch.device) -> torch.Tensor:
    """structured_activations from a generator on `device` seeded with `seed`, scaled to [-amax, amax].

    The unscaled rows of a decode-sized batch are made once per (device, shape, seed) and kept
    (every layer's check at that batch size draws the same rows, scaled to its own range), so a
    layer's light check or a serving canary step draws nothing; larger batches are drawn each time."""
    key = (torch.device(device), rows, cols, seed)
    with _seeded_lock:
        unit = _seeded.pop(key, None)
        if unit is not None:
            _seeded[key] = unit  # most recently used last
    if unit is None:
        gen = torch.Generator(device=device).manual_seed(seed)  # made where it is used: no host copy
        unit = structured_activations(rows, cols, 1.0, gen, device)
        if rows * cols <= _SEEDED_ELEMENTS:
            with _seeded_lock:
                _seeded[key] = unit
                while sum(t.numel() for t in _seeded.values()) > _SEEDED_BUDGET:
                    _seeded.pop(next(iter(_seeded)))
    return unit * amax


def quantized_inputs(shape: Shape, device: torch.device, seed: int):
    """Seeded bf16 activations and weights of `shape`, quantized with nvfp4: (x, gsf_x, mm_fp4 args).

    The activation scales are uint8 bytes, as SGLang's quantizer returns them; the weight's are
    float8_e4m3fn, as SGLang stores them: a kernel must read both as E4M3 bytes."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    # Structured rows (structured_activations); weights with zeroed rows (zero output columns) and
    # rows small enough for subnormal E4M3 block scales.
    x = structured_activations(m, k, 8.0, gen)
    w = torch.randn(n, k, generator=gen) * 0.02
    row = torch.arange(n).unsqueeze(1) % 13
    w = torch.where(row == 5, torch.zeros_like(w), torch.where(row == 9, w * 2e-5, w))
    x, w = x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device)
    gx, gw = nvfp4.global_scale(x), nvfp4.global_scale(w)
    qx, sx = nvfp4.quantize(x, gx)
    qw, sw = nvfp4.quantize(w, gw)
    alpha = (1.0 / (gx * gw)).reshape(1).to(torch.float32)
    return x, gx, (qx, qw.T, sx.view(torch.uint8), sw.T, alpha)


_COMPARE_ELEMENTS = 1 << 24  # rows compared at a time: a large prefill M never needs more than this in float32


def _resolution(dtype: torch.dtype, n: int) -> float:
    """The norm of a row of `n` values each off by the output dtype's smallest subnormal step: what
    rounding alone can leave of a row whose true values lie near the bottom of the dtype's range
    (fp16 outputs of tiny activations), so such a row is neither a "zero row" nor a relative error."""
    if not dtype.is_floating_point or dtype == torch.float32:
        return 0.0
    info = torch.finfo(dtype)
    return float(info.smallest_normal * info.eps) * n ** 0.5


def _row_stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of `out` against `ref` (float32): non-finite count (0-dim), all-zero, the reference's,
    the output's and the difference's norm, and the largest absolute difference (0-dim); a few
    thousand rows at a time, so a prefill-sized M costs no more memory than a chunk of it."""
    rows, cols = out.shape
    step = max(1, _COMPARE_ELEMENTS // max(cols, 1))
    parts = []
    for lo in range(0, rows, step):
        o, r = out[lo:lo + step].float(), ref[lo:lo + step].float()
        diff = o - r
        parts.append(((~torch.isfinite(o)).sum(), (o == 0).all(dim=1), r.norm(dim=1), o.norm(dim=1), diff.norm(dim=1),
                      diff.abs().amax()))
    if len(parts) == 1:
        return parts[0]
    nonfinite, zero, ref_n, out_n, diff_n, max_abs = zip(*parts)
    return (torch.stack(nonfinite).sum(), torch.cat(zero), torch.cat(ref_n), torch.cat(out_n), torch.cat(diff_n),
            torch.stack(max_abs).amax())


def _compare_stats(floor: float, max_row_rel_err: float, out: torch.Tensor, ref: torch.Tensor,
                   slack: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
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
    counts = torch.stack([nonfinite, zero_not_ref.sum(), excess.argmax(),
                          (row_norms == 0).all().long(), out_zero_rows.all().long()])
    norms = torch.stack([row_norms.norm(), diff_norms.norm(), row_err.amax(), max_abs, out_norms.norm(), excess.amax(),
                         slack_norm.float()])
    return torch.cat([counts.double(), norms.double()]), zero_not_ref, out_norms, safe_norms, row_norms, row_err, allowed_rows


def _compare(out: torch.Tensor, ref: torch.Tensor, bounds: Bounds, result: ShapeResult,
             slack: torch.Tensor | None = None) -> str | None:
    """None when `out` matches `ref` within `bounds` (each row's bound widened by its `slack`), else why not.

    Every row is checked: finite, not zero where the reference is not, its relative error. The
    statistics are computed where the tensors live and read back at once (one host synchronisation
    for a passing call; at a decode batch size from a CUDA graph, :mod:`sm120_fp4.graphs`); only a
    failure reads more, to say where."""
    floor = _resolution(out.dtype, out.shape[1])
    inputs = (out, ref) if slack is None else (out, ref, slack)
    return graphs.run("compare", functools.partial(_compare_stats, floor, bounds.max_row_rel_err), inputs,
                      lambda stats: _judge(out, bounds, result, floor, *stats), extra=(floor, bounds.max_row_rel_err))


def _judge(out: torch.Tensor, bounds: Bounds, result: ShapeResult, floor: float, stats: torch.Tensor,
           zero_not_ref: torch.Tensor, out_norms: torch.Tensor, safe_norms: torch.Tensor, row_norms: torch.Tensor,
           row_err: torch.Tensor, allowed_rows: torch.Tensor) -> str | None:
    """_compare's verdict from its statistics (read here, while they are valid)."""
    rows, cols = out.shape
    stats = stats.tolist()  # the one read-back of a passing call
    (nonfinite_n, bad_n, worst_excess, ref_all_zero, out_all_zero, ref_norm, diff_norm, max_row_err, max_abs_v, out_norm,
     max_excess, slack_n) = stats
    result.nonfinite = int(nonfinite_n)
    if result.nonfinite == out.numel():
        return "output left unwritten or all non-finite (every element is still the NaN poison or inf)"
    if result.nonfinite:
        step = max(1, _COMPARE_ELEMENTS // max(cols, 1))
        for lo in range(0, rows, step):  # the failure path: read where, a chunk at a time
            bad = (~torch.isfinite(out[lo:lo + step])).nonzero()
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
        return (f"output norm is {result.norm_ratio:.3g}x the reference's (accepted {lo_ratio}..{hi_ratio}); "
                f"worst row {worst} at {float(ratios[worst]):.3g}x")
    allowed_rel = bounds.max_rel_err + 2 * floor * rows ** 0.5 / ref_norm + 2 * slack_n / ref_norm
    if result.rel_err > allowed_rel:
        return f"relative error {result.rel_err:.3g} above {allowed_rel:.3g}"
    if max_excess > 0:
        worst = int(worst_excess)
        return f"row {worst} relative error {float(row_err[worst]):.3g} above {float(allowed_rows[worst]):.3g}"
    return None


# A checked call runs on the calling thread (the thread that will serve, on its current CUDA
# stream): a kernel with per-thread state, or one that runs on the stream it is given, is checked as
# it serves. A watchdog thread only observes: a call that returns after the bound fails the
# candidate; a call still running HANG_GRACE past the bound holds the serving thread for good (a
# hung kernel cannot be stopped), so the watchdog writes what it knows (hang_hooks: the report) and
# ends the process with EXIT_HUNG instead of serving from a process that can never return.
hang_hooks: list[Callable[[str], None]] = []  # called with the message before the process ends


def hang_grace(timeout_s: float) -> float:
    """How long past its bound a running call is waited for before the process gives up on it."""
    return min(max(5.0, 0.1 * timeout_s), 60.0)


class _Watchdog:
    """Watches the checked calls in progress (one per thread); never runs one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """A fresh state (also in a fork() child: the parent's watches are not the child's calls, and
        its condition may have been held by the parent's watchdog thread, which the child lacks)."""
        self._cond = threading.Condition(locks.lock())
        self._watches: dict[int, tuple[float, float, str]] = {}  # token -> (deadline, give up at, what)
        self._next = 0
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, give_up_at: float, what: str) -> int:
        with self._cond:
            self._next += 1
            self._watches[self._next] = (deadline, give_up_at, what)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sm120_fp4-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def done(self, token: int) -> None:
        with self._cond:
            self._watches.pop(token, None)
            self._cond.notify()

    def overdue(self) -> int:
        now = time.perf_counter()
        with self._cond:
            return sum(1 for deadline, _, _ in self._watches.values() if now > deadline)

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._watches:
                    self._cond.wait()
                    continue
                token, (_, give_up_at, what) = min(self._watches.items(), key=lambda item: item[1][1])
                left = give_up_at - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._watches.pop(token)
                break
        _give_up(what)


def _give_up(what: str) -> None:
    message = (f"sm120_fp4: refusing to serve: {what} is still running past the self-test's time bound "
               "(SM120_FP4_SELFTEST_TIMEOUT): a hung kernel holds the thread that would serve, so this process "
               f"cannot continue; exiting with code {EXIT_HUNG}. Exclude that backend (SM120_FP4_BACKENDS / "
               "SM120_FP4_MOE_BACKENDS), or run `sm120-fp4 selftest`, which records it and re-runs without it.")
    for hook in list(hang_hooks):
        try:
            hook(message)
        except Exception:  # noqa: BLE001 - the exit below must happen whatever a hook does
            pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(EXIT_HUNG)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._reset)


def calls_still_running() -> int:
    """How many checked calls are still running past their bound (on their calling threads).

    Calls run on the thread that will serve; one past its bound plus the grace ends the process
    (EXIT_HUNG), so this is non-zero only during that grace."""
    return _WATCHDOG.overdue()


def _call(fn: Callable[[], object], device: torch.device, deadline: float, give_up_at: float, what: str) -> object:
    """fn() on this thread and its current stream, synchronised: its value or its exception (an
    Exception is a finding; a BaseException such as KeyboardInterrupt propagates: an interrupted
    check is never a result)."""
    token = _WATCHDOG.watch(deadline, give_up_at, what)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            value = fn()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the stream that serves, not the device
        return value
    except Exception as exc:  # noqa: BLE001 - reported as the check's finding
        return exc
    finally:
        _WATCHDOG.done(token)


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


def _check_call(case: Case, result: ShapeResult, bounds: Bounds, deadline: float, grace: float, device: torch.device,
                snapshots: dict, where: str = "") -> str | None:
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

    def __init__(self, cases: list[Case], bounds: Bounds, device: torch.device, where: str = "", repeat: bool = True) -> None:
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
        except Exception as exc:  # noqa: BLE001 - building the call failed: a finding, not a crash
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
        return None if reason is None else f"{reason} (the same shape called again right after its first call, other data)"

    def run(self, passes: int) -> list[ShapeResult]:
        """`passes` passes within one deadline of `bounds.timeout_s` for all of them; the outcome."""
        deadline = time.perf_counter() + self.bounds.timeout_s
        for _ in range(passes):
            if not self.run_pass(deadline):
                break
        return self.outcome()

    def held_bytes(self, exclude: frozenset[int] = frozenset()) -> int:
        """Device memory this sweep holds between passes (each tensor once): the references, the
        tensors its calls are bound to (a functools.partial's arguments) and the inputs' copies;
        not the tensors whose storage is in `exclude` (a layer's own weights, which it holds anyway)."""
        seen: dict[tuple, int] = {}
        for case in self.cases:
            bound = getattr(case.invoke, "args", ()) + tuple(getattr(case.invoke, "keywords", {}).values())
            for t in (case.reference, case.out, case.slack, *bound):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in exclude:
                    seen[_input_key(t)] = t.numel() * t.element_size()
        return sum(seen.values()) + sum(k.nbytes if isinstance(k, _Fingerprinted) else k.numel() * k.element_size()
                                        for k in self._snapshots.values())

    def outcome(self) -> list[ShapeResult]:
        """The results so far: every case, or after a failure the cases tried."""
        return [r for r in self.results if r.calls] if self.failed else self.results


def sweep(cases: list[Case], bounds: Bounds, device: torch.device, passes: int = 2, where: str = "") -> list[ShapeResult]:
    """Call every case `passes` times (pass after pass, so each M is called again after all others;
    in the first pass each case's twin right after it) and check every call, within the deadline
    of `bounds.timeout_s` for the whole sweep; stop at the first failure (the results then list the
    cases tried)."""
    return Sweep(cases, bounds, device, where).run(passes)


def _backend_cases(fn: Callable, shapes: tuple[Shape, ...], device: torch.device, seed: int, dtype: torch.dtype) -> list[Case]:
    cases = []
    for i, (m, n, k) in enumerate(shapes):
        _, _, args = quantized_inputs((m, n, k), device, seed + i)
        ref = nvfp4.reference_mm_fp4(*args, out_dtype=torch.float32)
        out = torch.empty((m, n), dtype=dtype, device=device)
        cases.append(Case(m, n, k, functools.partial(fn, *args, dtype, out), ref, inputs=args, out=out,
                          twin=functools.partial(_negated, fn, args, dtype, out, ref)))
    return cases


def _negated(fn: Callable, args: tuple, dtype: torch.dtype, out: torch.Tensor, ref: torch.Tensor) -> Case:
    """The same call with the activation negated (every FP4 code's sign bit flipped): exactly -ref."""
    a = args[0] ^ 0x88
    m, n = out.shape
    return Case(m, n, a.shape[1] * 2, functools.partial(fn, a, *args[1:], dtype, out), -ref, inputs=(a, *args[1:]), out=out)


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


_FP_WIDTH = 4096  # words per row: the sums are kept per column of rows this wide
_FP_CHUNK = 1 << 26  # words summed at a time: a layer's weights never need more temporary memory than this
_fp_weights: dict[torch.device, torch.Tensor] = {}
_fp_sizes: dict[tuple, torch.Tensor] = {}  # (device, sizes) -> that one-element tensor: made once, no launch per call


def _fp_weighting(device: torch.device) -> torch.Tensor:
    """(1, 2, _FP_WIDTH) int64: ones, and a fixed odd pattern, on `device` (made once)."""
    weights = _fp_weights.get(device)
    if weights is None:
        gen = torch.Generator().manual_seed(0x5EED)
        pattern = torch.randint(0, 1 << 30, (_FP_WIDTH,), generator=gen, dtype=torch.int64) * 2 + 1
        weights = _fp_weights.setdefault(device, torch.stack((torch.ones_like(pattern), pattern)).unsqueeze(0).to(device))
    return weights


def _fp_size(device: torch.device, sizes: int) -> torch.Tensor:
    key = (device, sizes)
    size = _fp_sizes.get(key)
    if size is None:
        if len(_fp_sizes) >= 4096:
            _fp_sizes.clear()
        size = _fp_sizes.setdefault(key, torch.full((1,), sizes, dtype=torch.int64, device=device))
    return size


def fingerprint(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """A device tensor that changes when any byte of `tensors` changes: each tensor's 32-bit words
    laid out in rows of _FP_WIDTH, summed per column (in 64 bits, a chunk of rows at a time), then
    per tensor and chunk the sum of those column sums and their sum weighted by a fixed odd pattern
    (64-bit products, wrapping: exact in any order); the words past each tensor's last full row
    (all of a small tensor: a scale, an alpha) as they are; and one element for the tensors' sizes.
    A changed word changes its column's sum; two words swapped between columns change the weighted
    sum; a negation, a stray write and a resize are all seen. Computed where the tensors live with
    no host synchronisation: one reduction per chunk (a layer's tensors are one chunk each, up to
    256 MiB), written in place, and four launches for all the rest together; two calls on
    unchanged tensors give equal results. (Two words swapped within one column, _FP_WIDTH words
    apart, are not seen.)"""
    chunks: list[torch.Tensor] = []
    tails: list[torch.Tensor] = []  # the words past each tensor's last full row (all of a small tensor)
    sizes = 0
    device = None
    step = _FP_CHUNK // _FP_WIDTH * _FP_WIDTH
    for t in tensors:
        flat = t.reshape(-1)  # a copy only for a non-contiguous tensor
        if flat.element_size() != 4:
            flat = flat.view(torch.uint8)
        words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.to(torch.int32)
        device = words.device
        full = words.numel() // _FP_WIDTH * _FP_WIDTH
        chunks.extend(words[lo:min(lo + step, full)].view(-1, _FP_WIDTH) for lo in range(0, full, step))
        if full < words.numel():
            tails.append(words[full:] if full else words)
        sizes = (sizes * 1_000_003 + t.numel() + 1) % (1 << 62)
    if device is None:
        return torch.zeros(0, dtype=torch.int64)
    parts = []
    if chunks:
        sums = torch.empty((len(chunks), _FP_WIDTH), dtype=torch.int64, device=device)
        for row, chunk in zip(sums, chunks):
            torch.sum(chunk, 0, dtype=torch.int64, out=row)
        parts.append((sums.unsqueeze(1) * _fp_weighting(device)).sum(2).flatten())
    if tails:
        parts.append((torch.cat(tails) if len(tails) > 1 else tails[0]).to(torch.int64))
    parts.append(_fp_size(device, sizes))
    return torch.cat(parts)


def refuse_inside_capture(what: str, when: str) -> None:
    """SelfTestError when the current CUDA stream is capturing a graph: a `what` ("self-test",
    "re-check") synchronises and allocates, so it runs `when` ("before", "after") capturing."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise SelfTestError(f"sm120_fp4 {what} asked for inside CUDA-graph capture; run it {when} capturing")


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

    Two passes over the shapes, the first calling each shape twice in a row (the second time with
    the activation negated), every call checked: it returns `out` itself, `out` matches the oracle
    (after NaN poisoning), and its inputs are bitwise unchanged.
    """
    refuse_inside_capture("self-test", "before")
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
    results = sweep(_backend_cases(fn, shapes, tdev, seed, out_dtype), bounds, tdev, where=f" of backend {backend!r} on {device.label()}")
    if quantizer is not None:
        report.quantizer = check_quantizer(quantizer[0], quantizer[1], tdev, seed)
    return finish(report, results, start)


# ---- NVFP4 fused MoE -------------------------------------------------------------------------

# Per output row: a token's k routed rows are summed, each rounded to the output dtype, and the
# intermediate is re-quantized to FP4, where a kernel may round before quantizing (FlashInfer
# rounds it to the output dtype first: see nvfp4/reference.py). That rounding point moves some rows by up to
# ~10%: each case computes the oracle both ways and widens each row's bound by twice their
# difference on that row (its "slack"), so the bound neither trips on the kernel's rounding nor
# hides a dropped slot, a dropped expert, ignored routing weights or swapped gate/up halves.
MOE_BOUNDS = Bounds(max_rel_err=1e-2, max_row_rel_err=5e-2)


class MoeCase(BaseModel):
    """One fused-MoE call of a self-test: the layer (E, H, I, activation), the batch and its routing.

    `routing`: "balanced" gives every expert rows, and (tokens >= experts) lets every expert lead
    some token, carrying most of its output; "skewed" puts slot 0 of every token on one
    expert (>= 128 rows there when tokens >= 128: a kernel's second 64-row half of a tile is
    exercised); "random" picks k distinct experts per token; "padded" adds SGLang's -1 drop
    sentinel (slots a kernel must skip: padding rows, other ranks' experts).
    """

    experts: int
    hidden: int
    intermediate: int
    activation: Literal["swiglu", "relu2"]
    top_k: int
    tokens: int
    dtype: Literal["bfloat16", "float16"]
    routing: Literal["balanced", "skewed", "random", "padded"]

    def label(self) -> str:
        return (f"T={self.tokens} top_k={self.top_k} E={self.experts} H={self.hidden} I={self.intermediate} "
                f"{self.activation} {self.dtype} {self.routing}")


class MoeConfig(BaseModel):
    """The cases of one MoE self-test."""

    cases: tuple[MoeCase, ...]


def _moe_grid(experts, hidden, inter, activation, *rows) -> tuple[MoeCase, ...]:
    return tuple(MoeCase(experts=experts, hidden=hidden, intermediate=inter, activation=activation, top_k=k, tokens=t,
                         dtype=d, routing=r) for k, t, d, r in rows)


# 256 experts every one of which gets rows, >= 128 rows on one expert, top-k 1 and 8, T from 1 to
# 1024, H and I on (128) and off (160, 96) multiples of 128, swiglu and relu2, bf16 and fp16.
DEFAULT_MOE_CONFIG = MoeConfig(cases=(
    *_moe_grid(256, 128, 128, "swiglu",
               (8, 1024, "bfloat16", "balanced"), (8, 160, "bfloat16", "skewed"), (8, 1, "bfloat16", "random"),
               (8, 7, "float16", "random"), (1, 512, "bfloat16", "balanced"), (1, 300, "float16", "skewed")),
    *_moe_grid(16, 160, 96, "swiglu", (2, 130, "float16", "skewed"), (2, 5, "bfloat16", "random")),
    *_moe_grid(16, 160, 96, "relu2", (2, 130, "bfloat16", "skewed"), (1, 33, "float16", "random"), (2, 40, "bfloat16", "padded")),
))

# For a simulated CPU device (the oracle checked against itself: the wiring, not a kernel): the
# same kinds of cases on smaller layers.
SIMULATION_MOE_CONFIG = MoeConfig(cases=(
    *_moe_grid(32, 128, 64, "swiglu", (8, 64, "bfloat16", "balanced"), (4, 160, "bfloat16", "skewed"),
               (1, 130, "float16", "skewed")),
    *_moe_grid(8, 160, 96, "relu2", (2, 9, "bfloat16", "random"), (2, 12, "float16", "padded")),
))

_moe_weight_cache: dict[tuple, nvfp4.MoeWeights] = {}


def _moe_weights(experts: int, hidden: int, inter: int, activation: str, device: torch.device, seed: int) -> nvfp4.MoeWeights:
    """Seeded NVFP4 expert weights (each expert its own global scale) in reference_moe_fp4's layout;
    every 11th row zero (a zero output column of FC2, a dead channel of FC1) and another small
    enough for subnormal E4M3 block scales."""
    key = (experts, hidden, inter, activation, str(device), seed)
    if key in _moe_weight_cache:
        return _moe_weight_cache[key]
    gen = torch.Generator().manual_seed(seed)
    rows13 = 2 * inter if activation == "swiglu" else inter
    a1 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 4.0, device=device)  # activations of |x| <= 4
    a2 = torch.tensor(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX / 0.5, device=device)

    def experts_of(rows: int, cols: int, act_gsf: torch.Tensor):
        packed, scales, alphas = [], [], []
        for e in range(experts):
            w = torch.randn(rows, cols, generator=gen) * 0.05 * (1 + e % 7 / 7)
            row = torch.arange(rows).unsqueeze(1) % 11  # zeroed rows (zero output columns), rows of subnormal scales
            w = torch.where(row == 3, torch.zeros_like(w), torch.where(row == 7, w * 2e-5, w)).to(torch.bfloat16).to(device)
            gsf = nvfp4.global_scale(w)
            q, sf = nvfp4.quantize(w, gsf)
            packed.append(q)
            scales.append(sf)
            alphas.append(1.0 / (act_gsf * gsf))
        return torch.stack(packed), torch.stack(scales), torch.stack(alphas).float()

    w13, w13_sf, w13_alpha = experts_of(rows13, hidden, a1)
    w2, w2_sf, w2_alpha = experts_of(hidden, inter, a2)
    weights = nvfp4.MoeWeights(w13, w13_sf, w13_alpha, w2, w2_sf, w2_alpha, a1.reshape(1).float(), a2.reshape(1).float())
    _moe_weight_cache.clear()  # keep one layer's weights: a self-test walks its cases layer by layer
    _moe_weight_cache[key] = weights
    return weights


def moe_routing(tokens: int, top_k: int, experts: int, routing: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 (T, k), topk_weights float32 (T, k)) with distinct experts per token, weights
    in [0.1, 1] that do not sum to 1 (a kernel that ignores or renormalises them is seen).
    "padded" is "random" with SGLang's -1 drop sentinel in the last quarter of the tokens (every
    slot: the padding rows of a captured graph) and in the last slot of every fifth token.
    "balanced": token t leads with expert perm[t % E] (weight in [0.8, 1]) and has the next k - 1
    experts of a random permutation in its other slots (weights in [0.02, 0.1]), so with T >= E
    every expert leads some token and carries most of that token's output: an expert that is
    dropped or computed wrong shows in those rows, whatever the other slots add."""
    if routing == "balanced":
        perm = torch.randperm(experts, generator=gen)
        ids = perm[(torch.arange(tokens).unsqueeze(1) + torch.arange(top_k)) % experts]
        weights = torch.cat((0.8 + 0.2 * torch.rand(tokens, 1, generator=gen),
                             0.02 + 0.08 * torch.rand(tokens, top_k - 1, generator=gen)), dim=1)
        return ids.to(torch.int32), weights.float()
    # A random permutation of the experts per token (the order of uniform draws), k of them:
    # one draw for every token at once, not one randperm call per token.
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    if routing == "skewed":
        hot = int(torch.randint(experts, (1,), generator=gen))
        ids[ids == hot] = ids[:, :1].expand_as(ids)[ids == hot]  # keep ids distinct per token
        ids[:, 0] = hot
    elif routing == "padded" and tokens > 1:
        ids[torch.arange(tokens) % 5 == 4, -1] = -1
        ids[tokens - tokens // 4:] = -1
    weights = 0.1 + 0.9 * torch.rand(tokens, top_k, generator=gen)
    return ids.to(torch.int32), weights.float()


class ExpertCache(dict):
    """A reference_moe_fp4 `weight_cache` that keeps only the experts in `keep`: a check that routes
    to every one of a layer's experts dequantizes the others per call instead of holding them all."""

    def __init__(self, keep) -> None:
        super().__init__()
        self.keep = set(keep)

    def __setitem__(self, key, value) -> None:
        if key[1] in self.keep:
            super().__setitem__(key, value)


def moe_cases(fn: Callable, weights: nvfp4.MoeWeights, activation: str, plans: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
              bounds: Bounds = MOE_BOUNDS, cache: dict | None = None, *, first_expert: int = 0,
              served_ids: bool = False, mode: str = "w4a4", reference_weights: nvfp4.MoeWeights | None = None) -> list[Case]:
    """Calls of `fn` with `weights`, one per plan (label, x, topk_ids,
    topk_weights): each checked against the oracle, `out` poisoned first. `cache` keeps the
    references' dequantized experts for these weights (one dict per weights).

    The plans' ids are as SGLang serves them: global expert ids (this rank's experts are
    `first_expert` .. `first_expert` + E - 1, any other belongs to another expert-parallel rank) and
    SGLang's -1 drop sentinel. `fn` gets them in the backend convention (this rank's local ids, -1
    for every other slot: kernels.moe_call_to_convention), or unchanged with `served_ids` (a call
    through SGLang's seam). The oracle computes this rank's slots only: the others add nothing.

    `mode` is what the backend computes: "w4a4" against the oracle with quantized activations,
    "w4a16" against its W4A16 mode (``quantize_activations=False``, each expert's alpha times the
    activation scale it was made for: 1 / the weight's global scale). `reference_weights` (default
    `weights`) are what the oracle reads: the checkpoint's bytes where the served ones were converted."""
    cases = []
    cache = {} if cache is None else cache  # shared across plans: the weights are the same
    ref_w = reference_weights or weights
    experts = weights.w13.shape[0]
    for label, x, ids, topk_weights in plans:
        local = ids.long() - first_expert
        mine = (ids >= 0) & (local >= 0) & (local < experts)
        call_ids = ids if served_ids else torch.where(mine, local, torch.full_like(local, -1)).to(torch.int32)
        routed = (x, torch.where(mine, local, torch.zeros_like(local)), torch.where(mine, topk_weights, torch.zeros_like(topk_weights)))
        if mode == "w4a16":
            w4a16 = ref_w._replace(w13_alpha=ref_w.w13_alpha * ref_w.a1_gscale, w2_alpha=ref_w.w2_alpha * ref_w.a2_gscale,
                                   a1_gscale=None, a2_gscale=None)
            ref = nvfp4.reference_moe_fp4(*routed, *w4a16, activation=activation, out_dtype=torch.float32,
                                          quantize_activations=False, weight_cache=cache)
            slack = None  # nothing is re-quantized: no rounding point the oracle cannot decide
        else:
            # The reference, and the kernel's rounding of the intermediate (one pass: FC1 shared).
            ref, kernel_rounding = nvfp4.reference_moe_fp4_roundings(*routed, *ref_w, activation=activation, out_dtype=torch.float32,
                                                                     intermediate_dtypes=(None, x.dtype), weight_cache=cache)
            slack = (kernel_rounding - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        args = (x, call_ids, topk_weights, *weights)
        case = Case(x.shape[0], x.shape[1], weights.w2.shape[2] * 2, functools.partial(fn, *args, activation, x.dtype, out), ref,
                    inputs=tuple(a for a in args if isinstance(a, torch.Tensor)), out=out, label=label, bounds=bounds, slack=slack)
        case.twin = functools.partial(_rolled_tokens, case, fn, args, activation, out)
        cases.append(case)
    return cases


def _rolled_tokens(case: Case, fn: Callable, args: tuple, activation: str, out: torch.Tensor) -> Case:
    """The same MoE call with its tokens rolled by one (their activations, routing and weights)."""
    moved = tuple(a.roll(1, 0) for a in args[:3]) + args[3:]
    invoke = functools.partial(fn, *moved, activation, args[0].dtype, out)
    return rolled(case, invoke, tuple(a for a in moved if isinstance(a, torch.Tensor)))


def run_moe(backend: str, device: Device, config: MoeConfig | None = None, *, seed: int = 0,
            bounds: Bounds | None = None) -> SelfTestReport:
    """Self-test NVFP4 fused-MoE `backend` on `device` over `config` (default DEFAULT_MOE_CONFIG);
    never raises for a bad kernel. Two passes, every call checked per output row against
    nvfp4.reference_moe_fp4 (zero rows, non-finite values, per-row relative error), `out` returned,
    inputs unchanged."""
    refuse_inside_capture("self-test", "before")
    config = config or DEFAULT_MOE_CONFIG
    bounds = bounds or MOE_BOUNDS
    report = report_for(backend, device, config="NVFP4 fused MoE")
    start = time.perf_counter()
    try:
        fn = backends.resolve_moe(backend)
    except Exception as exc:
        report.reason = f"could not load MoE backend {backend!r}: {type(exc).__name__}: {exc}"
        return report
    tdev = device.torch_device
    mode = backends.get_moe(backend).mode
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    caches: dict[tuple, dict] = {}  # per layer shape: the same seeded weights
    for i, case in enumerate(config.cases):
        weights = _moe_weights(case.experts, case.hidden, case.intermediate, case.activation, tdev, seed + 17)
        ids, topk_weights = moe_routing(case.tokens, case.top_k, case.experts, case.routing, gen)
        x = structured_activations(case.tokens, case.hidden, 4.0, gen).to(getattr(torch, case.dtype)).to(tdev)
        cache = caches.setdefault((case.experts, case.hidden, case.intermediate, case.activation), {})
        cases += moe_cases(fn, weights, case.activation, [(case.label(), x, ids.to(tdev), topk_weights.to(tdev))], bounds, cache,
                           mode=mode)
    return finish(report, sweep(cases, Bounds(timeout_s=bounds.timeout_s), tdev, where=f" of MoE backend {backend!r} on {device.label()}"), start)
