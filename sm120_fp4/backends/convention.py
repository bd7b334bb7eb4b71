"""The two backend conventions (mm_fp4's; reference_moe_fp4's for fused MoE): their argument checks from tensor
metadata only (no host sync), and the mapping of a cutlass_fused_moe call to the MoE one."""

from __future__ import annotations

import functools
from collections import namedtuple

import torch

from .. import nvfp4
from ..errors import not_accepted
from ..nvfp4.reference import _bad_out, check_mm_fp4_args  # noqa: F401  (check_mm_fp4_args: re-exported)

MOE_ACTIVATIONS = {"swiglu": "Swiglu", "relu2": "Relu2"}  # the convention's name -> FlashInfer's ActivationType
_DTYPES = (torch.bfloat16, torch.float16)
# cutlass_fused_moe's keywords by what the MoE convention (and so the oracle) does with them: mapped into it,
# without effect on the numbers (TP ranks: the weights are this rank's shard already), or modeled only at the value
# given here. Any other keyword with a value other than None or False (clamped SwiGLU limits, expert biases, a flag
# added later) asks for math the oracle does not model: the call is not served, and named (unmodeled_moe_arguments).
_MAPPED = {"input", "token_selected_experts", "token_final_scales", "fc1_expert_weights", "fc2_expert_weights"}
_MAPPED |= {"quant_scales", "output", "output_dtype", "ep_size", "ep_rank", "activation_type"}
_NEUTRAL = {"tp_size", "tp_rank", "tune_max_num_tokens", "use_fused_finalize", "enable_pdl"}
_DEFAULTS = {
    "input_sf": None,
    "enable_alltoall": False,
    "cluster_size": 1,
    "cluster_rank": 0,
    "min_latency_mode": False,
}
# One call of the MoE backend convention (reference_moe_fp4's; -1 ids: slots that are not this rank's): tensors but
# activation (a str of MOE_ACTIVATIONS) and out_dtype (a torch.dtype).
_MOE_FIELDS = (
    "x topk_ids topk_weights w13 w13_sf w13_alpha w2 w2_sf w2_alpha a1_gscale a2_gscale activation out_dtype out"
)
MoeArgs = namedtuple("MoeArgs", _MOE_FIELDS)


_bad_moe = functools.partial(not_accepted, "fused MoE")


def check_moe_args(*args) -> MoeArgs:
    """Validate one call of the MoE convention from metadata alone (no host sync); return it as MoeArgs."""
    c = MoeArgs(*args)
    e, _ = nvfp4.check_moe_layout("fused MoE", *c[:9], c.activation)
    for name, scale in (("a1_gscale", c.a1_gscale), ("a2_gscale", c.a2_gscale)):
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() not in (1, e):
            raise _bad_moe(name, scale, f"a float32 tensor of 1 or E={e} elements (global encode scales)")
    if c.out_dtype not in _DTYPES:
        raise _bad_moe("out_dtype", c.out_dtype, "torch.bfloat16 or torch.float16")
    t, h = c.x.shape
    if _bad_out(c.out, c.out_dtype, (t, h)):
        raise _bad_moe("out", c.out, f"a contiguous ({t}, {h}) {c.out_dtype} tensor")
    return c


def is_nvfp4_moe_call(kwargs: dict) -> bool:
    """Return whether a ``cutlass_fused_moe(**kwargs)`` call is an NVFP4 one (packed weights, six scales)."""
    scales, w13 = kwargs.get("quant_scales"), kwargs.get("fc1_expert_weights")
    shaped = isinstance(scales, (list, tuple)) and len(scales) == 6 and isinstance(w13, torch.Tensor)
    return (
        shaped and w13.dtype == torch.int64 and isinstance(scales[1], torch.Tensor) and scales[1].dtype == torch.int32
    )


def unmodeled_moe_arguments(kwargs: dict, activation_type: type | None) -> dict[str, object]:
    """Return the arguments of a ``cutlass_fused_moe(**kwargs)`` call that the MoE oracle does not model."""
    found = {}
    for name, value in kwargs.items():
        if name == "activation_type":
            if value not in {getattr(activation_type, v) for v in MOE_ACTIVATIONS.values()}:
                found[name] = getattr(value, "name", value)
        elif name in _DEFAULTS:
            if isinstance(value, torch.Tensor) or value not in (None, _DEFAULTS[name]):
                found[name] = value
        elif name not in _MAPPED and name not in _NEUTRAL and value is not None and value is not False:
            found[name] = value
    return found


def unmodeled_moe_problem(kwargs: dict, activation_type: type | None = None) -> str | None:
    """Return why a call with these arguments cannot be served verified (naming each), or None."""
    found = unmodeled_moe_arguments(kwargs, activation_type)
    if not found:
        return None
    shown = ", ".join(f"{name}={_shown(value)}" for name, value in found.items())
    return (
        f"the fused-MoE call passes {shown}, which the MoE oracle does not model (it models SwiGLU without clamps "
        "and ReLU², no expert biases, activations quantized by the kernel), so no backend's numbers can be checked"
    )


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):  # its shape only: reading values would synchronise with the GPU
        return f"a {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    return repr(value)


def moe_call_to_convention(kwargs: dict, activation_type: type) -> MoeArgs | None:
    """Map one ``cutlass_fused_moe(**kwargs)`` call to the MoE convention, or None for a call it does not serve."""
    scales = kwargs.get("quant_scales")
    w13, w2, x = kwargs.get("fc1_expert_weights"), kwargs.get("fc2_expert_weights"), kwargs.get("input")
    names = {getattr(activation_type, v): k for k, v in MOE_ACTIVATIONS.items()}
    activation = names.get(kwargs.get("activation_type", getattr(activation_type, "Swiglu")))
    if activation is None or not is_nvfp4_moe_call(kwargs) or unmodeled_moe_arguments(kwargs, activation_type):
        return None
    w13_u8, w2_u8 = w13.view(torch.uint8), w2.view(torch.uint8)
    # SGLang's ids are global under expert parallelism (this rank's start at ep_rank * E), -1 for a dropped
    # slot; the convention's are local, -1 for every slot not this rank's (skipped: no work, nothing summed).
    ep_size, ep_rank = kwargs.get("ep_size", 1), kwargs.get("ep_rank", 0)
    local = w13_u8.shape[0]
    ids = kwargs["token_selected_experts"].to(torch.int32)
    if ep_size > 1:
        ids = torch.where(ids >= 0, ids - ep_rank * local, ids)
    ids = torch.where((ids >= 0) & (ids < local), ids, torch.full_like(ids, -1))
    out_dtype = kwargs.get("output_dtype", x.dtype)
    out = kwargs.get("output")
    if out is None:
        out = torch.empty((x.shape[0], w2_u8.shape[1]), dtype=out_dtype, device=x.device)
    e4m3 = torch.float8_e4m3fn
    weights = (w13_u8, scales[1].view(e4m3), scales[2], w2_u8, scales[4].view(e4m3), scales[5])
    gscales = (global_scale(scales[0]), global_scale(scales[3]))
    return MoeArgs(x, ids, kwargs["token_final_scales"], *weights, *gscales, activation, out_dtype, out)


def global_scale(scale: torch.Tensor) -> torch.Tensor:
    """Return a global encode scale as the convention has it: (1,) for one scale, (E,) for one per expert."""
    return scale.reshape(-1)
