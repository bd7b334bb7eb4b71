"""The serving canary's place in SGLang: the scheduler loop's idle point.

Every SGLang scheduler loop (normal, overlap, pipeline-parallel, disaggregated) calls one method when
it found no batch to run: ``Scheduler.on_idle`` (0.5.13+; ``SchedulerRuntimeCheckerMixin.on_idle`` in
0.5.11-0.5.12, ``self_check_during_idle`` before; ``sglang/targets.py`` has the range of each). It
runs on the scheduler thread, between two forward passes, never inside graph capture: the canary's
slice runs first there, with the stream the forward passes use made current, then SGLang's own idle
work. A refusal raised there leaves the loop; SGLang's ``run_scheduler_process`` logs it and sends
SIGQUIT to the server, which kills its process tree.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch

__all__ = ["make_idle_hook", "serving_stream"]


def serving_stream(scheduler: object) -> ContextManager:
    """Make current the stream the scheduler's forward passes run on: the model runner's forward
    stream where SGLang overlaps scheduling with computation (its run_batch enters that stream),
    else the stream the loop itself runs in (the current one)."""
    stream = getattr(scheduler, "forward_stream", None) if getattr(scheduler, "enable_overlap", False) else None
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def make_idle_hook(original: Callable, run: Callable[[Callable[[], ContextManager]], None]) -> Callable:
    """Wrap the scheduler's idle method: `run(stream)` (a canary slice; `stream()` enters the
    serving stream), then SGLang's own idle work."""

    @functools.wraps(original)
    def on_idle(self, *args, **kwargs):
        run(functools.partial(serving_stream, self))
        return original(self, *args, **kwargs)

    return on_idle
