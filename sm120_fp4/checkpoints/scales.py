"""An NVFP4 checkpoint's scales judged once for every engine: global, activation and block scales, fused shards.

The engine homes read a layer's scale tensors as their loaders left them (before processing reduces a fused
layer's shards to one) and pass plain tensors here; the validation pass passes the values it read from the files.
"""

from __future__ import annotations

import math
import re

import torch

from .quantization import COMPRESSED_TENSORS, MODELOPT, NAMES

# Each format's (weight global scale, activation global scale, whether they are encode scales): ModelOpt keeps
# decode scales (amax / (448 * 6): dequantized = code x block scale x it), compressed-tensors their inverse.
SCALE_NAMES = {
    MODELOPT: ("weight_scale_2", "input_scale", False),
    COMPRESSED_TENSORS: ("weight_global_scale", "input_global_scale", True),
}
# The smallest normal float32: a global scale below it (or an alpha, its product) is flushed to zero by the kernels.
_TINY = 2.0**-126
_F32_MAX = 3.4028234663852886e38
_BAD_BLOCK = re.compile(rb"[\x7f-\xff]")  # E4M3 NaN (0x7f, 0xff) or the sign bit set


def scale_problem(name: str, value: float) -> str | None:
    """Return why a global or activation scale is unusable (NaN, infinite, zero, negative, subnormal), or None."""
    why = (
        "a finite positive scale, a normal float32 (the checkpoint's scale is wrong, not a kernel: requantize or "
        "recalibrate the layer)"
    )
    return None if math.isfinite(value) and _TINY <= value <= _F32_MAX else f"{name} = {value!r}; accepted: {why}"


def alpha_problem(where: str, weight: float, activation: float, encode: bool) -> str | None:
    """Return why a layer's alpha (its two global scales combined) underflows or overflows float32, or None."""
    # ModelOpt keeps decode scales: alpha = input_scale x weight_scale_2; compressed-tensors encode scales:
    # alpha = 1 / (input_global_scale x weight_global_scale).
    product = weight * activation
    alpha = (1.0 / product if product else math.inf) if encode else product
    if _TINY <= alpha <= _F32_MAX:
        return None
    return (
        f"{where}: its global scales ({weight!r} and {activation!r}) give the GEMM an alpha of {alpha:.3g}, outside "
        "float32's normal range (flushed to zero, or infinite); accepted: global scales whose alpha is "
        "a normal float32 (the checkpoint's scales are wrong, not a kernel: requantize the layer)"
    )


def _at(flat: int, shape: tuple) -> str:
    """Return the index ``[i, j]`` of element `flat` of a tensor of `shape` (empty for a 0-dim tensor)."""
    return f"[{', '.join(str(int(i)) for i in torch.unravel_index(torch.tensor(flat), shape))}]" if shape else ""


def block_scale_problem(name: str, data: bytes, shape: tuple) -> str | None:
    """Return why E4M3 block-scale bytes (a tensor of `shape`) hold a NaN or a negative scale, or None."""
    if (found := _BAD_BLOCK.search(data)) is None:
        return None
    byte = data[found.start()]
    what = "a NaN block scale" if byte in (0x7F, 0xFF) else "a negative block scale (the sign bit set)"
    return (
        f"{name}{_at(found.start(), shape)} is {what} (E4M3 byte 0x{byte:02x}); accepted: float8_e4m3fn block scales that "
        "are positive or zero and not NaN (bytes 0x00-0x7e): the checkpoint is corrupt, not a kernel"
    )


def loaded_scales_problem(scales: dict[str, torch.Tensor], blocks: dict[str, torch.Tensor]) -> str | None:
    """Return why the global/activation `scales` or E4M3 `blocks` an engine loaded cannot serve (by name), or None."""
    for name, tensor in scales.items():
        if tensor.numel() == 0:
            continue
        values = tensor.detach().float().cpu()
        bad = ~(torch.isfinite(values) & (values >= _TINY) & (values <= _F32_MAX))
        if bool(bad.any()):  # the first bad value, named by its index
            flat = int(bad.reshape(-1).nonzero()[0])
            return scale_problem(
                f"the checkpoint's {name}{_at(flat, tuple(bad.shape))}", float(values.reshape(-1)[flat])
            )
    for name, tensor in blocks.items():
        if tensor.dtype in (torch.float8_e4m3fn, torch.uint8):
            data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
            if problem := block_scale_problem(f"the checkpoint's {name}", data, tuple(tensor.shape)):
                return problem
    return None


def shard_names(layer: object, count: int) -> list[str]:
    """Return how a fused layer's shards are named: q, k, v (the engines' QKVParallelLinear), else their index."""
    if count == 3 and type(layer).__name__ == "QKVParallelLinear":
        return ["q", "k", "v"]
    return [f"shard {i}" for i in range(count)] if count > 1 else ["(the only shard)"]


def shard_scales_problem(
    names: tuple[str, str, bool], shards: list[str], weight_scales: list[float], input_scales: list[float]
) -> str | None:
    """Return why a dense layer would serve wrong numbers from its shards' global scales, or None.

    `names` is the format's (weight global scale, activation global scale, whether they are encode scales).
    """
    # SGLang and vLLM serve a fused layer with ONE weight global scale, the largest of its shards': another shard's
    # rows come out scaled (the layer check cannot see it: its oracle reads the same alpha). Different activation
    # scales only change the activation's quantization; a non-positive or non-finite one is still named.
    weight_name, input_name, encode = names
    for name, values in ((weight_name, weight_scales), (input_name, input_scales)):
        for shard, value in zip(shards, values):
            if (problem := scale_problem(f"the checkpoint's {name} of {shard}", value)) is None:
                continue
            if len(shards) == 1:
                return problem
            listed = ", ".join(f"{s} {v:.6g}" for s, v in zip(shards, values))
            return (
                f"{problem}; the engines serve the fused layer with the largest of its shards' {name} ({listed}), "
                "which would hide it"
            )
    served = max(weight_scales)
    wrong = [(s, v) for s, v in zip(shards, weight_scales) if abs(v - served) > 1e-6 * served]
    if not wrong:
        return None
    # The served scale over the shard's own: decode scales multiply, encode scales divide.
    factors = ", ".join(f"{s} by {(v / served if encode else served / v):.4g}" for s, v in wrong)
    return (
        f"its shards' {weight_name} differ in the checkpoint "
        f"({', '.join(f'{s} {v:.6g}' for s, v in zip(shards, weight_scales))}): SGLang and vLLM serve the fused layer "
        f"with one global scale, the largest, which scales the rows of {factors} (wrong numbers for every token); "
        f"requantize the checkpoint with one {weight_name} for the shards fused into this layer"
    )


def gate_up_problem(name: str, scales: torch.Tensor) -> str | None:
    """Return why an MoE layer's gate and up global scales `name` (experts, 2) differ (the gate's serves both)."""
    if scales.dim() != 2 or scales.shape[1] != 2:
        return None
    gate, up = scales[:, 0].detach().float().cpu(), scales[:, 1].detach().float().cpu()
    differ = (gate - up).abs() > 1e-6 * gate.abs().clamp_min(1e-30)
    if not bool(differ.any()):
        return None
    expert = int(differ.nonzero()[0])
    return (
        f"expert {expert}'s gate and up {name.removeprefix('w13_')} differ ({float(gate[expert]):.6g} vs {float(up[expert]):.6g}): the "
        "NVFP4 MoE kernels apply the gate's scale to both halves, which serves wrong numbers for every token routed "
        "there; requantize the checkpoint with one global scale for w1 and w3"
    )


def layer_problem(fmt: str, layer: object, moe: bool = False, activation: bool = True) -> str | None:
    """Return why the checkpoint scales an engine's NVFP4 layer of format `fmt` loaded cannot serve, or None.

    Read before the engine processes the weights, where a fused layer still holds each shard's scales (SGLang and
    vLLM name the parameters as the checkpoint does; an MoE layer's with the ``w13_`` and ``w2_`` prefixes). With
    `activation` False (weight-only), no activation scale is loaded or read.
    """
    _, block, weight_name, input_name = NAMES[fmt]

    def tensors(*names: str) -> dict[str, torch.Tensor]:
        full = [f"{p}{n}" for n in names for p in (("w13_", "w2_") if moe else ("",))]
        return {n: t for n in full if isinstance(t := getattr(layer, n, None), torch.Tensor)}

    if problem := loaded_scales_problem(tensors(weight_name, *[input_name] * activation), tensors(block)):
        return problem
    if moe:
        return next((gate_up_problem(n, t) for n, t in tensors(weight_name).items() if n.startswith("w13_")), None)
    weights, inputs = getattr(layer, weight_name, None), getattr(layer, input_name, None)
    if not activation or not isinstance(weights, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        return None
    weights, inputs = (t.detach().float().reshape(-1).cpu().tolist() for t in (weights, inputs))
    return shard_scales_problem(SCALE_NAMES[fmt], shard_names(layer, len(weights)), weights, inputs)
