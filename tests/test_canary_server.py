"""The serving canary through a real SGLang server on this CPU (simulation), as an operator runs it.

``sm120-fp4 launch -- python -m sglang.launch_server`` with SM120_FP4_CANARY on and a dense kernel, from
an entry-point plugin, that is right at start-up and turns wrong after a number of calls made while
serving (tests/helpers/canary_server.py). With ``exit`` the next canary run of the dense kernel, within
one period, refuses: the scheduler raises at its idle point, SGLang kills its server, the launcher
exits non-zero and the report holds the reason. With ``log`` the server keeps serving and counts; a
healthy server with the canary on answers the prompt as the same server with it off.

Two background jobs (three server starts): each costs minutes of CPU, so each checks everything
its servers can show.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from helpers.procs import REPO, Popen, background, clean_env
from sm120_fp4.demo.server import group_members

pytest.importorskip("uvicorn", reason="the server packages (scripts/setup_env.sh installs them)")
pytest.importorskip("sglang.srt.entrypoints.http_server", reason="SGLang's HTTP server")
SERVER_TIMEOUT = 1800
# Each test waits for its job, started at session start: it may still be starting its servers when
# the test begins (pyproject's 300 s per test is for in-process work).
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(SERVER_TIMEOUT + 60)]


def _scenario(name: str):
    def start(folder):
        tests = REPO / "tests"
        return Popen([sys.executable, "-m", "helpers.canary_server", name, str(folder)],
                     clean_env(PYTHONPATH=f"{REPO}:{tests}"), folder, cwd=tests, merge=True, group=True, timeout=SERVER_TIMEOUT)

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
    # The launcher (SGLang's server process, exec'd by sm120-fp4 launch) exited by itself, non-zero,
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
    assert refusal["message"].startswith("sm120_fp4: refusing to serve NVFP4 on ") and "while serving: wears-out" in refusal["message"]
    shape = refusal["reports"][0]["shapes"][0]
    assert not shape["passed"] and shape["norm_ratio"] == pytest.approx(0.5, abs=0.01) and shape["m"] == caught["ms"][0]
    assert r["canary"]["state"].startswith("stopped the process")
    assert re.search(r"while serving: wears-out failed the serving canary's re-check of ModelOptFp4LinearMethod", r["log"])
    assert "Scheduler hit an exception" in r["log"], "SGLang's own path: the scheduler raised, the server killed its tree"


@background(_scenario("log"), heavy=True)
def test_with_action_log_the_server_keeps_serving_and_counts_and_the_canary_changes_no_answer(background):
    r = _result(background)
    assert r["ready"] and r["passed_before"], r.get("log", "")[-3000:]
    # A healthy server with the canary on (runs passed) answers as the same server with it off.
    assert r["off_ready"] and r["answer_on"] and r["answer_on"] == r["answer_off"], (r["answer_on"], r["answer_off"])
    assert r["off_canary"] == {}, "the canary is off there"
    assert r["off_left"] == [] and r["left"] == []
    # Worn out: every failing run counted, one warning per configuration, still answering.
    assert r["counted"] and r["alive"] and isinstance(r["answer_after"], str), r["log"][-3000:]
    section = r["canary"]
    assert section["failures"] >= 3 and sum(f["count"] for f in section["failed"]) == section["failures"]
    warned = re.findall(r"while serving: wears-out failed the serving canary's re-check of (.+?) on cpu", r["log"])
    assert sorted(warned) == sorted(f["config"] for f in section["failed"]), warned
    assert all(f["family"] == "dense" for f in section["failed"]), "the MoE kernel was not worn"
    assert r["refusals"] == [], "log never refuses"
