"""SELECT=fastest's timings from a stand-in clock: each backend call advances it by its cost at that M, and the
library's one timer (deciding.timed) reads it, so that rankings never depend on the machine's load."""

from __future__ import annotations

import contextlib
import functools
import types

from sm120_fp4 import backends, deciding
from sm120_fp4.backends import emulated_mm_fp4


def use_clock(monkeypatch) -> list[float]:
    """Return the stand-in clock ([seconds]) that SELECT=fastest's timings read from now on."""
    now = [0.0]

    monkeypatch.setattr(deciding, "timed", functools.partial(clock_timed, now))
    return now


def clock_timed(clock: list[float], call, device, repeats: int = 5) -> tuple[float, str]:
    """deciding.timed on the stand-in `clock`: the seconds one call of `call` advanced it."""
    start = clock[0]
    call()
    return clock[0] - start, "stand-in clock"


def kernel(name, clock, calls, cost, wrong=lambda m: False):
    """Register backend `name`: right (unless `wrong(M)`), costing `cost(M)`, logging (name, M) in `calls`."""

    def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
        calls.append((name, a.shape[0]))
        clock[0] += cost(a.shape[0])
        emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if wrong(a.shape[0]):
            out.mul_(0.5)
        return out

    backends.register(name, gemm)


@contextlib.contextmanager
def timed_humming(clock, monkeypatch, cost):
    """Humming's CPU stand-in in its place, its dense calls costing `box.cost(M)` and logged in `box.calls`."""
    from helpers.humming_stand_in import StandInEngine, engine

    with engine(StandInEngine()) as stand_in:
        gemm, box = stand_in.gemm, types.SimpleNamespace(cost=cost, calls=[])

        def timed(prepared, x, scale_2, out):
            box.calls.append(("humming", x.shape[0]))
            clock[0] += box.cost(x.shape[0])
            return gemm(prepared, x, scale_2, out)

        monkeypatch.setattr(stand_in, "gemm", timed)
        yield box
