"""End to end: a real ``python -m sglang.launch_server`` on this CPU (simulation), as a user starts it.

``sm120-fp4 demo --server`` writes a tiny ModelOpt NVFP4 checkpoint (dense and MoE layers), starts SGLang's
server through ``sm120-fp4 launch`` with SGLang's default flags (MoE runner left at 'auto'), asks it once,
then starts it again with a kernel from an entry-point plugin that is wrong only at one of the
checkpoint's layer shapes: the port never opens. ``--model-path`` with a kernel that fails its self-test:
refused before SGLang starts. (An llm-compressor checkpoint served with SGLang's default flags is
test_canary_server.py's exit scenario.) Each job runs in the background from the start of the session (a server start costs a
minute of CPU), in its own process group, and is killed with it.
"""

from __future__ import annotations

import re
import sys

import pytest
from helpers.common import module_installed
from helpers.procs import Popen, background, clean_env

from sm120_fp4.demo.server import group_members

pytest.importorskip("uvicorn", reason="the server packages (scripts/setup_env.sh installs them)")
if not module_installed("sglang.srt.entrypoints.http_server"):  # found, not imported (seconds of CPU)
    pytest.skip("SGLang's HTTP server is not installed", allow_module_level=True)
pytestmark = pytest.mark.sglang
SERVER_TIMEOUT = 1500


def _demo(folder, *args, **env):
    return Popen(
        [sys.executable, "-m", "sm120_fp4", "demo", "--server", *args],
        clean_env(**env),
        folder,
        cwd=folder,
        merge=True,
        group=True,
        timeout=SERVER_TIMEOUT,
    )


def _alive(pid: int) -> bool:
    return bool(group_members(pid))


def _pids(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"started pid (\d+) on 127\.0\.0\.1:\d+", out)]


@pytest.mark.timeout(3600)
@background(lambda folder: _demo(folder), heavy=2)  # two server starts
def test_server_demo_answers_then_refuses_a_kernel_wrong_at_one_layer_shape(background):
    rc, out, _ = background
    assert rc == 0, out[-4000:]
    answer = re.search(r"POST /generate 'The capital of France is' -> '(.*)' \((\d+) tokens", out)
    assert answer and int(answer.group(2)) > 0, out[-4000:]
    # Every NVFP4 layer configuration of the checkpoint was verified in SGLang's scheduler, the MoE one
    # through flashinfer_cutlass although the runner was left at 'auto'.
    for config in (
        "ModelOptFp4LinearMethod N=512 K=256",
        "ModelOptFp4LinearMethod N=256 K=256",
        "ModelOptNvFp4FusedMoEMethod E=8 H=256 I=128 top_k=2 swiglu",
    ):
        assert re.search(re.escape(config) + r".*: verified with emulated", out), config
    assert re.search(r"REFUSED: .*no FP4 GEMM backend passed verification for ModelOptFp4LinearMethod N=512 K=256", out)
    assert re.search(r"the server did not start: launcher exit -?\d+, nothing listening", out)
    pids = _pids(out)
    assert len(pids) == 2 and not [p for p in pids if _alive(p)], "every server process group is gone"


def _broken_model_path(folder):
    from helpers.plugins import plugin_site

    from sm120_fp4.demo.checkpoint import write_checkpoint

    path = write_checkpoint(str(folder / "mo"), seed=6)
    return _demo(
        folder,
        "--model-path",
        path,
        PYTHONPATH=f"{plugin_site(folder / 'plugins')}",
        SM120_FP4_MOE_BACKENDS="moe-zeros",
    )


@pytest.mark.timeout(3600)
@background(_broken_model_path, heavy=True)
def test_model_path_refuses_a_broken_entry_point_kernel_and_nothing_listens(background):
    rc, out, _ = background
    assert rc == 1, out[-4000:]
    assert "POST /generate" not in out
    assert re.search(r"the server did not start: launcher exit [1-9]\d*, nothing listening", out)
    assert "moe-zeros" in out, "the log tail names the refused kernel"
    assert not [p for p in _pids(out) if _alive(p)]


_TAKEN = "import sys; print(f'ERROR:    [Errno 98] error while attempting to bind on address (127.0.0.1, {sys.argv[1]}): address already in use')"
_HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_is_started_again_on_another(tmp_path, capsys):
    # The launcher is replaced by two stand-ins: the first reports the bind failure SGLang's uvicorn
    # logs and exits; the second answers /health. The real start / wait_ready / stop run.
    import subprocess

    from sm120_fp4.demo import server as demo_server

    attempts = []

    def launcher(command, **kwargs):
        port = command[command.index("--port") + 1]
        attempts.append(port)
        return subprocess.Popen([sys.executable, "-c", _TAKEN if len(attempts) == 1 else _HEALTHY, port], **kwargs)

    server = demo_server.Server(model_path=str(tmp_path / "model"), workdir=str(tmp_path), popen=launcher)
    server.start()
    try:
        assert server.wait_ready(timeout=60)
        assert len(attempts) == 2 and attempts[0] != attempts[1] and str(server.port) == attempts[1]
        out = capsys.readouterr().out
        assert f"port {attempts[0]} was taken" in out and _pids(out) == [server.proc.pid]
    finally:
        server.stop()
    assert not _alive(server.proc.pid)
    low, high = demo_server._ephemeral_range()
    assert all(not low <= int(p) <= high for p in attempts)  # never a port the kernel hands out by itself
