"""Verify a checkpoint's own NVFP4 layers on this device, without a server (``sm120-fp4 selftest --model DIR``).

Layers are grouped as SGLang serves them (shards fused per the model's ``packed_modules_mapping``); the
first layer of each distinct configuration is built through SGLang's own layers from the checkpoint's
tensors, and the patched weights hooks verify it as in a server. A failure raises RefusedToServe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .. import checkpoints
from ..errors import CheckpointError, ConfigError
from .layers import build_linear_layer
from .moe_layers import build_moe_layer_from_tensors

__all__ = ["ModelLayers", "discover", "check_model"]

_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>\w+)$"
)


@dataclass
class DenseLayer:
    name: str  # the fused module's name, e.g. model.layers.0.self_attn.qkv_proj
    shards: list[str]  # the checkpoint modules, in SGLang's shard order
    sizes: list[int]  # each shard's N
    k: int

    @property
    def key(self) -> tuple:
        return (tuple(self.sizes), self.k)


@dataclass
class MoeLayer:
    prefix: str  # e.g. model.layers.3.mlp.experts
    experts: int
    hidden: int
    inter: int
    gated: bool

    @property
    def key(self) -> tuple:
        return (self.experts, self.hidden, self.inter, self.gated)


@dataclass
class ModelLayers:
    """Hold what `discover` found: the format, the config, every NVFP4 layer, and where each tensor is."""

    fmt: str
    config: dict
    dense: list[DenseLayer] = field(default_factory=list)
    moe: list[MoeLayer] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> safetensors file
    shapes: dict[str, tuple] = field(default_factory=dict)

    def distinct(self) -> tuple[list[DenseLayer], list[MoeLayer]]:
        """Return the first layer of every distinct configuration (what a server verifies in full)."""
        dense, moe = {}, {}
        for layer in self.dense:
            dense.setdefault(layer.key, layer)
        for layer in self.moe:
            moe.setdefault(layer.key, layer)
        return list(dense.values()), list(moe.values())


def _text_config(config: dict) -> dict:
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def _packed_modules(config: dict) -> dict[str, list[str]]:
    """Return the model class's packed_modules_mapping (SGLang's fusion of shards), or the common one."""
    try:
        from sglang.srt.models.registry import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(config.get("architectures") or [])
        mapping = getattr(cls, "packed_modules_mapping", None)
        if isinstance(mapping, dict) and mapping:
            return {k: list(v) for k, v in mapping.items()}
    except Exception:
        pass
    return dict(_DEFAULT_PACKED)


def discover(model_dir: str, values: bool = False) -> ModelLayers:
    """Return every NVFP4 linear and MoE layer of `model_dir`, after checkpoints.inspect() validated it."""
    checkpoint = checkpoints.inspect(model_dir, values=values)
    found = ModelLayers(
        checkpoint.format,
        checkpoint.config,
        files={k: v.file for k, v in checkpoint.tensors.items()},
        shapes={k: v.shape for k, v in checkpoint.tensors.items()},
    )
    linear = checkpoint.linear()
    packed = _packed_modules(checkpoint.config)
    done: set[str] = set()
    for module in sorted(linear):
        if module in done:
            continue
        parent, _, leaf = module.rpartition(".")
        for fused, parts in packed.items():
            names = [f"{parent}.{p}" for p in parts]
            if leaf in parts and all(n in linear for n in names) and len({linear[n][1] for n in names}) == 1:
                found.dense.append(
                    DenseLayer(f"{parent}.{fused}", names, [linear[n][0] for n in names], linear[module][1])
                )
                done.update(names)
                break
        else:
            found.dense.append(DenseLayer(module, [module], [linear[module][0]], linear[module][1]))
            done.add(module)
    for prefix, roles in sorted(checkpoint.experts.items()):
        down = roles["down_proj"]
        hidden, inter = checkpoint.modules[down[min(down)]]
        found.moe.append(MoeLayer(prefix, len(down), hidden, inter, "gate_proj" in roles))
    return found


def _load(layers: ModelLayers, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out, by_file = {}, {}
    for name in names:
        by_file.setdefault(layers.files[name], []).append(name)
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    return out


def _dtype(config: dict) -> torch.dtype:
    text = _text_config(config)
    name = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return torch.float16 if name in ("float16", "half") else torch.bfloat16


def _build_dense(layers: ModelLayers, layer: DenseLayer, device: torch.device) -> None:
    """Build SGLang's linear layer of this format from its shards' tensors (the hooks verify it)."""
    kinds = checkpoints.NAMES[layers.fmt]
    tensors = _load(layers, [f"{s}.{k}" for s in layer.shards for k in kinds if f"{s}.{k}" in layers.files])
    shards = [{k: tensors[f"{s}.{k}"] for k in kinds} for s in layer.shards]
    build_linear_layer(shards, layers.fmt, device, _dtype(layers.config))


def _check_shard_scales(layers: ModelLayers) -> None:
    """Raise CheckpointError where one fused global scale would serve some dense layer's shard wrong."""
    from .hooks import shard_scales_problem

    kind = "ModelOptFp4LinearMethod" if layers.fmt == checkpoints.MODELOPT else "CompressedTensorsW4A4Fp4"
    _, _, global_name, input_name = checkpoints.NAMES[layers.fmt]
    names = [
        f"{s}.{k}"
        for layer in layers.dense
        for s in layer.shards
        for k in (global_name, input_name)
        if f"{s}.{k}" in layers.files
    ]
    scales = {name: value.float().reshape(-1) for name, value in _load(layers, names).items()}
    for layer in layers.dense:
        values = [
            [float(scales[f"{s}.{k}"][0]) for s in layer.shards if f"{s}.{k}" in scales]
            for k in (global_name, input_name)
        ]
        if any(len(v) != len(layer.shards) for v in values):
            continue  # a missing scale: said where the layer is built
        problem = shard_scales_problem(kind, [s.rpartition(".")[2] for s in layer.shards], *values)
        if problem is not None:
            raise CheckpointError(f"the NVFP4 layer {layer.name} ({kind}, shards {', '.join(layer.shards)}): {problem}")


def _build_moe(layers: ModelLayers, layer: MoeLayer, device: torch.device) -> None:
    """Build SGLang's FusedMoE of this format from the layer's expert tensors (the hooks verify it)."""
    kinds = checkpoints.NAMES[layers.fmt]
    matches = {n: _EXPERT.match(n) for n in layers.files if n.startswith(layer.prefix + ".")}
    matches = {n: m for n, m in matches.items() if m and m["kind"] in kinds}
    tensors = {}
    for name, value in _load(layers, list(matches)).items():
        m = matches[name]
        tensors[f"experts.{m['e']}.{checkpoints.ROLES.get(m['proj'], m['proj'])}.{m['kind']}"] = value
    text = _text_config(layers.config)
    top_k = int(text.get("num_experts_per_tok") or text.get("moe_topk") or 2)
    activation = "swiglu" if layer.gated else "relu2"
    spec = SimpleNamespace(
        num_experts=layer.experts,
        hidden=layer.hidden,
        intermediate=layer.inter,
        gated=layer.gated,
        activation=activation,
    )
    with torch.device(device):
        build_moe_layer_from_tensors(spec, tensors, top_k, fmt=layers.fmt, dtype=_dtype(layers.config))


def check_model(model_dir: str, device: torch.device) -> dict:
    """Build and verify every distinct NVFP4 layer configuration of `model_dir` on `device`; return what was checked."""
    layers = discover(model_dir)
    dense, moe = layers.distinct()
    if not dense and not moe:
        raise ConfigError(f"model_dir={model_dir!r}: no NVFP4 linear or MoE layer found in its safetensors files")
    _check_shard_scales(layers)
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
