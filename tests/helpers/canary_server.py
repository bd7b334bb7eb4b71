"""Real SGLang servers on this CPU (simulation) with the serving canary on, for tests/test_canary_server.py.

``python -m helpers.canary_server SCENARIO FOLDER [off]`` (tests/ on the path) prints one line
``CANARY-RESULT {json}`` and exits 0 when it could run the scenario (the test judges the result):

* ``exit``: a compressed-tensors (llm-compressor) checkpoint, served with SGLang's default flags, and a
  dense kernel from an entry-point plugin (``wears-out``) that returns half the right result once
  CANARY_TEST_TRIGGER exists and it has made CANARY_TEST_AFTER more calls. The server answers, a
  canary run passes, the trigger is created, a request makes the served calls that wear the kernel
  out; then the launcher must exit on its own (the canary's refusal).
* ``log``: the demo's ModelOpt checkpoint (``sm120-fp4 demo --server``'s, same seed) and the same
  kernel with SM120_FP4_CANARY_ACTION=log: answers before and after the fault, the failures counted
  in the report. With ``off``, a server with the canary off then answers the same prompt; without,
  the test compares with the demo's healthy server, which serves that checkpoint with the canary
  off (a server start is a minute of CPU: the suite starts it once).

Each server is one ``sm120-fp4 launch -- python -m sglang.launch_server`` (demo/server.py's Server),
in its own process group, stopped by its PID. The suite runs at most two real-server jobs at a time
(tests/conftest.py); a scenario may run beside the other.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from helpers.checkpoints import COMPRESSED_TENSORS, write_checkpoint
from helpers.plugins import distribution
from sm120_fp4.demo.server import PROMPT, Server, group_members, summarize

PERIOD = 8.0  # seconds: a canary run every 8 s (each run a few steps, one per idle point)
AFTER = 10  # the kernel is right for this many calls after the trigger (a request makes dozens)
READY_S = 900.0
WAIT_S = 240.0

MODULE = '''
"""A dense FP4 GEMM that is right until CANARY_TEST_TRIGGER exists and it has made CANARY_TEST_AFTER
more calls, then returns half the right result (a kernel that goes wrong while serving)."""
import os
import time

_calls = 0
_since = None


def wears_out(a, b, a_sf, b_sf, alpha, dtype, out):
    global _calls, _since
    from sm120_fp4.backends import emulated_mm_fp4

    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, dtype, out)
    trigger = os.environ.get("CANARY_TEST_TRIGGER")
    if trigger and os.path.exists(trigger):
        _calls += 1
        if _calls > int(os.environ.get("CANARY_TEST_AFTER", "0")):
            if _since is None:
                _since = time.time()
                with open(trigger + ".wrong", "w") as f:
                    f.write(repr(_since))
            out.mul_(0.5)
    return out
'''


def plugin(root: Path) -> Path:
    """A distribution whose entry point (group sm120_fp4.backends) is `wears-out`; put it on PYTHONPATH."""
    return distribution(
        root, "sm120_fp4_canary_wear", MODULE, "[sm120_fp4.backends]\nwears-out = sm120_fp4_canary_wear:wears_out\n"
    )


def canary_section(server: Server) -> dict:
    """The scheduler's canary section (the report whose canary is armed), or {}."""
    for report in server.reports():
        for proc in report.get("processes") or [report]:  # one section per process (sm120_fp4.report)
            section = proc.get("canary") or {}
            if section.get("armed_at"):
                return {**section, "pid": proc.get("pid")}
    return {}


def wait_for(predicate, timeout: float, server: Server) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if server.proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.5)
    return False


def start(folder: Path, name: str, ckpt: str, env: dict[str, str]) -> Server:
    workdir = folder / name
    workdir.mkdir()
    server = Server(ckpt, str(workdir), ["--sleep-on-idle"], env)
    server.start()
    return server


def answer(server: Server) -> str:
    """The demo's request (its prompt and length, greedy): answers compare with the demo server's."""
    return server.generate(PROMPT)["text"]


def scenario_exit(folder: Path, ckpt: str, env: dict[str, str]) -> dict:
    server = start(folder, "exit", ckpt, {**env, "SM120_FP4_CANARY_ACTION": "exit"})
    out: dict = {"pid": server.proc.pid}
    try:
        out["ready"] = server.wait_ready(READY_S)
        if not out["ready"]:
            return out
        out["answer"] = answer(server)
        out["passed_before"] = wait_for(lambda: canary_section(server).get("runs", 0) >= 1, WAIT_S, server)
        Path(env["CANARY_TEST_TRIGGER"]).touch()
        out["trigger_at"] = time.time()
        try:
            out["worn_answer"] = answer(server)  # the served calls that wear the kernel out
        except (OSError, RuntimeError) as exc:
            out["worn_answer_error"] = f"{type(exc).__name__}: {exc}"
        out["request_done_at"] = time.time()
        try:
            out["rc"] = server.proc.wait(PERIOD + WAIT_S)
        except Exception:
            out["rc"] = None
        out["exited_at"] = time.time()
        out["listening_after"] = _listening(server)
    finally:
        out["stop_rc"] = server.stop()
        out["left"] = group_members(server.proc.pid)
        out["canary"] = canary_section(server)
        out["summary"] = summarize(server.reports())
        out["refusals"] = [r for report in server.reports() for r in report.get("refusals", [])]
        out["log"] = server.log_tail(400)
        wrong = Path(env["CANARY_TEST_TRIGGER"] + ".wrong")
        out["wrong_since"] = float(wrong.read_text()) if wrong.exists() else None
    return out


def scenario_log(folder: Path, ckpt: str, env: dict[str, str], off_server: bool) -> dict:
    server = start(folder, "log", ckpt, {**env, "SM120_FP4_CANARY_ACTION": "log"})
    out: dict = {"pid": server.proc.pid}
    try:
        out["ready"] = server.wait_ready(READY_S)
        if not out["ready"]:
            out["log"] = server.log_tail(200)
            return out
        out["passed_before"] = wait_for(lambda: canary_section(server).get("runs", 0) >= 2, WAIT_S, server)
        out["answer_on"] = answer(server)  # the canary on, healthy, runs passed
        Path(env["CANARY_TEST_TRIGGER"]).touch()
        out["worn_answer"] = answer(server)
        out["counted"] = wait_for(lambda: canary_section(server).get("failures", 0) >= 3, 4 * PERIOD + WAIT_S, server)
        out["answer_after"] = answer(server)  # still serving
        out["alive"] = server.proc.poll() is None
    finally:
        out["stop_rc"] = server.stop()
        out["left"] = group_members(server.proc.pid)
        out["canary"] = canary_section(server)
        out["refusals"] = [r for report in server.reports() for r in report.get("refusals", [])]
        out["log"] = server.log_tail(100000)
    if not off_server:
        return out
    healthy = {
        **{k: v for k, v in env.items() if not k.startswith("SM120_FP4_CANARY")},
        "CANARY_TEST_TRIGGER": str(folder / "never"),
    }  # the same kernel, never worn out
    off = start(folder, "off", ckpt, healthy)
    try:
        out["off_ready"] = off.wait_ready(READY_S)
        out["answer_off"] = answer(off) if out["off_ready"] else None
        out["off_canary"] = canary_section(off)
    finally:
        out["off_stop_rc"] = off.stop()
        out["off_left"] = group_members(off.proc.pid)
    return out


def _listening(server: Server) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", server.port)) == 0


def main(scenario: str, folder: str, *flags: str) -> int:
    root = Path(folder)
    if scenario == "exit":
        ckpt = write_checkpoint(str(root / "ckpt"), seed=5, fmt=COMPRESSED_TENSORS)
    else:
        ckpt = write_checkpoint(str(root / "ckpt"), seed=3)  # the demo's checkpoint (demo/server.py)
    site = plugin(root / "plugin")
    env = {
        "SM120_FP4_BACKENDS": "wears-out",
        "SM120_FP4_MOE_BACKENDS": "emulated",
        "SM120_FP4_CANARY": f"{PERIOD:g}",
        "CANARY_TEST_TRIGGER": str(root / "trigger"),
        "CANARY_TEST_AFTER": str(AFTER),
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
    }
    if scenario == "exit":
        result = scenario_exit(root, ckpt, env)
    else:
        result = scenario_log(root, ckpt, env, off_server="off" in flags)
    print("CANARY-RESULT " + json.dumps({"period": PERIOD, **result}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
