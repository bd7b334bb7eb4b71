"""One rank of a two-rank run on the CPU (tests/test_serving_collective.py): its own process, torch.distributed over
gloo, SGLang's real NVFP4 linear layer loaded through the library's public path with SELECT=fastest. Each scenario
prints one JSON line: what this rank decided, or why it refused.

Run as ``python -m helpers.ranks RANK PORT`` from tests/ (importable without pytest).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import types


def _cost(table: dict, rank: int):
    """cost(M) from {rank: (cost at M <= 512, cost above)}."""
    low, high = table[rank]
    return lambda m: low if m <= 512 else high


def _wrong_on(rank: int, wanted: int, n: int | None = None):
    """wrong(M, N): on rank `wanted` only (at output width `n` only, where given: not a self-test shape)."""
    return lambda m, width: rank == wanted and (n is None or width == n)


def _register(name: str, clock: list, cost, wrong=lambda m, n: False) -> None:
    from sm120_fp4 import backends

    def gemm(a, b, a_sf, b_sf, alpha, dtype, out):
        clock[0] += cost[0](a.shape[0])
        backends.emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
        if wrong(a.shape[0], out.shape[1]):
            out.mul_(0.5)
        return out

    backends.register(name, gemm, replace=True)


def _load(rank: int, names: str, **settings) -> dict:
    """Install, load one layer, and return this rank's route (or its refusal) and how long it took."""
    import sm120_fp4
    from sm120_fp4 import serving
    from sm120_fp4.demo import synthetic
    from sm120_fp4.errors import RefusedToServe
    from sm120_fp4.sglang import layers

    sm120_fp4.install(simulate="12.0", backends=names, select="fastest", **settings)
    start = time.monotonic()
    try:
        layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    except RefusedToServe as exc:
        return {"refused": str(exc), "seconds": time.monotonic() - start}
    failed = dict(serving.STATE.records[("dense", -1)].failed)
    return {"route": sm120_fp4.status().routes[-1], "failed": failed, "seconds": time.monotonic() - start}


def _retime() -> str:
    """SGLang's BaseRunner.warmup (its autotune stands in), which the library's hook ends with the retime."""
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    import sm120_fp4

    BaseRunner.warmup(types.SimpleNamespace(model_context=contextlib.nullcontext, _warmup=lambda: None))
    return sm120_fp4.status().routes[-1]


def _reason() -> str:
    from sm120_fp4 import serving

    [decision] = serving.decisions()
    return decision.reason


def main(rank: int, port: int) -> None:
    import torch.distributed as dist

    import sm120_fp4
    from helpers.fastest import clock_timed
    from sm120_fp4 import deciding
    from sm120_fp4.sglang import hooks

    hooks.DEFAULT_CHUNKED_PREFILL = 2048  # as the in-process tests (tests/conftest.py): M up to 2049
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    clock = [0.0]
    deciding.timed = functools.partial(clock_timed, clock)

    def say(scenario: str, found: dict) -> None:
        print(json.dumps({"rank": rank, "scenario": scenario, **found}), flush=True)
        sm120_fp4.uninstall()

    # 1. Different timings per rank: `a` faster on rank 0, `b` on rank 1; summed, `b` is the faster. After the
    # warm-up, rank 1 alone would split at 512 (rank 0 alone would serve `a`); summed, both split.
    cost_a, cost_b = [_cost({0: (1.0, 1.0), 1: (5.0, 5.0)}, rank)], [_cost({0: (2.0, 2.0), 1: (2.0, 2.0)}, rank)]
    _register("a", clock, cost_a)
    _register("b", clock, cost_b)
    found = _load(rank, "a,b")
    cost_a[0], cost_b[0] = _cost({0: (1.0, 1.0), 1: (1.0, 10.0)}, rank), _cost({0: (2.0, 2.0), 1: (2.0, 2.0)}, rank)
    say("timings", {**found, "retimed": _retime(), "reason": _reason()})

    # 2. `b` (faster) wrong on rank 1 only, at the layer's width: rank 1 replaces it by `a`, rank 0 follows.
    cost_a[0], cost_b[0] = _cost({0: (2.0, 2.0), 1: (2.0, 2.0)}, rank), _cost({0: (1.0, 1.0), 1: (1.0, 1.0)}, rank)
    _register("b", clock, cost_b, _wrong_on(rank, 1, 32))
    found = _load(rank, "a,b")
    say("divergent layer", {**found, "retimed": _retime()})  # rank 1 has one candidate left, rank 0 two: both retime

    # 3. Each rank verifies a different candidate (`a` wrong on rank 1, `b` on rank 0): no route for every rank.
    _register("a", clock, cost_a, _wrong_on(rank, 1))
    _register("b", clock, cost_b, _wrong_on(rank, 0))
    say("disjoint", _load(rank, "a,b"))

    # 4. The only candidate wrong on rank 1 at the layer: rank 1 refuses alone; rank 0 waits at most 5 s.
    _register("a", clock, cost_a, _wrong_on(rank, 1, 32))
    found = _load(rank, "a", selftest_timeout="5")
    if rank == 1:
        time.sleep(8)  # still alive while rank 0 waits: its bound, not a closed connection, ends the wait
    say("timeout", found)
    os._exit(0)  # rank 0's timed-out exchange is still pending in gloo: nothing to wait for at exit


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
