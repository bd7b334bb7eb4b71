"""``sm120-fp4 selftest --model DIR`` (sm120_fp4.sglang.model_check): a checkpoint's own layers, verified
without a server, through SGLang's real layers (simulated SM120, CPU)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from helpers import faults
from helpers.cases import case
from helpers.common import simulated_moe_skip_reason
from helpers.plugins import plugin_site
from helpers.procs import Popen, background, clean_env
from helpers.workers import model_workers_in_process
from sm120_fp4 import backends, cli
from sm120_fp4.demo.checkpoint import COMPRESSED_TENSORS, MODELOPT, write_checkpoint
from sm120_fp4.errors import ConfigError

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
model_check = pytest.importorskip("sm120_fp4.sglang.model_check")
pytestmark = pytest.mark.sglang
SIM = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated", "SM120_FP4_MOE_BACKENDS": "emulated"}


def _selftest_model(folder, fmt, **env):
    path = write_checkpoint(str(folder / "ckpt"), seed=9, fmt=fmt)
    if "PYTHONPATH" in env:
        env["PYTHONPATH"] = f"{plugin_site(folder / 'plugins')}:{env['PYTHONPATH']}"
    return Popen([sys.executable, "-m", "sm120_fp4", "selftest", "--model", path, "--json"],
                 clean_env(**{**SIM, **env}), folder, cwd=folder, timeout=900)


def _selftest_model_in_process(tmp_path, monkeypatch, capsys, fmt, **env) -> tuple[int, dict]:
    """``sm120-fp4 selftest --model DIR --json`` with its worker in this process (cli's worker seam)."""
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    for name, value in {**SIM, **env}.items():
        monkeypatch.setenv(name, value)
    with model_workers_in_process():
        rc = cli.main(["selftest", "--model", path, "--json"])
    [result] = json.loads(capsys.readouterr().out).values()
    return rc, result


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_selftest_model_verifies_each_distinct_layer_configuration(sglang_unpatched, tmp_path, monkeypatch, capsys, fmt):
    rc, result = _selftest_model_in_process(tmp_path, monkeypatch, capsys, fmt)
    assert rc == 0, result
    configs = [layer["config"] for d in result["decisions"] for layer in d["layers"] if layer["passed"]]
    kind = "ModelOpt" if fmt == MODELOPT else "CompressedTensors"
    assert len(configs) == 3 and all(c.startswith(kind) for c in configs), configs
    assert any("N=512 K=256" in c for c in configs), "q, k and v are verified as the one fused GEMM SGLang serves"
    assert result["checked"]["layers"] == 6, "2 layers x (qkv, o_proj, experts)"


def test_selftest_model_exits_1_with_a_broken_dense_kernel(sglang_unpatched, tmp_path, monkeypatch, capsys):
    backends.register("zeros", faults.returns_zeros)
    rc, result = _selftest_model_in_process(tmp_path, monkeypatch, capsys, MODELOPT, SM120_FP4_BACKENDS="zeros")
    assert rc == 1, result
    assert not result["ok"] and "refusing to serve NVFP4" in result["message"] and "zeros" in result["message"]


# One true end to end: the CLI, its worker process, an entry-point kernel found there, the exit code.
@background(lambda folder: _selftest_model(folder, MODELOPT, PYTHONPATH=str(folder), SM120_FP4_MOE_BACKENDS="moe-zeros"),
            heavy=True)
@pytest.mark.timeout(3600)
def test_selftest_model_worker_process_exits_1_with_a_broken_entry_point_moe_kernel(background):
    rc, out, err = background
    assert rc == 1, err[-3000:]
    [result] = json.loads(out).values()
    assert not result["ok"] and "refusing to serve NVFP4" in result["message"]
    assert "moe-zeros" in result["message"]


def test_discover_groups_shards_as_sglang_fuses_them(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    layers = model_check.discover(path)
    dense, moe = layers.distinct()
    assert [(d.name, d.sizes, d.k) for d in dense] == [("model.layers.0.self_attn.qkv_proj", [256, 128, 128], 256),
                                                       ("model.layers.0.self_attn.o_proj", [256], 256)]
    assert [(m.prefix, m.key) for m in moe] == [("model.layers.0.mlp.experts", (8, 256, 128, True))]
    assert len(layers.dense) == 4 and len(layers.moe) == 2


def test_discover_reads_mixtral_style_expert_names(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    renamed = {k.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2.")
               if ".experts." in k else k: v for k, v in tensors.items()}
    save_file(renamed, f"{path}/model.safetensors")
    _, moe = model_check.discover(path).distinct()
    assert [m.key for m in moe] == [(8, 256, 128, True)]


def test_a_checkpoint_without_nvfp4_is_a_config_error(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "hf_quant_config.json").unlink()
    with pytest.raises(ConfigError, match="is not NVFP4"):
        model_check.discover(path)


def test_no_safetensors_is_a_config_error(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        model_check.discover(path)
    assert torch.__version__  # the module imported torch: nothing else needed it


def _rescale(path: str, name: str, factor: float) -> None:
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    tensors[name] = tensors[name] * factor
    save_file(tensors, f"{path}/model.safetensors")


@pytest.mark.parametrize("fmt, tensor", [(MODELOPT, "weight_scale_2"), (COMPRESSED_TENSORS, "weight_global_scale")])
@pytest.mark.parametrize("factor", [0.25, 0.0], ids=["4x smaller", "zero"])
@case("configuration", "selftest --model on a checkpoint ({fmt}) whose second layer's q_proj {tensor} is {factor} times k_proj's and v_proj's",
      "refused, naming the fused layer, its shards and their values, although its configuration's first layer is fine")
def test_selftest_model_refuses_shards_with_different_global_scales(sglang_unpatched, tmp_path, monkeypatch, capsys, fmt, tensor,
                                                                    factor):
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    _rescale(path, f"model.layers.1.self_attn.q_proj.{tensor}", factor)
    for name, value in SIM.items():
        monkeypatch.setenv(name, value)
    with model_workers_in_process():
        rc = cli.main(["selftest", "--model", path, "--json"])
    [result] = json.loads(capsys.readouterr().out).values()
    assert rc == 1 and not result["ok"], result
    assert "model.layers.1.self_attn.qkv_proj" in result["message"] and "q_proj" in result["message"], result["message"]
    assert ("differ in the checkpoint" if factor else "not a usable global scale") in result["message"], result["message"]
