"""One report for every process that writes it -- the preflight's workers, the
server `launch` starts, several serving processes; merged under a lock, earlier runs dropped."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cases import case
from helpers.common import CpuGpu
from helpers.plugins import plugin_site
from helpers.procs import REPO, Popen, background, clean_env

import sm120_fp4
from sm120_fp4 import files, report, serving
from sm120_fp4.config import Settings


def _env(folder: Path, **env: str) -> dict[str, str]:
    return clean_env(
        PYTHONPATH=f"{plugin_site(folder / 'plugins')}:{REPO}",
        SM120_FP4_VERDICTS="off",
        SM120_FP4_REPORT=str(folder / "report.json"),
        SM120_FP4_SIMULATE="12.0",
        **env,
    )


def _report(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@case(
    "reports",
    "`sm120-fp4 launch` whose dense preflight refuses (a zero-returning kernel) while its MoE preflight passes, SM120_FP4_REPORT a file",
    "exit 1; the one report holds the dense refusal and the MoE decision (the preflight writes it from every worker's result)",
)
@background(
    lambda folder: Popen(
        [
            "sh",
            "-c",
            f'"$@"; rc=$?; cat {folder}/report.json; echo; exit $rc',
            "sh",
            sys.executable,
            "-m",
            "sm120_fp4",
            "launch",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],
        _env(folder, SM120_FP4_BACKENDS="zeros", SM120_FP4_MOE_BACKENDS="emulated"),
        folder,
    )
)
def test_launch_reports_every_preflight_worker(background):
    rc, stdout, stderr = background
    assert rc == 1, stderr
    report = json.loads(stdout[stdout.index("{") :])
    assert [d["family"] for d in report["decisions"]] == ["moe"] and report["decisions"][0]["backend"] == "emulated"
    assert [r["family"] for r in report["refusals"]] == ["dense"] and "zeros" in report["refusals"][0]["rejected"]
    outcomes = {(p["family"], p["outcome"]) for p in report["processes"][0]["preflight"]}
    assert outcomes == {("dense", "refused"), ("moe", "passed")} and report["processes"][0]["role"] == "preflight"


SERVER = (
    "import json, os, sm120_fp4; sm120_fp4.decide(); print(json.dumps(json.load(open(os.environ['SM120_FP4_REPORT']))))"
)


@case(
    "reports",
    "`sm120-fp4 launch` that passes, then the server it starts (its child) decides and writes the same report",
    "the report holds the preflight's decisions and the server's: the server's write keeps the preflight's section",
)
@background(
    lambda folder: Popen(
        [sys.executable, "-m", "sm120_fp4", "launch", "--", sys.executable, "-c", SERVER],
        _env(folder, SM120_FP4_BACKENDS="emulated", SM120_FP4_MOE_BACKENDS="emulated"),
        folder,
    )
)
def test_the_server_launch_starts_keeps_the_preflight_report(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    report = _report(stdout)
    roles = [(p["role"], p["run"]) for p in report["processes"]]
    assert [r for r, _ in roles] == ["preflight", "worker"] and roles[0][1] == roles[1][1]  # one run: launch's group
    assert sorted(d["family"] for d in report["decisions"]) == ["dense", "dense", "moe"]


SERVING = """
import json, os, subprocess, sys
child = "import sm120_fp4; sm120_fp4.decide(candidates=[os.environ['WHICH']])"
first = subprocess.run([sys.executable, '-c', 'import os; ' + child], env={**os.environ, 'WHICH': 'zeros'})
procs = [subprocess.Popen([sys.executable, '-c', 'import os; ' + child], env={**os.environ, 'WHICH': 'emulated'}) for _ in range(2)]
codes = [first.returncode] + [p.wait() for p in procs]
print(json.dumps([codes, json.load(open(os.environ['SM120_FP4_REPORT']))]))
"""


@case(
    "reports",
    "three serving processes of one run write one report file: one refuses and exits first, then two decide at the same time",
    "the report holds all three: the refusal of the process that exited and both decisions (merged under a lock, one section per process)",
)
@background(lambda folder: Popen([sys.executable, "-c", SERVING], _env(folder), folder))
def test_serving_processes_of_one_run_share_one_report(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    codes, report = _report(stdout)
    assert codes[0] != 0 and codes[1:] == [0, 0], stderr
    assert len(report["refusals"]) == 1 and "zeros" in report["refusals"][0]["rejected"]
    assert len(report["decisions"]) == 2 and len({d["pid"] for d in report["decisions"]}) == 2
    assert len(report["processes"]) == 3


@case(
    "reports",
    "a report file left by an earlier run (a process that is gone, of another process group) when a new run writes",
    "the earlier run's sections are dropped: a stale refusal never reads as this run's",
)
def test_a_new_run_drops_the_sections_of_an_earlier_one(tmp_path):
    path = tmp_path / "report.json"
    stale = {
        "version": 2,
        "pid": 1,
        "processes": [{"pid": 999999, "role": "worker", "run": "1@1", "started": "1"}],
        "decisions": [],
        "refusals": [{"pid": 999999, "role": "worker", "message": "an old refusal"}],
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, json.dumps(stale).encode())
    os.close(fd)
    sm120_fp4.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(path), selftest="off"))
    report = json.loads(path.read_text())
    assert report["refusals"] == [] and [p["pid"] for p in report["processes"]] == [os.getpid()]
    assert len(report["decisions"]) == 1 and report["decisions"][0]["pid"] == os.getpid()


# ---- the report file of one process (sm120_fp4.report.update through decide()) ------------------------


def _decide_with_report(path) -> Path:
    # SELFTEST=off: the report, not the self-test, is under test here (and it is faster).
    sm120_fp4.decide(candidates=["emulated"], settings=Settings(simulate="12.0", report=str(path), selftest="off"))
    return Path(str(path).replace("{pid}", str(os.getpid())))


@case(
    "reports",
    "report written under umask {umask}",
    "mode 0600 exactly (owner-only); valid JSON; no temporary file left next to it",
)
@pytest.mark.parametrize("umask", ["000", "022", "077", "777"])
def test_report_mode_is_0600_whatever_the_umask(tmp_path, umask):
    previous = os.umask(int(umask, 8))
    try:
        path = _decide_with_report(tmp_path / "report-{pid}.json")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # fchmod, whatever the umask
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@case(
    "reports",
    "symlink planted at a file report path after start-up (to a file, to a directory, dangling)",
    "the link is neither followed nor replaced (a warning names it); its target is never written or created; the decision stands",
)
@pytest.mark.parametrize("target_kind", ["file", "directory", "dangling"])
def test_report_never_follows_or_replaces_a_planted_symlink(tmp_path, target_kind, caplog):
    victim = tmp_path / "victim"
    if target_kind == "file":
        victim.write_text("precious")
    elif target_kind == "directory":
        victim.mkdir()
    link = tmp_path / "report.json"
    settings = Settings(simulate="12.0", report=str(link), selftest="off")  # read while the path is no link
    link.symlink_to(victim)
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert sm120_fp4.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert link.is_symlink() and os.readlink(link) == str(victim)
    assert any("is a symbolic link" in r.getMessage() for r in caplog.records)
    if target_kind == "file":
        assert victim.read_text() == "precious"
    elif target_kind == "directory":
        assert list(victim.iterdir()) == []
    else:
        assert not victim.exists()


@case(
    "reports",
    "a report write that fails half-way (unserialisable payload)",
    "the previous report is intact; no temporary file is left",
)
def test_a_failed_report_write_leaves_the_previous_report_and_no_temp_file(tmp_path):
    path = _decide_with_report(tmp_path / "report.json")
    before = path.read_text()
    with pytest.raises(TypeError):
        report.write(path, {"bad": object()}, directory=False)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["report.json"]


@case(
    "reports",
    "secrets in the environment (HF_TOKEN, AWS_SECRET_ACCESS_KEY, any other variable)",
    "the report holds no environment value except the library's own settings",
)
def test_report_contains_no_environment_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value_123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-456")
    text = _decide_with_report(tmp_path / "report.json").read_text()
    leaked = [k for k, v in os.environ.items() if not k.startswith("SM120_FP4") and len(v) >= 8 and v in text]
    assert leaked == []


@case(
    "reports",
    "report directory removed after install(), then the first layer loads",
    "the decision stands (one warning says the report was not written); the worker does not crash",
)
def test_an_unwritable_report_does_not_stop_a_worker(tmp_path, caplog):
    folder = tmp_path / "reports"
    folder.mkdir()
    settings = Settings(simulate="12.0", report=str(folder / "r.json"), selftest="off")
    folder.rmdir()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert sm120_fp4.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert any("report" in r.getMessage() for r in caplog.records)


@case(
    "reports",
    "two decisions finish at once in one process, writers interleave",
    "the report lists both decisions (the last writer writes the latest state)",
)
@pytest.mark.slow
def test_concurrent_report_writes_never_lose_a_decision(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    first_dumping, second_decided = threading.Event(), threading.Event()
    real_dump = json.dump

    def ordered_dump(payload, handle, **kwargs):
        if len(payload.get("decisions", ())) == 1:  # the first writer is held mid-write until the second decision
            first_dumping.set()
            second_decided.wait(60)
        return real_dump(payload, handle, **kwargs)

    # The json of the package's one JSON writer (files.write_json) only: json.dump itself is every thread's, and
    # a background job of another test may be writing JSON in this process meanwhile.
    monkeypatch.setattr(files, "json", SimpleNamespace(**{**vars(json), "dump": ordered_dump}))
    decide = lambda index: sm120_fp4.decide(CpuGpu(index, f"gpu{index}", (12, 0)), ["emulated"], settings=settings)  # noqa: E731
    first = threading.Thread(target=decide, args=(0,))
    first.start()
    assert first_dumping.wait(60)
    second = threading.Thread(target=decide, args=(1,))
    second.start()
    deadline = time.monotonic() + 60
    while len(serving.decisions()) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    second_decided.set()  # the second decision is made; its writer now queues behind the first
    first.join()
    second.join()
    assert len(json.loads(path.read_text())["decisions"]) == 2


@case(
    "reports",
    "SM120_FP4_REPORT is a symlink to a directory (/logs -> /mnt/vol/logs), two processes write",
    "the link is kept and is that directory: one sm120_fp4-PID.json per process inside the target",
)
def test_a_report_link_to_a_directory_is_that_directory(tmp_path, monkeypatch):
    target = tmp_path / "vol" / "logs"
    target.mkdir(parents=True)
    link = tmp_path / "logs"
    link.symlink_to(target)
    monkeypatch.setenv("SM120_FP4_REPORT", str(link))
    settings = Settings(simulate="12.0", selftest="off")
    sm120_fp4.decide(candidates=["emulated"], settings=settings)
    report.write(link, {"pid": 1}, directory=settings.report_is_dir)  # as another worker's write lands
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert [p.name for p in target.iterdir()] == [f"sm120_fp4-{os.getpid()}.json"]


@case(
    "reports",
    "report directory (or the link to it) removed after start-up, then a decision is written",
    "a warning; no file is created at the directory's name; the decision stands",
)
@pytest.mark.parametrize("kind", ["directory", "link to a directory"])
def test_a_vanished_report_directory_is_not_replaced_by_a_file(tmp_path, caplog, kind):
    target = tmp_path / "logs"
    target.mkdir()
    path = target
    if kind != "directory":
        path = tmp_path / "link"
        path.symlink_to(target)
    settings = Settings(simulate="12.0", report=str(path), selftest="off")
    target.rmdir()
    caplog.set_level(logging.WARNING, "sm120_fp4")
    assert sm120_fp4.decide(candidates=["emulated"], settings=settings).backend == "emulated"
    assert not target.exists() and any(
        "report" in r.getMessage() and "no longer exists" in r.getMessage() for r in caplog.records
    )


# ---- ranks: which of a server's ranks wrote, verified, refused ---------------------------------------------------


@case(
    "reports",
    "decide() in a process that is TP rank 1 of 2 (the engine's rank as serving reads it), with a candidate that "
    "returns zeros; the candidate reads the report during its own self-test",
    "the report said `verifying` before the first check ran (a rank the engine stops meanwhile still says so); the "
    "refusal's message names `TP rank 1/2`; its record in status() and the report carries tp_rank and tp_size, as "
    "does the process's entry",
)
def test_a_rank_records_that_it_verifies_before_the_first_check_and_its_refusal_names_the_rank(tmp_path):
    from helpers import faults

    from sm120_fp4 import backends
    from sm120_fp4.errors import RefusedToServe

    path, seen = tmp_path / "report.json", []

    def zeros_reading_the_report(*args):
        seen.append(json.loads(path.read_text())["processes"][-1])
        return faults.returns_zeros(*args)

    backends.register("zeros-reading", zeros_reading_the_report)
    sm120_fp4.decide(candidates=["emulated"], settings=Settings(simulate="12.0", selftest="off"))  # wires the report
    serving.STATE.rank = lambda: {"tp_rank": 1, "tp_size": 2}
    try:
        with pytest.raises(RefusedToServe, match=r"\(TP rank 1/2\)"):
            serving.decide(candidates=["zeros-reading"], settings=Settings(simulate="12.0", report=str(path)))
        refusal = sm120_fp4.status().refusals[0]
    finally:
        serving.STATE.rank = dict
    assert seen and seen[0]["verifying"] == ["FP4 GEMM on cpu 'simulated (CPU)' (sm_120, simulated)"]
    assert seen[0]["rank"] == {"tp_rank": 1, "tp_size": 2}
    assert refusal.rank == {"tp_rank": 1, "tp_size": 2}
    assert refusal.message.splitlines()[0].endswith("passed verification. (TP rank 1/2)"), refusal.message
    written = json.loads(path.read_text())
    assert written["refusals"][0]["rank"] == {"tp_rank": 1, "tp_size": 2}
    assert written["processes"][-1]["verifying"] == [] and written["processes"][-1]["rank"]["tp_rank"] == 1


def test_a_layer_check_with_the_canary_on_is_in_the_report_before_it_runs_without_waiting(tmp_path, monkeypatch):
    """With the canary on, a layer's check is written to the report (`verifying`) before it runs, and the checking
    thread's write is done, not waited out: the canary's report section reads what is served without the record's
    lock, which the check holds (it did: each new configuration waited the write's whole bound, 5 s, and the report
    said nothing of the check)."""
    pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant", reason="needs the pinned SGLang")
    from sm120_fp4 import backends
    from sm120_fp4.demo import synthetic
    from sm120_fp4.sglang import layers

    path, seen, writes = tmp_path / "report.json", [], []

    def emulated_reading_the_report(*args):
        seen.append(json.loads(path.read_text())["processes"][-1]["verifying"])
        return backends.resolve("emulated")(*args)

    backends.register("emulated-reading", emulated_reading_the_report)
    sm120_fp4.install(simulate="12.0", backends="emulated-reading", canary="60", report=str(path))
    write_now = serving.STATE.report.write_now
    monkeypatch.setattr(
        serving.STATE.report, "write_now", lambda settings: writes.append(write_now(settings)) or writes[-1]
    )
    layers.build_modelopt_layer(synthetic.make_checkpoint(32, 64))
    assert writes and all(writes), writes  # every write the checking thread waited for was done
    layer = [v for entries in seen for v in entries if v.startswith("ModelOptFp4LinearMethod N=32 K=64 ")]
    assert layer and "cpu 'simulated (CPU)'" in layer[0], sorted({v for entries in seen for v in entries})
    assert sm120_fp4.status().canary.enabled
