"""The serving canary's place in SGLang: the scheduler loop's idle point (targets.py has its name per release).

It runs on the scheduler thread between forward passes, never inside graph capture; a refusal raised there leaves
the loop, and SGLang's run_scheduler_process kills the server's process tree.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch

from ..engines import make_call_hook


def serving_stream(scheduler: object) -> ContextManager:
    """Enter the stream the scheduler's forward passes run on (the forward stream when SGLang overlaps)."""
    stream = getattr(scheduler, "forward_stream", None) if getattr(scheduler, "enable_overlap", False) else None
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def make_idle_hook(original: Callable, run: Callable[[Callable[[], ContextManager]], None]) -> Callable:
    """Wrap the scheduler's idle method: `run(stream)` (a canary slice), then SGLang's own idle work."""
    return make_call_hook(original, before=lambda self, *args: run(functools.partial(serving_stream, self)))
