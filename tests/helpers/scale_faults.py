"""Faulty checkpoint scales of one fused q/k/v layer: the same faults run through SGLang's and vLLM's real layers.

Each fault edits the shards of :func:`helpers.sglang_layers.fused_dense_shards` (ModelOpt's names; the builders
give compressed-tensors the encode scales, 1 / ModelOpt's) and says what the refusal must name, in either format.
"""

from __future__ import annotations

import torch

QKV = [128, 64, 64]
K = 160


def _scale(shard: int, key: str, value: float | None = None, factor: float = 1.0):
    def change(shards: list[dict]) -> None:
        tensor = shards[shard][key]
        shards[shard][key] = torch.full_like(tensor, value) if value is not None else tensor * factor

    return change


def _block_byte(shards: list[dict]) -> None:
    shards[0]["weight_scale"] = shards[0]["weight_scale"].clone()
    shards[0]["weight_scale"].view(torch.uint8)[1, 3] = 0xB8


# fault -> (edit of the shards, a regular expression the refusal matches in both formats)
SHARD_FAULTS = {
    "q's weight global scale 4x smaller than k's and v's": (
        _scale(0, "weight_scale_2", factor=0.25),
        r"weight_(scale_2|global_scale) differ in the checkpoint .*rows of shard \d by (4|0.25)\b",
    ),
    "k's weight global scale zero": (
        _scale(1, "weight_scale_2", 0.0),
        r"the checkpoint's weight_(scale_2|global_scale)\[1\] = (0.0|inf); accepted: a finite positive scale",
    ),
    "v's activation scale negative": (
        _scale(2, "input_scale", -1.0),
        r"the checkpoint's input(_global)?_scale\[2\] = -1.0; accepted: a finite positive scale",
    ),
    "q's weight global scale 1e-45 (subnormal: alpha underflows)": (
        _scale(0, "weight_scale_2", 1e-45),
        r"the checkpoint's weight_(scale_2|global_scale)\[0\] = (1.40\d*e-45|inf); accepted: .*a normal float32",
    ),
    "a block-scale byte with the sign bit set": (
        _block_byte,
        r"the checkpoint's weight_scale\[1, 3\] is a negative block scale \(the sign bit set\) \(E4M3 byte 0xb8\)",
    ),
}


def faulty_shards(fault: str) -> list[dict]:
    """Return the fused layer's shards with `fault` applied."""
    from helpers.sglang_layers import fused_dense_shards

    shards = fused_dense_shards(QKV, K)
    SHARD_FAULTS[fault][0](shards)
    return shards


def _moe_scale(name: str, index: tuple, value: float | None = None, factor: float = 1.0):
    def change(ckpt) -> None:
        tensor = getattr(ckpt, name)
        tensor[index] = value if value is not None else tensor[index] * factor

    return change


def _moe_block_byte(ckpt) -> None:
    ckpt.w13_weight_scale.view(torch.uint8)[1, 2, 3] = 0x90


# fault -> (edit of a synthetic.make_moe_checkpoint, a regular expression the refusal matches in both formats)
MOE_FAULTS = {
    "expert 2's w2 activation scale infinite": (
        _moe_scale("w2_input_scale", (2,), float("inf")),
        r"the checkpoint's w2_input(_global)?_scale\[2\] = (inf|0.0); accepted: a finite positive scale",
    ),
    "expert 3's gate and up weight global scales differ": (
        _moe_scale("w13_weight_scale_2", (3, 1), factor=4.0),
        r"expert 3's gate and up weight_(scale_2|global_scale) differ .* requantize the checkpoint",
    ),
    "a w13 block-scale byte with the sign bit set": (
        _moe_block_byte,
        r"the checkpoint's w13_weight_scale\[1, \d+, 3\] is a negative block scale \(the sign bit set\)",  # expert 1
    ),
}


def faulty_moe(fault: str, experts: int, hidden: int, inter: int, seed: int = 7):
    """Return a synthetic MoE checkpoint with `fault` applied."""
    from sm120_fp4.demo import synthetic

    ckpt = synthetic.make_moe_checkpoint(experts, hidden, inter, seed=seed)
    MOE_FAULTS[fault][0](ckpt)
    return ckpt
