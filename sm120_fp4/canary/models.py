"""The serving canary's records (the report file's "canary" section) and the texts status and the log share."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

__all__ = ["CanaryRun", "CanaryFailure", "CanaryStatus", "SWEEP", "WEIGHT_UPDATE_LIMIT_S"]
SWEEP = 4  # at every run, besides the re-checked layer's, the fingerprints of this many more layers in rotation
# A weight update open longer than this (a session begun and never ended) is reported: a warning once,
# and status says the fingerprints have not been compared since (the oracle checks still run).
WEIGHT_UPDATE_LIMIT_S = 300.0


class CanaryRun(BaseModel):
    """One re-check of one configuration while serving (times are seconds since the epoch)."""

    family: str
    device: str
    backend: str
    config: str
    layer: str | None = None  # the layer of the configuration whose weights this run used
    ms: list[int]
    passed: bool
    reason: str | None = None
    max_rel_err: float | None = None
    due_at: float
    started_at: float
    finished_at: float
    late_s: float  # how long after it was due the run started (no idle point meanwhile)
    busy_ms: float  # time the serving thread spent in this run (one idle point)


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
    slice_ms: float  # the budget of one run at one idle point (SM120_FP4_CANARY_SLICE_MS)
    state: str
    idle_point: str | None = None
    fingerprints: str = (
        f"compared at every run: the re-checked layer's, and {SWEEP} more layers' of its family and device in rotation"
    )
    weights_update: str | None = None  # how long SGLang's weight update has been open (fingerprints wait)
    armed_at: float | None = None
    runs: int = 0
    failures: int = 0
    failed: list[CanaryFailure] = Field(default_factory=list)
    last_run: CanaryRun | None = None
    recent: list[CanaryRun] = Field(default_factory=list)
    skipped_saturated: int = 0  # periods that passed with no idle point (the run waited)
    skipped_capturing: int = 0  # idle points skipped because a CUDA graph was being captured
    skipped_memory: int = 0  # runs skipped because their check could not get its GPU memory (each retried)
    longest_wait_s: float = 0.0  # the longest a due run waited for an idle point
    busy_s: float = 0.0  # time the serving thread spent in the canary
    share: float | None = None  # busy_s over the time since the canary was armed
    longest_slice_ms: float = 0.0  # the longest pause the canary added at one idle point (its run: `recent`)
    # Per configuration whose run took longer than the slice: the batch sizes no longer re-checked
    # while serving (verified at load and after warm-up), or that its smallest run runs anyway.
    beyond_slice: list[str] = Field(default_factory=list)


@dataclass
class Over:
    """A configuration whose run took longer than the slice: its larger sizes from `cap` on are skipped."""

    cap: int
    took_s: float
    ms: list[int]
    smallest: bool  # the run was the configuration's smallest (it runs anyway)


def over_text(label: str, over: Over, budget_s: float) -> str:
    """Return what status and the log say of a configuration's run over the slice."""
    took = (
        f"its run at M={', '.join(map(str, over.ms))} took {over.took_s * 1e3:.4g} ms, over "
        f"SM120_FP4_CANARY_SLICE_MS={budget_s * 1e3:g}"
    )
    if over.smallest:
        return f"{label}: {took}; that is its smallest run (a decode size and M={over.cap}): it runs anyway"
    return (
        f"{label}: M>={over.cap} is not re-checked while serving ({took}; verified at load and after "
        "warm-up; a larger SM120_FP4_CANARY_SLICE_MS includes it)"
    )


def update_text(open_s: float) -> str:
    """Return what status and the log say of a weight update open for `open_s` seconds."""
    text = (
        f"SGLang's weight update has been open for {open_s:.0f} s: weight fingerprints are not compared until it "
        "ends (the canary's checks against the oracle still run)"
    )
    if open_s > WEIGHT_UPDATE_LIMIT_S:
        text += (
            f"; that is over {WEIGHT_UPDATE_LIMIT_S:.0f} s: a weight-update session begun "
            "(begin_weight_update) and never ended (end_weight_update)?"
        )
    return text
