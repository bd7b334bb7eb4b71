"""sm120_fp4.checkpoints: a checkpoint's quantization, as its config files say (ModelOpt, compressed-tensors)."""

from __future__ import annotations

import json

import pytest

from sm120_fp4.checkpoints import COMPRESSED_TENSORS, MODELOPT, read_quantization
from sm120_fp4.errors import ConfigError

NVFP4_GROUP = {"weights": {"num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]}
FP8_GROUP = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}, "targets": ["Linear"]}


def write(tmp_path, config=None, legacy=None):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if legacy is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(legacy))
    return str(tmp_path)


@pytest.mark.parametrize(
    "quant, fmt, nvfp4",
    [
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, MODELOPT, True),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, MODELOPT, False),
        (
            {
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {"a": {"quant_algo": "FP8"}, "b": {"quant_algo": "NVFP4"}},
            },
            MODELOPT,
            True,
        ),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": NVFP4_GROUP}}, COMPRESSED_TENSORS, True),
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": FP8_GROUP}}, COMPRESSED_TENSORS, False),
        ({"quant_method": "awq", "bits": 4}, "awq", False),
    ],
    ids=["modelopt-nvfp4", "modelopt-fp8", "modelopt-mixed", "ct-nvfp4", "ct-fp8", "awq"],
)
def test_quantization_config_in_config_json(tmp_path, quant, fmt, nvfp4):
    q = read_quantization(write(tmp_path, {"architectures": ["X"], "quantization_config": quant}))
    assert (q.format, q.nvfp4) == (fmt, nvfp4)


def test_the_older_hf_quant_config_json_and_a_vlm_text_config(tmp_path):
    q = read_quantization(write(tmp_path, {"architectures": ["X"]}, {"quantization": {"quant_algo": "NVFP4"}}))
    assert (q.format, q.nvfp4) == (MODELOPT, True)
    (tmp_path / "hf_quant_config.json").unlink()
    vlm = {"text_config": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}}
    assert read_quantization(write(tmp_path, vlm)).nvfp4


def test_an_unquantized_checkpoint(tmp_path):
    q = read_quantization(write(tmp_path, {"architectures": ["X"]}))
    assert (q.format, q.nvfp4) == (None, False)


@pytest.mark.parametrize("case", ["missing-dir", "no-config", "bad-json", "not-an-object"])
def test_unusable_directories_are_config_errors_naming_the_path(tmp_path, case):
    if case == "missing-dir":
        path = str(tmp_path / "nope")
    elif case == "no-config":
        path = str(tmp_path)
    else:
        (tmp_path / "config.json").write_text("{not json" if case == "bad-json" else "[1, 2]")
        path = str(tmp_path)
    with pytest.raises(ConfigError, match="config.json|not a directory") as err:
        read_quantization(path)
    assert str(tmp_path) in str(err.value)
