"""Build SGLang's real NVFP4 linear layer from one layer's checkpoint tensors (demo, selftest --model).

SGLang's own create_weights, the tensors placed as its loader places them, then process_weights_after_loading.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..checkpoints import MODELOPT, NAMES


def _create_weights(fmt: str, module: torch.nn.Module, sizes: list[int], k: int, dtype: torch.dtype):
    """Return SGLang's linear method (or scheme) for `fmt`, its create_weights run on `module`."""
    noop = lambda *args, **kwargs: None  # noqa: E731 - the tensors are placed by the caller, as the loader would
    if fmt == MODELOPT:
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod

        method = ModelOptFp4LinearMethod(ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16))
        shape = dict(input_size_per_partition=k, output_partition_sizes=sizes, input_size=k, output_size=sum(sizes))
        method.create_weights(module, **shape, params_dtype=dtype, weight_loader=noop)
        return method
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
        CompressedTensorsW4A4Fp4,
    )

    scheme = CompressedTensorsW4A4Fp4()
    scheme.create_weights(
        module, output_partition_sizes=sizes, input_size_per_partition=k, params_dtype=dtype, weight_loader=noop
    )
    return scheme


def _scalar_into(param: torch.Tensor, index: int, value: torch.Tensor) -> None:
    param.data.view(-1)[index] = value.float().reshape(-1)[0].to(param.dtype)


def build_linear_layer(
    shards: list[Mapping[str, torch.Tensor]],
    fmt: str = MODELOPT,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
):
    """Return (method, layer): SGLang's NVFP4 linear layer of `shards` (fused in order), weights processed."""
    weight, block, global_scale, input_scale = NAMES[fmt]
    sizes = [shard[weight].shape[0] for shard in shards]
    k = shards[0][weight].shape[1] * 2
    module = torch.nn.Module()
    module.params_dtype = dtype  # as SGLang's LinearBase.__init__ sets it (some releases' create_weights do not)
    method = _create_weights(fmt, module, sizes, k, dtype)
    module.to(device)
    with torch.no_grad():
        row = 0
        for i, (shard, n) in enumerate(zip(shards, sizes)):
            getattr(module, weight).data[row : row + n].copy_(shard[weight])
            getattr(module, block).data[row : row + n].copy_(shard[block].view(torch.float8_e4m3fn))
            _scalar_into(getattr(module, global_scale), i, shard[global_scale])
            _scalar_into(getattr(module, input_scale), i, shard[input_scale])
            row += n
    method.process_weights_after_loading(module)
    return method, module


def build_modelopt_layer(ckpt, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """Return (method, layer) for a :class:`sm120_fp4.demo.synthetic.Checkpoint`; ``method.apply(layer, x)`` runs it."""
    return build_linear_layer([ckpt.tensors()], MODELOPT, device, dtype)
