"""Synthetic NVFP4 checkpoints for the demo's in-process layers, and what a layer must compute from them.

Everything here is made with :mod:`sm120_fp4.nvfp4` alone (no SGLang): one linear layer's ModelOpt
tensors (:func:`make_checkpoint`) and one MoE layer's, stacked over experts (:func:`make_moe_checkpoint`),
with what SGLang's layer built from them must output, from the checkpoint alone
(:func:`reference_output`, :func:`reference_moe_output`). The numbers of both references are the
library's oracle, :func:`sm120_fp4.nvfp4.reference_mm_fp4` and :func:`sm120_fp4.nvfp4.reference_moe_fp4`:
this module only lays the checkpoint's bytes out as the kernel receives them and derives the
kernel's constants as SGLang does. SGLang's layers themselves are built by
:mod:`sm120_fp4.sglang.layers` (``build_modelopt_layer``) and :mod:`sm120_fp4.sglang.moe_layers`
(``build_modelopt_moe_layer``), which take these checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .. import nvfp4
from ..errors import check_ranks, not_accepted

__all__ = [
    "Checkpoint",
    "make_checkpoint",
    "reference_output",
    "MoeCheckpoint",
    "make_moe_checkpoint",
    "compressed_tensors_tensors",
    "reference_moe_from_weights",
    "reference_moe_output",
    "MODELOPT",
    "COMPRESSED_TENSORS",
    "ACTIVATIONS",
]

# SGLang's names of the two NVFP4 MoE quantizations (``--quantization modelopt_fp4``; compressed-tensors
# is named by a checkpoint's config), as sm120_fp4.sglang.moe_layers uses them.
MODELOPT = "modelopt_fp4"
COMPRESSED_TENSORS = "compressed-tensors"
_QUANTIZATIONS = (MODELOPT, COMPRESSED_TENSORS)
ACTIVATIONS = ("swiglu", "relu2")
_KERNEL_TENSORS = nvfp4.MoeWeights._fields


# --------------------------------------------------------------------------------------------
# One linear layer
# --------------------------------------------------------------------------------------------


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


def reference_output(ckpt: Checkpoint, x: torch.Tensor) -> torch.Tensor:
    """What the layer must compute: nvfp4 quantize x as SGLang does, then reference_mm_fp4."""
    device = x.device
    input_scale = ckpt.input_scale.to(device).max().float()
    gsf_x = (1 / input_scale).float()
    qx, sx = nvfp4.quantize(x, gsf_x)
    w_sf = nvfp4.swizzle_scales(ckpt.weight_scale.to(device))
    alpha = (input_scale * ckpt.weight_scale_2.to(device).max().float()).reshape(1)
    return nvfp4.reference_mm_fp4(qx, ckpt.weight.to(device).T, sx, w_sf.T, alpha, x.dtype)


# --------------------------------------------------------------------------------------------
# One MoE layer
# --------------------------------------------------------------------------------------------


@dataclass
class MoeCheckpoint:
    """ModelOpt NVFP4 tensors of one MoE layer (E experts, hidden H, intermediate I), stacked over experts.

    ``S`` below is the number of w13 shards: 2 for "swiglu" (w1 = gate, w3 = up), 1 for "relu2" (the
    non-gated expert has only an up projection, which SGLang loads as shard w1). Rows of ``w13_*`` are
    in checkpoint (logical) order, ``[gate; up]``: each shard is one ModelOpt tensor on disk (see
    :meth:`tensors`). SGLang's loader, not this class, puts them in the kernel's ``[up; gate]`` order.
    """

    activation: str  # "swiglu" or "relu2"
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

    def shard_names(self) -> tuple[str, ...]:
        """The checkpoint's names of the w13 shards, in row order (nemotron_h's relu2 experts: up_proj)."""
        return ("gate_proj", "up_proj") if self.gated else ("up_proj",)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-expert tensors as a ModelOpt safetensors file names them (``experts.{e}.{proj}.{kind}``)."""
        out: dict[str, torch.Tensor] = {}
        inter = self.intermediate
        for e in range(self.num_experts):
            for s, proj in enumerate(self.shard_names()):
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


def make_moe_checkpoint(
    num_experts: int, hidden: int, intermediate: int, activation: str = "swiglu", seed: int = 0
) -> MoeCheckpoint:
    """Quantize random per-expert bf16 weights with nvfp4 into ModelOpt's NVFP4 MoE checkpoint layout.

    Experts differ in magnitude, so per-expert scales matter. Gate and up of an expert share one
    weight global scale (``w13_weight_scale_2[:, 0] == [:, 1]``), as ModelOpt exports a fused gate/up:
    SGLang's cutlass path passes only the gate's alpha (``g1_alphas``) to the kernel, for both halves,
    so a checkpoint with unequal values would not be served faithfully. The input scales are calibrated on
    random activations and differ per expert, so SGLang's max over experts matters too.

    ``hidden`` and ``intermediate`` must be multiples of 16; SGLang's flashinfer_cutlass path also
    needs the per-rank intermediate size to be a multiple of 64 for "swiglu" (it cannot pad a gated
    w13) and pads it to a multiple of 128 for "relu2".
    """
    func = "make_moe_checkpoint"
    if activation not in ACTIVATIONS:
        raise not_accepted(func, "activation", activation, f"one of {ACTIVATIONS}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise not_accepted(func, "num_experts", num_experts, "a positive int")
    for name, value in (("hidden", hidden), ("intermediate", intermediate)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % nvfp4.BLOCK_SIZE:
            raise not_accepted(func, name, value, f"a positive int, a multiple of {nvfp4.BLOCK_SIZE}")
    gated = activation == "swiglu"
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    calibration = (torch.randn(64, hidden, generator=gen) * 1.5).to(bf16)
    x_amax_scale = nvfp4.global_scale(calibration)
    stacks: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("w13", "w13_sf", "w13_s2", "w13_in", "w2", "w2_sf", "w2_s2", "w2_in", "gate", "up", "down")
    }
    for e in range(num_experts):
        spread = 1.0 + 0.5 * e / max(num_experts - 1, 1)  # experts of different magnitude
        gate = (torch.randn(intermediate, hidden, generator=gen) * 0.04 * spread).to(bf16)
        up = (torch.randn(intermediate, hidden, generator=gen) * 0.03 * spread).to(bf16)
        down = (torch.randn(hidden, intermediate, generator=gen) * 0.05 / spread).to(bf16)
        w13_dense = torch.cat([gate, up]) if gated else up
        gsf13 = nvfp4.global_scale(w13_dense)  # one global scale for the fused gate/up
        packed13, sf13 = nvfp4.quantize(w13_dense, gsf13)
        gsf2 = nvfp4.global_scale(down)
        packed2, sf2 = nvfp4.quantize(down, gsf2)
        # Calibrated activation scales: what each expert saw (slightly different per expert).
        xf = calibration.float()
        h = xf @ up.float().T
        h = torch.nn.functional.silu(xf @ gate.float().T) * h if gated else torch.relu(h) ** 2
        x_gsf = x_amax_scale / (1.0 + 0.1 * e)
        h_gsf = nvfp4.global_scale(h) / (1.0 + 0.05 * e)
        shards = 2 if gated else 1
        stacks["w13"].append(packed13)
        stacks["w13_sf"].append(nvfp4.unswizzle_scales(sf13, w13_dense.shape[0], hidden))
        stacks["w13_s2"].append((1.0 / gsf13).reshape(1).expand(shards))
        stacks["w13_in"].append((1.0 / x_gsf).reshape(1).expand(shards))
        stacks["w2"].append(packed2)
        stacks["w2_sf"].append(nvfp4.unswizzle_scales(sf2, hidden, intermediate))
        stacks["w2_s2"].append((1.0 / gsf2).reshape(()))
        stacks["w2_in"].append((1.0 / h_gsf).reshape(()))
        stacks["gate"].append(gate)
        stacks["up"].append(up)
        stacks["down"].append(down)
    st = {k: torch.stack(v).contiguous() for k, v in stacks.items()}
    return MoeCheckpoint(
        activation=activation,
        w13_weight=st["w13"],
        w13_weight_scale=st["w13_sf"],
        w13_weight_scale_2=st["w13_s2"].float(),
        w13_input_scale=st["w13_in"].float(),
        w2_weight=st["w2"],
        w2_weight_scale=st["w2_sf"],
        w2_weight_scale_2=st["w2_s2"].float(),
        w2_input_scale=st["w2_in"].float(),
        dense_gate=st["gate"] if gated else None,
        dense_up=st["up"],
        dense_down=st["down"],
    )


def compressed_tensors_tensors(ckpt: MoeCheckpoint) -> dict[str, torch.Tensor]:
    """The same quantized experts under compressed-tensors (llm-compressor NVFP4) names.

    ``weight_packed`` and ``weight_scale`` are ModelOpt's bytes; ``weight_global_scale`` and
    ``input_global_scale`` are the encode scales themselves, ``1 / weight_scale_2`` and
    ``1 / input_scale`` (float32, shape (1,)), as llm-compressor stores them.
    """
    out = {}
    for name, value in ckpt.tensors().items():
        stem, kind = name.rsplit(".", 1)
        if kind == "weight":
            out[stem + ".weight_packed"] = value
        elif kind == "weight_scale":
            out[stem + ".weight_scale"] = value
        elif kind == "weight_scale_2":
            out[stem + ".weight_global_scale"] = (1.0 / value.float()).reshape(1)
        elif kind == "input_scale":
            out[stem + ".input_global_scale"] = (1.0 / value.float()).reshape(1)
    return out


def reference_moe_from_weights(
    weights: Mapping[str, Any], x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """One rank's MoE output from kernel-layout weights: one ``nvfp4.reference_moe_fp4`` call.

    `weights` has ``reference_moe_fp4``'s tensor names (``w13`` .. ``a2_gscale``; per-expert
    ``a1_gscale``/``a2_gscale`` as compressed-tensors has them are the oracle's own case), ``activation``
    and optionally ``first_expert`` (default 0). `topk_ids` are global expert ids, as the kernel receives
    them; experts ``[first_expert, first_expert + E_loc)`` are this rank's, every other slot (another
    rank's expert, or SGLang's -1) enters on local expert 0 with weight 0 and adds nothing (0 * a finite
    row), as the kernel skips it.
    """
    e_loc = weights["w13"].shape[0]
    ids = topk_ids.long() - int(weights.get("first_expert", 0))
    local = (topk_ids >= 0) & (ids >= 0) & (ids < e_loc)
    return nvfp4.reference_moe_fp4(
        x,
        torch.where(local, ids, torch.zeros_like(ids)),
        torch.where(local, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32)),
        **{k: weights[k] for k in _KERNEL_TENSORS},
        activation=weights["activation"],
    )


def _rank_tensors(ckpt: MoeCheckpoint, ep_size: int, ep_rank: int, tp_size: int, tp_rank: int):
    """This rank's experts and I-slice of the checkpoint, w13 rows in the kernel's [up; gate] order,
    scales swizzled per expert: the layout the kernel receives, made without SGLang."""
    e_loc, i_p = ckpt.num_experts // ep_size, ckpt.intermediate // tp_size
    experts = slice(ep_rank * e_loc, (ep_rank + 1) * e_loc)
    cols = slice(tp_rank * i_p, (tp_rank + 1) * i_p)
    inter = ckpt.intermediate
    shards = [1, 0] if ckpt.gated else [0]  # kernel order: up rows first, then gate
    w13 = torch.cat([ckpt.w13_weight[experts, s * inter :][:, cols] for s in shards], dim=1)
    w13_plain_sf = torch.cat([ckpt.w13_weight_scale[experts, s * inter :][:, cols] for s in shards], dim=1)
    w2 = ckpt.w2_weight[experts][:, :, cols.start // 2 : cols.stop // 2]
    w2_plain_sf = ckpt.w2_weight_scale[experts][:, :, cols.start // 16 : cols.stop // 16]
    w13_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w13_plain_sf])
    w2_sf = torch.stack([nvfp4.swizzle_scales(s.contiguous()) for s in w2_plain_sf])
    return experts, w13.contiguous(), w13_sf, w2.contiguous(), w2_sf


def reference_moe_output(
    ckpt: MoeCheckpoint,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    quantization: str = MODELOPT,
) -> torch.Tensor:
    """What rank (ep_rank, tp_rank)'s layer must compute, from the checkpoint alone (never the layer).

    A rank's output is a **partial** sum: over the slots routed to its experts
    ``[ep_rank * E/ep_size, (ep_rank+1) * E/ep_size)`` only (`topk_ids` are global ids), and, under
    TP, the FC2 of its slice ``[tp_rank * I/tp_size, (tp_rank+1) * I/tp_size)`` of the intermediate
    (FC1 rows of that slice for gate and for up, FC2 columns of it; 16-blocks never straddle
    slices). SGLang all-reduces the partials; their sum equals the single-rank output up to the
    rounding of each partial to x's dtype.

    The kernel's constants are derived as SGLang's cutlass path states them, in float32:
    ModelOpt: ``in = max(w13_input_scale over all E experts and shards)``, ``a1_gscale = 1 / in``,
    ``w13_alpha[e] = in * w13_weight_scale_2[e, 0]``, likewise ``a2``/``w2_alpha`` from
    ``w2_input_scale`` and ``w2_weight_scale_2``. compressed-tensors (from
    :func:`compressed_tensors_tensors`): per local expert ``a1[e] = min(input_global_scale[e, :])``,
    ``w13_alpha[e] = (1 / a1[e]) * (1 / weight_global_scale[e, 0])``, ``a2[e] = w2 input_global_scale[e]``,
    ``w2_alpha[e] = (1 / a2[e]) * (1 / w2 weight_global_scale[e])``. The weights are the
    checkpoint's bytes, sliced and put in the kernel's layout here; everything numeric is
    one ``nvfp4.reference_moe_fp4`` call (:func:`reference_moe_from_weights`).

    One alpha per expert cannot express gate and up weight scales that differ: such a checkpoint
    is an InvalidArgument (SGLang's cutlass path would apply the gate's alpha to the up rows).
    """
    func = "reference_moe_output"
    check_ranks(func, ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in _QUANTIZATIONS:
        raise not_accepted(func, "quantization", quantization, f"one of {_QUANTIZATIONS}")
    if ckpt.num_experts % ep_size:
        raise not_accepted(func, "ep_size", ep_size, f"a divisor of the checkpoint's {ckpt.num_experts} experts")
    if ckpt.intermediate % (tp_size * nvfp4.BLOCK_SIZE):
        raise not_accepted(
            func,
            "tp_size",
            tp_size,
            f"a size that splits the intermediate {ckpt.intermediate} into {nvfp4.BLOCK_SIZE}-blocks",
        )
    if ckpt.gated and not torch.equal(ckpt.w13_weight_scale_2[:, 0], ckpt.w13_weight_scale_2[:, 1]):
        raise not_accepted(
            func,
            "ckpt",
            ckpt.w13_weight_scale_2,
            "gate and up weight_scale_2 equal per expert (the cutlass path applies the gate's alpha to both "
            "halves, and no single-alpha reference states what a checkpoint with unequal ones means)",
        )
    experts, w13, w13_sf, w2, w2_sf = _rank_tensors(ckpt, ep_size, ep_rank, tp_size, tp_rank)
    if quantization == MODELOPT:
        in13 = ckpt.w13_input_scale.max().to(torch.float32)
        in2 = ckpt.w2_input_scale.max().to(torch.float32)
        a1, a2 = (1 / in13).to(torch.float32), (1 / in2).to(torch.float32)
        alpha1 = (in13 * ckpt.w13_weight_scale_2[experts, 0]).to(torch.float32)
        alpha2 = (in2 * ckpt.w2_weight_scale_2[experts]).to(torch.float32)
    else:
        if not ckpt.gated:
            raise not_accepted(
                func,
                "quantization",
                quantization,
                f"{MODELOPT!r} for a relu2 checkpoint (compressed-tensors NVFP4 MoE has gated (swiglu) experts only)",
            )
        ct = compressed_tensors_tensors(ckpt)
        ids = range(experts.start, experts.stop)
        in_gs = torch.stack(
            [torch.cat([ct[f"experts.{e}.{p}.input_global_scale"] for p in ckpt.shard_names()]) for e in ids]
        )
        w_gs = torch.stack([ct[f"experts.{e}.gate_proj.weight_global_scale"][0] for e in ids])
        a1 = in_gs.min(dim=1).values.to(torch.float32)
        alpha1 = (1 / a1) * (1 / w_gs)
        a2 = torch.stack([ct[f"experts.{e}.down_proj.input_global_scale"][0] for e in ids])
        alpha2 = (1 / a2) * (1 / torch.stack([ct[f"experts.{e}.down_proj.weight_global_scale"][0] for e in ids]))
        alpha2 = alpha2.to(torch.float32)
    weights = {
        "w13": w13,
        "w13_sf": w13_sf,
        "w13_alpha": alpha1.contiguous(),
        "w2": w2,
        "w2_sf": w2_sf,
        "w2_alpha": alpha2.contiguous(),
        "a1_gscale": a1,
        "a2_gscale": a2,
        "activation": ckpt.activation,
        "first_expert": experts.start,
    }
    device = x.device
    weights = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    return reference_moe_from_weights(weights, x, topk_ids, topk_weights)
