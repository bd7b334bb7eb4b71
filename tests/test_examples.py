"""Every file in examples/ is exercised here, so none can rot: run for real in simulation (CPU) where
it can be, otherwise parsed and checked against the installed SGLang, FlashInfer and sm120_fp4.

The three subprocesses are background jobs (conftest.py): they start with the session and run meanwhile.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import json
import re
import shlex
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from helpers.procs import Popen, background, clean_env

from sm120_fp4 import cli
from sm120_fp4.config import Settings, env_name, load_settings

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SIM = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated"}
SETTING_VARS = {env_name(field) for field in Settings.model_fields}


def _env(extra: dict[str, str]) -> dict[str, str]:
    return clean_env(**extra)  # a job's thread reads the session's environment, never os.environ


def _sglang_file(relative: str) -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    return Path(spec.submodule_search_locations[0]) / relative


@cache
def _sglang_routes() -> set[str]:
    source = _sglang_file("srt/entrypoints/http_server.py").read_text()
    return set(re.findall(r'@app\.(?:get|post|api_route)\(\s*"([^"]+)"', source))


@cache
def _server_args_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


# ---- the Dockerfile, parsed with the stdlib -------------------------------------------------


def _dockerfile() -> list[tuple[str, str, str | None]]:
    """(INSTRUCTION, arguments, heredoc body or None) for each instruction."""
    lines = (EXAMPLES / "Dockerfile").read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        keyword, _, rest = line.partition(" ")
        body = None
        heredoc = re.search(r"<<-?'?(\w+)'?", rest)
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            body, i = "\n".join(lines[i:end]) + "\n", end + 1
        out.append((keyword.upper(), rest.strip(), body))
    return out


def _docker_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest, _ in _dockerfile():
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def _exec_form(keyword: str) -> list[str]:
    [rest] = [rest for kw, rest, _ in _dockerfile() if kw == keyword]
    return json.loads(rest)


def _python_snippets() -> list[str]:
    """Every Python program the Dockerfile runs: heredocs fed to python, and python -c "..."."""
    snippets = []
    for keyword, rest, body in _dockerfile():
        if keyword not in ("RUN", "HEALTHCHECK"):
            continue
        if body is not None and re.match(r"python3? -", rest):
            snippets.append(body)
        words = shlex.split(rest.split("<<")[0])
        snippets += [words[j + 1] for j, w in enumerate(words[:-1]) if w == "-c" and "python" in words[j - 1]]
    return snippets


def _precompile_snippet() -> str:
    [snippet] = [s for s in _python_snippets() if "build()" in s]
    return snippet


def _precompile_job(folder: Path) -> Popen:
    """Run the Dockerfile's pre-compile program for real, nvcc aside: `build` only records the spec."""
    imports = [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(_precompile_snippet()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    workspace = folder / "flashinfer-workspace"
    driver = (
        "import importlib, json\n"
        f"missing = [(m, n) for m, n in {imports!r} if not hasattr(importlib.import_module(m), n)]\n"
        "import flashinfer.jit.core as core\n"
        "built = []\n"
        "core.JitSpecNvcc.build = lambda self, *a, **k: built.append(self)\n"
        + _precompile_snippet()
        + "print('RESULT=' + json.dumps({'workspace': %r, 'missing': missing, 'specs': [[s.name, str(s.jit_library_path),"
        " ' '.join(s.extra_cuda_cflags or [])] for s in built]}))\n" % str(workspace)
    )
    return Popen(
        [sys.executable, "-c", driver],
        _env({**_docker_env(), "FLASHINFER_WORKSPACE_BASE": str(workspace)}),
        folder,
        cwd=ROOT,
    )


def _example(*args: str, merge: bool = False):
    return lambda folder: Popen([sys.executable, *args], _env(SIM), folder, cwd=ROOT, merge=merge)


# ---- launch_sglang.py ----------------------------------------------------------------------


@background(_example("examples/launch_sglang.py", "--help", merge=True))
def test_launch_sglang_installs_then_hands_argv_to_sglangs_launcher(background):
    code, out, _ = background
    assert code == 0, out[-3000:]
    status = re.search(r"^sm120_fp4 \S+: installed \(sglang [\d.]+\); patches: (.*)$", out, re.M)
    assert status, out[:3000]
    assert "flashinfer-fp4-gemm-alias=pending" in status.group(1)  # hooked, applied when SGLang imports it
    usage = out.index("usage: sglang serve")  # SGLang's own argparse got our --help
    assert status.start() < usage and "--model-path MODEL_PATH" in out[usage:]


# ---- offline_engine.py ---------------------------------------------------------------------


@background(_example("examples/offline_engine.py", "--check-only"))
def test_offline_engine_check_only_installs_in_simulation(background):
    code, out, err = background
    assert code == 0, err[-3000:]
    status = json.loads(out)
    assert status["installed"] is True and status["message"].startswith("installed (sglang ")
    assert status["settings"]["backends"] == ["emulated"] and status["settings"]["simulate"] == "12.0"
    assert any("sm_120" in d for d in status["devices"])


def _engine_script() -> tuple[ast.Module, list[ast.Call]]:
    tree = ast.parse((EXAMPLES / "offline_engine.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return tree, calls


def test_offline_engine_builds_sglang_engine_with_real_server_args():
    from sglang.srt.server_args import ServerArgs

    tree, calls = _engine_script()
    [engine] = [c for c in calls if ast.unparse(c.func) == "sglang.Engine"]
    kwargs = {k.arg: k.value for k in engine.keywords}
    accepted = inspect.signature(ServerArgs).parameters  # Engine(**kwargs) -> ServerArgs(**kwargs)
    assert not engine.args and set(kwargs) <= set(accepted), set(kwargs) - set(accepted)
    assert ast.literal_eval(kwargs["quantization"]) == "modelopt_fp4" and "model_path" in kwargs
    choices = _server_args_parser()._option_string_actions["--quantization"].choices
    assert "modelopt_fp4" in choices
    [install] = [c for c in calls if ast.unparse(c.func) == "sm120_fp4.install"]
    assert install.lineno < engine.lineno  # patched before any worker is spawned
    [shutdown] = [c for c in calls if ast.unparse(c.func) == "engine.shutdown"]
    assert any(isinstance(n, ast.Try) and shutdown in ast.walk(ast.Module(n.finalbody, [])) for n in ast.walk(tree))


def test_offline_engine_generate_call_matches_engine_generate():
    from sglang.srt.sampling.sampling_params import SamplingParams

    # sglang.srt.entrypoints.engine does not import on CPU (uvloop): read generate()'s signature.
    engine_src = ast.parse(_sglang_file("srt/entrypoints/engine.py").read_text())
    [cls] = [n for n in engine_src.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    [gen] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "generate"]
    params = [a.arg for a in gen.args.args][1:]
    assert params[:2] == ["prompt", "sampling_params"]
    _, calls = _engine_script()
    [call] = [c for c in calls if ast.unparse(c.func) == "engine.generate"]
    assert len(call.args) <= 2 and {k.arg for k in call.keywords} <= set(params)
    sampling = ast.literal_eval(call.args[1])
    assert set(sampling) <= set(inspect.signature(SamplingParams).parameters)


# ---- k8s/deployment.yaml -------------------------------------------------------------------


def _manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((EXAMPLES / "k8s" / "deployment.yaml").read_text())}


def _container() -> dict:
    [container] = _manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_env_sets_the_toggle_and_only_valid_settings(monkeypatch):
    env = {e["name"]: e["value"] for e in _container()["env"] if "value" in e}
    assert env["SM120_FP4"] == "1"
    ours = {k: v for k, v in env.items() if k.startswith("SM120_FP4")}
    assert set(ours) <= SETTING_VARS, set(ours) - SETTING_VARS
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()  # raises ConfigError on any value the library would reject
    assert settings.toggle is True and settings.selftest == "strict"
    mounts = {m["mountPath"] for m in _container()["volumeMounts"]}
    assert settings.report is None or str(settings.report) in mounts  # the report directory exists


def test_k8s_runs_sglang_through_the_launcher_with_one_gpu():
    deployment, container = _manifests()["Deployment"], _container()
    assert deployment["spec"]["replicas"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    command = container["command"]
    args = cli._parser().parse_args(command[1:])
    assert command[0] == "sm120-fp4" and args.cmd == "launch"
    inner = [a for a in args.command if a != "--"]
    assert inner[1:3] == ["-m", "sglang.launch_server"]
    server = _server_args_parser().parse_args(inner[3:])
    assert server.quantization == "modelopt_fp4" and server.host == "0.0.0.0" and server.model_path
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == server.port
    service = _manifests()["Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports) | set(ports.values())


def test_k8s_probes_hit_a_real_sglang_route():
    container = _container()
    probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
    assert {"startupProbe", "readinessProbe"} <= set(container)
    ports = {p["name"] for p in container["ports"]}
    for probe in probes:
        assert probe["httpGet"]["path"] in _sglang_routes()
        assert probe["httpGet"]["port"] in ports


def test_sm120_fp4_is_a_console_script_of_the_package():
    import importlib.metadata

    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("sm120-fp4") == "sm120_fp4.cli:main"


# ---- Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_installs_the_package_from_the_files_its_build_needs():
    steps = _dockerfile()
    assert steps[0][0] == "FROM" and "sglang" in steps[0][1]
    copied = {Path(src).parts[0] for kw, rest, _ in steps if kw == "COPY" for src in shlex.split(rest)[:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {"pyproject.toml", project["project"]["readme"], *wheel["packages"]}
    needed |= {Path(src).parts[0] for src in wheel["force-include"]}
    assert needed <= copied and all((ROOT / p).exists() for p in copied)
    assert any(
        kw == "RUN" and re.search(r"pip install .*(sm120-fp4|/opt/sm120_fp4-src)", rest) for kw, rest, _ in steps
    )


def test_dockerfile_sets_the_toggle_and_valid_settings(monkeypatch):
    env = _docker_env()
    assert env["SM120_FP4"] == "1"
    ours = {k: v for k, v in env.items() if k.startswith("SM120_FP4")}
    assert set(ours) <= SETTING_VARS
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    assert load_settings().toggle is True


def test_dockerfile_python_snippets_compile():
    snippets = _python_snippets()
    assert len(snippets) >= 2  # the pre-compile step and the HEALTHCHECK
    for snippet in snippets:
        compile(snippet, "<Dockerfile>", "exec")
    [health] = [rest for kw, rest, _ in _dockerfile() if kw == "HEALTHCHECK"]
    assert re.search(r"127\.0\.0\.1:30000(/[\w]+)", health).group(1) in _sglang_routes()


@background(_precompile_job)
def test_dockerfile_precompiles_flashinfer_sm120_fp4_kernels_for_sm_120f(background):
    code, out, err = background
    assert code == 0, err[-3000:]
    result = json.loads(out.split("RESULT=")[-1])
    assert result["missing"] == []  # every name the step imports exists in the installed FlashInfer
    names = {name for name, _, _ in result["specs"]}
    assert {"fp4_gemm_cutlass_sm120", "fp4_quantization_120f"} <= names
    workspace = result["workspace"]
    for _, library, flags in result["specs"]:
        assert "compute_120f" in flags and "sm_120f" in flags  # built for the family, no device asked
        assert library.startswith(workspace) and "/120f/cached_ops/" in library  # the cache a 12.x server reads


def test_dockerfile_entrypoint_launches_sglang_with_nvfp4():
    entry, cmd = _exec_form("ENTRYPOINT"), _exec_form("CMD")
    args = cli._parser().parse_args(entry[1:])
    assert entry[0] == "sm120-fp4" and args.cmd == "launch"
    inner = [a for a in args.command if a != "--"]
    assert inner[1:3] == ["-m", "sglang.launch_server"]
    server = _server_args_parser().parse_args(inner[3:] + cmd)
    assert server.quantization == "modelopt_fp4" and server.host == "0.0.0.0"
    exposed = [rest for kw, rest, _ in _dockerfile() if kw == "EXPOSE"]
    assert exposed == [str(server.port)]
