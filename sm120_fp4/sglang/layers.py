"""SGLang's real NVFP4 linear layer (``ModelOptFp4LinearMethod``) built from one layer's ModelOpt tensors.

The demo's dense layer (``sm120-fp4 demo``; its checkpoint is :func:`sm120_fp4.demo.synthetic.make_checkpoint`,
what it must compute :func:`sm120_fp4.demo.synthetic.reference_output`): SGLang's own create_weights,
checkpoint load, process_weights_after_loading (where the patched hook verifies the layer) and apply.
The MoE twin is :mod:`.moe_layers`.
"""

from __future__ import annotations

import torch

__all__ = ["build_modelopt_layer"]


def build_modelopt_layer(ckpt, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """SGLang's ModelOptFp4LinearMethod: create_weights, load `ckpt`, process_weights_after_loading.

    `ckpt` has one linear layer's ModelOpt tensors, ``weight`` (uint8 (N, K/2)), ``weight_scale``,
    ``weight_scale_2`` and ``input_scale`` (a :class:`sm120_fp4.demo.synthetic.Checkpoint`).

    `dtype` is the model's activation dtype (SGLang's params_dtype). Returns (method, layer);
    ``method.apply(layer, x)`` runs SGLang's forward.
    """
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod

    n, k = ckpt.weight.shape[0], ckpt.weight.shape[1] * 2
    method = ModelOptFp4LinearMethod(ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16))
    layer = torch.nn.Module()
    layer.params_dtype = dtype  # as SGLang's LinearBase.__init__ sets it (some releases' create_weights do not)
    method.create_weights(
        layer,
        input_size_per_partition=k,
        output_partition_sizes=[n],
        input_size=k,
        output_size=n,
        params_dtype=dtype,
    )
    layer.to(device)
    with torch.no_grad():
        for name in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            getattr(layer, name).data.copy_(getattr(ckpt, name).to(device))
    method.process_weights_after_loading(layer)
    return method, layer
