"""Real SGLang NVFP4 layers built from synthetic checkpoints (the demo's and the tests' layers).

The layer is SGLang's own ``ModelOptFp4LinearMethod`` (create_weights, checkpoint load,
process_weights_after_loading, apply); the checkpoint is made with :mod:`sm120_fp4.nvfp4` in
ModelOpt's format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import nvfp4

__all__ = ["Checkpoint", "make_checkpoint", "build_modelopt_layer", "reference_output"]


@dataclass
class Checkpoint:
    """ModelOpt NVFP4 tensors of one linear layer (N outputs, K inputs)."""

    weight: torch.Tensor  # uint8 (N, K/2), packed E2M1
    weight_scale: torch.Tensor  # float8_e4m3fn (N, K/16), not swizzled (as stored on disk)
    weight_scale_2: torch.Tensor  # float32 (1,), 1 / weight global scale
    input_scale: torch.Tensor  # float32 (1,), 1 / activation global scale (calibrated)
    dense: torch.Tensor  # the bf16 weight it was made from


def make_checkpoint(n: int, k: int, seed: int = 0, calibration: torch.Tensor | None = None) -> Checkpoint:
    """Quantize a random (N, K) bf16 weight with nvfp4 into ModelOpt's checkpoint layout."""
    gen = torch.Generator().manual_seed(seed)
    dense = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    gsf_w = nvfp4.global_scale(dense)
    packed, swizzled = nvfp4.quantize(dense, gsf_w)
    if calibration is None:
        calibration = torch.randn(64, k, generator=gen).to(torch.bfloat16) * 2
    gsf_x = nvfp4.global_scale(calibration)
    return Checkpoint(
        weight=packed,
        weight_scale=nvfp4.unswizzle_scales(swizzled, n, k),
        weight_scale_2=(1.0 / gsf_w).reshape(1),
        input_scale=(1.0 / gsf_x).reshape(1),
        dense=dense,
    )


def build_modelopt_layer(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """SGLang's ModelOptFp4LinearMethod: create_weights, load `ckpt`, process_weights_after_loading.

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


def reference_output(ckpt: Checkpoint, x: torch.Tensor) -> torch.Tensor:
    """What the layer must compute: nvfp4 quantize x as SGLang does, then reference_mm_fp4."""
    device = x.device
    input_scale = ckpt.input_scale.to(device).max().float()
    gsf_x = (1 / input_scale).float()
    qx, sx = nvfp4.quantize(x, gsf_x)
    w_sf = nvfp4.swizzle_scales(ckpt.weight_scale.to(device))
    alpha = (input_scale * ckpt.weight_scale_2.to(device).max().float()).reshape(1)
    return nvfp4.reference_mm_fp4(qx, ckpt.weight.to(device).T, sx, w_sf.T, alpha, x.dtype)
