"""SELECT=fastest: each M range served by the verified candidate fastest at its serving batch sizes and boundaries,
the same on every rank under tensor parallelism (every rank's timings and failures, through .collective)."""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable

from .. import backends
from ..config import Settings
from ..deciding import Choice, Decision, time_call
from ..errors import RefusedToServe
from .collective import gather, ranks, refusal
from .layers import check_layer, verify_everything
from .records import LayerCheck, Record, refuse_now, route_text
from .state import STATE

SEPARATION = 1.03  # a backend faster by less than this ratio of the range's time is within noise: no split


def ranged(bounds: tuple[int, ...], fns: tuple[Callable, ...]) -> Callable:
    """Return a call that serves batch size M with fns[i], the first range whose bound is >= M."""

    def by_batch_size(a, *args):
        return fns[bisect_left(bounds, a.shape[0])](a, *args)  # M is a shape: no host sync

    return by_batch_size


def plan(times: dict[str, dict[int, float]]) -> list[tuple[int | None, str]]:
    """Return [(largest M, backend), ..., (None, backend)]: one range unless a split beats noise."""
    sizes = sorted(set.intersection(*(set(t) for t in times.values())))
    total = {n: sum(t[m] for m in sizes) for n, t in times.items()}
    single = min(total, key=total.__getitem__)
    best, gain = [(None, single)], 0.0
    for i in range(len(sizes) - 1):
        low, high = sizes[: i + 1], sizes[i + 1 :]
        parts = [(part, min(times, key=lambda n: sum(times[n][m] for m in part))) for part in (low, high)]
        if parts[0][1] == parts[1][1]:
            continue
        cost = {name: sum(times[name][m] for m in part) for part, name in parts}
        base = [sum(times[single][m] for m in part) for part, _ in parts]
        if any(name != single and b < SEPARATION * cost[name] for (_, name), b in zip(parts, base)):
            continue
        if total[single] - sum(cost.values()) > gain:
            best, gain = [(low[-1], parts[0][1]), (None, parts[1][1])], total[single] - sum(cost.values())
    return best


def _single(serving: Record, base: Decision, name: str) -> Choice:
    """Return a Choice of backend `name` alone, with `base`'s device facts."""
    update = {"backend": name, "mode": backends.mode_of(serving.family.name, name), "layers": [], "ranges": []}
    return Choice(base.model_copy(update={**update, "timings_ms": {}}), serving.family.resolve(name))


def _split(serving: Record, base: Decision, ranges: list, singles: dict[str, Choice]) -> Choice:
    """Return the Choice serving each range of `ranges` with its backend (one Choice where one range)."""
    if len(ranges) == 1:
        return singles[ranges[0][1]]
    names = [name for _, name in ranges]
    decision = _single(serving, base, names[-1]).decision
    decision.ranges = ranges
    fns = tuple(singles[n].fn for n in names)
    return Choice(decision, ranged(tuple(b for b, _ in ranges[:-1]), fns))


def _time(serving: Record, check: LayerCheck) -> dict[int, float]:
    """Return milliseconds per serving batch size of `check`'s served calls."""
    tdev = serving.device.torch_device
    return {case.m: time_call(case.invoke, tdev) * 1e3 for case in check.cases(check.recheck_ms)}


def retime(settings: Settings) -> None:
    """Time every verified candidate again on every configuration and route again (after autotune, before capture)."""
    # Whether it runs depends on the settings alone: under tensor parallelism every rank takes part, or none.
    if settings.select != "fastest":
        return
    served = [serving for serving in STATE.served() if serving.checks]
    every = _shared(settings, "the retime after warm-up", sorted(s.family.name for s in served))
    if any(families != every[0] for families in every):
        refuse_now(settings, refusal(f"the ranks serve different kernel families after warm-up ({every})"))
    for serving in served:
        with serving.lock:
            measure(serving, list(serving.checks.values()), new=False)
    # The last decision before capture: what a candidate serving no device prepared (its own layouts) is freed.
    routes = {(s.family.name, n) for s in STATE.served() for n in s.route_backends}
    for serving in served:
        for name in (n for n in serving.candidates if (serving.family.name, n) not in routes):
            serving.release(name)


def measure(serving: Record, checks: list[LayerCheck], new: bool) -> None:
    """Time every candidate still eligible on `checks` (checking it first on a `new` configuration), then route."""
    first, base = serving.choice, serving.choice.decision
    names = [n for n in serving.candidates if n not in serving.failed]
    if len(names) < 2 and not base.ranges and ranks()[1] < 2:
        return
    singles = {n: first if n == base.backend and not base.ranges else _single(serving, base, n) for n in names}
    try:
        for name, choice in singles.items():
            timings = serving.timings.setdefault(name, {})
            if not new and any(c.key not in timings for c in checks):
                continue  # not verified on every configuration: not a candidate
            serving.serve(choice)
            if new and choice is not first:
                report, _ = check_layer(serving, checks[0], True)
                if not report.passed:
                    serving.failed[name] = f"{report.config}: {report.reason}"
                    continue
                serving.candidate_layers.setdefault(name, []).append(report)
            timings.update({c.key: _time(serving, c) for c in checks})
        _settle(serving, singles, first, f"{'a new' if new else 'the retimed'} {serving.family.what} configuration")
    except BaseException:
        serving.serve(first)
        raise


def _settle(serving: Record, singles: dict[str, Choice], first: Choice, point: str) -> None:
    """Route to the fastest plan whose backends pass every check at their ranges on every rank, else back to `first`."""
    keys = list(serving.checks)
    eligible = [n for n in singles if n not in serving.failed and all(k in serving.timings.get(n, {}) for k in keys)]
    # milliseconds per batch size summed over the configurations (the sizes every one was timed at)
    sizes = {n: set.intersection(*(set(serving.timings[n][k]) for k in keys)) for n in eligible}
    times = _everyone(
        serving, point, {n: {m: sum(serving.timings[n][k][m] for k in keys) for m in sizes[n]} for n in eligible}
    )
    eligible = list(times)
    while eligible:
        ranges = plan({n: times[n] for n in eligible})
        choice = _split(serving, first.decision, ranges, singles)
        serving.serve(choice)
        bad, reports = None, []
        if choice is not first:  # a switch: every layer so far (and every configuration at a boundary)
            reports, bad = verify_everything(serving, None, False, configurations=len(ranges) > 1)
        found = bad and (bad.backend, f"{bad.config}: {bad.reason}")
        every = _shared(serving.settings, f"the route checked on {point}", found, serving)
        failed = next(((rank, f) for rank, f in enumerate(every) if f is not None), None)
        if failed is None:  # on every rank
            _describe(serving, choice, first, ranges, times, reports, len(keys))
            return
        rank, (name, why) = failed
        serving.failed.setdefault(name, why if rank == ranks()[0] else f"{why} (on rank {rank})")
        eligible.remove(name)
    serving.serve(first)
    if ranks()[1] > 1:  # the ranks' routes would differ
        problem = f"no {serving.family.what} route passes every check on every rank: {serving.failed}"
        refuse_now(serving.settings, refusal(problem), serving)


def _everyone(serving: Record, point: str, times: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Return the candidates timed on every rank and failed on none, with their times summed over the ranks (one rank:
    `times`); a failure on another rank marks the candidate failed here too."""
    every = _shared(serving.settings, point, (times, dict(serving.failed)), serving)
    for rank, (_, failed) in enumerate(every):
        for name, why in failed.items():
            serving.failed.setdefault(name, f"{why} (on rank {rank})")
    ranked = [n for n in every[0][0] if n not in serving.failed and all(n in t for t, _ in every)]
    sizes = {n: set.intersection(*(set(t[n]) for t, _ in every)) for n in ranked}
    return {n: {m: sum(t[n][m] for t, _ in every) for m in sizes[n]} for n in ranked}


def _shared(settings: Settings, point: str, facts: object, serving: Record | None = None) -> list:
    """Return every rank's `facts` at `point`; a rank missing or elsewhere is a recorded refusal (RefusedToServe)."""
    try:
        return gather(point, facts, settings.selftest_timeout)
    except RefusedToServe as exc:
        refuse_now(settings, str(exc), serving)


def _describe(serving: Record, choice: Choice, first: Choice, ranges: list, times: dict, reports: list, n: int):
    """Record on the serving decision its timings, its verified layers and why it was chosen."""
    decision = choice.decision
    if choice is not first and not first.decision.ranges:
        serving.candidate_layers[first.decision.backend] = list(first.decision.layers)
    if len(ranges) > 1:
        decision.layers = reports
    elif choice is not first:
        decision.layers = list(serving.candidate_layers.get(decision.backend, []))
    decision.timings_ms = {name: sum(t.values()) for name, t in times.items()}
    world = ranks()[1]
    summed = f"; the times of {world} ranks summed" if world > 1 else ""
    decision.reason = (
        f"fastest of {len(times)} verified candidates on the served layer configurations at their serving batch "
        f"sizes ({route_text(decision)}; {n} configuration(s){summed})"
    )
