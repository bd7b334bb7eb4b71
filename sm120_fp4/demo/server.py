"""``sm120-fp4 demo --server``: a real SGLang server behind ``sm120-fp4 launch`` on this CPU, then a refused kernel."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from ..sglang.release import LAUNCH_SERVER
from . import _say

# What SGLang needs to serve on a CPU (docs/operations.md, "A real server on a CPU"); the KV cache
# capped (SGLang sizes it from the machine's free memory on a CPU), small and quick to allocate.
CPU_SERVER_ARGS = (
    "--device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup --tp 1 "
    "--mem-fraction-static 0.5 --max-total-tokens 32768"
).split()
CPU_SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SM120_FP4": "1"}  # always: the CPU engine, the library on
# Defaults the operator's environment may override (a broken kernel named in SM120_FP4_BACKENDS, say).
CPU_SERVER_DEFAULTS = dict(HF_HUB_OFFLINE="1", SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="cutlass,b12x,emulated")
CPU_SERVER_DEFAULTS.update(SM120_FP4_MOE_BACKENDS="cutlass,emulated")
START_TIMEOUT_S = 900.0
PROMPT = "The capital of France is"


QKV_N, QKV_K = 512, 256  # the demo checkpoint's fused qkv projection, whole (each of T TP ranks holds N / T)


def wrong_at_qkv(a, b, a_sf, b_sf, alpha, out_dtype, out):
    """Zero rows 64-127 at the demo checkpoint's fused qkv shard (N=512/TP, K=256) only: the demo's broken kernel."""
    import torch

    from ..backends import emulated_mm_fp4

    emulated_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out)
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if b.shape[1] == QKV_N // ranks and a.shape[1] * 2 == QKV_K:
        out[64:128] = 0
    return out


def _ephemeral_range() -> tuple[int, int]:
    """Return the kernel's range for ports it hands out by itself (outgoing connections, bind to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 free now, outside the ephemeral range (which others may take before the bind)."""
    low, high = _ephemeral_range()
    choices = [p for p in range(20000, 65536) if not low <= p <= high]
    rng = random.SystemRandom()
    for port in (rng.choice(choices) for _ in range(100)) if choices else ():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every one tried is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def group_members(pgid: int) -> list[int]:
    """Return the live (not zombie) processes of process group `pgid` (read from /proc: the servers run on Linux)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@dataclass
class Server:
    """Run one ``sm120-fp4 launch -- python -m sglang.launch_server ...`` in its own process group."""

    model_path: str
    workdir: str
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen | None = None
    popen: Callable[..., subprocess.Popen] = subprocess.Popen  # how the launcher is started (a test's stand-in)

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"server-{self.port}.log")

    @property
    def report_dir(self) -> str:
        return os.path.join(self.workdir, f"reports-{self.port}")

    def start(self) -> None:
        self.port = self.port or free_port()
        os.makedirs(self.report_dir, mode=0o700, exist_ok=True)
        env = {**CPU_SERVER_DEFAULTS, **os.environ, **CPU_SERVER_ENV, "SM120_FP4_REPORT": self.report_dir, **self.env}
        command = [sys.executable, "-m", "sm120_fp4", "launch", "--", sys.executable, "-m", LAUNCH_SERVER]
        command += ["--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port)]
        command += [*CPU_SERVER_ARGS, *self.extra_args]
        io = dict(stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as log:
            self.proc = self.popen(command, stdout=log, **io)

    def wait_ready(self, timeout: float = START_TIMEOUT_S, restarts: int = 2) -> bool:
        """Return True once ``/health`` answers 200, False when the launcher exits first or time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # A port taken before the server could bind it: start again on another, up to `restarts` times.
                if restarts > 0 and self._port_was_taken():
                    restarts -= 1
                    taken = self.port
                    self.stop()
                    self.port = 0
                    self.start()
                    why = f"   port {taken} was taken before the server could bind it: started pid {self.proc.pid}"
                    _say(f"{why} on 127.0.0.1:{self.port} instead (log: {self.log_path})")
                    continue
                return False
            with contextlib.suppress(OSError):
                if self._http("GET", "/health", timeout=5)[0] == 200:
                    return True
            time.sleep(1.0)
        return False

    def _port_was_taken(self) -> bool:
        with contextlib.suppress(OSError):
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return any("address already in use" in line and str(self.port) in line for line in f)
        return False

    def _http(self, method: str, path: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def generate(self, text: str, max_new_tokens: int = 16) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0}
        status, body = self._http("POST", "/generate", {"text": text, "sampling_params": params})
        if status != 200:
            raise RuntimeError(f"/generate answered HTTP {status}: {body[:500]}")
        return json.loads(body)

    def stop(self, grace_s: float = 20.0) -> int:
        """Stop the started launcher and every process it started (its process group); return its exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left (SGLang's children)
        code = self.proc.wait()
        deadline = time.monotonic() + grace_s
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # SIGKILL is delivered, the processes are not all gone yet
        return code

    def reports(self) -> list[dict]:
        from ..report import read_all

        return [payload for _, payload in read_all(self.report_dir)]

    def log_tail(self, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        return ""


def summarize(reports: list[dict]) -> list[str]:
    """Return one line per verified layer configuration and per refusal, from SGLang's processes' report files."""
    from ..devices import rank_text

    rows = []
    for report in reports:
        ranks = {p.get("pid"): rank_text(p.get("rank") or {}) for p in report.get("processes", [])}
        pid = f"   pid {report.get('pid')}{' (' + ranks[report.get('pid')] + ')' if ranks.get(report.get('pid')) else ''}:"
        for d in report.get("decisions", []):
            for layer in d.get("layers", []):
                state = "verified" if layer.get("passed") else "FAILED"
                batches = f"{d.get('backend')} ({len(layer.get('shapes', []))} batch sizes)"
                rows.append(f"{pid} {d.get('family')} {layer.get('config')}: {state} with {batches}")
            rows += [f"{pid} re-check after warm-up: {check}" for check in d.get("rechecks", []) or []]
        for refusal in report.get("refusals", []):
            reason = refusal.get("message") if isinstance(refusal, dict) else str(refusal)
            rows.append(f"{pid} REFUSED: {str(reason).splitlines()[0]}")
        stopped = [p for p in report.get("processes", []) if p.get("verifying") and not report.get("refusals")]
        rows += [f"{pid} stopped by the engine while verifying {', '.join(p['verifying'])}" for p in stopped]
    return rows


def _write_plugin(root: str) -> str:
    """Write a distribution whose sm120_fp4.backends entry point is :func:`wrong_at_qkv`; return its path."""
    path = os.path.join(root, "plugin")
    info = os.path.join(path, "sm120_fp4_demo_broken-0.0.dist-info")
    os.makedirs(info, mode=0o700)
    files = {
        "METADATA": "Metadata-Version: 2.1\nName: sm120-fp4-demo-broken\nVersion: 0.0\n",
        "entry_points.txt": f"[sm120_fp4.backends]\ndemo-wrong-at-qkv = {__name__}:wrong_at_qkv\n",
    }
    for name, text in files.items():
        with open(os.open(os.path.join(info, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
    return path


def _ask_once(server: Server) -> tuple[bool, str | None]:
    """Wait for `server` and ask it once; return (whether it started, what failed or None)."""
    started = time.monotonic()
    if not server.wait_ready():
        return False, None
    took = time.monotonic() - started
    try:
        answer = server.generate(PROMPT)
    except (OSError, RuntimeError, ValueError) as exc:
        return True, f"the server is up but /generate failed: {exc}"
    _say(
        f"   up after {took:.0f} s; POST /generate {PROMPT!r} -> {answer.get('text')!r} "
        f"({answer.get('meta_info', {}).get('completion_tokens')} tokens; random weights: no sense expected)"
    )
    return True, None


def serve_once(model_path: str, workdir: str, extra_args: list, env=None, expect_refusal=False) -> int:
    """Start one server, ask it once (or see it refuse), stop it; return this step's exit code."""
    server = Server(model_path, workdir, extra_args, env or {})
    server.start()
    _say(f"   started pid {server.proc.pid} on 127.0.0.1:{server.port}; waiting for it (log: {server.log_path})")
    try:
        ready, failed = _ask_once(server)
    finally:
        code = server.stop()
        still = _listening(server.port)
        left = group_members(server.proc.pid)
    if left:
        _say(f"   ERROR: processes {left} of the server's process group are still running")
        return 1
    summary = summarize(server.reports())
    _say("   what every SGLang process verified (SM120_FP4_REPORT files):", *(summary or ["   (no report written)"]))
    if still:
        _say(f"   ERROR: something still listens on 127.0.0.1:{server.port} after the server was stopped")
        return 1
    if failed is not None:
        _say(f"   ERROR: {failed}\n   server log: {server.log_path}")
        return 1
    if ready:
        return int(expect_refusal)
    _say(f"   the server did not start: launcher exit {code}, nothing listening on 127.0.0.1:{server.port}")
    refused = any("REFUSED" in line for line in summary)
    if not expect_refusal or not refused:
        tail = "".join(f"   | {line}\n" for line in server.log_tail().splitlines())
        _say(f"   server log: {server.log_path}\n{tail}")
    return 0 if expect_refusal and refused and code != 0 else 1


def main(model_path: str | None = None, extra_args: list[str] | None = None) -> int:
    """Run the server demo; with `model_path`, serve that checkpoint once instead (exit 0 on an answer)."""
    extra = list(extra_args or [])
    extra = extra[1:] if extra[:1] == ["--"] else extra
    _say("sm120_fp4 demo --server: a real SGLang server on this CPU, SIMULATED SM120 (SGLang's CPU engine)", "=" * 78)
    workdir = tempfile.mkdtemp(prefix="sm120_fp4_server_")
    if model_path is not None:
        _say(f"Serving {model_path} with SGLang's default flags{' + ' + ' '.join(extra) if extra else ''}:")
        code = serve_once(os.path.abspath(model_path), workdir, extra)
        _say(f"\nExit {code}. Logs and reports kept in {workdir}")
        return code
    from .checkpoint import write_checkpoint

    ckpt = write_checkpoint(os.path.join(workdir, "tiny-nvfp4-moe"), seed=3)
    _say(
        f"1. A tiny NVFP4 checkpoint (ModelOpt format: Qwen3-MoE, 2 layers, 8 experts, top-2) in {ckpt};",
        "   sm120-fp4 launch -- python -m sglang.launch_server --model-path ... (MoE runner left at 'auto'):",
    )
    first = serve_once(ckpt, workdir, extra)
    if first != 0:
        _say(f"\nThe healthy server did not answer. Logs and reports kept in {workdir}")
        return 1
    from ..devices import ranks_in
    from ..sglang.simulation import PARALLEL_FLAGS

    tp = ranks_in(extra, {"tp": PARALLEL_FLAGS["tp"]})  # the TP size SGLang's arguments ask for (1 unless given)
    at = f"N={QKV_N // tp}, K={QKV_K}" + (f", each of {tp} TP ranks' shard" if tp > 1 else "")
    _say(
        f"\n2. The same server with a kernel wrong only at this checkpoint's fused qkv shape ({at}),",
        "   registered by an entry-point plugin and named in SM120_FP4_BACKENDS:",
    )
    plugin = _write_plugin(workdir)
    env = {
        "SM120_FP4_BACKENDS": "demo-wrong-at-qkv",
        "PYTHONPATH": os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH", "")) if p),
    }
    second = serve_once(ckpt, workdir, extra, env, expect_refusal=True)
    if second != 0:
        _say(f"\nERROR: the broken kernel was not refused. Logs and reports kept in {workdir}")
        return 1
    _say(
        "\nDone: the healthy server answered; the broken kernel never reached a request (the port never opened).",
        f"Logs and reports: {workdir}",
    )
    return 0
