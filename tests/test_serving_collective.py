"""SELECT=fastest under tensor parallelism: each rank its own process, the same route on every rank. Two real
processes on the CPU (torch.distributed over gloo), each loading SGLang's real NVFP4 linear layer through the library's
public path (tests/helpers/ranks.py), with timings and faults that differ per rank."""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest
from helpers.cases import case
from helpers.procs import REPO, background, python, pythonpath

pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")

RUN = "import sys; from helpers.ranks import main; main(int(sys.argv[1]), int(sys.argv[2]))"


class _BothRanks:
    """Both ranks' processes as one background job (helpers.procs.Queued): wait() waits for both and gives the
    worst exit code and both outputs; kill() stops both."""

    def __init__(self, folder):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.ranks = []
        for rank in (0, 1):
            code = f"import sys; sys.argv[1:] = ['{rank}', '{port}']; {RUN}"
            (folder / f"rank{rank}").mkdir()
            env = dict(cwd=REPO / "tests", PYTHONPATH=pythonpath(REPO, REPO / "tests"))
            self.ranks.append(python(code, folder / f"rank{rank}", **env))
        self.proc = self.ranks[0].proc  # the pool nices this one; wait() gives rank 1 the same niceness

    def wait(self, timeout: float) -> tuple[int, str, str]:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.ranks[1].proc.pid, os.getpriority(os.PRIO_PROCESS, self.proc.pid))
        outputs = [rank.wait(timeout) for rank in self.ranks]
        self.cpu_s = sum(getattr(rank, "cpu_s", 0.0) for rank in self.ranks)  # JOB_TIMES
        rc = next((rc for rc, _, _ in outputs if rc != 0), 0)
        return rc, "".join(out for _, out, _ in outputs), "".join(err for _, _, err in outputs)

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()


def _both_ranks(folder):
    return _BothRanks(folder)


# One run of both ranks (a background job: it runs beside the in-process tests) that the four tests read.
@pytest.fixture
def ranks(background) -> dict[str, list[dict]]:
    """Each scenario's JSON line from rank 0 and rank 1."""
    rc, out, err = background
    assert rc == 0, err[-3000:]
    found: dict[str, list[dict]] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            found.setdefault(result["scenario"], [None, None])[result["rank"]] = result
    return found


@case(
    "configuration",
    "SELECT=fastest with two ranks whose timings differ (each alone would serve another backend), then SGLang's "
    "warm-up on both (its autotune changes the timings of one rank only)",
    "every rank takes the same route, from every rank's timings summed: at load and after the retime (a split)",
)
@background(_both_ranks, shared=True)
def test_every_rank_takes_the_same_route_whatever_its_own_timings(ranks):
    first, second = ranks["timings"]
    assert first["route"] == second["route"] == "b", (first, second)
    assert first["retimed"] == second["retimed"] == "a (M<=512), b (M>512)"
    assert "the times of 2 ranks summed" in first["reason"]


@case(
    "backend faults",
    "SELECT=fastest with two ranks: the fastest candidate is wrong on rank 1 only, at the layer's shape",
    "rank 1 replaces it; rank 0 learns why and takes the same route; no refusal; SGLang's warm-up then retimes on "
    "both ranks (whether to retime depends on the settings alone) and keeps that route",
)
@background(_both_ranks, shared=True)
def test_a_failure_on_one_rank_moves_every_rank(ranks):
    first, second = ranks["divergent layer"]
    assert first["route"] == second["route"] == first["retimed"] == second["retimed"] == "a", (first, second)
    assert first["failed"]["b"].endswith("(on rank 1)") and "M=" in first["failed"]["b"]


@case(
    "backend faults",
    "SELECT=fastest with two ranks, each verifying a different candidate (one wrong on rank 0, one on rank 1)",
    "a named refusal on both ranks at the first layer (no candidate verified on every rank), never a hang",
)
@background(_both_ranks, shared=True)
def test_a_divergent_verification_is_a_named_refusal_on_every_rank(ranks):
    for rank, result in enumerate(ranks["disjoint"]):
        assert "no FP4 GEMM backend passed verification" in result["refused"]
        assert f"passed its self-test here, but not on rank {1 - rank}" in result["refused"]


@case(
    "backend faults",
    "SELECT=fastest with two ranks, the only candidate wrong on rank 1 only: rank 1 refuses in its own layer check",
    "rank 0, waiting for rank 1's timings, refuses within SM120_FP4_SELFTEST_TIMEOUT (5 s), naming the point",
)
@background(_both_ranks, shared=True)
def test_a_rank_that_never_arrives_is_a_refusal_within_the_bound(ranks):
    first, second = ranks["timeout"]
    assert "no FP4 GEMM backend passed verification for ModelOptFp4LinearMethod N=32 K=64" in second["refused"]
    assert "not every rank reached a new FP4 GEMM configuration within 5 s" in first["refused"], first
    assert first["seconds"] < 5 + 30
