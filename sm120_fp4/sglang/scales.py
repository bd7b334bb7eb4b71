"""Refuse an NVFP4 checkpoint whose scales cannot serve, before any kernel is blamed: read as SGLang loaded them."""

from __future__ import annotations

import math

import torch

from .. import checkpoints

# The checkpoint's scales in each hooked layer before processing: (block, weight global, activation global).
_MODELOPT = ("weight_scale", "weight_scale_2", "input_scale")
_CT = ("weight_scale", "weight_global_scale", "input_global_scale")
CHECKPOINT_SCALES = {
    "ModelOptFp4LinearMethod": tuple((name,) for name in _MODELOPT),
    "CompressedTensorsW4A4Fp4": tuple((name,) for name in _CT),
    "ModelOptNvFp4FusedMoEMethod": tuple((f"w13_{name}", f"w2_{name}") for name in _MODELOPT),
    "CompressedTensorsW4A4Nvfp4MoE": tuple((f"w13_{name}", f"w2_{name}") for name in _CT),
}


def _first(mask: torch.Tensor) -> str:
    """Return the index of the first True of `mask`, as ``[i, j]`` (empty for a 0-dim tensor)."""
    flat = int(mask.reshape(-1).nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape)] if mask.dim() else []
    return f"[{', '.join(map(str, index))}]" if index else ""


W4A16_KNOB = "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"


def quant_mode_problem(kind: str, method: object) -> str | None:
    """Return why a dense NVFP4 layer's quant mode (0.5.19+ 'w4a16') cannot be served verified; None for W4A4."""
    mode = getattr(method, "quant_mode", "w4a4")
    if mode == "w4a4":
        return None
    return (
        f"SGLang serves {kind} with quant_mode={mode!r} ({W4A16_KNOB} with --fp4-gemm-backend flashinfer_cutedsl): "
        "its FP4 GEMM calls FlashInfer's mm_bf16_fp4 directly, which sm120_fp4 neither routes nor verifies on this "
        f"GPU. Unset {W4A16_KNOB} (the layer then runs W4A4 through the FP4 GEMM verified here), or set "
        "SM120_FP4_SELFTEST=warn to serve it unverified"
    )


def checkpoint_scale_problem(kind: str, method: object, layer: object) -> str | None:
    """Return why the checkpoint scales `layer` loaded cannot serve (non-positive, non-finite or NaN), or None."""
    block, weight_global, activation = CHECKPOINT_SCALES[kind]
    if getattr(method, "quant_mode", "w4a4") != "w4a4":
        activation = ()  # weight-only: no activation scale is loaded or read
    for name in (*weight_global, *activation):
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        values = tensor.detach().float()
        bad = ~(torch.isfinite(values) & (values > 0))
        if bool(bad.any()):
            at = _first(bad)
            value = float(values.reshape(-1)[int(bad.reshape(-1).nonzero()[0])])
            return checkpoints.scale_problem(f"the checkpoint's {name}{at}", value)
    for name in block:
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.float8_e4m3fn, torch.uint8):
            continue
        nan = (tensor.detach().view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            return (
                f"the checkpoint's {name}{_first(nan)} is a NaN block scale (E4M3 byte 0x7f/0xff); accepted: "
                "block scales that are not NaN (the checkpoint is corrupt, not a kernel)"
            )
    return None


# Where each dense format keeps its per-shard global scales before processing, and whether they are
# decode scales (ModelOpt: amax / (448 * 6), dequantized = code x block scale x it) or encode scales
# (compressed-tensors: the inverse).
SHARD_SCALES = {
    "ModelOptFp4LinearMethod": ("weight_scale_2", "input_scale", False),
    "CompressedTensorsW4A4Fp4": ("weight_global_scale", "input_global_scale", True),
}


def shard_scales_problem(kind: str, shards: list[str], weight_scales: list, input_scales: list) -> str | None:
    """Return why a fused layer of format `kind` would serve wrong numbers from its shards' global scales, or None."""
    # SGLang serves a fused layer with ONE weight global scale, the largest of its shards': another shard's rows
    # come out scaled (the layer check cannot see it: its oracle reads the same alpha). Different activation
    # scales only change the activation's quantization; a non-positive or non-finite one is still named.
    weight_name, input_name, encode = SHARD_SCALES[kind]
    for name, values in ((weight_name, weight_scales), (input_name, input_scales)):
        for shard, value in zip(shards, values):
            if not (math.isfinite(value) and value > 0):
                return (
                    f"the checkpoint's {name} of {shard} is {value!r}, not a usable global scale "
                    f"(accepted: a positive finite number); SGLang serves the fused layer with the largest of its "
                    f"shards' {name} ({', '.join(f'{s} {v:.6g}' for s, v in zip(shards, values))}), which hides it: "
                    "fix or requantize the checkpoint"
                )
    served = max(weight_scales)
    wrong = [(s, v) for s, v in zip(shards, weight_scales) if abs(v - served) > 1e-6 * served]
    if not wrong:
        return None
    # The served scale over the shard's own: decode scales multiply, encode scales divide.
    factors = ", ".join(f"{s} by {(v / served if encode else served / v):.4g}" for s, v in wrong)
    return (
        f"its shards' {weight_name} differ in the checkpoint "
        f"({', '.join(f'{s} {v:.6g}' for s, v in zip(shards, weight_scales))}): SGLang serves the fused layer with "
        f"one global scale, the largest, which scales the rows of {factors} (wrong numbers for every token); "
        f"requantize the checkpoint with one {weight_name} for the shards fused into this layer"
    )


def shard_names(layer: object, count: int) -> list[str]:
    """Return how a fused layer's shards are named: q, k, v (SGLang's QKVParallelLinear), else their index."""
    if count == 3 and type(layer).__name__ == "QKVParallelLinear":
        return ["q", "k", "v"]
    return [f"shard {i}" for i in range(count)] if count > 1 else ["(the only shard)"]


def layer_scales_problem(kind: str, method: object, layer: object) -> str | None:
    """Return shard_scales_problem of a dense W4A4 layer, read before SGLang reduces the scales to one."""
    if kind not in SHARD_SCALES or getattr(method, "quant_mode", "w4a4") != "w4a4":
        return None
    weight_name, input_name, _ = SHARD_SCALES[kind]
    weights, inputs = getattr(layer, weight_name, None), getattr(layer, input_name, None)
    if not isinstance(weights, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        return None
    weights, inputs = (t.detach().float().reshape(-1).cpu().tolist() for t in (weights, inputs))
    return shard_scales_problem(kind, shard_names(layer, len(weights)), weights, inputs)
