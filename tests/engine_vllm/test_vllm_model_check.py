"""``sm120-fp4 selftest --model DIR --engine vllm`` (sm120_fp4.vllm.model_check): a checkpoint's own NVFP4 layers
built through vLLM's real layer classes and verified without a server (simulated 12.0, CPU)."""

from __future__ import annotations

import json

import pytest
from helpers import vllm_layers

pytestmark = pytest.mark.skipif(vllm_layers.available() is not None, reason=str(vllm_layers.available()))

from helpers import faults  # noqa: E402
from helpers.cases import case  # noqa: E402
from helpers.checkpoints import COMPRESSED_TENSORS, MODELOPT, write_checkpoint  # noqa: E402
from helpers.workers import _as_a_worker_process, _runner  # noqa: E402

import sm120_fp4  # noqa: E402
from sm120_fp4 import backends, cli  # noqa: E402

SIM = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated", "SM120_FP4_MOE_BACKENDS": "emulated"}


@pytest.fixture(scope="module", autouse=True)
def _vllm_imported():
    """vLLM's modules imported once, in simulation (its import chain starts a helper interpreter once per process)."""
    sm120_fp4.install(simulate="12.0", backends="emulated")
    try:
        vllm_layers.import_modules()
    finally:
        sm120_fp4.uninstall()


def _in_process(argv: list[str], label: str, env: dict[str, str], stop=None) -> tuple:
    """A cli WorkerRunner that runs the model-check worker (`argv`: its arguments, --engine vllm) in this process."""
    args = cli._parser().parse_args(argv)
    results: list[dict] = []
    with _as_a_worker_process(env):
        try:
            code = cli._model_worker(args, emit=results.append)
        finally:
            if sm120_fp4.status().installed:
                sm120_fp4.uninstall()
    return results[-1], None, code, ""


def _selftest_model(tmp_path, monkeypatch, capsys, fmt, **env) -> tuple[int, dict]:
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    for name, value in {**SIM, **env}.items():
        monkeypatch.setenv(name, value)
    with _runner(cli.use_worker_runner, _in_process):
        rc = cli.main(["selftest", "--model", path, "--engine", "vllm", "--json"])
    [result] = json.loads(capsys.readouterr().out).values()
    return rc, result


@pytest.mark.skipif(
    vllm_layers.cpu_build(), reason="vLLM's CPU build selects no NVFP4 MoE backend (the checkpoint's MoE)"
)
def test_selftest_model_verifies_each_layer_configuration_through_vllms_layers(tmp_path, monkeypatch, capsys):
    rc, result = _selftest_model(tmp_path, monkeypatch, capsys, COMPRESSED_TENSORS)
    assert rc == 0, result
    configs = sorted(layer["config"] for d in result["decisions"] for layer in d["layers"] if layer["passed"])
    assert [c.split(" N=")[0].split(" E=")[0] for c in configs] == [
        "vLLM CompressedTensorsW4A4Fp4",
        "vLLM CompressedTensorsW4A4Fp4",
        "vLLM CompressedTensorsW4A4Nvfp4MoEMethod",
    ], configs
    assert any("N=512 K=256" in c for c in configs), "q, k and v verified as the one fused GEMM vLLM serves"
    assert result["checked"]["layers"] == 6


@case(
    "backend faults",
    "``selftest --model DIR --engine vllm`` (a ModelOpt checkpoint, vLLM's layers) with a dense kernel that returns zeros",
    "exit 1: refused at the first NVFP4 layer vLLM builds, the table says REFUSED",
)
def test_selftest_model_with_vllm_refuses_a_broken_dense_kernel(tmp_path, monkeypatch, capsys):
    backends.register("zeros", faults.returns_zeros)
    rc, result = _selftest_model(tmp_path, monkeypatch, capsys, MODELOPT, SM120_FP4_BACKENDS="zeros")
    assert rc == 1 and not result["ok"], result
    assert "no FP4 GEMM backend passed verification" in result["message"]
    # The worker's ranks, as vLLM's parallel state gives them (its one-rank groups), for the table's rank column.
    assert {k: result["rank"][k] for k in ("tp_rank", "tp_size", "pp_rank", "pp_size")} == dict.fromkeys(
        ("tp_rank", "pp_rank"), 0
    ) | dict.fromkeys(("tp_size", "pp_size"), 1), result["rank"]


def test_engine_without_model_is_a_usage_error(capsys):
    assert cli.main(["selftest", "--engine", "vllm"]) == 2
    assert "--engine goes with --model" in capsys.readouterr().err


@pytest.mark.parametrize("fmt, tensor", [(MODELOPT, "weight_scale_2"), (COMPRESSED_TENSORS, "weight_global_scale")])
@case(
    "configuration",
    "``selftest --model DIR --engine vllm`` on a checkpoint ({fmt}) whose second layer's q_proj {tensor} is 4 times "
    "smaller than k_proj's and v_proj's",
    "exit 2 naming the fused layer, its shards and the tensor, as with SGLang; no kernel blamed",
)
def test_selftest_model_with_vllm_refuses_shards_with_different_global_scales(
    tmp_path, monkeypatch, capsys, fmt, tensor
):
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    tensors = load_file(f"{path}/model.safetensors")
    tensors[f"model.layers.1.self_attn.q_proj.{tensor}"] *= 0.25
    save_file(tensors, f"{path}/model.safetensors")
    for name, value in SIM.items():
        monkeypatch.setenv(name, value)
    with _runner(cli.use_worker_runner, _in_process):
        rc = cli.main(["selftest", "--model", path, "--engine", "vllm", "--json"])
    captured = capsys.readouterr()
    assert rc == 2, (captured.out, captured.err)
    [result] = json.loads(captured.out).values()
    message = result["message"]
    assert not result["ok"] and "REFUSED" not in captured.out, result
    assert "model.layers.1.self_attn.qkv_proj" in message and "q_proj" in message and tensor in message, message
    assert "differ in the checkpoint" in message, message
