"""``sm120-fp4 launch -- vllm serve ...``: vLLM's commands recognised, the preflight run as for SGLang, the command
run as launch's child with SM120_FP4=1; the serving canary (no idle point wired in vLLM) refused before the preflight."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from helpers import faults  # noqa: E402
from helpers.cases import case  # noqa: E402
from helpers.workers import workers_in_process  # noqa: E402

from sm120_fp4 import backends, cli  # noqa: E402
from sm120_fp4.vllm import ENGINE  # noqa: E402

launches = ENGINE.launches

SIM = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated", "SM120_FP4_MOE_BACKENDS": "emulated"}
API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--port", "8000"]


def _launch(monkeypatch, capsys, command: list[str], **env) -> tuple[int, str, list]:
    """`sm120-fp4 launch -- COMMAND` in this process, its workers too; the start recorded, not made."""
    execs: list = []
    monkeypatch.setenv("SM120_FP4", "0")
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
    for name, value in {**SIM, **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli.launch, "_spawn", lambda argv, environ: execs.append((argv, environ["SM120_FP4"])))
    with workers_in_process():
        code = cli.main(["launch", "--", *command])
    return code, capsys.readouterr().err, execs


def test_vllms_commands_are_recognised():
    assert launches(["vllm", "serve", "/m"]) and launches(["/venv/bin/vllm", "serve", "/m"])
    assert launches(API_SERVER) and launches(["python3", "-m", "vllm", "serve"])
    assert not launches(["python", "-m", "sglang.launch_server"]) and not launches(["python", "vllm.py"])


@pytest.mark.parametrize("command", [["vllm", "serve", "/m", "--port", "8000"], API_SERVER], ids=["cli", "module"])
def test_launch_runs_the_preflight_then_execs_vllm_with_the_toggle_on(monkeypatch, capsys, command):
    code, err, execs = _launch(monkeypatch, capsys, command)
    assert code == 0 and "preflight passed" in err, err
    assert execs == [(command, "1")]


@case(
    "backend faults",
    "`sm120-fp4 launch -- vllm serve ...` with a zero-returning dense kernel (simulated 12.0)",
    "exit 1: the preflight refuses, vLLM is not started",
)
def test_launch_does_not_start_vllm_when_the_preflight_refuses(monkeypatch, capsys):
    backends.register("zeros", faults.returns_zeros)
    code, err, execs = _launch(monkeypatch, capsys, ["vllm", "serve", "/m"], SM120_FP4_BACKENDS="zeros")
    assert code == 1 and not execs and "not starting the server" in err, err


@case(
    "configuration",
    "`sm120-fp4 launch -- vllm serve ...` with SM120_FP4_CANARY=60 (vLLM has no idle point the library uses)",
    "exit 2 before the preflight, naming SM120_FP4_CANARY=off; vLLM is not started",
)
def test_launch_refuses_the_canary_for_vllm_before_the_preflight(monkeypatch, capsys):
    code, err, execs = _launch(monkeypatch, capsys, ["vllm", "serve", "/m"], SM120_FP4_CANARY="60")
    assert code == 2 and not execs, err
    assert "SM120_FP4_CANARY=off" in err and "self-testing" not in err, err


PLUGINS = [("other_plugin", False), ("", False), ("other_plugin, sm120_fp4", False), ("other_plugin,sm120_fp4", True)]


@case(
    "configuration",
    "`sm120-fp4 launch -- vllm serve ...` with VLLM_PLUGINS={value!r} (the allow-list of vLLM's plugins)",
    "where it does not name sm120_fp4 exactly (vLLM would load nothing of the library): exit 2 before the "
    "preflight, one line naming VLLM_PLUGINS and the value to set; where it does: the preflight runs, vLLM starts",
)
@pytest.mark.parametrize("value, loads", PLUGINS, ids=[repr(v) for v, _ in PLUGINS])
def test_launch_refuses_vllm_plugins_without_the_library(monkeypatch, capsys, value, loads):
    code, err, execs = _launch(monkeypatch, capsys, ["vllm", "serve", "/m"], VLLM_PLUGINS=value)
    if loads:
        assert code == 0 and execs and "preflight passed" in err, err
        return
    assert code == 2 and not execs and "self-testing" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("sm120-fp4 launch: VLLM_PLUGINS=") and "not starting the server" in line, err
    fix = "VLLM_PLUGINS=other_plugin,sm120_fp4" if "other" in value else "VLLM_PLUGINS=sm120_fp4"
    assert fix in line and "unset VLLM_PLUGINS" in line, line
