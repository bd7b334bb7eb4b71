"""The serving canary's engine: the rotation, one run per idle point, the slice bound, counters and the action."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .. import deciding, graphs, serving, verify
from ..config import Settings
from ..errors import RefusedToServe
from ..serving import policy
from . import models
from .models import SWEEP, CanaryFailure, CanaryRun, CanaryStatus, Over, over_text, update_text

__all__ = ["Canary", "SMALL_M"]
_LOG = logging.getLogger("sm120_fp4")
SMALL_M = 128  # batch sizes below this are decode sizes (one per run); from here on the larger one
RECENT = 16  # runs kept in status
# The Canary attributes status reports under the same name.
_COUNTERS = (
    "idle_point",
    "runs",
    "failures",
    "skipped_saturated",
    "skipped_capturing",
    "skipped_memory",
    "longest_wait_s",
    "busy_s",
)


@dataclass
class _Job:
    """One configuration's due run: its layer, its batch sizes, and how late it is."""

    served: serving.Served
    ms: list[int]
    late_s: float
    due_at: float  # the same, wall time
    retried: bool = False  # skipped once for memory, queued again

    @property
    def key(self) -> tuple:
        return (self.served.family, self.served.device.index, self.served.check.key)


class Canary:
    """The canary of one process: rotation, one run per idle point, counters and the action on a failure."""

    def __init__(self, settings: Settings, idle_point: str | None = None) -> None:
        if settings.canary_period is None:
            raise ValueError("Canary needs SM120_FP4_CANARY set to a period")
        self.settings, self.period, self.idle_point = settings, settings.canary_period, idle_point
        self.budget_s = settings.canary_slice_ms / 1e3
        # When runs are due and what a run costs the serving thread (tests replace it)
        self.clock: Callable[[], float] = time.perf_counter
        self._lock = threading.Lock()
        self._armed_at: float | None = None
        self._due = math.inf
        self._last_idle: float | None = None
        self._queue: list[_Job] = []
        self._cursor: dict[tuple, int] = {}
        self._sweep: dict[tuple, int] = {}  # (family, device index) -> where the next fingerprint sweep starts
        self._rounds: dict[tuple, int] = {}
        self._over: dict[tuple, Over] = {}  # job key -> its run over the slice (the cap on its larger sizes)
        self._labels: dict[tuple, str] = {}
        self._captured: set[int] = set()
        self._failed: dict[tuple, CanaryFailure] = {}
        self._recent: deque[CanaryRun] = deque(maxlen=RECENT)
        self._stopped: str | None = None
        self._stopped_message = ""
        self._told_update = False  # the open weight update past WEIGHT_UPDATE_LIMIT_S was logged
        self.runs = self.failures = self.skipped_saturated = self.skipped_capturing = self.skipped_memory = 0
        self.busy_s = self.longest_wait_s = self.longest_slice_s = 0.0

    def on_warmup(self, captured: list[int]) -> None:
        """Add the batch sizes of the graphs the engine captured to the rotation."""
        self._captured.update(m for m in captured if isinstance(m, int) and m > 0)

    def idle(self, serving_stream: Callable[[], ContextManager] | None = None) -> None:
        """Run the next due run, if any: the serving loop is between forward passes."""
        # The first call arms the canary (the first run is due one period later). Cheap otherwise.
        now = self.clock()
        self._last_idle = now
        self._check_update()
        if self._armed_at is None:
            self._armed_at, self._due = time.time(), now + self.period
            return
        if self._stopped is not None:  # the loop went on after the refusal: tell it again
            raise RefusedToServe(self._stopped_message)
        if not self._queue and now < self._due:
            return
        with (serving_stream or contextlib.nullcontext)():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self.skipped_capturing += 1
                return
            if not self._queue:
                self._start_period(now)
            if self._queue:
                self._run(self._queue.pop(0))  # raises on a failure with SM120_FP4_CANARY_ACTION=exit

    def _check_update(self) -> None:
        """Log once when a weight update has been open past WEIGHT_UPDATE_LIMIT_S."""
        open_s = serving.weights_update_open_s()
        if open_s is None:
            self._told_update = False
        elif open_s > models.WEIGHT_UPDATE_LIMIT_S and not self._told_update:  # read each call (tests lower it)
            self._told_update = True
            _LOG.warning("sm120_fp4: %s", update_text(open_s))

    def _start_period(self, now: float) -> None:
        """Queue one due job per (family, device): its next configuration, layer and batch sizes."""
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
            if job.ms:  # a configuration with no batch size to check has nothing to run
                self._queue.append(job)

    def _sizes(self, job: _Job) -> tuple[list[int], list[int]]:
        """Return the decode and the larger batch sizes of `job`'s configuration, below its cap."""
        # The verification policy's (load, re-check, captured graphs); the smallest larger one always.
        ms = policy.canary_ms(job.served.check, self._captured)
        if not ms:
            return [], []
        decode = [m for m in ms if m < SMALL_M] or ms[:1]
        larger = [m for m in ms if m >= SMALL_M] or ms[-1:]
        over = self._over.get(job.key)
        return decode, larger[:1] + [m for m in larger[1:] if over is None or m < over.cap]

    def _batch_sizes(self, job: _Job, round_: int) -> list[int]:
        """Return one decode batch size and one larger one, each rotating with the configuration's runs."""
        decode, larger = self._sizes(job)
        if not decode:
            return []
        self._labels[job.key] = f"{job.served.check.label} on {job.served.device.label()}"
        return sorted({decode[round_ % len(decode)], larger[round_ % len(larger)]})

    def _run(self, job: _Job) -> None:
        """Run `job` whole at this idle point: its fingerprints, then its check at its batch sizes."""
        started_at, start = time.time(), self.clock()
        try:
            with graphs.no_capture():  # a graph capture costs several eager calls: never inside a run
                report = self._check(job)
            report = self._wait(job, report)
        finally:
            took = self.clock() - start
            self.busy_s += took
            self.longest_slice_s = max(self.longest_slice_s, took)
        if report.skipped is not None:
            self._skip(job, report.skipped)
            return
        self._fit(job, took)
        self._finish(job, report, started_at, took)

    def _skip(self, job: _Job, why: str) -> None:
        """Count and log (the first) a run whose check could not get its memory; queue it again once."""
        self.skipped_memory += 1
        if self.skipped_memory == 1:
            _LOG.warning(
                "sm120_fp4: the serving canary skipped its re-check of %s: %s (still serving; retried at the next "
                "idle point, then in its turn; counted in skipped_memory, logged once)",
                self._labels.get(job.key, job.served.check.label),
                why,
            )
        if not job.retried:
            job.retried = True
            self._queue.insert(0, job)

    def _fit(self, job: _Job, took: float) -> None:
        """Cap the configuration's larger sizes below the one `job` checked where it took over the slice."""
        if took <= self.budget_s:
            return
        known = self._over.get(job.key)
        over = self._over[job.key] = Over(max(job.ms), took, list(job.ms), max(job.ms) == self._sizes(job)[1][0])
        if known is None or known.cap != over.cap:
            text = over_text(self._labels.get(job.key, ""), over, self.budget_s)
            _LOG.info("sm120_fp4: the serving canary: %s", text)

    def _check(self, job: _Job) -> verify.SelfTestReport:
        """Return `job`'s report: its fingerprints compared, then its check at each batch size."""
        served = job.served
        try:
            # A weight corrupted in memory after start-up is invisible to the oracle, which reads the
            # same corrupted weight: the layer's fingerprint says whether it is what was verified.
            group = (served.family, served.device.index)
            problem, self._sweep[group] = serving.fingerprints(served, self._sweep.get(group, 0), SWEEP)
            if problem is not None:
                return self._failed_run(job, f"the layer's weights changed since they were verified: {problem}")
            reports = []
            for m in job.ms:  # one size at a time: a call that wrote into the weights is named at its size
                reports.append(serving.check_served(served, m))
                if not reports[-1].passed:
                    return reports[-1]
            errors = [r.max_rel_err for r in reports if r.max_rel_err is not None]
            reports[-1].max_rel_err = max(errors) if errors else None
            return reports[-1]
        except torch.OutOfMemoryError as exc:  # outside the check's own retry (its fingerprints): a skip too
            verify.free_memory(served.device.torch_device)
            report = self._failed_run(job, "the canary could not get its GPU memory")
            report.skipped = f"out of GPU memory ({str(exc).splitlines()[0][:200]})"
            return report
        except Exception as exc:
            return self._could_not(job, exc)

    def _wait(self, job: _Job, report: verify.SelfTestReport) -> verify.SelfTestReport:
        """Return `report` once the run's GPU work on the serving stream is done (a device error: the finding)."""
        # The run's time is then its GPU time, and no forward pass queues behind work it did not count.
        tdev = job.served.device.torch_device
        try:
            if tdev.type == "cuda":
                torch.cuda.current_stream(tdev).synchronize()
        except Exception as exc:
            return self._could_not(job, exc)
        return report

    @staticmethod
    def _failed_run(job: _Job, reason: str) -> verify.SelfTestReport:
        served = job.served
        report = verify.report_for(served.backend, served.device, config=served.check.label)
        report.reason = reason
        return report

    def _could_not(self, job: _Job, exc: BaseException) -> verify.SelfTestReport:
        return self._failed_run(job, f"the canary could not run the check: {type(exc).__name__}: {exc}")

    def _finish(self, job: _Job, report: verify.SelfTestReport, started_at: float, took: float) -> None:
        """Record `job`'s run and act on a failure (exit or log, as SM120_FP4_CANARY_ACTION says)."""
        served, check = job.served, job.served.check
        run = CanaryRun(
            family=served.family,
            device=served.device.label(),
            config=check.label,
            layer=check.layer,
            **report.model_dump(include={"backend", "passed", "max_rel_err"}),
            ms=job.ms,
            reason=None if report.passed else report.reason,
            due_at=job.due_at,
            started_at=started_at,
            finished_at=time.time(),
            late_s=job.late_s,
            busy_ms=took * 1e3,
        )
        with self._lock:
            self.runs += 1
            self._recent.append(run)
            if not run.passed:
                self.failures += 1
                named = run.model_dump(include={"family", "device", "config"})
                first = CanaryFailure(**named, count=0, first_reason=run.reason or "", first_at=run.finished_at)
                self._failed.setdefault(job.key, first).count += 1
        if not run.passed and self.settings.canary_action == "exit":
            self._exit(job, run, report)
        if not run.passed and self._failed[job.key].count == 1:
            _LOG.warning(
                "sm120_fp4: while serving: %s failed the serving canary's re-check of %s on %s: %s "
                "(SM120_FP4_CANARY_ACTION=log: still serving; counted, logged once per configuration)",
                *(run.backend, run.config, run.device, run.reason),
            )
        serving.STATE.report.request(self.settings)  # written by the report's own thread: never waited for here

    def _exit(self, job: _Job, run: CanaryRun, report: verify.SelfTestReport) -> None:
        """Record the refusal in the report file, log it and raise RefusedToServe."""
        served, family = job.served, deciding.FAMILIES[job.served.family]
        message = (
            f"sm120_fp4: refusing to serve NVFP4 on {run.device}: while serving: {run.backend} failed the serving canary's "
            f"re-check of {run.config}.\n"
            f"  {run.reason}\n"
            "It passed at start-up and after warm-up: the kernel, the driver or the GPU changed behaviour while serving. "
            "This process stops (SM120_FP4_CANARY_ACTION=exit) so that it is restarted and verified again; if that "
            f"happens again, try another backend ({family.backends_var}), {family.fallback_var}=emulated, or check the GPU."
        )
        self._stopped, self._stopped_message = f"stopped the process: {run.config} failed while serving", message
        _LOG.error("%s", message)
        serving.refuse_now(  # in the report file, before the process goes
            self.settings,
            message,
            device=run.device,
            config=f"{run.config} (while serving)",
            family=served.family,
            rejected={run.backend: f"failed while serving: {run.reason}"},
            reports=[report],
        )

    def _state(self) -> str:
        """Return what the canary is doing now, for status."""
        said = self._stopped if self._stopped is not None else _nothing_to_check(self.settings)
        if said is not None:
            return said
        if self._armed_at is None:
            return "on; armed at the serving loop's first idle point (none in this process yet)"
        now = self.clock()
        waited = now - (self._last_idle or now)
        saturated = f"; skipped: the serving loop has had no idle point for {waited:.0f} s (saturated), "
        saturated = saturated + "the run waits for the next one" if waited > self.period else ""
        if self._queue:
            return f"re-checking {self._queue[0].served.check.label} at the next idle point{saturated}"
        if now >= self._due:
            return "due: runs at the next idle point" + saturated
        return f"next run in {self._due - now:.1f} s"

    def status(self) -> CanaryStatus:
        """Return this canary's status (the report file's "canary" section)."""
        with self._lock:
            recent = list(self._recent)
            failed = [f.model_copy() for f in self._failed.values()]
            beyond = [over_text(self._labels.get(key, ""), over, self.budget_s) for key, over in self._over.items()]
        elapsed = time.time() - self._armed_at if self._armed_at is not None else None
        open_s = serving.weights_update_open_s()
        update = update_text(open_s) if open_s is not None else None
        fingerprints = {"fingerprints": f"not compared now: {update}"} if update else {}
        return CanaryStatus(
            enabled=True,
            period_s=self.period,
            action=self.settings.canary_action,
            state=self._state(),
            slice_ms=self.budget_s * 1e3,
            longest_slice_ms=self.longest_slice_s * 1e3,
            armed_at=self._armed_at,
            failed=failed,
            last_run=recent[-1] if recent else None,
            recent=recent,
            share=self.busy_s / elapsed if elapsed else None,
            beyond_slice=beyond,
            weights_update=update,
            **fingerprints,
            **{name: getattr(self, name) for name in _COUNTERS},
        )


def _nothing_to_check(settings: Settings) -> str | None:
    """Return why the canary has nothing to re-check although layers were decided, or None."""
    if serving.served_configurations():
        return None
    unverified = [d for d in serving.decisions() if d.layers or not d.verified]
    if not unverified:
        return None
    return (
        f"on, but nothing to re-check: no layer configuration is verified in this process ({len(unverified)} "
        f"decision(s) serve unverified under SM120_FP4_SELFTEST={settings.selftest}); the canary re-checks only "
        "what was verified"
    )
