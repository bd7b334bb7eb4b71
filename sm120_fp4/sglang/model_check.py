"""Verify a checkpoint's own NVFP4 layers on this device, without a server (``sm120-fp4 selftest --model DIR``).

The first layer of each distinct configuration (shards fused as SGLang fuses them) is built through SGLang's own
layers and verified by the patched weights hooks; a failure raises RefusedToServe.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from .. import checkpoints
from ..checkpoints import ModelLayers
from ..errors import ConfigError, say_once
from .layers import build_linear_layer
from .moe_layers import build_moe_layer_from_tensors


def _packed_modules(config: dict) -> dict[str, list[str]]:
    """Return the model class's packed_modules_mapping (SGLang's fusion of shards), else the common one (said once)."""
    architectures = config.get("architectures") or []
    try:
        from sglang.srt.models.registry import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(architectures)
        mapping = getattr(cls, "packed_modules_mapping", None)
        if isinstance(mapping, dict) and mapping:
            return {k: list(v) for k, v in mapping.items()}
        problem = f"{cls.__name__} has no packed_modules_mapping"
    except Exception as exc:  # no model class SGLang registers for these architectures, or none named
        problem = f"{type(exc).__name__}: {exc}"
    fused = "; ".join(f"{name} = {' + '.join(shards)}" for name, shards in checkpoints.DEFAULT_PACKED.items())
    say_once(
        logging.WARNING,
        "sm120_fp4: SGLang's model class for config.json's architectures %s is not readable here (%s): shards are "
        "fused as most models fuse them (%s), which may differ from how SGLang fuses this model's; set "
        "config.json's architectures to the model class SGLang serves this checkpoint with",
        architectures,
        problem,
        fused,
    )
    return dict(checkpoints.DEFAULT_PACKED)


def discover(model_dir: str, values: bool = False) -> ModelLayers:
    """Return every NVFP4 linear and MoE layer of `model_dir`, shards fused as SGLang's model class fuses them."""
    return checkpoints.discover(model_dir, values, packed=_packed_modules)


def _build_dense(layers: ModelLayers, layer, device: torch.device) -> None:
    """Build SGLang's linear layer of this format from its shards' tensors (the hooks verify it)."""
    kinds = checkpoints.NAMES[layers.fmt]
    tensors = checkpoints.load(layers, [f"{s}.{k}" for s in layer.shards for k in kinds if f"{s}.{k}" in layers.files])
    shards = [{k: tensors[f"{s}.{k}"] for k in kinds} for s in layer.shards]
    build_linear_layer(shards, layers.fmt, device, checkpoints.dtype(layers.config))


def _build_moe(layers: ModelLayers, layer, device: torch.device) -> None:
    """Build SGLang's FusedMoE of this format from the layer's expert tensors (the hooks verify it)."""
    kinds = checkpoints.NAMES[layers.fmt]
    matches = {n: checkpoints.EXPERT.match(n) for n in layers.files if n.startswith(layer.prefix + ".")}
    matches = {n: m for n, m in matches.items() if m and m["kind"] in kinds}
    tensors = {}
    for name, value in checkpoints.load(layers, list(matches)).items():
        m = matches[name]
        tensors[f"experts.{m['e']}.{checkpoints.ROLES.get(m['proj'], m['proj'])}.{m['kind']}"] = value
    text = checkpoints.text_config(layers.config)
    top_k = int(text.get("num_experts_per_tok") or text.get("moe_topk") or 2)
    activation = "swiglu" if layer.gated else "relu2"
    sizes = dict(num_experts=layer.experts, hidden=layer.hidden, intermediate=layer.inter, gated=layer.gated)
    spec = SimpleNamespace(**sizes, activation=activation)
    with torch.device(device):
        build_moe_layer_from_tensors(spec, tensors, top_k, fmt=layers.fmt, dtype=checkpoints.dtype(layers.config))


def check_model(model_dir: str, device: torch.device) -> dict:
    """Build and verify every distinct NVFP4 layer configuration of `model_dir` on `device`; return what was checked."""
    layers = discover(model_dir)
    dense, moe = layers.distinct()
    if not dense and not moe:
        raise ConfigError(f"model_dir={model_dir!r}: no NVFP4 linear or MoE layer found in its safetensors files")
    for layer in dense:
        _build_dense(layers, layer, device)
    for layer in moe:
        _build_moe(layers, layer, device)
    return {
        "format": layers.fmt,
        "dense": [d.name for d in dense],
        "moe": [m.prefix for m in moe],
        "layers": len(layers.dense) + len(layers.moe),
    }
