"""Verify a checkpoint's own NVFP4 layers on this device, without a server (``sm120-fp4 selftest --model DIR``).

The checkpoint's tensors are listed from its safetensors headers (nothing is loaded but the layers
checked). Its linear layers are grouped as SGLang serves them: shards SGLang fuses into one GEMM
(``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``, as the model class's own
``packed_modules_mapping`` says) become one layer of N = the sum of the shards. For each distinct
configuration (dense: N, K; MoE: experts, hidden, intermediate, activation) the first such layer is built
as SGLang builds it: its quantization method's ``create_weights``, the checkpoint's own tensors put where
SGLang's loader puts them (dense: each shard's rows and per-shard scales at tensor-parallel size 1; MoE:
through ``FusedMoE.weight_loader``), then ``process_weights_after_loading``, whose patched hooks decide
the device's backend and run the layer checks (the served call, this layer's weights, every batch-size
bucket) exactly as in a server. A failure raises RefusedToServe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .. import checkpoints
from ..errors import ConfigError

__all__ = ["ModelLayers", "discover", "check_model"]

_DENSE_SUFFIX = {fmt: names[0] for fmt, names in checkpoints.NAMES.items()}
_DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>\w+)$"
)
_PROJ = checkpoints.ROLES
_SCALES = {fmt: names[1:] for fmt, names in checkpoints.NAMES.items()}


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
    """What `discover` found: the format, the config, every NVFP4 layer, and where each tensor is."""

    fmt: str
    config: dict
    dense: list[DenseLayer] = field(default_factory=list)
    moe: list[MoeLayer] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> safetensors file
    shapes: dict[str, tuple] = field(default_factory=dict)

    def distinct(self) -> tuple[list[DenseLayer], list[MoeLayer]]:
        """The first layer of every distinct configuration (what a server verifies in full)."""
        dense, moe = {}, {}
        for layer in self.dense:
            dense.setdefault(layer.key, layer)
        for layer in self.moe:
            moe.setdefault(layer.key, layer)
        return list(dense.values()), list(moe.values())


def _text_config(config: dict) -> dict:
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def _packed_modules(config: dict) -> dict[str, list[str]]:
    """The model class's packed_modules_mapping (SGLang's fusion of shards), or the common one."""
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
    """Every NVFP4 linear and MoE layer of the checkpoint in `model_dir`, from its config and headers,
    after checkpoints.inspect() validated them (CheckpointError names what is wrong; `values`: its scales too)."""
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


def _scalar_into(param: torch.Tensor, index: int, value: torch.Tensor) -> None:
    param.data.view(-1)[index] = value.float().reshape(-1)[0].to(param.dtype)


def _build_dense(layers: ModelLayers, layer: DenseLayer, device: torch.device) -> None:
    """SGLang's linear method for this format, this layer's shards loaded, weights processed (the hooks verify)."""
    fmt, dtype = layers.fmt, _dtype(layers.config)
    weight_name, (block, global_name, input_name) = _DENSE_SUFFIX[fmt], _SCALES[fmt]
    tensors = _load(
        layers,
        [
            f"{s}.{k}"
            for s in layer.shards
            for k in (weight_name, block, global_name, input_name)
            if f"{s}.{k}" in layers.files
        ],
    )
    module = torch.nn.Module()
    module.params_dtype = dtype
    noop = lambda *args, **kwargs: None  # noqa: E731 - the tensors are placed below, as the loader would
    if fmt == checkpoints.MODELOPT:
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod

        method = ModelOptFp4LinearMethod(ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16))
        method.create_weights(
            module,
            input_size_per_partition=layer.k,
            output_partition_sizes=layer.sizes,
            input_size=layer.k,
            output_size=sum(layer.sizes),
            params_dtype=dtype,
            weight_loader=noop,
        )
        process = method.process_weights_after_loading
    else:
        from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
            CompressedTensorsW4A4Fp4,
        )

        scheme = CompressedTensorsW4A4Fp4()
        scheme.create_weights(
            module,
            output_partition_sizes=layer.sizes,
            input_size_per_partition=layer.k,
            params_dtype=dtype,
            weight_loader=noop,
        )
        process = scheme.process_weights_after_loading
    module.to(device)
    with torch.no_grad():
        row = 0
        for i, (shard, n) in enumerate(zip(layer.shards, layer.sizes)):
            getattr(module, weight_name).data[row : row + n].copy_(tensors[f"{shard}.{weight_name}"])
            getattr(module, block).data[row : row + n].copy_(tensors[f"{shard}.{block}"].view(torch.float8_e4m3fn))
            _scalar_into(getattr(module, global_name), i, tensors[f"{shard}.{global_name}"])
            _scalar_into(getattr(module, input_name), i, tensors[f"{shard}.{input_name}"])
            row += n
    process(module)


def _check_shard_scales(layers: ModelLayers) -> None:
    """Every dense layer's shards' own global scales (not only each configuration's first layer: only
    scalars are read), as SGLang's fusion would serve them: RefusedToServe naming the layer, its
    shards and their values where one global scale would serve some shard's rows wrong: CheckpointError
    naming the layer, its shards and their values (the checkpoint's fault, whatever kernel would run)."""
    from ..errors import CheckpointError
    from .scales import shard_scales_problem

    kind = "ModelOptFp4LinearMethod" if layers.fmt == checkpoints.MODELOPT else "CompressedTensorsW4A4Fp4"
    _, global_name, input_name = _SCALES[layers.fmt]
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


@dataclass
class _Experts:
    """What moe_layers' builder reads of a checkpoint: sizes and activation."""

    num_experts: int
    hidden: int
    intermediate: int
    gated: bool

    @property
    def activation(self) -> str:
        return "swiglu" if self.gated else "relu2"


def _build_moe(layers: ModelLayers, layer: MoeLayer, device: torch.device) -> None:
    from . import moe_layers

    kinds = (_DENSE_SUFFIX[layers.fmt], *_SCALES[layers.fmt])
    names = [
        n
        for n in layers.files
        if n.startswith(layer.prefix + ".") and _EXPERT.match(n) and _EXPERT.match(n)["kind"] in kinds
    ]
    tensors = {}
    for name, value in _load(layers, names).items():
        m = _EXPERT.match(name)
        tensors[f"experts.{m['e']}.{_PROJ.get(m['proj'], m['proj'])}.{m['kind']}"] = value
    top_k = int(
        _text_config(layers.config).get("num_experts_per_tok") or _text_config(layers.config).get("moe_topk") or 2
    )
    spec = _Experts(layer.experts, layer.hidden, layer.inter, layer.gated)
    with torch.device(device):
        moe_layers.build_moe_layer_from_tensors(spec, tensors, top_k, fmt=layers.fmt, dtype=_dtype(layers.config))


def check_model(model_dir: str, device: torch.device) -> dict:
    """Build and verify every distinct NVFP4 layer configuration of `model_dir` on `device` (install() first).

    Returns what was checked: {"format", "dense": [names], "moe": [prefixes], "layers": total NVFP4 layers}.
    Raises RefusedToServe when a configuration does not verify, CheckpointError for an unusable checkpoint
    (ConfigError for one that is not NVFP4).
    """
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
