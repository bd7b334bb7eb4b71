"""The operator commands, run as an operator runs them (subprocesses), with their exit codes."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from sm120_fp4 import cli, doctor

SIM_OK = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated"}


def run(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SM120_FP4")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "sm120_fp4", *args], capture_output=True, text=True, env=full_env, timeout=timeout)


# ---- selftest -----------------------------------------------------------------------------

def cli_in_process(monkeypatch, capsys, *args, env=None):
    """Run the CLI in this process (the self-test workers are still subprocesses)."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_selftest_passes_with_exit_0_a_table_and_progress(monkeypatch, capsys):
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env=SIM_OK)
    assert code == 0, err
    assert "| cpu 'simulated (no GPU)' (sm_120, simulated) | emulated | True |" in out
    assert "self-testing" in err and "JIT-compiles" in err  # progress for long steps


def test_selftest_refusal_is_exit_1_with_the_refusal_message(monkeypatch, capsys):
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", "--backend", "cutlass", env={"SM120_FP4_SIMULATE": "12.0"})
    assert code == 1
    assert "REFUSED" in out and "refusing to serve NVFP4" in err
    assert "cutlass: not supported: FlashInfer kernels need a real GPU" in err


@pytest.mark.parametrize(
    "args, env, message",
    [
        (("selftest",), {"SM120_FP4_SELFTEST": "bogus"}, "SM120_FP4_SELFTEST='bogus' is not accepted"),
        (("selftest", "--device", "7"), SIM_OK, "--device [7] not visible"),
        (("selftest", "--backend", "nope"), {"SM120_FP4_SIMULATE": "12.0"}, "unknown backend(s) ['nope']"),
        (("selftest", "--device", "x"), SIM_OK, "invalid int value"),
    ],
)
def test_selftest_bad_usage_or_environment_is_exit_2(monkeypatch, capsys, args, env, message):
    code, out, err = cli_in_process(monkeypatch, capsys, *args, env=env)
    assert code == 2 and message in err


def test_selftest_json_holds_the_decision(monkeypatch, capsys):
    code, out, _ = cli_in_process(monkeypatch, capsys, "selftest", "--json", env=SIM_OK)
    data = json.loads(out)
    assert code == 0 and data["-1"]["ok"] and data["-1"]["decision"]["backend"] == "emulated"


def test_the_console_script_runs_the_same_program():
    proc = run("selftest", "--device", "7", env=SIM_OK)  # python -m sm120_fp4, as an operator runs it
    assert proc.returncode == 2 and "not visible" in proc.stderr


# ---- launch -------------------------------------------------------------------------------

def test_launch_execs_the_command_with_the_toggle_after_a_passing_preflight():
    proc = run("launch", "--", sys.executable, "-c", "import os; print('child toggle', os.environ['SM120_FP4'])", env=SIM_OK)
    assert proc.returncode == 0, proc.stderr
    assert "child toggle 1" in proc.stdout and "preflight passed" in proc.stderr


def test_launch_refuses_to_start_the_server_when_preflight_fails(tmp_path):
    marker = tmp_path / "started"
    proc = run("launch", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", env={"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "cutlass"})
    assert proc.returncode == 1 and "not starting the server" in proc.stderr
    assert not marker.exists()


def test_launch_without_a_command_is_usage_error():
    assert cli.main(["launch"]) == 2


# ---- doctor -------------------------------------------------------------------------------

def test_doctor_markdown_and_json_describe_this_machine(monkeypatch, capsys):
    code, md, err = cli_in_process(monkeypatch, capsys, "doctor", env=SIM_OK)
    assert code == 0, err
    for heading in ("## sm120-fp4 doctor", "### GPUs", "### Settings", "### SGLang patch targets", "### Backends", "### Activation"):
        assert heading in md
    assert "| simulate | 12.0 | env SM120_FP4_SIMULATE |" in md
    data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--json")[1])
    assert data["versions"]["sglang"] and data["sglang"]["supported"] is True
    assert {t["name"] for t in data["sglang"]["targets"] if t["applies"]} >= {"flashinfer-fp4-gemm-alias", "modelopt-fp4-weights-hook"}
    assert any(b["backend"] == "emulated" and b["supported"] for b in data["backends"])
    assert data["activation"]["plugin_entry_point"], "the sglang.srt.plugins entry point is installed"


def test_doctor_strict_fails_on_a_bad_setting_but_never_crashes(monkeypatch, capsys):
    code, out, _ = cli_in_process(monkeypatch, capsys, "doctor", "--strict", env={"SM120_FP4_ENABLE": "maybe"})
    assert code == 1 and "SM120_FP4_ENABLE='maybe'" in out
    assert cli_in_process(monkeypatch, capsys, "doctor")[0] == 0


def test_doctor_works_without_sglang(monkeypatch, capsys):
    real_version = importlib.metadata.version

    def version(dist):
        if dist == "sglang":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    assert doctor.run(as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["sglang"] is None and data["sglang"]["supported"] is False
    assert "sglang is not installed" in data["sglang"]["reason"]


def test_doctor_survives_a_broken_probe(monkeypatch, capsys):
    from sm120_fp4 import devices

    def broken(*args, **kwargs):
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(devices, "list_devices", broken)
    assert doctor.run() == 0
    assert "NVML exploded" in capsys.readouterr().out


# ---- demo ---------------------------------------------------------------------------------

def test_demo_runs_to_the_end_and_shows_the_refusal(capsys):
    # In process (the README runs it as `python -m sm120_fp4 demo`; the console path is tested above).
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact: True" in out and "decision: emulated" in out
    assert "flashinfer-fp4-gemm-alias" in out and "applied" in out
    assert "zero-band: self-test failed: M=129 N=160 K=480: 64 row(s) all zero" in out
    from test_docs import readme_refusal

    shown = [line.removeprefix("   | ") for line in out.splitlines() if line.startswith("   | ")]
    assert readme_refusal() == shown, "README's troubleshooting shows the refusal exactly as it prints"
