"""``sm120-fp4 selftest --model DIR --engine vllm``: each layer configuration built through vLLM's loader."""

from __future__ import annotations

import contextlib
import tempfile

import torch

from .. import checkpoints
from ..errors import ConfigError

_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # vLLM's fused-MoE loader's shard ids


@contextlib.contextmanager
def _vllm_process(device: torch.device):
    """vLLM's current config and the one-rank process group a worker has when it loads (made once per process)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            backend, init = "gloo" if device.type == "cpu" else "nccl", f"file://{tempfile.mkdtemp()}/init"
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend=backend, distributed_init_method=init
            )
            initialize_model_parallel(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(device)
        yield


def _quant_config(layers, model_dir: str):
    """vLLM's quantization config for the checkpoint's format (compressed-tensors: its own config.json section)."""
    if layers.fmt == checkpoints.MODELOPT:
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        return ModelOptNvFp4Config(is_checkpoint_nvfp4_serialized=True)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    return CompressedTensorsConfig.from_config(checkpoints.read_quantization(model_dir).config)


def _build_dense(layers, layer, quant_config, device: torch.device) -> None:
    """vLLM's fused linear layer for `layer`'s shards, each shard loaded by vLLM's loader, weights processed."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    dtype = checkpoints.dtype(layers.config)
    with torch.device(device):
        module = MergedColumnParallelLinear(
            layer.k, layer.sizes, bias=False, quant_config=quant_config, prefix=layer.name, params_dtype=dtype
        )
    names = checkpoints.NAMES[layers.fmt]
    tensors = checkpoints.load(layers, [f"{s}.{k}" for s in layer.shards for k in names if f"{s}.{k}" in layers.files])
    with torch.no_grad():
        for index, shard in enumerate(layer.shards):
            for kind in names:
                param = getattr(module, kind)
                param.weight_loader(param, tensors[f"{shard}.{kind}"].to(device), index)
    module.quant_method.process_weights_after_loading(module)


def _build_moe(layers, layer, quant_config, device: torch.device) -> None:
    """vLLM's fused-MoE layer for `layer`, every expert tensor placed by vLLM's own loader, weights processed."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    text = checkpoints.text_config(layers.config)
    top_k = int(text.get("num_experts_per_tok") or text.get("moe_topk") or 2)
    sizes = dict(num_experts=layer.experts, top_k=top_k, hidden_size=layer.hidden, intermediate_size=layer.inter)
    fields = dict(params_dtype=checkpoints.dtype(layers.config), prefix=layer.prefix, quant_config=quant_config)
    with torch.device(device):
        runner = FusedMoEFactory(**sizes, **fields, activation="silu" if layer.gated else "relu2_no_mul")
    [module] = [m for m in runner.modules() if hasattr(m, "weight_loader") and hasattr(m, "w2_weight_scale")]
    kinds, prefix = checkpoints.NAMES[layers.fmt], layer.prefix + "."
    matches = ((n, checkpoints.EXPERT.match(n)) for n in layers.files if n.startswith(prefix))
    names = [n for n, m in matches if m and m["kind"] in kinds]
    with torch.no_grad():
        for name, value in checkpoints.load(layers, names).items():
            m = checkpoints.EXPERT.match(name)
            proj = checkpoints.ROLES.get(m["proj"], m["proj"])
            target = "w2" if proj == "down_proj" else "w13"
            param = getattr(module, f"{target}_{m['kind']}")
            module.weight_loader(param, value.to(device), name, _SHARDS[proj], int(m["e"]))
    module.quant_method.process_weights_after_loading(module)


def check_model(model_dir: str, device: torch.device) -> dict:
    """Build and verify every distinct NVFP4 layer configuration of `model_dir` through vLLM's layers."""
    layers = checkpoints.discover(model_dir)  # the common fusion (qkv, gate_up), as vLLM's loader fuses them
    dense, moe = layers.distinct()
    if not dense and not moe:
        raise ConfigError(f"model_dir={model_dir!r}: no NVFP4 linear or MoE layer found in its safetensors files")
    with _vllm_process(device):
        quant_config = _quant_config(layers, model_dir)
        for layer in dense:
            _build_dense(layers, layer, quant_config, device)
        for layer in moe:
            _build_moe(layers, layer, quant_config, device)
    count = len(layers.dense) + len(layers.moe)
    return {"format": layers.fmt, "dense": [d.name for d in dense], "moe": [m.prefix for m in moe], "layers": count}
