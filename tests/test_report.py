"""One report for every process that writes it (issue 22, item 6): the preflight's workers, the
server `launch` starts, several serving processes; merged under a lock, earlier runs dropped."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers.cases import case
from helpers.plugins import plugin_site
from helpers.procs import REPO, Popen, background, clean_env


def _env(folder: Path, **env: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=f"{plugin_site(folder / 'plugins')}:{REPO}", SM120_FP4_VERDICTS="off",
                     SM120_FP4_REPORT=str(folder / "report.json"), SM120_FP4_SIMULATE="12.0", **env)


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@case("reports", "`sm120-fp4 launch` whose dense preflight refuses (a zero-returning kernel) while its MoE preflight passes, SM120_FP4_REPORT a file",
      "exit 1; the one report holds the dense refusal and the MoE decision (the preflight writes it from every worker's result)")
@background(lambda folder: Popen(["sh", "-c", f'"$@"; rc=$?; cat {folder}/report.json; echo; exit $rc', "sh", sys.executable, "-m",
                                  "sm120_fp4", "launch", "--", sys.executable, "-c", "pass"],
                                 _env(folder, SM120_FP4_BACKENDS="zeros", SM120_FP4_MOE_BACKENDS="emulated"), folder))
def test_launch_reports_every_preflight_worker(background):
    rc, stdout, stderr = background
    assert rc == 1, stderr
    report = json.loads(stdout[stdout.index("{"):])
    assert [d["family"] for d in report["decisions"]] == ["moe"] and report["decisions"][0]["backend"] == "emulated"
    assert [r["family"] for r in report["refusals"]] == ["dense"] and "zeros" in report["refusals"][0]["rejected"]
    outcomes = {(p["family"], p["outcome"]) for p in report["processes"][0]["preflight"]}
    assert outcomes == {("dense", "refused"), ("moe", "passed")} and report["processes"][0]["role"] == "preflight"


SERVER = "import json, os, sm120_fp4; sm120_fp4.decide(); print(json.dumps(json.load(open(os.environ['SM120_FP4_REPORT']))))"


@case("reports", "`sm120-fp4 launch` that passes, then the server it starts (the same process, after exec) decides and writes the same report",
      "the report holds the preflight's decisions and the server's: the server's write keeps the preflight's section")
@background(lambda folder: Popen([sys.executable, "-m", "sm120_fp4", "launch", "--", sys.executable, "-c", SERVER],
                                 _env(folder, SM120_FP4_BACKENDS="emulated", SM120_FP4_MOE_BACKENDS="emulated"), folder))
def test_the_server_launch_starts_keeps_the_preflight_report(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    report = _report(stdout)
    roles = [(p["role"], p["pid"]) for p in report["processes"]]
    assert [r for r, _ in roles] == ["preflight", "worker"] and roles[0][1] == roles[1][1]  # exec keeps the pid
    assert sorted(d["family"] for d in report["decisions"]) == ["dense", "dense", "moe"]


SERVING = """
import json, os, subprocess, sys
child = "import sm120_fp4; sm120_fp4.decide(candidates=[os.environ['WHICH']])"
first = subprocess.run([sys.executable, '-c', 'import os; ' + child], env={**os.environ, 'WHICH': 'zeros'})
procs = [subprocess.Popen([sys.executable, '-c', 'import os; ' + child], env={**os.environ, 'WHICH': 'emulated'}) for _ in range(2)]
codes = [first.returncode] + [p.wait() for p in procs]
print(json.dumps([codes, json.load(open(os.environ['SM120_FP4_REPORT']))]))
"""


@case("reports", "three serving processes of one run write one report file: one refuses and exits first, then two decide at the same time",
      "the report holds all three: the refusal of the process that exited and both decisions (merged under a lock, one section per process)")
@background(lambda folder: Popen([sys.executable, "-c", SERVING], _env(folder), folder))
def test_serving_processes_of_one_run_share_one_report(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    codes, report = _report(stdout)
    assert codes[0] != 0 and codes[1:] == [0, 0], stderr
    assert len(report["refusals"]) == 1 and "zeros" in report["refusals"][0]["rejected"]
    assert len(report["decisions"]) == 2 and len({d["pid"] for d in report["decisions"]}) == 2
    assert len(report["processes"]) == 3


@case("reports", "a report file left by an earlier run (a process that is gone, of another process group) when a new run writes",
      "the earlier run's sections are dropped: a stale refusal never reads as this run's")
def test_a_new_run_drops_the_sections_of_an_earlier_one(tmp_path):
    from sm120_fp4 import selection
    from sm120_fp4.config import Settings

    path = tmp_path / "report.json"
    stale = {"version": 2, "pid": 1, "processes": [{"pid": 999999, "role": "worker", "run": "1@1", "started": "1"}],
             "decisions": [], "refusals": [{"pid": 999999, "role": "worker", "message": "an old refusal"}]}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, json.dumps(stale).encode())
    os.close(fd)
    selection.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(path), selftest="off"))
    report = json.loads(path.read_text())
    assert report["refusals"] == [] and [p["pid"] for p in report["processes"]] == [os.getpid()]
    assert len(report["decisions"]) == 1 and report["decisions"][0]["pid"] == os.getpid()
