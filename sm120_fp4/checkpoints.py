"""What an NVFP4 checkpoint directory says about itself: its quantization format, read from its config files.

Two producers write NVFP4 checkpoints that SGLang serves: NVIDIA ModelOpt (``quant_method: modelopt``,
``quant_algo: NVFP4`` in ``config.json``'s ``quantization_config``, or the older ``hf_quant_config.json``
with ``{"quantization": {"quant_algo": "NVFP4"}}``; ``MIXED_PRECISION`` lists per-layer algorithms) and
llm-compressor / compressed-tensors (``quant_method: compressed-tensors``, a config group whose weights
are 4-bit floats in groups of 16). Only the standard library and the files themselves are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Quantization", "read_quantization", "MODELOPT", "COMPRESSED_TENSORS"]

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"
_MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization: `format` (MODELOPT, COMPRESSED_TENSORS or the config's own name, or None
    for none), whether any of its layers are NVFP4, and the config it was read from."""

    format: str | None
    nvfp4: bool
    config: dict


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes; not a model config")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds {type(value).__name__}, expected a JSON object")
    return value


def _is_nvfp4_group(group: object) -> bool:
    weights = group.get("weights") if isinstance(group, dict) else None
    return (isinstance(weights, dict) and weights.get("num_bits") == 4 and weights.get("type") == "float"
            and weights.get("group_size") == 16)


def _modelopt_nvfp4(quant: dict) -> bool:
    algo = str(quant.get("quant_algo") or "").upper()
    if algo == "NVFP4":
        return True
    layers = quant.get("quantized_layers")
    if algo == "MIXED_PRECISION" and isinstance(layers, dict):
        return any(isinstance(v, dict) and str(v.get("quant_algo", "")).upper() == "NVFP4" for v in layers.values())
    return False


def read_quantization(model_dir: str) -> Quantization:
    """The quantization of the checkpoint in `model_dir` (a local directory with a ``config.json``)."""
    if not isinstance(model_dir, (str, os.PathLike)) or not os.path.isdir(model_dir):
        raise ConfigError(f"model_dir={model_dir!r} is not a directory; expected a local checkpoint directory "
                          "with config.json")
    config = _read_json(os.path.join(model_dir, "config.json"))
    if config is None:
        raise ConfigError(f"model_dir={model_dir!r} has no config.json; expected a Hugging Face checkpoint directory")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    quant = config.get("quantization_config") or text.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method") or "").lower()
        if method == MODELOPT or "quant_algo" in quant:
            return Quantization(MODELOPT, _modelopt_nvfp4(quant), quant)
        if method == COMPRESSED_TENSORS:
            groups = quant.get("config_groups")
            nvfp4 = isinstance(groups, dict) and any(_is_nvfp4_group(g) for g in groups.values())
            return Quantization(COMPRESSED_TENSORS, nvfp4, quant)
        return Quantization(method or None, False, quant)
    legacy = _read_json(os.path.join(model_dir, "hf_quant_config.json"))
    section = legacy.get("quantization") if isinstance(legacy, dict) else None
    if isinstance(section, dict):
        return Quantization(MODELOPT, _modelopt_nvfp4(section), section)
    return Quantization(None, False, {})
