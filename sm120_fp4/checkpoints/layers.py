"""A checkpoint's NVFP4 layers as an engine serves them: dense shards fused, MoE experts grouped, tensors loaded."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from .checks import _EXPERT, inspect
from .quantization import text_config
from .scales import SCALE_NAMES, shard_scales_problem
from .tensors import TensorInfo, read_bytes, read_scalar

DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
EXPERT = re.compile(_EXPERT.pattern.removesuffix("$") + r"\.(?P<kind>\w+)$")


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

    def distinct(self) -> tuple[list[DenseLayer], list[MoeLayer]]:
        """Return the first layer of every distinct configuration (what a server verifies in full)."""
        dense, moe = {}, {}
        for layer in self.dense:
            dense.setdefault(layer.key, layer)
        for layer in self.moe:
            moe.setdefault(layer.key, layer)
        return list(dense.values()), list(moe.values())


def discover(model_dir: str, values: bool = False, packed: Callable[[dict], dict] | None = None) -> ModelLayers:
    """Return every NVFP4 linear and MoE layer of `model_dir`, shards fused as `packed(config)` says."""
    checkpoint = inspect(model_dir, values=values)
    files = {k: v.file for k, v in checkpoint.tensors.items()}
    found = ModelLayers(checkpoint.format, checkpoint.config, files=files)
    linear = checkpoint.linear()
    packed = packed(checkpoint.config) if packed else dict(DEFAULT_PACKED)
    done: set[str] = set()
    for module in sorted(linear):
        if module in done:
            continue
        parent, _, leaf = module.rpartition(".")
        for fused, parts in packed.items():
            names = [f"{parent}.{p}" for p in parts]
            if leaf in parts and all(n in linear for n in names) and len({linear[n][1] for n in names}) == 1:
                sizes = [linear[n][0] for n in names]
                found.dense.append(DenseLayer(f"{parent}.{fused}", names, sizes, linear[module][1]))
                done.update(names)
                break
        else:
            found.dense.append(DenseLayer(module, [module], [linear[module][0]], linear[module][1]))
            done.add(module)
    _check_shard_scales(found, checkpoint.tensors)
    for prefix, roles in sorted(checkpoint.experts.items()):
        down = roles["down_proj"]
        hidden, inter = checkpoint.modules[down[min(down)]]
        found.moe.append(MoeLayer(prefix, len(down), hidden, inter, "gate_proj" in roles))
    return found


def _check_shard_scales(found: ModelLayers, tensors: dict[str, TensorInfo]) -> None:
    """Raise CheckpointError where the one global scale an engine serves a dense layer with is wrong for a shard."""
    names = SCALE_NAMES[found.fmt]
    opened: dict = {}
    with contextlib.ExitStack() as files:

        def value(name: str) -> float:
            return read_scalar(read_bytes(files, opened, name, tensors[name]), tensors[name].dtype)

        for layer in found.dense:
            values = [[value(f"{s}.{kind}") for s in layer.shards] for kind in names[:2]]
            problem = shard_scales_problem(names, [s.rpartition(".")[2] for s in layer.shards], *values)
            if problem is not None:
                where = tensors[f"{layer.shards[0]}.{names[0]}"].file
                shards = f", shards {', '.join(layer.shards)}" if len(layer.shards) > 1 else ""
                raise CheckpointError(f"{where}: the NVFP4 layer {layer.name}{shards}: {problem}")


def load(layers: ModelLayers, names: list[str]) -> dict[str, torch.Tensor]:
    """Return the named tensors, each read from its safetensors file."""
    from safetensors import safe_open

    out, by_file = {}, {}
    for name in names:
        by_file.setdefault(layers.files[name], []).append(name)
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    return out


def dtype(config: dict) -> torch.dtype:
    """Return the activation dtype the checkpoint's config names (float16, else bfloat16)."""
    text = text_config(config)
    name = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return torch.float16 if name in ("float16", "half") else torch.bfloat16
