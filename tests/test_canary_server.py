"""The serving canary through a real SGLang server on this CPU (simulation), as an operator runs it.

``sm120-fp4 launch -- python -m sglang.launch_server`` with SM120_FP4_CANARY on and a dense kernel, from
an entry-point plugin, that is right at start-up and turns wrong after a number of calls made while
serving (tests/helpers/canary_server.py). With ``exit`` (a compressed-tensors checkpoint with SGLang's
default flags) the next canary run of the dense kernel, within one period, refuses: the scheduler
raises at its idle point, SGLang kills its server, the launcher exits non-zero and the report holds
the reason. With ``log`` (the demo's ModelOpt checkpoint) the server keeps serving and counts; a
healthy server with the canary on answers the prompt as the demo's server, the same checkpoint with
the canary off, does (test_demo_server.py's job; a server of its own when that test is not selected).

Two background jobs, a server start each: a start costs a minute of CPU, so each checks everything
its server can show.
"""

from __future__ import annotations

import ast
import json
import re
import sys

import pytest
from helpers.common import module_installed
from helpers.procs import REPO, TIMEOUT, Popen, background, clean_env, job_of

from sm120_fp4.demo.server import group_members

pytest.importorskip("uvicorn", reason="the server packages (scripts/setup_env.sh installs them)")
if not module_installed("sglang.srt.entrypoints.http_server"):  # found, not imported (seconds of CPU)
    pytest.skip("SGLang's HTTP server is not installed", allow_module_level=True)
SERVER_TIMEOUT = 1800
# Each test waits for its job, started at session start: it may still be starting its servers when
# the test begins (pyproject's 300 s per test is for in-process work).
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(SERVER_TIMEOUT + 60)]


DEMO = "test_demo_server.py::test_server_demo_answers_then_refuses_a_kernel_wrong_at_one_layer_shape"


def _scenario(name: str):
    def start(folder):
        tests = REPO / "tests"
        flags = ["off"] if name == "log" and job_of(DEMO) is None else []  # no demo server in this run: its own
        return Popen(
            [sys.executable, "-m", "helpers.canary_server", name, str(folder), *flags],
            clean_env(PYTHONPATH=f"{REPO}:{tests}"),
            folder,
            cwd=tests,
            merge=True,
            group=True,
            timeout=SERVER_TIMEOUT,
        )

    return start


def _result(background) -> dict:
    rc, out, _ = background
    line = next((ln for ln in out.splitlines() if ln.startswith("CANARY-RESULT ")), None)
    assert rc == 0 and line is not None, out[-4000:]
    return json.loads(line.removeprefix("CANARY-RESULT "))


@background(_scenario("exit"), heavy=True)
def test_a_kernel_worn_out_while_serving_stops_the_server_within_one_period(background):
    r = _result(background)
    assert r["ready"] and r["answer"] is not None and r["passed_before"], r.get("log", "")[-3000:]
    # An llm-compressor checkpoint with SGLang's default flags (MoE runner 'auto'): each of its NVFP4
    # layer configurations verified in the scheduler before it served.
    summary = "\n".join(r["summary"])
    assert re.search(r"CompressedTensorsW4A4Nvfp4MoE E=8 H=256 I=128 top_k=2 swiglu bfloat16: verified", summary), (
        summary
    )
    assert re.search(r"CompressedTensorsW4A4Fp4 N=512 K=256 .*: verified", summary), summary
    # The launcher (sm120-fp4 launch, whose child is SGLang's server process) exited by itself, non-zero,
    # and nothing of the server is left or listening.
    assert r["rc"] is not None and r["rc"] != 0, r["log"][-3000:]
    assert not r["listening_after"] and r["left"] == [] and not [p for p in [r["pid"]] if group_members(p)]
    # Caught by the first run of the dense kernel after it went wrong, started within one period of it.
    assert r["wrong_since"] is not None, "the kernel went wrong while serving"
    dense = [run for run in r["canary"]["recent"] if run["family"] == "dense" and run["started_at"] > r["wrong_since"]]
    assert dense and not dense[0]["passed"], r["canary"]["recent"]
    caught = dense[0]
    assert caught["started_at"] - r["wrong_since"] <= r["period"] + caught["late_s"] + 1.0, (caught, r["wrong_since"])
    assert "norm is 0.5x" in caught["reason"] and r["canary"]["failures"] == 1
    # The reason, the configuration and the numbers are in the report file, and in the log.
    [refusal] = r["refusals"]
    assert refusal["config"] == caught["config"] + " (while serving)"
    assert (
        refusal["message"].startswith("sm120_fp4: refusing to serve NVFP4 on ")
        and "while serving: wears-out" in refusal["message"]
    )
    shape = refusal["reports"][0]["shapes"][0]
    assert not shape["passed"] and shape["norm_ratio"] == pytest.approx(0.5, abs=0.01) and shape["m"] == caught["ms"][0]
    assert r["canary"]["state"].startswith("stopped the process")
    assert re.search(
        r"while serving: wears-out failed the serving canary's re-check of CompressedTensorsW4A4Fp4", r["log"]
    )
    assert "Scheduler hit an exception" in r["log"], (
        "SGLang's own path: the scheduler raised, the server killed its tree"
    )


@background(_scenario("log"), heavy=True)
def test_with_action_log_the_server_keeps_serving_and_counts_and_the_canary_changes_no_answer(background):
    r = _result(background)
    assert r["ready"] and r["passed_before"], r.get("log", "")[-3000:]
    # A healthy server with the canary on (runs passed) answers as a server of the same checkpoint with
    # it off: the demo's (its canary off), or one of the scenario's own.
    if "off_ready" in r:
        assert r["off_ready"] and r["off_canary"] == {} and r["off_left"] == [], "the canary is off there"
        answer_off = r["answer_off"]
    else:
        answer_off = _demo_answer(job_of(DEMO).wait(TIMEOUT))
    assert r["answer_on"] and r["answer_on"] == answer_off, (r["answer_on"], answer_off)
    assert r["left"] == []
    # Worn out: every failing run counted, one warning per configuration, still answering.
    assert r["counted"] and r["alive"] and isinstance(r["answer_after"], str), r["log"][-3000:]
    section = r["canary"]
    assert section["failures"] >= 3 and sum(f["count"] for f in section["failed"]) == section["failures"]
    warned = re.findall(r"while serving: wears-out failed the serving canary's re-check of (.+?) on cpu", r["log"])
    assert sorted(warned) == sorted(f["config"] for f in section["failed"]), warned
    assert all(f["family"] == "dense" for f in section["failed"]), "the MoE kernel was not worn"
    assert r["refusals"] == [], "log never refuses"


def _demo_answer(demo) -> str:
    """The text the demo's healthy server answered (``sm120-fp4 demo --server``'s output)."""
    rc, out, _ = demo
    found = re.findall(r"POST /generate '[^']*' -> (.*) \(\d+ tokens; random weights", out)
    assert rc == 0 and found, f"the demo's healthy server gave no answer to compare with:\n{out[-3000:]}"
    return ast.literal_eval(found[0])
