"""What a checkpoint's config files say (standard library only): ModelOpt or compressed-tensors, NVFP4 or not."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import ConfigError
from .tensors import read_json

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization format (None for none), whether any layer is NVFP4, and its config."""

    format: str | None
    nvfp4: bool
    config: dict
    source: str = ""  # the file it was read from


def _fp4_weights(group: object) -> dict | None:
    """Return a compressed-tensors config group's weights section where they are 4-bit floats, else None."""
    weights = group.get("weights") if isinstance(group, dict) else None
    fp4 = isinstance(weights, dict) and weights.get("num_bits") == 4 and weights.get("type") == "float"
    return weights if fp4 else None


def _modelopt_nvfp4(quant: dict) -> bool:
    algo = str(quant.get("quant_algo") or "").upper()
    if algo == "NVFP4":
        return True
    layers = quant.get("quantized_layers")
    if algo == "MIXED_PRECISION" and isinstance(layers, dict):
        return any(isinstance(v, dict) and str(v.get("quant_algo", "")).upper() == "NVFP4" for v in layers.values())
    return False


def text_config(config: dict) -> dict:
    """Return the text model's config: a VLM's ``text_config``, else `config` itself."""
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def read_quantization(model_dir: str) -> Quantization:
    """Return the quantization of the checkpoint in local directory `model_dir`."""
    if not isinstance(model_dir, (str, os.PathLike)) or not os.path.isdir(model_dir):
        raise ConfigError(
            f"model_dir={model_dir!r} is not a directory; expected a local checkpoint directory with config.json"
        )
    source = os.path.join(model_dir, "config.json")
    if (config := read_json(source)) is None:
        raise ConfigError(f"model_dir={model_dir!r} has no config.json; expected a Hugging Face checkpoint directory")
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method") or "").lower()
        if method == MODELOPT or "quant_algo" in quant:
            return Quantization(MODELOPT, _modelopt_nvfp4(quant), quant, source)
        if method == COMPRESSED_TENSORS:
            groups = quant.get("config_groups")
            fp4 = [_fp4_weights(g) or {} for g in groups.values()] if isinstance(groups, dict) else []
            return Quantization(COMPRESSED_TENSORS, any(w.get("group_size") == 16 for w in fp4), quant, source)
        return Quantization(method or None, False, quant, source)
    source = os.path.join(model_dir, "hf_quant_config.json")
    legacy = read_json(source)
    section = legacy.get("quantization") if isinstance(legacy, dict) else None
    if isinstance(section, dict):
        # The file's top level may carry group_size and config_groups beside its "quantization" section.
        return Quantization(MODELOPT, _modelopt_nvfp4(section), {**section, **legacy}, source)
    return Quantization(None, False, {})


# Each format's names for an NVFP4 layer's four tensors: packed weight, block scales, the weight's
# global scale, the activation's global scale (ModelOpt: decode scales; compressed-tensors: encode scales).
NAMES = {
    MODELOPT: ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}
GROUP_SIZE = 16


def group_size_problem(quant: Quantization) -> str | None:
    """Return why the quantization config names a group size other than NVFP4's 16, or None."""
    config = quant.config
    if quant.format == MODELOPT:
        nvfp4 = "NVFP4" in str(config.get("quant_algo", "")).upper()
        inner = config.get("quantization") if isinstance(config.get("quantization"), dict) else {}
        sizes = [("group_size", config.get("group_size")), ("quantization.group_size", inner.get("group_size"))]
        sizes = sizes if nvfp4 else []
        groups = config.get("config_groups") if nvfp4 and isinstance(config.get("config_groups"), dict) else {}
        for g, group in groups.items():  # SGLang and vLLM read a group's size, or its weights' (any part's)
            parts = {"": group, **group} if isinstance(group, dict) else {}
            for part, info in parts.items():
                if isinstance(info, dict) and "group_size" in info:
                    sizes.append((f"config_groups.{g}.{part + '.' if part else ''}group_size", info["group_size"]))
        layers = config.get("quantized_layers")
        for layer, info in layers.items() if isinstance(layers, dict) else ():
            if isinstance(info, dict) and "NVFP4" in str(info.get("quant_algo", "")).upper():
                sizes.append((f"quantized_layers.{layer}.group_size", info.get("group_size", GROUP_SIZE)))
    elif quant.format == COMPRESSED_TENSORS:
        groups = config.get("config_groups")
        sizes = [
            (f"config_groups.{g}.weights.group_size", _fp4_weights(group).get("group_size"))
            for g, group in (groups.items() if isinstance(groups, dict) else ())
            if _fp4_weights(group) is not None
        ]
    else:
        return None
    for key, value in sizes:
        if value is not None and value != GROUP_SIZE:
            return (
                f"{quant.source}: {key} = {value!r}; accepted: {GROUP_SIZE} (NVFP4 block scales cover 16 weights, "
                "and SGLang's NVFP4 layers read them so)"
            )
    return None


def ignored(quant: Quantization, module: str) -> str | None:
    """Return the ignore list's entry that makes SGLang build `module` unquantized, or None."""
    config = quant.config
    entries = config.get("ignore", config.get("exclude_modules")) if quant.format == MODELOPT else config.get("ignore")
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, str):
            continue
        if quant.format == COMPRESSED_TENSORS:  # compressed_tensors.utils.check_equal_or_regex_match
            hit = (
                re.match(entry[3:], module) is not None
                if entry.startswith("re:")
                else module == entry or module.endswith("." + entry)
            )
        else:  # ModelOpt: is_layer_excluded (a glob over the whole name or any of its parts)
            try:
                pattern = re.compile(entry.replace(".", r"\.").replace("*", ".*"))
            except re.error:
                continue  # SGLang cannot compile it either
            names = [module, module.removeprefix("language_model.")]
            hit = any(pattern.fullmatch(n) for n in names) or any(pattern.fullmatch(p) for p in module.split("."))
        if hit:
            return entry
    return None
