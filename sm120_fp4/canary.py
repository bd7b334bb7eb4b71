"""The serving canary (``SM120_FP4_CANARY``): while the server runs, re-verify the kernels it serves.

The start-up verification and the re-check after warm-up say nothing about a kernel that goes wrong
later: a tactic re-chosen, a driver or firmware fault, a degrading card. With the canary on, every
period each serving process re-verifies, for each kernel family it serves (the dense FP4 GEMM, the
NVFP4 fused MoE) on each device, one of that family's verified layer configurations, in rotation:
through the exact routed call with one of its layers' own weights (rotating through every verified
layer of the configuration: a kernel wrong with one layer's weights only is reached too), at one
decode batch size and one larger batch size (both rotating through the batch sizes verified at load,
the re-check's and the captured graph sizes whose step fits the slice: see :meth:`Canary._batch_sizes`;
the sizes that do not, prefill sizes mostly, are listed in status), against the oracle. It is the re-check's own check
(two passes, every call checked, :class:`serving.ServedCheck`): building it (the activations and
the oracle's reference, which dequantizes the layer's whole weight) is a step, and each pass a step
of its own, at three idle points with the server's forward passes between them, where the check
holds at most KEEP_BYTES (its activations and reference, kept meanwhile; built again when SGLang
updated weights in between); a larger check (a prefill-sized reference) is built and runs both
passes in one step. The first step of a run compares that layer's weight
fingerprint and SWEEP more layers' in rotation (:func:`serving.fingerprint_sweep`), so a weight
changed in memory is found on any layer.

Engine-neutral: the engine integration calls :func:`idle` where its serving loop is between forward
passes (for SGLang: the scheduler loop's idle point, on the serving thread, with the stream the
forward passes use made current). A step never runs inside CUDA-graph capture. At one idle point
the canary runs steps for at most ``SM120_FP4_CANARY_SLICE_MS`` (one step at least, so a run always
progresses; a step whose last run took longer than what is left, or that never ran, waits for the
next idle point). A saturated loop has no idle point: the run waits for the next one, each period
it missed is counted as skipped, and :func:`status` says so.

On a failure, ``SM120_FP4_CANARY_ACTION=exit`` (the default) records the refusal ("while serving:
...", the configuration, the numbers) in status and the report file, logs it and raises
RefusedToServe out of the idle point: the engine's loop stops the process non-zero (SGLang then
kills its server), so that an orchestrator restarts it and the start-up verification runs again.
``log`` logs the first failure of each configuration, counts every one, and keeps serving.

A step never captures a CUDA graph of the checks' own (:func:`graphs.no_capture`): it replays
the graphs the start-up checks captured and runs anything else eagerly, since a capture costs several
eager calls. The time a step or a slice takes is measured on the serving thread; every step waits for its
GPU work on the serving stream before the next step or forward pass (its calls are synchronised and
compared on the host, and a step ends with the stream synchronised), so it measures the GPU time a
slice holds the forward passes back, from above. Where the oracle reads a converted layer's weights
from pinned host memory (humming keeps the first layer's checkpoint bytes there), the run's first
step starts copying them to the device on a side stream (:func:`backends.fetch_originals`) and the
build waits at idle points for them to arrive (FETCH_WAIT_S at most), so the transfer holds no slice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from pydantic import BaseModel, Field

from . import backends, deciding, graphs, report as report_file, serving, verify
from .config import Settings
from .errors import RefusedToServe

__all__ = ["CanaryRun", "CanaryFailure", "CanaryStatus", "Canary", "configure", "stop", "active", "idle",
           "on_warmup", "status", "settings_problem", "SMALL_M", "KEEP_BYTES"]

_LOG = logging.getLogger("sm120_fp4")
SMALL_M = 128  # batch sizes below this are decode sizes (one per run); from here on the larger one
KEEP_BYTES = 64 << 20  # a check holding at most this (its activations and reference) waits between its two passes
RECENT = 16  # runs kept in status
SWEEP = 4  # at every run's first step, besides the re-checked layer's, the fingerprints of this many more layers in rotation
FETCH_WAIT_S = 1.0  # a build waits at most this for its weights' fetch, then runs (its step waits for the rest)
# A weight update open longer than this (a session begun and never ended) is reported: a warning once,
# and status says the fingerprints have not been compared since (the oracle checks still run).
WEIGHT_UPDATE_LIMIT_S = 300.0


class CanaryRun(BaseModel):
    """One re-check of one configuration while serving (times are seconds since the epoch)."""

    family: str
    device: str
    backend: str
    config: str
    layer: str | None = Field(None, description="the layer of the configuration whose weights this run used")
    ms: list[int]
    passed: bool
    reason: str | None = None
    max_rel_err: float | None = None
    due_at: float
    started_at: float
    finished_at: float
    late_s: float = Field(description="how long after it was due the run started (no idle point meanwhile)")
    busy_ms: float = Field(description="time the serving thread spent in this run's steps")
    slices: int


class CanaryFailure(BaseModel):
    """A configuration that failed while serving: how often, and the first time."""

    family: str
    device: str
    config: str
    count: int
    first_reason: str
    first_at: float


class CanaryStatus(BaseModel):
    """The serving canary in this process (JSON-serialisable; the "canary" section of the report file)."""

    enabled: bool
    period_s: float | None = None
    action: str
    slice_ms: float
    state: str
    idle_point: str | None = None
    fingerprints: str = (f"compared at the first step of every run: the re-checked layer's, and {SWEEP} more layers' of "
                         "its family and device in rotation")
    weights_update: str | None = Field(None, description=(
        "while SGLang's weight update (a call, or a session begun and not ended) is open: for how long; weight "
        "fingerprints are not compared meanwhile"))
    armed_at: float | None = None
    runs: int = 0
    failures: int = 0
    failed: list[CanaryFailure] = Field(default_factory=list)
    last_run: CanaryRun | None = None
    recent: list[CanaryRun] = Field(default_factory=list)
    skipped_saturated: int = Field(0, description="periods that passed with no idle point (the run waited)")
    skipped_capturing: int = Field(0, description="idle points skipped because a CUDA graph was being captured")
    longest_wait_s: float = Field(0.0, description="the longest a due run waited for an idle point")
    busy_s: float = Field(0.0, description="time the serving thread spent in the canary")
    share: float | None = Field(None, description="busy_s over the time since the canary was armed")
    slices: int = 0
    longest_slice_ms: float = 0.0
    longest_step_ms: float = 0.0
    longest_step: str | None = None
    beyond_slice: list[str] = Field(default_factory=list, description=(
        "per configuration, the batch sizes a step of which does not fit the slice: verified at load and after "
        "warm-up, not re-checked while serving (SM120_FP4_CANARY_SLICE_MS includes them)"))


def settings_problem(settings: Settings) -> str | None:
    """Why the canary cannot do what these settings ask (None: it can), independent of the engine."""
    if settings.canary_period is not None and settings.selftest == "off":
        return (f"SM120_FP4_CANARY={settings.canary_period:g} re-verifies the verified layer configurations while "
                "serving, but SM120_FP4_SELFTEST=off verifies none; set SM120_FP4_SELFTEST=strict (or warn), "
                "or SM120_FP4_CANARY=off")
    return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class _Job:
    """One configuration's run in progress: its steps (the weight fingerprints, then per batch size
    its check built and its two passes), and what they found."""

    served: serving.Served
    ms: list[int]
    late_s: float
    due_at: float  # the same, wall time
    started_at: float | None = None
    reports: list[verify.SelfTestReport] = field(default_factory=list)
    busy_s: float = 0.0
    slices: int = 0
    steps: list[tuple[str, int]] = field(default_factory=list)  # (kind, M): "weights", "build", "pass 1", "pass 2"
    done: int = 0  # steps done
    pending: serving.ServedCheck | None = None  # a batch size's check, built, before its second pass
    fetch: Any = None  # backends.fetch_originals' handle: the oracle's weight bytes on their way
    fetch_since: float = 0.0  # when the fetch began (the timer's clock)

    @property
    def key(self) -> tuple:
        return (self.served.family, self.served.device.index, self.served.check.key)


_PASSES = ("pass 1", "pass 2")  # a batch size's steps after its build: alike in cost, so estimated together


def _steps(ms: list[int]) -> list[tuple[str, int]]:
    """A run's steps: the fingerprints first, then per batch size its check built, then its two
    passes; where the check holds more than KEEP_BYTES, its build step runs both passes too (a
    prefill-sized reference is never kept between forward passes)."""
    return [("weights", 0)] + [(kind, m) for m in ms for kind in ("build", *_PASSES)]


def _scaled(measured: dict[int, float], m: int) -> float | None:
    """measured[m]; else an upper bound, from the largest size measured below `m` scaled by M (a
    GEMM's time and the oracle's grow at most in proportion to M, their fixed costs do not grow;
    a check's activations and references grow in proportion to M); None where there is neither."""
    if m in measured:
        return measured[m]
    below = [size for size in measured if size < m]
    return measured[max(below)] * m / max(below) if below else None


@dataclass
class _SizeTimes:
    """One configuration's steps as measured so far, per batch size: the last time of its build, the
    longest last time of its passes, and the bytes its check held when built (read once per run)."""

    builds: dict[int, float]
    passes: dict[int, float]
    held: dict[int, int]

    def longest_step(self, m: int) -> float | None:
        """The longest step at batch size `m` (bounded from smaller sizes where `m` never ran); None
        where nothing is known. A build not run yet whose check will not be kept (over KEEP_BYTES, its
        bytes bounded likewise; kept where none is known) runs both passes in its step, so its bound
        includes them."""
        passes, build, held = _scaled(self.passes, m), _scaled(self.builds, m), _scaled(self.held, m)
        if build is not None and m not in self.builds and held is not None and held > KEEP_BYTES:
            build += 2 * (passes or 0.0)
        known = [t for t in (build, passes) if t is not None]
        return max(known) if known else None


class Canary:
    """The canary of one process: rotation, slices, counters and the action on a failure."""

    def __init__(self, settings: Settings, idle_point: str | None = None) -> None:
        if settings.canary_period is None:
            raise ValueError("Canary needs SM120_FP4_CANARY set to a period")
        self.settings = settings
        self.period = settings.canary_period
        self.budget_s = settings.canary_slice_ms / 1e3
        self.idle_point = idle_point
        self.clock: Callable[[], float] = time.monotonic  # when runs are due (tests replace it)
        self.timer: Callable[[], float] = time.perf_counter  # what a step costs the serving thread
        self._lock = threading.Lock()
        self._armed: float | None = None
        self._armed_at: float | None = None
        self._due = math.inf
        self._last_idle: float | None = None
        self._queue: list[_Job] = []
        self._cursor: dict[tuple, int] = {}
        self._sweep: dict[tuple, int] = {}  # (family, device index) -> where the next fingerprint sweep starts
        self._rounds: dict[tuple, int] = {}
        self._estimate: dict[tuple, float] = {}  # job key + (step kind, M) -> what the step took last
        self._held: dict[tuple, int] = {}  # job key + (M,) -> the bytes its check held when last built
        self._beyond: dict[tuple, dict[int, float]] = {}  # job key -> sizes whose step is estimated over the slice
        self._labels: dict[tuple, str] = {}
        self._told: set[tuple] = set()
        self._captured: set[int] = set()
        self._failed: dict[tuple, CanaryFailure] = {}
        self._recent: deque[CanaryRun] = deque(maxlen=RECENT)
        self._stopped: str | None = None
        self._stopped_message = ""
        self._told_update = False  # the open weight update past WEIGHT_UPDATE_LIMIT_S was logged
        self.runs = self.failures = self.slices = self.skipped_saturated = self.skipped_capturing = 0
        self.busy_s = self.longest_wait_s = self.longest_slice_s = self.longest_step_s = 0.0
        self.longest_step: str | None = None

    # ---- what the engine calls ----------------------------------------------------------------

    def on_warmup(self, captured: list[int]) -> None:
        """The batch sizes of the graphs the engine captured: the runs rotate through them too."""
        self._captured.update(m for m in captured if isinstance(m, int) and m > 0)

    def idle(self, serving_stream: Callable[[], ContextManager] | None = None) -> None:
        """The serving loop is between forward passes: run a slice if a run is due or in progress.

        The first call arms the canary (the first run is due one period later). Cheap otherwise."""
        now = self.clock()
        self._last_idle = now
        self._check_update()
        if self._armed is None:
            self._armed, self._armed_at, self._due = now, time.time(), now + self.period
            return
        if self._stopped is not None:  # the loop went on after the refusal: tell it again
            raise RefusedToServe(self._stopped_message)
        if not self._queue and now < self._due:
            return
        if self._queue and self._fetching(self._queue[0]):
            return  # nothing to run until the copy arrives (the forward passes run meanwhile)
        with (serving_stream or contextlib.nullcontext)():
            if _capturing():
                self.skipped_capturing += 1
                return
            if not self._queue:
                self._start_period(now)
            self._slice()

    def _check_update(self) -> None:
        """Log once when a weight update has been open past WEIGHT_UPDATE_LIMIT_S (cheap otherwise)."""
        open_s = serving.weights_update_open_s()
        if open_s is None:
            self._told_update = False
        elif open_s > WEIGHT_UPDATE_LIMIT_S and not self._told_update:
            self._told_update = True
            _LOG.warning("sm120_fp4: %s", _update_text(open_s))

    # ---- rotation -----------------------------------------------------------------------------

    def _start_period(self, now: float) -> None:
        late = max(0.0, now - self._due)
        self.skipped_saturated += int(late // self.period)
        self.longest_wait_s = max(self.longest_wait_s, late)
        due_at = time.time() - late
        self._due = now + self.period
        groups: dict[tuple, list[serving.Served]] = {}
        for served in serving.served_configurations():
            groups.setdefault((served.family, served.device.index), []).append(served)
        for group, configs in groups.items():
            position = self._cursor.get(group, 0)
            self._cursor[group] = position + 1
            config = configs[position % len(configs)]
            job = _Job(config, [], late, due_at)
            round_ = self._rounds.get(job.key, 0)
            self._rounds[job.key] = round_ + 1
            job.served = serving.served_layer(config, round_)  # this run's layer of the configuration
            job.ms = self._batch_sizes(job, round_)
            job.steps = _steps(job.ms)
            if job.ms:  # a configuration with no batch size to check has nothing to run
                self._queue.append(job)

    def _batch_sizes(self, job: _Job, round_: int) -> list[int]:
        """One decode batch size and one larger one, from the batch sizes verified at load, the
        re-check's and the captured graph sizes whose step fits the slice: a size not measured yet
        first (smallest first), else rotating with the configuration's runs."""
        check = job.served.check
        ms = sorted(set(check.ms) | set(check.recheck_ms) | self._captured)
        if not ms:
            return []
        self._labels[job.key] = f"{check.label} on {job.served.device.label()}"
        times = _SizeTimes(self._measured(job.key, ("build",)), self._measured(job.key, _PASSES),
                           {size: nbytes for (*key, size), nbytes in self._held.items() if tuple(key) == job.key})
        picked = set()
        for sizes in ([m for m in ms if m < SMALL_M] or ms[:1], [m for m in ms if m >= SMALL_M] or ms[-1:]):
            fits = self._within(job.key, sizes, times)
            new = [m for m in fits if m not in times.builds and m not in times.passes]
            picked.add(new[0] if new else fits[round_ % len(fits)])
        return sorted(picked)

    def _measured(self, key: tuple, kinds: tuple[str, ...]) -> dict[int, float]:
        """Batch size -> the longest last time of its steps of `kinds`, for job key `key`."""
        measured: dict[int, float] = {}
        for (*job_key, kind, size), took in self._estimate.items():
            if tuple(job_key) == key and kind in kinds:
                measured[size] = max(took, measured.get(size, 0.0))
        return measured

    def _within(self, key: tuple, sizes: list[int], times: _SizeTimes) -> list[int]:
        """The sizes of `sizes` whose step fits the slice: the smallest always (a run checks a decode
        size and a larger one); any other once its estimate fits. A size estimated over the slice is
        listed in status: verified at load and after warm-up, not re-checked while serving."""
        fits, beyond = sizes[:1], self._beyond.setdefault(key, {})
        for m in sizes[1:]:
            estimate = times.longest_step(m)
            beyond.pop(m, None)
            if estimate is not None and estimate <= self.budget_s:
                fits.append(m)
            elif estimate is not None:
                beyond[m] = estimate
        if beyond and key not in self._told:
            self._told.add(key)
            _LOG.info("sm120_fp4: the serving canary does not re-check %s at M=%s while serving: a step there is "
                      "estimated over SM120_FP4_CANARY_SLICE_MS=%g (those sizes were verified at load and after "
                      "warm-up; a larger slice includes them)", self._labels.get(key, key),
                      ", ".join(map(str, sorted(beyond))), self.budget_s * 1e3)
        return fits

    # ---- slices and steps ---------------------------------------------------------------------

    def _fetching(self, job: _Job) -> bool:
        """Whether the next step of `job` is a build still waiting for its weights' fetch (the
        oracle's copy of them moving to the device off the serving stream), for at most FETCH_WAIT_S."""
        return (job.steps[job.done][0] == "build" and job.fetch is not None
                and self.timer() - job.fetch_since < FETCH_WAIT_S and not job.fetch.ready())

    def _slice(self) -> None:
        start = self.timer()
        touched: list[_Job] = []
        try:
            while self._queue:
                job = self._queue[0]
                if self._fetching(job):
                    break
                kind, m = job.steps[job.done]
                measured = self._estimate.get(job.key + (kind, m))
                if touched and (measured is None or self.timer() - start + measured > self.budget_s):
                    # It would overrun the slice, or it never ran (a first run pays one-off costs, an
                    # allocation, a first launch, that no bound from other steps holds): the next
                    # idle point runs it first.
                    break
                if job not in touched:
                    touched.append(job)
                if job.started_at is None:
                    job.started_at = time.time()
                began = self.timer()
                with graphs.no_capture():  # a graph capture costs several eager calls: never inside a slice
                    report = self._step(job, kind, m)
                report = self._wait(job, report)
                took = self.timer() - began
                self._estimate[job.key + (kind, m)] = took
                job.busy_s += took
                if took > self.longest_step_s:
                    what = "the weight fingerprints" if kind == "weights" else f"M={m} ({kind})"
                    self.longest_step_s, self.longest_step = took, f"{job.served.check.label} {what}"
                if report is not None:
                    job.reports.append(report)
                if (report is not None and not report.passed) or job.done == len(job.steps):
                    self._queue.pop(0)
                    job.pending = None
                    self._finish(job)  # raises on a failure with SM120_FP4_CANARY_ACTION=exit
                if self.timer() - start >= self.budget_s:
                    break
        finally:
            spent = self.timer() - start
            for job in touched:
                job.slices += 1
            self.busy_s += spent
            self.slices += 1
            self.longest_slice_s = max(self.longest_slice_s, spent)

    def _wait(self, job: _Job, report: verify.SelfTestReport | None) -> verify.SelfTestReport | None:
        """Wait for the step's GPU work on the serving stream (a build queues the oracle's and reads
        nothing back): the step's time is then its GPU time, and the next forward pass is not queued
        behind work the slice did not count. A device error there is the step's finding."""
        tdev = job.served.device.torch_device
        if tdev.type != "cuda":
            return report
        try:
            torch.cuda.current_stream(tdev).synchronize()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a finding, never a silent pass
            return self._could_not(job, exc)
        return report

    @staticmethod
    def _failed_step(job: _Job, reason: str) -> verify.SelfTestReport:
        served = job.served
        report = verify.report_for(served.backend, served.device, config=served.check.label)
        report.reason = reason
        return report

    @classmethod
    def _could_not(cls, job: _Job, exc: BaseException) -> verify.SelfTestReport:
        return cls._failed_step(job, f"the canary could not run the check: {type(exc).__name__}: {exc}")

    @staticmethod
    def _release(job: _Job) -> None:
        if job.fetch is not None:
            job.fetch.release()
            job.fetch = None

    def _step(self, job: _Job, kind: str, m: int) -> verify.SelfTestReport | None:
        """Run step `kind` of `job` at batch size `m`: its report when it completes a batch size (or
        fails), None while a batch size is between its steps or for passing fingerprints."""
        served = job.served
        try:
            if kind == "weights":
                # A weight corrupted in memory after start-up is invisible to the oracle, which reads
                # the same corrupted weight: the layer's fingerprint says whether it is what was verified.
                job.done += 1
                problem = serving.fingerprint_problem(served.check)
                if problem is None:
                    group = (served.family, served.device.index)
                    problem, self._sweep[group] = serving.fingerprint_sweep(*group, self._sweep.get(group, 0), SWEEP)
                if problem is None:
                    # Where the oracle reads a converted layer's kept bytes from host memory (humming),
                    # they move to the device now, off the serving stream, while forward passes run.
                    job.fetch_since = self.timer()
                    try:
                        job.fetch = backends.fetch_originals(served.check.tensors)
                    except torch.OutOfMemoryError:  # no room to hold them between steps: the build copies them
                        _LOG.info("sm120_fp4: the serving canary could not fetch %s's weights ahead of its build "
                                  "(out of memory): the build step copies them", served.check.label)
                    return None
                reason = f"the layer's weights changed since they were verified: {problem}"
            elif kind == "build":
                job.done += 1
                try:
                    pending = serving.ServedCheck(served, m)
                finally:
                    if all(k != "build" for k, _ in job.steps[job.done:]):
                        self._release(job)  # the run's last build read them
                if pending.built:
                    held = self._held[job.key + (m,)] = pending.held_bytes
                    if held <= KEEP_BYTES:
                        job.pending = pending  # its passes at the next steps
                        return None
                job.done += 2  # not built (its report says why), or too large to keep: both passes now
                if pending.run_pass():
                    pending.run_pass()
                return pending.report()
            else:  # "pass 1", "pass 2"
                return self._pass(job, kind)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a finding, never a silent pass
            return self._could_not(job, exc)
        return self._failed_step(job, reason)

    @staticmethod
    def _pass(job: _Job, kind: str) -> verify.SelfTestReport | None:
        """Pass `kind` of the batch size whose check `job` built: its report after the second pass
        (or a failing first), None after a passing first pass or when the check is built again."""
        pending = job.pending
        if pending is None or pending.stale:  # SGLang updated weights since it was built: build it again
            job.pending = None
            job.done -= _PASSES.index(kind) + 1
            return None
        job.done += 1
        if kind == "pass 1" and pending.run_pass():
            return None  # the second pass at the next step
        job.pending = None
        if kind == "pass 1":
            job.done += 1  # it failed: no second pass
        else:
            pending.run_pass()
        return pending.report()

    def _finish(self, job: _Job) -> None:
        self._release(job)
        failing = next((r for r in job.reports if not r.passed), None)
        errors = [r.max_rel_err for r in job.reports if r.max_rel_err is not None]
        served = job.served
        run = CanaryRun(family=served.family, device=served.device.label(), backend=job.reports[-1].backend,
                        config=served.check.label, layer=served.check.layer, ms=job.ms, passed=failing is None,
                        reason=failing.reason if failing else None, max_rel_err=max(errors) if errors else None,
                        due_at=job.due_at, started_at=job.started_at or time.time(), finished_at=time.time(),
                        late_s=job.late_s, busy_ms=job.busy_s * 1e3, slices=job.slices + 1)
        with self._lock:
            self.runs += 1
            self._recent.append(run)
            if failing is not None:
                self.failures += 1
                known = self._failed.get(job.key)
                if known is None:
                    self._failed[job.key] = CanaryFailure(family=run.family, device=run.device, config=run.config, count=1,
                                                          first_reason=run.reason or "", first_at=run.finished_at)
                else:
                    known.count += 1
        if failing is None:
            report_file.update(self.settings)
        elif self.settings.canary_action == "exit":
            self._exit(job, run, failing)
        else:
            if self._failed[job.key].count == 1:
                _LOG.warning("sm120_fp4: while serving: %s failed the serving canary's re-check of %s on %s: %s "
                             "(SM120_FP4_CANARY_ACTION=log: still serving; counted, logged once per configuration)",
                             run.backend, run.config, run.device, run.reason)
            report_file.update(self.settings)

    def _exit(self, job: _Job, run: CanaryRun, report: verify.SelfTestReport) -> None:
        served = job.served
        family = deciding.FAMILIES[served.family]
        message = (
            f"sm120_fp4: refusing to serve NVFP4 on {run.device}: while serving: {run.backend} failed the serving canary's "
            f"re-check of {run.config}.\n"
            f"  {run.reason}\n"
            "It passed at start-up and after warm-up: the kernel, the driver or the GPU changed behaviour while serving. "
            "This process stops (SM120_FP4_CANARY_ACTION=exit) so that it is restarted and verified again; if that "
            f"happens again, try another backend ({family.backends_var}), {family.fallback_var}=emulated, or check the GPU."
        )
        self._stopped = f"stopped the process: {run.config} failed while serving"
        self._stopped_message = message
        refusal = deciding.Refusal(device=run.device, config=f"{run.config} (while serving)", family=served.family,
                                   message=message, rejected={run.backend: f"failed while serving: {run.reason}"},
                                   reports=[report])
        serving.record_refusal(refusal, self.settings)  # the report file, before the process goes
        _LOG.error("%s", message)
        raise RefusedToServe(message)

    # ---- status -------------------------------------------------------------------------------

    def _state(self) -> str:
        if self._stopped is not None:
            return self._stopped
        nothing = _nothing_to_check(self.settings)
        if nothing is not None:
            return nothing
        if self._armed is None:
            return "on; armed at the serving loop's first idle point (none in this process yet)"
        now = self.clock()
        waited = now - (self._last_idle or now)
        saturated = (f"; skipped: the serving loop has had no idle point for {waited:.0f} s (saturated), "
                     "the run waits for the next one") if waited > self.period else ""
        if self._queue:
            job = self._queue[0]
            return f"re-checking {job.served.check.label} (step {len(job.reports) + 1} of {len(job.ms)}){saturated}"
        if now >= self._due:
            return "due: runs at the next idle point" + saturated
        return f"next run in {self._due - now:.1f} s"

    def status(self) -> CanaryStatus:
        with self._lock:
            recent = list(self._recent)
            failed = [f.model_copy() for f in self._failed.values()]
            beyond = [self._beyond_text(key, sizes) for key, sizes in self._beyond.items() if sizes]
        elapsed = time.time() - self._armed_at if self._armed_at is not None else None
        open_s = serving.weights_update_open_s()
        update = _update_text(open_s) if open_s is not None else None
        return CanaryStatus(
            weights_update=update,
            **({"fingerprints": f"not compared now: {update}"} if update else {}),
            enabled=True, period_s=self.period, action=self.settings.canary_action, slice_ms=self.budget_s * 1e3,
            state=self._state(), idle_point=self.idle_point, armed_at=self._armed_at, runs=self.runs,
            failures=self.failures, failed=failed, last_run=recent[-1] if recent else None, recent=recent,
            skipped_saturated=self.skipped_saturated, skipped_capturing=self.skipped_capturing,
            longest_wait_s=self.longest_wait_s, busy_s=self.busy_s,
            share=self.busy_s / elapsed if elapsed else None, slices=self.slices,
            longest_slice_ms=self.longest_slice_s * 1e3, longest_step_ms=self.longest_step_s * 1e3,
            longest_step=self.longest_step, beyond_slice=beyond,
        )

    def _beyond_text(self, key: tuple, sizes: dict[int, float]) -> str:
        ms = sorted(sizes)
        listed = ", ".join(map(str, ms)) if len(ms) <= 8 else f"{', '.join(map(str, ms[:4]))}, ..., {', '.join(map(str, ms[-2:]))}"
        return (f"{self._labels.get(key, key)}: {len(ms)} size(s), M={listed} (a step estimated at "
                f"{min(sizes.values()) * 1e3:.3g} ms or more)")


def _update_text(open_s: float) -> str:
    text = (f"SGLang's weight update has been open for {open_s:.0f} s: weight fingerprints are not compared until it "
            "ends (the canary's checks against the oracle still run)")
    if open_s > WEIGHT_UPDATE_LIMIT_S:
        text += (f"; that is over {WEIGHT_UPDATE_LIMIT_S:.0f} s: a weight-update session begun "
                 "(begin_weight_update) and never ended (end_weight_update)?")
    return text


def _nothing_to_check(settings: Settings) -> str | None:
    """Why the canary has nothing to re-check although layers were decided (all served unverified), or None."""
    if serving.served_configurations():
        return None
    unverified = [d for d in serving.decisions() if d.layers or not d.verified]
    if not unverified:
        return None
    return (f"on, but nothing to re-check: no layer configuration is verified in this process ({len(unverified)} "
            f"decision(s) serve unverified under SM120_FP4_SELFTEST={settings.selftest}); the canary re-checks only "
            "what was verified")


# ---- the process's canary -----------------------------------------------------------------------

_active: Canary | None = None


def configure(settings: Settings, idle_point: str | None = None) -> Canary | None:
    """Start this process's canary (install): None, and nothing runs, with SM120_FP4_CANARY=off."""
    global _active
    if settings.canary_period is None:
        return None
    _active = Canary(settings, idle_point)
    report_file.sections["canary"] = lambda: status(settings).model_dump(mode="json")
    return _active


def stop() -> None:
    """Forget this process's canary (uninstall)."""
    global _active
    _active = None
    report_file.sections.pop("canary", None)


def active() -> Canary | None:
    return _active


def idle(serving_stream: Callable[[], ContextManager] | None = None) -> None:
    """The engine's serving loop is between forward passes (see Canary.idle); nothing when off."""
    canary = _active
    if canary is not None:
        canary.idle(serving_stream)


def on_warmup(captured: list[int]) -> None:
    canary = _active
    if canary is not None:
        canary.on_warmup(captured)


def status(settings: Settings | None = None) -> CanaryStatus:
    """This process's canary, or what the settings say where none runs here."""
    canary = _active
    if canary is not None:
        return canary.status()
    period = settings.canary_period if settings is not None else None
    action = settings.canary_action if settings is not None else "exit"
    slice_ms = settings.canary_slice_ms if settings is not None else 5.0
    state = "off (SM120_FP4_CANARY=off)" if period is None else "not running: sm120_fp4 is not installed in this process"
    return CanaryStatus(enabled=False, period_s=period, action=action, slice_ms=slice_ms, state=state,
                        fingerprints="not compared: the canary is off")
