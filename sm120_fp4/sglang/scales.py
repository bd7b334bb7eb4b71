"""The checkpoint scales of an SGLang NVFP4 layer as SGLang loaded them, judged by the core (checkpoints.scales)."""

from __future__ import annotations

from .. import checkpoints
from ..checkpoints import scales

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
    """Return why the checkpoint scales `layer` loaded cannot serve (each tensor, a fused layer's shards), or None."""
    # The hooked kinds: ModelOptFp4LinearMethod, CompressedTensorsW4A4Fp4, ModelOptNvFp4FusedMoEMethod and
    # CompressedTensorsW4A4Nvfp4MoE, their parameters named as the checkpoint's tensors (MoE: w13_ and w2_).
    fmt = checkpoints.MODELOPT if kind.startswith("ModelOpt") else checkpoints.COMPRESSED_TENSORS
    w4a4 = getattr(method, "quant_mode", "w4a4") == "w4a4"
    return scales.layer_problem(fmt, layer, moe="MoE" in kind, activation=w4a4)
