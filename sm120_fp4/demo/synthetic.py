"""Synthetic NVFP4 checkpoints (one linear, one MoE layer) and their nvfp4-oracle references, as SGLang computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .. import nvfp4
from ..errors import not_accepted

ACTIVATIONS = ("swiglu", "relu2")
_KERNEL_TENSORS = nvfp4.MoeWeights._fields


def quantize_weight(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ModelOpt's (weight, weight_scale, weight_scale_2 0-dim) of a bf16 (N, K) weight."""
    gsf = nvfp4.global_scale(dense)
    packed, swizzled = nvfp4.quantize(dense, gsf)
    return packed, nvfp4.unswizzle_scales(swizzled, *dense.shape), (1.0 / gsf).reshape(())


@dataclass
class Checkpoint:
    """Hold ModelOpt NVFP4 tensors of one linear layer (N outputs, K inputs)."""

    weight: torch.Tensor  # uint8 (N, K/2), packed E2M1
    weight_scale: torch.Tensor  # float8_e4m3fn (N, K/16), not swizzled (as stored on disk)
    weight_scale_2: torch.Tensor  # float32 (1,), 1 / weight global scale
    input_scale: torch.Tensor  # float32 (1,), 1 / activation global scale (calibrated)
    dense: torch.Tensor  # the bf16 weight it was made from

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return the four tensors under ModelOpt's names."""
        return {k: getattr(self, k) for k in ("weight", "weight_scale", "weight_scale_2", "input_scale")}


def make_checkpoint(n: int, k: int, seed: int = 0) -> Checkpoint:
    """Quantize a random (N, K) bf16 weight with nvfp4 into ModelOpt's checkpoint layout."""
    gen = torch.Generator().manual_seed(seed)
    dense = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    packed, scales, scale_2 = quantize_weight(dense)
    calibration = torch.randn(64, k, generator=gen).to(torch.bfloat16) * 2
    input_scale = (1.0 / nvfp4.global_scale(calibration)).reshape(1)
    return Checkpoint(packed, scales, scale_2.reshape(1), input_scale, dense)


def reference_output(ckpt: Checkpoint, x: torch.Tensor) -> torch.Tensor:
    """Return what the layer must compute: nvfp4 quantize x as SGLang does, then reference_mm_fp4."""
    device = x.device
    input_scale = ckpt.input_scale.to(device).max().float()
    qx, sx = nvfp4.quantize(x, (1 / input_scale).float())
    w_sf = nvfp4.swizzle_scales(ckpt.weight_scale.to(device))
    alpha = (input_scale * ckpt.weight_scale_2.to(device).max().float()).reshape(1)
    return nvfp4.reference_mm_fp4(qx, ckpt.weight.to(device).T, sx, w_sf.T, alpha, x.dtype)


@dataclass
class MoeCheckpoint:
    """Hold ModelOpt NVFP4 tensors of one MoE layer (E experts, hidden H, intermediate I), stacked over experts."""

    activation: str  # "swiglu" (S = 2 w13 shards, rows [gate; up] as on disk) or "relu2" (S = 1: up only, SGLang's w1)
    w13_weight: torch.Tensor  # uint8 (E, S*I, H/2), packed E2M1, rows [gate; up]
    w13_weight_scale: torch.Tensor  # float8_e4m3fn (E, S*I, H/16), not swizzled (as on disk)
    w13_weight_scale_2: torch.Tensor  # float32 (E, S): 1 / weight global scale per shard (gate == up)
    w13_input_scale: torch.Tensor  # float32 (E, S): 1 / calibrated activation global scale per shard
    w2_weight: torch.Tensor  # uint8 (E, H, I/2)
    w2_weight_scale: torch.Tensor  # float8_e4m3fn (E, H, I/16), not swizzled
    w2_weight_scale_2: torch.Tensor  # float32 (E,)
    w2_input_scale: torch.Tensor  # float32 (E,)
    dense_gate: torch.Tensor | None  # bf16 (E, I, H) the gate weights it was made from (None for relu2)
    dense_up: torch.Tensor  # bf16 (E, I, H)
    dense_down: torch.Tensor  # bf16 (E, H, I)

    @property
    def num_experts(self) -> int:
        return self.w13_weight.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_weight.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w2_weight.shape[2] * 2

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return the per-expert tensors as a ModelOpt safetensors file names them (``experts.{e}.{proj}.{kind}``)."""
        out: dict[str, torch.Tensor] = {}
        inter = self.intermediate
        for e in range(self.num_experts):
            for s, proj in enumerate(("gate_proj", "up_proj") if self.gated else ("up_proj",)):  # w13's row order
                rows = slice(s * inter, (s + 1) * inter)
                p = f"experts.{e}.{proj}."
                out[p + "weight"] = self.w13_weight[e, rows]
                out[p + "weight_scale"] = self.w13_weight_scale[e, rows]
                out[p + "weight_scale_2"] = self.w13_weight_scale_2[e, s].reshape(())
                out[p + "input_scale"] = self.w13_input_scale[e, s].reshape(())
            p = f"experts.{e}.down_proj."
            out[p + "weight"] = self.w2_weight[e]
            out[p + "weight_scale"] = self.w2_weight_scale[e]
            out[p + "weight_scale_2"] = self.w2_weight_scale_2[e].reshape(())
            out[p + "input_scale"] = self.w2_input_scale[e].reshape(())
        return out


def _check_sizes(num_experts: int, hidden: int, intermediate: int, activation: str) -> None:
    func = "make_moe_checkpoint"
    if activation not in ACTIVATIONS:
        raise not_accepted(func, "activation", activation, f"one of {ACTIVATIONS}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise not_accepted(func, "num_experts", num_experts, "a positive int")
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % nvfp4.BLOCK_SIZE:
            raise not_accepted(func, name, value, f"a positive int, a multiple of {nvfp4.BLOCK_SIZE}")


def make_moe_checkpoint(
    num_experts: int, hidden: int, intermediate: int, activation: str = "swiglu", seed: int = 0
) -> MoeCheckpoint:
    """Quantize random per-expert bf16 weights with nvfp4 into ModelOpt's NVFP4 MoE checkpoint layout."""
    _check_sizes(num_experts, hidden, intermediate, activation)
    gated = activation == "swiglu"
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    calibration = (torch.randn(64, hidden, generator=gen) * 1.5).to(bf16)
    x_amax_scale = nvfp4.global_scale(calibration)
    rows = []  # per expert: w13, its block scales, weight_scale_2, input_scale, the same of w2, then gate, up, down
    for e in range(num_experts):
        spread = 1.0 + 0.5 * e / max(num_experts - 1, 1)  # experts of different magnitude: per-expert scales matter
        gate = (torch.randn(intermediate, hidden, generator=gen) * 0.04 * spread).to(bf16)
        up = (torch.randn(intermediate, hidden, generator=gen) * 0.03 * spread).to(bf16)
        down = (torch.randn(hidden, intermediate, generator=gen) * 0.05 / spread).to(bf16)
        # One global scale for gate/up, as ModelOpt exports it (SGLang's cutlass path applies the gate's alpha to both).
        packed13, sf13, s2_13 = quantize_weight(torch.cat([gate, up]) if gated else up)
        packed2, sf2, s2_2 = quantize_weight(down)
        # Calibrated activation scales, different per expert, so SGLang's max over experts matters too.
        xf = calibration.float()
        h = xf @ up.float().T
        h = torch.nn.functional.silu(xf @ gate.float().T) * h if gated else torch.relu(h) ** 2
        x_gsf = x_amax_scale / (1.0 + 0.1 * e)
        h_gsf = nvfp4.global_scale(h) / (1.0 + 0.05 * e)
        shards = 2 if gated else 1
        row = (packed13, sf13, s2_13.reshape(1).expand(shards), (1.0 / x_gsf).reshape(1).expand(shards))
        rows.append((*row, packed2, sf2, s2_2, (1.0 / h_gsf).reshape(()), gate, up, down))
    st = [torch.stack(v).contiguous() for v in zip(*rows)]  # the scales: float32 (nvfp4.global_scale's)
    return MoeCheckpoint(activation, *st[:8], st[8] if gated else None, st[9], st[10])


def reference_moe_from_weights(weights: Mapping[str, Any], x, topk_ids, topk_weights) -> torch.Tensor:
    """Return one rank's MoE output from kernel-layout weights; global `topk_ids` off its experts (or -1) add 0."""
    ids = topk_ids.long() - int(weights.get("first_expert", 0))
    local = (topk_ids >= 0) & (ids >= 0) & (ids < weights["w13"].shape[0])
    ids = torch.where(local, ids, torch.zeros_like(ids))
    topk_weights = torch.where(local, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
    kernel = {k: weights[k] for k in _KERNEL_TENSORS}
    return nvfp4.reference_moe_fp4(x, ids, topk_weights, **kernel, activation=weights["activation"])


def rank_weights(ckpt: MoeCheckpoint, experts: slice, cols: slice, constants: tuple, device) -> dict:
    """Return `experts`' weights at the intermediate columns `cols` (one rank's share) in the kernel's layout (w13 rows
    [up; gate], scales swizzled) on `device`, with `constants` (a1_gscale, a2_gscale, w13_alpha, w2_alpha): the
    argument of :func:`reference_moe_from_weights`."""
    inter = ckpt.intermediate
    shards = [1, 0] if ckpt.gated else [0]  # kernel order: up rows first, then gate
    w13 = torch.cat([ckpt.w13_weight[experts, s * inter :][:, cols] for s in shards], dim=1)
    w13_plain_sf = torch.cat([ckpt.w13_weight_scale[experts, s * inter :][:, cols] for s in shards], dim=1)
    w2 = ckpt.w2_weight[experts][:, :, cols.start // 2 : cols.stop // 2]
    w2_plain_sf = ckpt.w2_weight_scale[experts][:, :, cols.start // 16 : cols.stop // 16]
    w13_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w13_plain_sf])
    w2_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w2_plain_sf])
    a1, a2, alpha1, alpha2 = constants
    weights = nvfp4.MoeWeights(
        w13.contiguous(), w13_sf, alpha1.contiguous(), w2.contiguous(), w2_sf, alpha2.contiguous(), a1, a2
    )
    found = {k: v.to(device) for k, v in weights._asdict().items()}
    return {**found, "activation": ckpt.activation, "first_expert": experts.start}


def modelopt_constants(ckpt: MoeCheckpoint, experts: slice) -> tuple[torch.Tensor, ...]:
    """Return (a1_gscale, a2_gscale, w13_alpha, w2_alpha) of `experts` as SGLang's ModelOpt cutlass path derives them,
    in float32: one input scale over all experts and shards, the max."""
    in13 = ckpt.w13_input_scale.max().to(torch.float32)
    in2 = ckpt.w2_input_scale.max().to(torch.float32)
    alpha1 = (in13 * ckpt.w13_weight_scale_2[experts, 0]).to(torch.float32)
    alpha2 = (in2 * ckpt.w2_weight_scale_2[experts]).to(torch.float32)
    return (1 / in13).to(torch.float32), (1 / in2).to(torch.float32), alpha1, alpha2


def reference_moe_output(ckpt: MoeCheckpoint, x, topk_ids, topk_weights) -> torch.Tensor:
    """Return what SGLang's ModelOpt NVFP4 MoE layer of `ckpt` on one rank (every expert, the whole intermediate
    size) computes, from the checkpoint alone (the gate's alpha applied to both halves, as the cutlass path does)."""
    every = slice(0, ckpt.num_experts)
    weights = rank_weights(ckpt, every, slice(0, ckpt.intermediate), modelopt_constants(ckpt, every), x.device)
    return reference_moe_from_weights(weights, x, topk_ids, topk_weights)
