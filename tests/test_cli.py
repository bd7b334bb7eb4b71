"""The operator commands, run as an operator runs them (subprocesses), with their exit codes."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest
import torch
from helpers import faults
from helpers.cases import case
from helpers.children import all_zeros as zeros
from helpers.common import SIM_ENV as SIM_OK
from helpers.plugins import plugin_site
from helpers.procs import REPO, Popen, background, clean_env
from helpers.workers import workers_in_process
from packaging.utils import canonicalize_name

from sm120_fp4 import backends, cli, doctor
from sm120_fp4.demo.checkpoint import write_checkpoint


def cli_job(*args: str, env: dict[str, str]):
    """`python -m sm120_fp4 ARGS` as an operator runs it, started in the background."""
    return lambda folder: Popen([sys.executable, "-m", "sm120_fp4", *args], clean_env(**env), folder)


# ---- selftest -----------------------------------------------------------------------------


def cli_in_process(monkeypatch, capsys, *args, env=None):
    """Run the CLI in this process, its self-test workers too (helpers.workers: the real worker, its
    lines read as the preflight reads a worker process's); the background jobs run it as processes."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    with workers_in_process():
        code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_selftest_passes_with_exit_0_a_table_and_progress(monkeypatch, capsys):
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env=SIM_OK)
    assert code == 0, err
    assert "| cpu 'simulated (CPU)' (sm_120, simulated) | emulated | True |" in out
    assert "self-testing" in err and "self-test of emulated" in err  # progress for long steps
    assert "JIT-compiles" not in err, "no FlashInfer backend is tested in simulation: no nvcc warning"


def test_selftest_refusal_is_exit_1_with_the_refusal_message(monkeypatch, capsys):
    code, out, err = cli_in_process(
        monkeypatch, capsys, "selftest", "--backend", "cutlass", env={"SM120_FP4_SIMULATE": "12.0"}
    )
    assert code == 1
    assert "| dense | -1 | - | REFUSED |" in out and "refusing to serve NVFP4" in err
    assert "cutlass: not supported: FlashInfer kernels need a real GPU" in err


@case(
    "backend faults",
    "sm120-fp4 selftest with a kernel whose workspace is kept between calls of one shape (right on a shape's first call, the previous result from the second call in a row on)",
    "exit 1, the refusal names the second call of the same shape",
)
def test_selftest_refuses_a_kernel_wrong_from_the_second_call_of_one_shape(monkeypatch, capsys):
    backends.register("stale", faults.make_stale_workspace())
    code, out, err = cli_in_process(
        monkeypatch, capsys, "selftest", env={"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "stale"}
    )
    assert code == 1, err
    assert "REFUSED" in out and "the same shape called again right after its first call" in err


@pytest.mark.parametrize(
    "args, env, message",
    [
        (("selftest",), {"SM120_FP4_SELFTEST": "bogus"}, "SM120_FP4_SELFTEST='bogus' is not accepted"),
        (("selftest", "--device", "7"), SIM_OK, "--device [7] not visible"),
        (
            ("selftest", "--backend", "nope"),
            {"SM120_FP4_SIMULATE": "12.0"},
            "--backend names unknown backend(s) ['nope']",
        ),
        (("selftest", "--device", "x"), SIM_OK, "invalid int value"),
    ],
)
def test_selftest_bad_usage_or_environment_is_exit_2(monkeypatch, capsys, args, env, message):
    code, out, err = cli_in_process(monkeypatch, capsys, *args, env=env)
    assert code == 2 and message in err


@case(
    "configuration",
    "FLASHINFER_NVFP4_4OVER6=1 set for `selftest` and `doctor`",
    "selftest exits 2 naming the variable and its value before any candidate runs; doctor lists it under problems "
    "(text and --json)",
)
def test_flashinfer_fp4_knobs_are_named_by_selftest_and_doctor(monkeypatch, capsys):
    env = {**SIM_OK, "FLASHINFER_NVFP4_4OVER6": "1"}
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env=env)
    assert code == 2 and "FLASHINFER_NVFP4_4OVER6='1'" in err and "unset FLASHINFER_NVFP4_4OVER6" in err, err
    assert "self-test of emulated" not in err, "refused before any candidate ran (it would have been blamed)"
    code, md, _ = cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--strict")
    assert code == 1 and "- variables: {'FLASHINFER_NVFP4_4OVER6': '1'}" in md
    problems = md.split("### Problems")[1]
    assert "FLASHINFER_NVFP4_4OVER6='1'" in problems and "quantization recipe" in problems
    data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--json")[1])
    assert data["flashinfer_env"]["variables"] == {"FLASHINFER_NVFP4_4OVER6": "1"}
    assert any("FLASHINFER_NVFP4_4OVER6='1'" in p for p in data["problems"])


def test_selftest_json_holds_the_decision(monkeypatch, capsys):
    code, out, _ = cli_in_process(monkeypatch, capsys, "selftest", "--json", env=SIM_OK)
    data = json.loads(out)
    assert code == 0 and data["-1"]["ok"] and data["-1"]["decision"]["backend"] == "emulated"


@background(cli_job("selftest", "--device", "7", env=SIM_OK))
def test_the_console_script_runs_the_same_program(background):
    rc, _, stderr = background
    assert rc == 2 and "not visible" in stderr


CLI_GARBAGE = [
    ("SM120_FP4", "true"),
    ("SM120_FP4_ENABLE", "yes"),
    ("SM120_FP4_SELFTEST", "Strict"),
    ("SM120_FP4_FALLBACK", "emulate"),
    ("SM120_FP4_SELECT", "FIRST"),
    ("SM120_FP4_BACKENDS", "cutlass;b12x"),
    ("SM120_FP4_SIMULATE", "12.0.1"),
    ("SM120_FP4_REPORT", "/nonexistent-sm120/{pid}.json"),
    ("SM120_FP4_SELFTESTS", "off"),
    ("SM120_FP4_REPORT", "/tmp/" + "y" * 300 + "/{pid}.json"),
    ("SM120_FP4_SIMULATE", "\uff11\uff12.\uff10"),
    ("SM120_FP4_UNSUPPORTED_RELEASE", "yes"),
    ("SM120_FP4_UNSUPPORTED_RELEASE", "Serve-Unverified"),
]


@case(
    "configuration",
    "`sm120-fp4 selftest` with {variable}={value}",
    "exit code 2 at start, before any self-test; stderr names the variable and the value",
)
@pytest.mark.parametrize("variable, value", CLI_GARBAGE, ids=[f"{v}={x[:30]}" for v, x in CLI_GARBAGE])
def test_garbage_settings_stop_the_cli_at_start_with_exit_2(monkeypatch, capsys, variable, value):
    # In process: the same cli.main the console script runs (test_the_console_script_runs_the_same_program).
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env={**SIM_OK, variable: value})
    assert code == 2, err
    assert f"{variable}={value!r}"[:150] in err, err
    assert "self-testing" not in err and out == ""


# ---- launch -------------------------------------------------------------------------------

SIM_BOTH = {**SIM_OK, "SM120_FP4_MOE_BACKENDS": "emulated"}


@background(
    cli_job(
        "launch", "--", sys.executable, "-c", "import os; print('child toggle', os.environ['SM120_FP4'])", env=SIM_BOTH
    )
)
def test_launch_execs_the_command_with_the_toggle_after_a_passing_preflight(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    assert "child toggle 1" in stdout and "preflight passed" in stderr
    assert "| dense |" in stdout and "| moe |" in stdout, "launch runs the dense and the MoE preflight"


def test_launch_refuses_to_start_the_server_when_preflight_fails(monkeypatch, capsys, tmp_path):
    marker = tmp_path / "started"
    monkeypatch.setenv("SM120_FP4", "0")  # launch sets it to 1; monkeypatch restores it afterwards
    monkeypatch.setattr(cli.launch, "_spawn", lambda *args: pytest.fail(f"exec {args}"))
    code, _, err = cli_in_process(
        monkeypatch,
        capsys,
        "launch",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        env={"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "cutlass"},
    )
    assert code == 1 and "not starting the server" in err
    assert not marker.exists()


def test_launch_without_a_command_is_usage_error():
    assert cli.main(["launch"]) == 2


# ---- doctor -------------------------------------------------------------------------------


def test_doctor_markdown_and_json_describe_this_machine(monkeypatch, capsys):
    code, md, err = cli_in_process(monkeypatch, capsys, "doctor", env=SIM_OK)
    assert code == 0, err
    for heading in (
        "## sm120-fp4 doctor",
        "### GPUs",
        "### Settings",
        "### SGLang patch targets",
        "### Backends",
        "### Activation",
    ):
        assert heading in md
    assert "| simulate | 12.0 | env SM120_FP4_SIMULATE |" in md
    data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--json")[1])
    assert data["versions"]["sglang"] and data["sglang"]["supported"] is True
    assert {t["name"] for t in data["sglang"]["targets"] if t["applies"]} >= {
        "flashinfer-fp4-gemm-alias",
        "modelopt-fp4-weights-hook",
    }
    assert any(b["backend"] == "emulated" and b["supported"] for b in data["backends"])
    assert data["activation"]["plugin_entry_point"], "the sglang.srt.plugins entry point is installed"


def test_doctor_says_jit_builds_will_fail_with_glibc_2_41_and_cuda_13_0_headers(monkeypatch, capsys):
    from sm120_fp4.backends import flashinfer

    clash = flashinfer.Toolchain((13, 0), "nvcc /opt/cuda/bin/nvcc", (2, 41), None)
    monkeypatch.setattr(flashinfer, "toolchain", lambda: clash)
    code, md, _ = cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--strict", env=SIM_OK)
    data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--json")[1])
    assert code == 1 and "- cuda: 13.0\n- cuda_source: nvcc /opt/cuda/bin/nvcc\n- glibc: 2.41" in md
    jit = [p for p in data["problems"] if p.startswith("JIT builds will fail")]
    assert jit and "glibc 2.41 with CUDA 13.0 headers" in jit[0] and "rsqrt/cospi" in jit[0], data["problems"]
    assert jit[0] in md.split("### Problems")[1]
    fixed = flashinfer.Toolchain((13, 1), "nvcc /opt/cuda/bin/nvcc", (2, 41), None)
    older_libc = flashinfer.Toolchain((12, 9), "torch.version.cuda", (2, 40), None)
    for tc in (fixed, older_libc):
        monkeypatch.setattr(flashinfer, "toolchain", lambda: tc)
        data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--json")[1])
        assert not any(p.startswith("JIT builds") for p in data["problems"]), (tc, data["problems"])


@pytest.mark.parametrize(
    "tc, reason",
    [
        (((12, 8), None), "b12x needs CUDA >= 12.9; found 12.8 (nvcc /usr/local/cuda/bin/nvcc)"),
        (
            ((13, 0), "nvidia-cutlass-dsl is not installed (`cutlass.cute` not found)"),
            "b12x needs the CuTe DSL: nvidia-cutlass-dsl is not installed",
        ),
    ],
    ids=["cuda-12.8", "no-cute-dsl"],
)
def test_doctor_names_why_b12x_cannot_run_on_a_real_sm120(monkeypatch, capsys, tc, reason):
    from helpers.common import fake_devices

    from sm120_fp4.backends import flashinfer

    cuda, cute = tc
    probe = flashinfer.Toolchain(cuda, "nvcc /usr/local/cuda/bin/nvcc", (2, 36), cute)
    monkeypatch.setattr(flashinfer, "toolchain", lambda: probe)
    with fake_devices(("NVIDIA RTX PRO 6000 Blackwell", (12, 0))):
        data = json.loads(cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--json")[1])
    rows = {(b["family"], b["backend"]): b for b in data["backends"]}
    assert rows[("dense", "b12x")]["supported"] is False and reason in rows[("dense", "b12x")]["reason"], rows[
        ("dense", "b12x")
    ]
    assert "b12x" not in (rows[("dense", "cutlass")]["reason"] or ""), "cutlass says its own reason"


def test_doctor_strict_fails_on_a_bad_setting_but_never_crashes(monkeypatch, capsys):
    code, out, _ = cli_in_process(monkeypatch, capsys, "doctor", "--strict", env={"SM120_FP4_ENABLE": "maybe"})
    assert code == 1 and "SM120_FP4_ENABLE='maybe'" in out
    assert cli_in_process(monkeypatch, capsys, "doctor")[0] == 0


@case(
    "configuration",
    "`SM120_FP4=1 sm120-fp4 doctor --strict` in the server's environment (the start-up hook has installed the library)",
    "exit 0, no problem: the library's own patches show as applied, never as 'does not apply'",
)
@background(cli_job("doctor", "--strict", env={**SIM_OK, "SM120_FP4": "1"}))
def test_doctor_in_the_servers_environment_is_healthy(background):
    rc, stdout, stderr = background
    assert rc == 0 and "does not apply" not in stdout, stdout.split("### Problems")[-1] + stderr
    assert "| flashinfer-fp4-gemm-alias | applied | patched by this process's install of sm120_fp4" in stdout
    assert stdout.split("### Problems")[1].strip() == "- none found"


FI = importlib.metadata.version("flashinfer-python")
KERNEL_PACKAGES = [
    ({"flashinfer-jit-cache": f"{FI}+cu130", "flashinfer_jit_cache_sm120f": f"{FI}+cu130"}, None),
    ({"flashinfer-cubin": FI, "nvidia-cutlass-dsl": "4.8.1"}, None),
    (
        {"flashinfer-jit-cache": "0.0.1+cu130"},
        f"flashinfer-jit-cache 0.0.1+cu130 does not match flashinfer-python {FI}",
    ),
    (
        {"flashinfer-jit-cache": f"{FI}+cu130", "flashinfer_jit_cache_sm120f": f"{FI}+cu129"},
        f"flashinfer-jit-cache-sm120f {FI}+cu129 does not match flashinfer-jit-cache {FI}+cu130",
    ),
    ({"flashinfer_jit_cache_sm120f": f"{FI}+cu130"}, "flashinfer-jit-cache-sm120f"),
    ({"flashinfer-cubin": "0.0.1"}, f"flashinfer-cubin 0.0.1 does not match flashinfer-python {FI}"),
]


@case(
    "configuration",
    "`sm120-fp4 doctor --json --strict` with the kernel packages {installed} installed beside flashinfer-python",
    "each shows under versions; one whose version FlashInfer would not use with flashinfer-python is a problem "
    "(exit 1) naming both versions",
)
@pytest.mark.parametrize("installed, problem", KERNEL_PACKAGES, ids=[",".join(i) for i, _ in KERNEL_PACKAGES])
def test_doctor_shows_the_kernel_packages_and_a_mismatch_is_a_problem(
    monkeypatch, capsys, tmp_path, installed, problem
):
    from helpers.plugins import installed_package

    from sm120_fp4 import versions

    for name, version in installed.items():
        monkeypatch.syspath_prepend(str(installed_package(tmp_path / name, name, version)))
    versions.clear_cache()
    try:
        code, out, _ = cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--json", "--strict", env=SIM_OK)
    finally:
        versions.clear_cache()
    report = json.loads(out)
    shown = {canonicalize_name(name): version for name, version in installed.items()}
    assert shown.items() <= report["versions"].items(), report["versions"]
    kernel = [p for p in report["problems"] if "flashinfer-" in p and "does not match" in p or "is unused" in p]
    if problem is None:
        assert code == 0 and not kernel, report["problems"]
    else:
        assert code == 1 and len(kernel) == 1 and problem in kernel[0], report["problems"]


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


@case(
    "devices",
    "`sm120-fp4 doctor --json` where {what}",
    "every error a section shows is also under problems, and --strict exits 1",
)
@pytest.mark.parametrize(
    "what",
    [
        "the GPUs' numbering cannot be determined (a mixed box, CUDA_DEVICE_ORDER unset)",
        "a probe raises (NVML fails while listing the devices)",
    ],
)
def test_every_error_doctor_shows_is_a_problem(monkeypatch, capsys, what):
    from helpers.nvml import A6000, PRO6000, fake_pynvml

    from sm120_fp4 import devices

    devices.clear_cache()
    if "mixed" in what:
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([PRO6000, A6000]))
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setattr(
            devices, "list_devices", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("NVML exploded"))
        )
    monkeypatch.delenv("SM120_FP4_SIMULATE", raising=False)
    assert cli.main(["doctor", "--json", "--quick", "--strict"]) == 1
    data = json.loads(capsys.readouterr().out)
    shown = data["devices"]["error"]
    assert any(shown in p and p.startswith("devices") for p in data["problems"]), (shown, data["problems"])
    devices.clear_cache()


# ---- demo ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_runs_to_the_end_and_shows_the_refusal(capsys):
    # In process (the README runs it as `python -m sm120_fp4 demo`; the console path is tested above).
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "bit-exact: True" in out and "decision: emulated" in out
    assert "flashinfer-fp4-gemm-alias" in out and "applied" in out
    assert "zero-band: self-test failed: M=129 N=160 K=480: call 1: 64 row(s) all zero" in out
    from test_docs import readme_refusal

    shown = [line.removeprefix("   | ") for line in out.splitlines() if line.startswith("   | ")]
    blocks, current = [], []
    for line in shown:  # the demo prints the MoE refusal and the dense one, each from its first line
        if line.startswith("sm120_fp4: refusing") and current:
            blocks.append(current)
            current = []
        current.append(line)
    blocks.append(current)
    assert len(blocks) == 2 and "fused-MoE" in blocks[0][0] and "FP4 GEMM" in blocks[1][0]
    assert readme_refusal() == blocks[1], "README's troubleshooting shows the dense refusal exactly as it prints"


# ---- reliability: the preflight is for verification -------------------------------------------


def plugin_env(folder, **env):
    """clean_env with the throw-away entry-point distribution (helpers.plugins) on PYTHONPATH."""
    return clean_env(
        PYTHONPATH=f"{plugin_site(folder / 'plugins')}:{REPO}", SM120_FP4_VERDICTS=str(folder / "verdicts.json"), **env
    )


def cli_plugin_job(*args, **env):
    return lambda folder, **params: Popen(
        [sys.executable, "-m", "sm120_fp4", *args], plugin_env(folder, **env, **params), folder
    )


UNVERIFIED = {"warn": {"SM120_FP4_SELFTEST": "warn"}, "off": {"SM120_FP4_SELFTEST": "off"}}


@case(
    "backend faults",
    "`sm120-fp4 selftest` with SM120_FP4_SELFTEST={mode} and a kernel that returns zeros (a registered backend)",
    f"exit {cli.EXIT_UNVERIFIED} (unverified), never 0; the row says UNVERIFIED",
)
@pytest.mark.parametrize("mode", list(UNVERIFIED))
def test_an_unverified_preflight_has_its_own_exit_code(monkeypatch, capsys, mode):
    backends.register("zeros", zeros)
    code, out, err = cli_in_process(
        monkeypatch,
        capsys,
        "selftest",
        env={"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "zeros", **UNVERIFIED[mode]},
    )
    assert code == cli.EXIT_UNVERIFIED, err
    assert "| zeros | UNVERIFIED |" in out


def launch_in_process(monkeypatch, capsys, *args, env):
    """`sm120-fp4 launch ARGS` in this process, its workers too; the command's start recorded, not made:
    (exit code, stderr, the started argv and its SM120_FP4, or None)."""
    execs = []
    monkeypatch.setenv("SM120_FP4", "0")  # launch sets it to 1; monkeypatch restores it afterwards
    monkeypatch.setattr(cli.launch, "_spawn", lambda argv, environ: execs.append((argv, environ.get("SM120_FP4"))))
    code, _, err = cli_in_process(monkeypatch, capsys, "launch", *args, env=env)
    return code, err, (execs[0] if execs else None)


@case(
    "backend faults", "`sm120-fp4 launch {flag}` with SM120_FP4_SELFTEST=warn and a zero-returning kernel", "{outcome}"
)
@pytest.mark.parametrize(
    "flag, outcome",
    [
        ("", "exit 3; the command is not started"),
        ("--allow-unverified", "the command starts, after a warning that it is unverified"),
    ],
)
def test_launch_does_not_start_an_unverified_server_unless_told(monkeypatch, capsys, flag, outcome):
    backends.register("zeros", zeros)
    command = [sys.executable, "-c", "print('started')"]
    code, err, started = launch_in_process(
        monkeypatch,
        capsys,
        *([flag] if flag else []),
        "--",
        *command,
        env={
            "SM120_FP4_SIMULATE": "12.0",
            "SM120_FP4_BACKENDS": "zeros",
            "SM120_FP4_MOE_BACKENDS": "emulated",
            "SM120_FP4_SELFTEST": "warn",
        },
    )
    if flag:
        assert code == 0 and "--allow-unverified was given" in err and started == (command, "1"), err
    else:
        assert code == cli.EXIT_UNVERIFIED and "not starting the server" in err and "--allow-unverified" in err, err
        assert started is None


# ---- an SGLang release outside the supported range ------------------------------------------

OUTSIDE = ["0.5.24.dev0", "0.6.0", "0.5.2"]  # a pre-release of the next, a later, an earlier release


def sglang_release(monkeypatch, version):
    """Make the library read `version` as the installed SGLang (its own version seam)."""
    from sm120_fp4.sglang import release

    monkeypatch.setattr(release.RELEASE, "version", lambda: version)
    return release


def says_unverified(err: str, version: str) -> None:
    from sm120_fp4.sglang.release import SUPPORTED

    assert f"SGLang {version} is installed, outside the releases" in err and SUPPORTED in err, err
    floor = SUPPORTED.split(",")[0].removeprefix(">=")
    remedy = f"supports no release before {floor}" if version == "0.5.2" else "pip install -U sm120-fp4"
    assert "served UNVERIFIED" in err and remedy in err, err


@case(
    "configuration",
    "`sm120-fp4 selftest` (SELFTEST=strict) with SGLang {version} installed on a 12.x GPU",
    "exit 2 before any self-test: stderr says its NVFP4 layers would be served UNVERIFIED, the version and the supported "
    "range, and how to proceed (upgrade sm120_fp4, or SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified)",
)
@pytest.mark.parametrize("version", OUTSIDE)
def test_selftest_refuses_an_sglang_outside_the_supported_range_under_strict(monkeypatch, capsys, tmp_path, version):
    sglang_release(monkeypatch, version)
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env=SIM_OK)
    assert code == cli.EXIT_USAGE and "refusing to start" in err and "self-testing" not in err and out == "", err
    says_unverified(err, version)
    assert "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified" in err
    checkpoint = write_checkpoint(str(tmp_path / "ckpt"), seed=9)  # a sound one: only the release is refused
    code, _, err = cli_in_process(monkeypatch, capsys, "selftest", "--model", checkpoint, env=SIM_OK)
    assert code == cli.EXIT_USAGE and "refusing to start" in err, err


@pytest.mark.parametrize("version", OUTSIDE)
def test_doctor_says_an_sglang_outside_the_range_would_serve_unverified(monkeypatch, capsys, version):
    sglang_release(monkeypatch, version)
    code, out, err = cli_in_process(monkeypatch, capsys, "doctor", env=SIM_OK)
    problems = out.split("### Problems", 1)[1]
    says_unverified(problems, version)
    assert "left untouched" not in out


@case(
    "configuration",
    "`sm120-fp4 selftest` with SGLang 0.6.0 installed and {setting}",
    "the kernels are self-tested, then exit 3 (unverified): stderr says nothing of what SGLang serves was verified",
)
@pytest.mark.parametrize("setting", ["SM120_FP4_SELFTEST=warn", "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified"])
def test_selftest_with_an_sglang_outside_the_range_never_passes(monkeypatch, capsys, tmp_path, setting):
    sglang_release(monkeypatch, "0.6.0")
    name, value = setting.split("=")
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", env={**SIM_OK, name: value})
    assert code == cli.EXIT_UNVERIFIED and "| emulated | True |" in out, err
    says_unverified(err, "0.6.0")
    assert "not what SGLang will serve" in err
    checkpoint = write_checkpoint(str(tmp_path / "ckpt"), seed=9)
    code, _, err = cli_in_process(monkeypatch, capsys, "selftest", "--model", checkpoint, env={**SIM_OK, name: value})
    assert code == cli.EXIT_UNVERIFIED and "nothing was verified" in err, err


@case(
    "configuration", "`sm120-fp4 launch {flag}` with SGLang {version} installed on a 12.x GPU, {setting}", "{outcome}"
)
@pytest.mark.parametrize(
    "version, setting, flag, outcome",
    [
        (
            "0.5.24.dev0",
            "SM120_FP4_SELFTEST=strict",
            "",
            "exit 2, the command not started; stderr says UNVERIFIED and how to proceed",
        ),
        ("0.6.0", "SM120_FP4_SELFTEST=strict", "--allow-unverified", "exit 2: the flag does not override strict"),
        ("0.6.0", "SM120_FP4_SELFTEST=warn", "", "exit 3, the command not started"),
        (
            "0.6.0",
            "SM120_FP4_SELFTEST=warn",
            "--allow-unverified",
            "the command starts after stderr says it serves unverified",
        ),
        (
            "0.5.2",
            "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified",
            "",
            "the command starts after stderr says it serves unverified",
        ),
    ],
)
def test_launch_with_an_sglang_outside_the_range_refuses_or_says_unverified(
    monkeypatch, capsys, version, setting, flag, outcome
):
    sglang_release(monkeypatch, version)
    name, value = setting.split("=")
    command = [sys.executable, "-c", "print('started')"]
    code, err, started = launch_in_process(
        monkeypatch, capsys, *([flag] if flag else []), "--", *command, env={**SIM_BOTH, name: value}
    )
    says_unverified(err, version)
    assert "self-testing" not in err, "no preflight: nothing of the library runs in that server"
    if outcome.startswith("the command starts"):
        assert code == 0 and started == (command, "1") and "Starting the server anyway" in err, err
    else:
        assert started is None and "not starting the server" in err, err
        assert code == (cli.EXIT_USAGE if "strict" in setting else cli.EXIT_UNVERIFIED), err
        assert "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified" in err


WRAPPED = [
    "env vllm serve /m",
    "/usr/bin/env -i FOO=1 vllm serve /m",
    "bash -c 'VLLM_LOGGING_LEVEL=INFO exec vllm serve /m --port 8000'",
    "uv run --with x vllm serve /m",
    "uv run -m vllm.entrypoints.openai.api_server --model /m",
    "numactl --interleave=all -N 0 vllm serve /m",
    "taskset -c 0-3 vllm serve /m",
    "nice -n 5 vllm serve /m",
    "nohup timeout 3600 stdbuf -oL python -m vllm.entrypoints.openai.api_server",
    "sh -c 'cd /srv && vllm serve /m'",  # shell syntax: which engine cannot be told
    "bash serve.sh",  # a script: which engine cannot be told
    "uv --directory /srv run vllm serve /m",  # an option launch does not know
]


@case(
    "configuration",
    "`sm120-fp4 launch -- {command}` (SELFTEST=strict) with vLLM 0.35.0 installed (outside the range), SGLang inside",
    "exit 2, not started: launch looks through the wrapper to vLLM, or checks every installed engine's release when "
    "it cannot tell which engine the command starts",
)
@pytest.mark.parametrize("command", WRAPPED)
def test_launch_refuses_a_wrapped_command_of_an_engine_outside_the_range(monkeypatch, capsys, tmp_path, command):
    import shlex

    from sm120_fp4.vllm import release

    monkeypatch.setattr(release.RELEASE, "version", lambda: "0.35.0")
    for name in ("vllm", "uv", "numactl", "taskset", "stdbuf", "timeout", "nohup", "nice"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{sys.prefix}/bin:/usr/bin:/bin")
    code, err, started = launch_in_process(monkeypatch, capsys, "--", *shlex.split(command), env=SIM_BOTH)
    assert code == cli.EXIT_USAGE and started is None and "self-testing" not in err, err
    assert "vLLM 0.35.0 is installed, outside the releases" in err and "refusing to start" in err, err
    wrapped = "which engine" in err
    assert wrapped == any(w in command for w in ("&&", "serve.sh", "--directory")), err


def test_launch_of_an_sglang_command_is_not_refused_for_another_engines_release(monkeypatch, capsys):
    from sm120_fp4.vllm import release

    monkeypatch.setattr(release.RELEASE, "version", lambda: "0.35.0")
    command = ["env", "FOO=1", sys.executable, "-m", "sglang.launch_server", "--help"]
    code, err, started = launch_in_process(monkeypatch, capsys, "--", *command, env=SIM_BOTH)
    assert code == 0 and started == (command, "1") and "preflight passed" in err, err


@case("configuration", "`sm120-fp4 selftest {args}`", "exit 2; stderr names --backend and the name; no table row")
@pytest.mark.parametrize("args", ["--backend bogus", "--moe --backend bogus"])
def test_an_unknown_backend_on_the_command_line_names_the_option(monkeypatch, capsys, args):
    code, out, err = cli_in_process(monkeypatch, capsys, "selftest", *args.split(), env=SIM_OK)
    assert code == 2 and "--backend names unknown backend(s) ['bogus']" in err, err
    assert "SM120_FP4_BACKENDS" not in err.split("known:")[0] and "REFUSED" not in out and "| -1 |" not in out


@case(
    "configuration",
    "`sm120-fp4 launch` with {gpus}",
    "one rule: nothing for the library to serve, so the command starts (exit 0) and stderr says nothing was verified",
)
@pytest.mark.parametrize("gpus", ["no GPU visible", "only a non-12.x GPU (simulated 9.0)"])
def test_launch_starts_the_command_when_there_is_nothing_to_verify(monkeypatch, capsys, gpus):
    if gpus.startswith("no") and torch.cuda.is_available():
        pytest.skip("this process sees a GPU (the CPU runs show no GPU visible)")
    command = [sys.executable, "-c", "print('started')"]
    code, err, started = launch_in_process(
        monkeypatch, capsys, "--", *command, env={} if gpus.startswith("no") else {"SM120_FP4_SIMULATE": "9.0"}
    )
    assert code == 0 and started == (command, "1") and "nothing to verify" in err, err


def _crashing_first(name: str):
    """A WorkerRunner whose dense worker dies of SIGSEGV while self-testing `name` (as an illegal
    memory access kills it), then runs for real (helpers.workers) without it."""
    from helpers.workers import in_process

    def runner(argv, label, env, stop=None):
        if "--moe" not in argv and f"{name}=" not in " ".join(argv):  # a dense worker, `name` not yet crashed
            return (
                None,
                {"event": "self-test", "family": "dense", "backend": name, "flashinfer": False, "key": {"gpu": "x"}},
                -11,
                "",
            )
        return in_process(argv, label, env, stop)

    return runner


@case(
    "files and trust",
    "`sm120-fp4 launch` where a candidate crashes the preflight and the verdict store {store}",
    "the server is not started (exit 2): its workers would load the crashed candidate; stderr says once that the crash "
    "is not recorded and why, and how to proceed",
)
@pytest.mark.parametrize("store", ["is a path under a regular file", "is off"])
def test_launch_never_starts_a_server_that_would_load_a_crash_it_could_not_record(monkeypatch, capsys, tmp_path, store):
    (tmp_path / "file").write_text("")
    backends.register("crash", zeros)
    verdicts = str(tmp_path / "file" / "verdicts.json") if "regular" in store else "off"
    monkeypatch.setattr(cli.selftest, "_worker_runner", None)
    with pytest.MonkeyPatch.context() as mp:
        execs = []
        mp.setenv("SM120_FP4", "0")
        mp.setattr(cli.launch, "_spawn", lambda argv, environ: execs.append(argv))
        for k, v in {**SIM_BOTH, "SM120_FP4_BACKENDS": "crash,emulated", "SM120_FP4_VERDICTS": verdicts}.items():
            mp.setenv(k, v)
        previous = cli.use_worker_runner(_crashing_first("crash"))
        try:
            code = cli.main(["launch", "--", sys.executable, "-c", "print('started')"])
        finally:
            cli.use_worker_runner(previous)
    err = capsys.readouterr().err
    assert code == 2 and not execs, err
    assert "NOT recorded as crashed" in err and "recorded as crashed in" not in err, err
    assert "not starting the server" in err and "SM120_FP4_BACKENDS without crash" in err, err


@case("configuration", "`sm120-fp4 launch -- {command}`", "exit 2 at once, naming the command, before any self-test")
@pytest.mark.parametrize("command", ["/nonexistent/server", "no-such-command-sm120", "a file without the execute bit"])
def test_launch_checks_its_command_before_the_preflight(monkeypatch, capsys, tmp_path, command):
    monkeypatch.setattr(cli.launch, "cmd_selftest", lambda *a, **k: pytest.fail("the preflight ran"))
    name = command
    if command.startswith("a file"):
        name = str(tmp_path / "server.sh")
        (tmp_path / "server.sh").write_text("#!/bin/sh\n")
        (tmp_path / "server.sh").chmod(0o644)
    assert cli.main(["launch", "--", name, "--port", "30000"]) == 2
    err = capsys.readouterr().err
    assert repr(name) in err and "not running the preflight" in err, err


REFUSED_SETTINGS = [
    ({"SM120_FP4_BACKENDS": "nosuch"}, "SM120_FP4_BACKENDS names unknown backend(s) ['nosuch']"),
    ({"SM120_FP4_MOE_BACKENDS": "cutlass,nosuch"}, "SM120_FP4_MOE_BACKENDS names unknown backend(s) ['nosuch']"),
    ({"SM120_FP4_ENABLE": "maybe"}, "SM120_FP4_ENABLE='maybe' is not accepted"),
    ({"SM120_FP4_CANARY": "60", "SM120_FP4_SELFTEST": "off"}, "but SM120_FP4_SELFTEST=off verifies none"),
    ({"FLASHINFER_NVFP4_4OVER6": "1"}, "FLASHINFER_NVFP4_4OVER6='1' set"),
]


@case(
    "configuration",
    "`sm120-fp4 launch` refuses the settings {env} (exit 2); `sm120-fp4 doctor --strict` with the same settings",
    "doctor lists the refusal, in the same words, under problems and exits 1: what launch refuses, doctor reports",
)
@pytest.mark.parametrize("env, says", REFUSED_SETTINGS, ids=[next(iter(e)) for e, _ in REFUSED_SETTINGS])
def test_doctor_reports_every_setting_that_launch_refuses(monkeypatch, capsys, env, says):
    command = [sys.executable, "-c", "print('started')"]
    code, err, started = launch_in_process(monkeypatch, capsys, "--", *command, env={**SIM_BOTH, **env})
    assert code == 2 and started is None and says in err, err
    monkeypatch.delenv("SM120_FP4")  # as the operator runs doctor: the toggle unset
    code, out, _ = cli_in_process(monkeypatch, capsys, "doctor", "--quick", "--strict", "--json")
    problems = json.loads(out)["problems"]
    assert code == 1 and any(says in p for p in problems), problems


def test_launch_shortens_sglangs_wait_for_coredumps_unless_set(monkeypatch, capsys):
    command = [sys.executable, "-c", "print('started')"]
    seen = []
    monkeypatch.delenv(cli.COREDUMP_WAIT_VAR, raising=False)
    monkeypatch.setattr(cli.launch, "cmd_selftest", lambda *a, **k: 0)
    monkeypatch.setattr(cli.launch, "_spawn", lambda argv, environ: seen.append(environ.get(cli.COREDUMP_WAIT_VAR)))
    monkeypatch.setenv("SM120_FP4", "0")
    assert cli.main(["launch", "--", *command]) == 0
    monkeypatch.setenv(cli.COREDUMP_WAIT_VAR, "30")
    assert cli.main(["launch", "--", *command]) == 0
    assert seen == ["0", "30"]


@case(
    "configuration",
    "`sm120-fp4 launch -- python -m sglang.launch_server ... --tp 2` in simulation with SGLang's CPU engine; then "
    "with the operator's own SGLANG_CPU_OMP_THREADS_BIND; then without the CPU engine",
    "the command gets SGLANG_CPU_OMP_THREADS_BIND: this process's cores split into one group per rank (`0|1` on 2 "
    "cores), said on stderr; the operator's value is left as set; without the CPU engine nothing is set",
)
def test_launch_splits_the_cores_over_the_cpu_engines_ranks_unless_the_operator_did(monkeypatch, capsys):
    import os

    command = [sys.executable, "-c", "print('started')", "--tp", "2"]
    seen = []
    monkeypatch.setattr(cli.launch, "cmd_selftest", lambda *a, **k: 0)
    monkeypatch.setattr(cli.launch, "_spawn", lambda argv, env: seen.append(env.get("SGLANG_CPU_OMP_THREADS_BIND")))
    for name, value in {"SM120_FP4": "0", "SM120_FP4_SIMULATE": "12.0", "SGLANG_USE_CPU_ENGINE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    assert cli.main(["launch", "--", *command]) == 0
    cores = sorted(os.sched_getaffinity(0))
    groups = seen[0].split("|")
    assert len(groups) == 2 and ("0|1" == seen[0] or len(cores) != 2), seen
    assert f"SGLANG_CPU_OMP_THREADS_BIND={seen[0]}" in capsys.readouterr().err
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert cli.main(["launch", "--", *command]) == 0
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")
    assert cli.main(["launch", "--", *command]) == 0
    assert seen[1:] == ["0-3|4-7", None]


KILLED_LAUNCHER = """
import os, signal, subprocess, sys, time
server = "import os, time; open('server.pid', 'w').write(str(os.getpid())); time.sleep(120)"
launch = subprocess.Popen([sys.executable, '-m', 'sm120_fp4', 'launch', '--', sys.executable, '-c', server])
deadline = time.monotonic() + 120
while not os.path.exists('server.pid') and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(0.5)
pid = int(open('server.pid').read())
os.kill(launch.pid, signal.SIGKILL)  # no handler runs: as the out-of-memory killer or `kill -9` ends it
launch.wait()
deadline = time.monotonic() + 30
while os.path.exists(f'/proc/{pid}') and time.monotonic() < deadline:
    time.sleep(0.1)
print('server gone' if not os.path.exists(f'/proc/{pid}') else 'server left running')
"""


@case(
    "interrupts",
    "`sm120-fp4 launch -- CMD` killed by SIGKILL while CMD serves (no GPU: nothing to verify, CMD started at once)",
    "CMD, launch's child, gets SIGTERM and ends (its parent-death signal): no server is left running without launch",
)
@background(
    lambda folder: Popen([sys.executable, "-c", KILLED_LAUNCHER], clean_env(PYTHONPATH=str(REPO)), folder, folder)
)
def test_the_server_ends_when_launch_is_killed(background):
    rc, out, err = background
    assert rc == 0 and out.strip().splitlines()[-1] == "server gone", (out, err)


RANK_REFUSES = """
import sm120_fp4
from sm120_fp4 import serving
sm120_fp4.decide(candidates=["emulated"])  # wires the report, as a server process's install does
serving.STATE.rank = lambda: {"tp_rank": 1, "tp_size": 2}  # this process is TP rank 1 of 2, as the engine says
serving.decide(candidates=["zeros"])  # refused: RefusedToServe ends the process, as in a server's rank
"""


@case(
    "backend faults",
    "`sm120-fp4 launch -- CMD` where CMD is TP rank 1 of 2 and refuses a zero-returning kernel (the report unset)",
    "launch exits with the command's code and prints which rank refused and why, from the report its processes "
    "wrote in launch's own private folder (removed afterwards)",
)
@pytest.mark.subprocess
def test_launch_names_the_rank_that_refused_when_the_server_exits(monkeypatch, capsys, tmp_path):
    import os

    monkeypatch.setattr(cli.launch, "cmd_selftest", lambda *a, **k: 0)
    env = {"SM120_FP4": "0", "SM120_FP4_SIMULATE": "12.0", "SM120_FP4_VERDICTS": "off"}
    env["PYTHONPATH"] = f"{plugin_site(tmp_path / 'plugins')}{os.pathsep}{REPO}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SM120_FP4_REPORT", raising=False)
    assert cli.main(["launch", "--", sys.executable, "-c", RANK_REFUSES]) == 1
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("sm120-fp4 launch: TP rank 1/2 (pid ")]
    assert said and "no FP4 GEMM backend passed verification. (TP rank 1/2)" in said[0], err
    assert "(zeros: self-test failed: " in said[0] and "output is all zeros" in said[0], err
    assert "sm120-fp4 launch: the server exited with code 1" in err
    assert "SM120_FP4_REPORT" not in os.environ


@case(
    "backend faults",
    "candidate that kills its process (SIGSEGV, as an illegal memory access does) in `sm120-fp4 selftest`, SELECT=fastest",
    "the preflight survives: the crash is recorded in the verdict file (GPU, capability, driver, CUDA, FlashInfer, family, backend), the worker re-runs without it and verifies the next candidate (exit 0); a serving process then skips it, naming the crash and when it was recorded",
)
@background(
    lambda folder: Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, json\n"
            "r = subprocess.run([sys.executable, '-m', 'sm120_fp4', 'selftest', '--json'], capture_output=True, text=True)\n"
            "print(json.dumps([r.returncode, r.stdout, r.stderr]))\n"
            "import sm120_fp4\n"
            "d = sm120_fp4.decide()\n"
            "print(json.dumps([d.backend, d.rejected]))\n",
        ],
        plugin_env(folder, SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="crash,good", SM120_FP4_SELECT="fastest"),
        folder,
    )
)
def test_a_crashing_candidate_is_isolated_recorded_and_skipped_by_workers(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    first, second = stdout.splitlines()[:2]
    code, out, err = json.loads(first)
    assert code == 0, err
    decision = json.loads(out)["-1"]["decision"]
    assert decision["backend"] == "good" and decision["verified"]
    assert "crash" in decision["rejected"] and "killed by SIGSEGV" in decision["rejected"]["crash"]
    assert "self-test of crash" in err and "recorded as crashed" in err
    backend, rejected = json.loads(second)
    assert (
        backend == "good"
        and "crashed the self-test process" in rejected["crash"]
        and "recorded 20" in rejected["crash"]
    )


@case(
    "backend faults",
    "`sm120-fp4 selftest` whose first candidate is still running tensor ops on the worker's thread (the thread that would serve) when its bound (SM120_FP4_SELFTEST_TIMEOUT=6) and the grace after it are up",
    "the worker writes why and exits with code 4 (hung), not an abort at interpreter shutdown (134); the preflight records the candidate as not returning within the bound, re-runs the worker without it and verifies the next one (exit 0)",
)
@background(
    cli_plugin_job(
        "selftest", "--json", SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS="late,good", SM120_FP4_SELFTEST_TIMEOUT="6"
    )
)  # 6 s: room for `good` on a loaded 2-core runner
def test_a_hung_candidate_ends_its_worker_and_the_preflight_verifies_the_next(background):
    rc, stdout, stderr = background
    decision = json.loads(stdout)["-1"]["decision"]
    assert rc == 0 and decision["backend"] == "good" and decision["verified"], stderr
    assert "did not return within the self-test's time bound" in decision["rejected"]["late"]
    assert (
        "the self-test of late did not return within the self-test's time bound (its worker exited with code 4)"
        in stderr
    )
    assert "terminate called" not in stderr, stderr


@case(
    "backend faults",
    "`sm120-fp4 selftest --moe` (MoE family: SM120_FP4_MOE_BACKENDS, --backend naming MoE backends)",
    "MoE rows of its own in the table; a verified MoE backend exits 0, an unsupported one exits 1 (refused)",
)
def test_selftest_moe_is_the_same_preflight_for_the_moe_family(monkeypatch, capsys):
    code, out, err = cli_in_process(
        monkeypatch,
        capsys,
        "selftest",
        "--moe",
        env={"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_MOE_BACKENDS": "emulated"},
    )
    assert code == 0 and "| moe | cpu 'simulated (CPU)' (sm_120, simulated) | emulated | True |" in out, err
    code, out, err = cli_in_process(
        monkeypatch, capsys, "selftest", "--moe", "--backend", "cutlass", env={"SM120_FP4_SIMULATE": "12.0"}
    )
    assert code == 1 and "| moe | -1 | - | REFUSED |" in out and "NVFP4 fused-MoE" in err


# ---- interrupts and killed workers ----------------------------------------------------------

INTERRUPT = """
import json, os, signal, subprocess, sys, time
command, how = sys.argv[1], sys.argv[2]
args = [sys.executable, '-m', 'sm120_fp4', *(['selftest'] if command == 'selftest' else ['launch', '--', sys.executable, '-c', "open('started', 'w')"])]
parent = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # as a shell job
deadline = time.monotonic() + 200
while not os.path.exists('hanging') and time.monotonic() < deadline and parent.poll() is None:
    time.sleep(0.05)
worker = int(open('hanging').read() or 0) if os.path.exists('hanging') else 0
if how == 'Ctrl-C':
    os.killpg(parent.pid, signal.SIGINT)  # what a terminal sends: the whole foreground process group
else:
    os.kill(parent.pid, signal.SIGTERM)  # what a service manager sends the main process
out, err = parent.communicate(timeout=200)
try:
    os.kill(worker, 0)
    alive = worker > 0
except ProcessLookupError:
    alive = False
verdicts = json.load(open('verdicts.json')) if os.path.exists('verdicts.json') else {'verdicts': []}
print(json.dumps([parent.returncode, out, err, alive, verdicts, os.path.exists('started')]))
"""
HOW = {"Ctrl-C": 130, "SIGTERM": 143}


@case(
    "interrupts",
    "{how} while `sm120-fp4 {command}` self-tests a candidate (SM120_FP4_BACKENDS=hang,good)",
    "exit {code}; the preflight stops: the next candidate is not tried, nothing is recorded for the interrupted one (no `crashed` verdict), the worker is gone, launch starts nothing",
)
@pytest.mark.parametrize(
    "command, how, code", [("selftest", "Ctrl-C", HOW["Ctrl-C"]), ("launch", "SIGTERM", HOW["SIGTERM"])]
)
@background(
    lambda folder, command, how, code: Popen(
        [sys.executable, "-c", INTERRUPT, command, how],
        plugin_env(
            folder,
            SM120_FP4_SIMULATE="12.0",
            SM120_FP4_BACKENDS="hang,good",
            SM120_FP4_MOE_BACKENDS="emulated",
            TEST_HANG_MARK=str(folder / "hanging"),
        ),
        folder,
        cwd=folder,
    )
)
def test_an_interrupt_stops_the_preflight_and_records_nothing(background, command, how, code):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    returncode, out, err, alive, recorded, started = json.loads(stdout.strip().splitlines()[-1])
    assert returncode == code, err
    assert "interrupted by" in err and "nothing was recorded" in err, err
    assert "self-test of good" not in err and "recorded as crashed" not in err
    assert not any(v["verdict"] == "crashed" for v in recorded["verdicts"]), recorded
    assert not alive and not started


@case(
    "interrupts",
    "a self-test worker killed by SIGKILL (as the out-of-memory killer kills) {when}",
    "{outcome}; never recorded as a `crashed` verdict (retry policy: SIGKILL_RETRIES = 1)",
)
@pytest.mark.parametrize(
    "when, outcome, backends",
    [
        ("once, then not", "the worker runs again with the same candidate, which verifies: exit 0", "oom-once"),
        (
            "every time",
            "run once more, then the preflight stops with exit 2 saying it was SIGKILL (out of memory?), not a verdict",
            "oom,good",
        ),
    ],
)
@background(
    lambda folder, when, outcome, backends: Popen(
        [sys.executable, "-m", "sm120_fp4", "selftest"],
        plugin_env(folder, SM120_FP4_SIMULATE="12.0", SM120_FP4_BACKENDS=backends),
        folder,
        cwd=folder,
    )
)
def test_a_worker_killed_by_sigkill_is_not_a_kernel_verdict(background, when, outcome, backends, tmp_path):
    rc, stdout, stderr = background
    assert "killed by SIGKILL" in stderr and "not a verdict on the kernel, nothing recorded" in stderr, stderr
    assert "recorded as crashed" not in stderr
    if backends == "oom-once":
        assert rc == 0 and "running it again" in stderr and "| oom-once | True |" in stdout, stderr
    else:
        assert rc == 2 and "it happened 2 times" in stderr and "self-test of good" not in stderr, stderr


FORK = """
import json, os, sys, threading, time
import torch
torch.set_num_threads(1)
import sm120_fp4
from sm120_fp4 import backends, serving
from sm120_fp4.backends import emulated_mm_fp4
from sm120_fp4.config import Settings

parent, started, release = os.getpid(), threading.Event(), threading.Event()

def slow_in_parent(*args):
    if os.getpid() == parent:
        started.set()
        release.wait(120)  # the parent's self-test holds its locks meanwhile
    return emulated_mm_fp4(*args)

backends.register('slow', slow_in_parent)
settings = Settings(simulate='12.0', selftest_timeout=300)
thread = threading.Thread(target=lambda: sm120_fp4.decide(candidates=['slow'], settings=settings))
thread.start()
started.wait(120)
pid = os.fork()  # while another thread is inside the self-test
if pid == 0:
    try:
        decision = sm120_fp4.decide(candidates=['slow'], settings=settings)
        ok = decision.backend == 'slow' and decision.verified and sm120_fp4.status().decisions
    except BaseException as exc:
        sys.stderr.write(repr(exc))
        ok = False
    os._exit(0 if ok else 3)
deadline, code = time.monotonic() + 120, None
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        code = os.waitstatus_to_exitcode(status)
        break
    time.sleep(0.1)
if code is None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
release.set()
thread.join()
print(json.dumps(code))
"""


@case(
    "interrupts",
    "fork() from another thread while a self-test holds the library's locks; the child decides on the same device",
    "the child does not deadlock: it runs its own self-test and verifies (exit 0); the parent's self-test finishes too",
)
@background(lambda folder: Popen([sys.executable, "-c", FORK], clean_env(PYTHONPATH=str(REPO)), folder))
def test_fork_during_a_selftest_does_not_deadlock_the_child(background):
    rc, stdout, stderr = background
    assert rc == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == 0, (
        "the child deadlocked (killed after 120 s) or failed: " + stderr
    )
