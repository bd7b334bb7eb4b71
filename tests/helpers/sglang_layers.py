"""Test-only helpers around SGLang's real NVFP4 FusedMoE layer (tests of sm120_fp4.sglang.moe_layers).

:func:`build_compressed_tensors_moe_layer` builds the layer from a synthetic checkpoint in
compressed-tensors' names; :func:`moe_weights` reads what SGLang hands the kernel, in
``nvfp4.reference_moe_fp4``'s argument names; :func:`reference_moe_output` is the checkpoint's reference for
any EP/TP rank and either format. The runtime builder is
:func:`sm120_fp4.sglang.moe_layers.build_moe_layer_from_tensors`; the checkpoints and the one-rank ModelOpt
reference (the demo's) are :mod:`sm120_fp4.demo.synthetic`.
"""

from __future__ import annotations

import torch

from helpers.checkpoints import as_compressed_tensors
from sm120_fp4 import nvfp4
from sm120_fp4.demo import synthetic
from sm120_fp4.demo.synthetic import MoeCheckpoint
from sm120_fp4.errors import check_ranks, not_accepted
from sm120_fp4.sglang import moe_layers
from sm120_fp4.sglang.moe_layers import COMPRESSED_TENSORS, MODELOPT

__all__ = ["build_compressed_tensors_moe_layer", "moe_weights", "fused_dense_shards", "build_fused_dense_layer"]
__all__ += ["reference_moe_output"]


def build_compressed_tensors_moe_layer(
    ckpt: MoeCheckpoint,
    top_k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    ep_size: int = 1,
    ep_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """SGLang's FusedMoE + CompressedTensorsConfig (CompressedTensorsW4A4Nvfp4MoE) for rank (ep_rank, tp_rank),
    the checkpoint converted by ``as_compressed_tensors``: ``build_moe_layer_from_tensors`` with
    ``fmt="compressed-tensors"`` (its context has ``quantization="compressed-tensors"``)."""
    return moe_layers.build_moe_layer_from_tensors(
        ckpt,
        as_compressed_tensors(ckpt.tensors()),
        top_k,
        fmt="compressed-tensors",
        dtype=dtype,
        ep_size=ep_size,
        ep_rank=ep_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def _check_reference(ckpt: MoeCheckpoint, ep_size, ep_rank, tp_size, tp_rank, quantization: str) -> None:
    func = "reference_moe_output"
    check_ranks(func, ep_size, ep_rank, tp_size, tp_rank)
    if quantization not in (MODELOPT, COMPRESSED_TENSORS):
        raise not_accepted(func, "quantization", quantization, f"one of {(MODELOPT, COMPRESSED_TENSORS)}")
    if ckpt.num_experts % ep_size:
        raise not_accepted(func, "ep_size", ep_size, f"a divisor of the checkpoint's {ckpt.num_experts} experts")
    if ckpt.intermediate % (tp_size * nvfp4.BLOCK_SIZE):
        why = f"a size that splits the intermediate {ckpt.intermediate} into {nvfp4.BLOCK_SIZE}-blocks"
        raise not_accepted(func, "tp_size", tp_size, why)
    if ckpt.gated and not torch.equal(ckpt.w13_weight_scale_2[:, 0], ckpt.w13_weight_scale_2[:, 1]):
        why = (
            "gate and up weight_scale_2 equal per expert (the cutlass path applies the gate's alpha to both "
            "halves, and no single-alpha reference states what a checkpoint with unequal ones means)"
        )
        raise not_accepted(func, "ckpt", ckpt.w13_weight_scale_2, why)
    if quantization == COMPRESSED_TENSORS and not ckpt.gated:
        why = f"{MODELOPT!r} for a relu2 checkpoint (compressed-tensors NVFP4 MoE has gated (swiglu) experts only)"
        raise not_accepted(func, "quantization", quantization, why)


def _compressed_tensors_constants(ckpt: MoeCheckpoint, experts: slice) -> tuple[torch.Tensor, ...]:
    """(a1_gscale, a2_gscale, w13_alpha, w2_alpha) of `experts` as SGLang's compressed-tensors cutlass path derives
    them, in float32: the checkpoint stores encode scales (1 / ModelOpt's); per local expert a1 = min over its shards."""
    a1 = (1.0 / ckpt.w13_input_scale[experts].float()).min(dim=1).values.to(torch.float32)
    alpha1 = (1 / a1) * (1 / (1.0 / ckpt.w13_weight_scale_2[experts, 0].float()))
    a2 = 1.0 / ckpt.w2_input_scale[experts].float()
    alpha2 = ((1 / a2) * (1 / (1.0 / ckpt.w2_weight_scale_2[experts].float()))).to(torch.float32)
    return a1, a2, alpha1, alpha2


def reference_moe_output(
    ckpt: MoeCheckpoint, x, topk_ids, topk_weights, *, ep_size=1, ep_rank=0, tp_size=1, tp_rank=0, quantization=MODELOPT
) -> torch.Tensor:
    """Rank (ep_rank, tp_rank)'s partial output (its experts, its I-slice) of `ckpt`'s layer in `quantization`, from
    the checkpoint alone: ``synthetic.reference_moe_output`` (one rank, ModelOpt) for any rank and either format."""
    _check_reference(ckpt, ep_size, ep_rank, tp_size, tp_rank, quantization)
    e_loc, i_p = ckpt.num_experts // ep_size, ckpt.intermediate // tp_size
    experts = slice(ep_rank * e_loc, (ep_rank + 1) * e_loc)
    cols = slice(tp_rank * i_p, (tp_rank + 1) * i_p)
    if quantization == MODELOPT:
        constants = synthetic.modelopt_constants(ckpt, experts)
    else:
        constants = _compressed_tensors_constants(ckpt, experts)
    weights = synthetic.rank_weights(ckpt, experts, cols, constants, x.device)
    return synthetic.reference_moe_from_weights(weights, x, topk_ids, topk_weights)


def _method_kind(layer) -> str:
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    if isinstance(layer.quant_method, ModelOptNvFp4FusedMoEMethod):
        return MODELOPT
    scheme = getattr(layer, "scheme", None)
    if scheme is not None and type(scheme).__name__ == "CompressedTensorsW4A4Nvfp4MoE":
        return COMPRESSED_TENSORS
    raise TypeError(
        f"not an NVFP4 MoE layer this helper knows: quant_method {type(layer.quant_method).__name__}, "
        f"scheme {type(scheme).__name__}"
    )


def moe_weights(layer) -> dict:
    """The processed tensors SGLang passes to the kernel, in ``nvfp4.reference_moe_fp4``'s names.

    Read from the layer as ``process_weights_after_loading`` left it (views, not copies):

    ========== =============================================== =========================================
    key        ModelOptNvFp4FusedMoEMethod                     CompressedTensorsW4A4Nvfp4MoE
    ========== =============================================== =========================================
    w13        ``w13_weight`` uint8 (E_loc, 2I, H/2) [up; gate] (relu2: (E_loc, I_pad, H/2))
    w13_sf     ``w13_blockscale_swizzled`` (never               ``w13_weight_scale`` (swizzled in place
               ``w13_weight_scale``: it is an alias only when   under the same name)
               the swizzled shape equals the plain one)
    w13_alpha  ``g1_alphas`` (E_loc,) (gate's; ``g1_alphas_up`` ``g1_alphas``
               is not passed to cutlass)
    w2, w2_sf  ``w2_weight``, ``w2_blockscale_swizzled``        ``w2_weight``, ``w2_weight_scale``
    w2_alpha   ``g2_alphas`` (E_loc,)                           ``g2_alphas``
    a1_gscale  ``w13_input_scale_quant`` 0-dim (1 / max over    ``w13_input_scale_quant`` **(E_loc,)**
               all experts' input scales)                       (one per local expert)
    a2_gscale  ``w2_input_scale_quant`` 0-dim                   ``w2_input_scale_quant`` **(E_loc,)**
    ========== =============================================== =========================================

    ``w13_sf``/``w2_sf`` are float8_e4m3fn, (E_loc, ceil128(rows), ceil4(K/16)). Per-expert
    ``a1_gscale``/``a2_gscale`` (compressed-tensors) are beyond one ``reference_moe_fp4`` call, which
    takes one scale or one per expert (as :func:`sm120_fp4.demo.synthetic.reference_moe_from_weights` passes them). Also: ``activation`` ("swiglu" /
    "relu2"), ``quantization``, ``num_local_experts``, ``num_experts`` (global), ``first_expert``
    (``ep_rank * num_local_experts``: kernel-side ids are global), ``hidden``,
    ``intermediate_per_partition`` (SGLang's, before relu2 padding; ``w13.shape[1]`` is the padded
    size the kernel sees), ``top_k``, ``ep_rank``, ``ep_size``, ``tp_rank``, ``tp_size``, ``dtype``.
    A configured SwiGLU clamp (``_cutlass_swiglu_params``) is not modelled: NotImplementedError.
    """
    kind = _method_kind(layer)
    config = layer.moe_runner_config
    if config.is_gated and config.activation == "silu":
        activation = "swiglu"
    elif not config.is_gated and config.activation == "relu2":
        activation = "relu2"
    else:
        raise NotImplementedError(f"activation {config.activation!r} (is_gated={config.is_gated}) is not modelled")
    swiglu = getattr(layer, "_cutlass_swiglu_params", (None, None, None))
    if any(p is not None for p in swiglu):
        raise NotImplementedError("a SwiGLU clamp (swiglu_alpha/beta/limit) reaches the kernel; not modelled")
    if kind == MODELOPT:
        w13_sf, w2_sf = layer.w13_blockscale_swizzled, layer.w2_blockscale_swizzled
    else:
        w13_sf, w2_sf = layer.w13_weight_scale, layer.w2_weight_scale
    w13 = layer.w13_weight.detach().view(torch.uint8)
    w2 = layer.w2_weight.detach().view(torch.uint8)
    e_loc, rows13, h_half = w13.shape
    for name, sf, rows, k in (("w13_sf", w13_sf, rows13, h_half * 2), ("w2_sf", w2_sf, w2.shape[1], w2.shape[2] * 2)):
        want = (e_loc, *nvfp4.swizzled_scale_shape(rows, k))
        if tuple(sf.shape) != want:
            raise RuntimeError(
                f"{name}: SGLang's processed scales have shape {tuple(sf.shape)}, expected the swizzled {want}"
            )
    return {
        "w13": w13,
        "w13_sf": w13_sf.detach().view(torch.float8_e4m3fn),
        "w13_alpha": layer.g1_alphas.detach(),
        "w2": w2,
        "w2_sf": w2_sf.detach().view(torch.float8_e4m3fn),
        "w2_alpha": layer.g2_alphas.detach(),
        "a1_gscale": layer.w13_input_scale_quant.detach(),
        "a2_gscale": layer.w2_input_scale_quant.detach(),
        "activation": activation,
        "quantization": kind,
        "num_local_experts": int(layer.num_local_experts),
        "num_experts": int(layer.num_experts),
        "first_expert": int(layer.moe_ep_rank) * int(layer.num_local_experts),
        "hidden": int(layer.hidden_size),
        "intermediate_per_partition": int(layer.intermediate_size_per_partition),
        "top_k": layer.top_k,
        "ep_rank": int(layer.moe_ep_rank),
        "ep_size": int(layer.moe_ep_size),
        "tp_rank": int(layer.moe_tp_rank),
        "tp_size": int(layer.moe_tp_size),
        "dtype": layer.params_dtype,
    }


def fused_dense_shards(sizes: list[int], k: int, seed: int = 0) -> list[dict]:
    """One fused layer's shards (rows `sizes`, K `k`) quantized together, as ModelOpt's export makes a
    fused layer's shards: one weight_scale_2 and one input_scale shared by all. Each shard: ModelOpt's
    ``weight``, ``weight_scale`` (linear e4m3), ``weight_scale_2``, ``input_scale`` (shape (1,))."""
    from sm120_fp4.demo import synthetic

    whole = synthetic.make_checkpoint(sum(sizes), k, seed=seed)
    shards, row = [], 0
    for n in sizes:
        shards.append(
            {
                "weight": whole.weight[row : row + n].clone(),
                "weight_scale": whole.weight_scale[row : row + n].clone(),
                "weight_scale_2": whole.weight_scale_2.clone(),
                "input_scale": whole.input_scale.clone(),
            }
        )
        row += n
    return shards


def build_fused_dense_layer(
    shards: list[dict],
    fmt: str = MODELOPT,
    *,
    dtype: torch.dtype = torch.bfloat16,
    prefix: str = "model.layers.0.self_attn.qkv_proj",
):
    """SGLang's real dense NVFP4 linear method of `fmt` (ModelOptFp4LinearMethod, or compressed-tensors'
    CompressedTensorsW4A4Fp4 with the encode scales 1 / ModelOpt's) over a fused layer of `shards`
    (fused_dense_shards), each shard's rows and per-shard scales placed where SGLang's loader puts them,
    then process_weights_after_loading (the patched hook). Returns (method or scheme, layer)."""
    sizes = [s["weight"].shape[0] for s in shards]
    k = shards[0]["weight"].shape[1] * 2
    layer = torch.nn.Module()
    layer.params_dtype, layer.prefix = dtype, prefix
    noop = lambda *args, **kwargs: None  # noqa: E731
    if fmt == MODELOPT:
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptFp4LinearMethod

        method = ModelOptFp4LinearMethod(ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16))
        method.create_weights(
            layer,
            input_size_per_partition=k,
            output_partition_sizes=sizes,
            input_size=k,
            output_size=sum(sizes),
            params_dtype=dtype,
            weight_loader=noop,
        )
        names = ("weight", "weight_scale", "weight_scale_2", "input_scale")
        process = method.process_weights_after_loading
    else:
        from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
            CompressedTensorsW4A4Fp4,
        )

        method = CompressedTensorsW4A4Fp4()
        method.create_weights(
            layer, output_partition_sizes=sizes, input_size_per_partition=k, params_dtype=dtype, weight_loader=noop
        )
        names = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
        process = method.process_weights_after_loading
    with torch.no_grad():
        row = 0
        for i, shard in enumerate(shards):
            n = shard["weight"].shape[0]
            getattr(layer, names[0]).data[row : row + n].copy_(shard["weight"])
            getattr(layer, names[1]).data[row : row + n].copy_(shard["weight_scale"].view(torch.float8_e4m3fn))
            for name, key in ((names[2], "weight_scale_2"), (names[3], "input_scale")):
                value = shard[key].float().reshape(-1)[0]
                getattr(layer, name).data.view(-1)[i] = value if fmt == MODELOPT else 1.0 / value
            row += n
    process(layer)
    return method, layer
