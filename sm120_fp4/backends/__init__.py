"""FP4 GEMM and NVFP4 fused-MoE backends behind two conventions (:mod:`.convention`): the registries (:mod:`.registry`,
entry-point groups ``sm120_fp4.backends`` / ``sm120_fp4.moe_backends``), FlashInfer's, ``emulated``, Humming."""

from .registry import *  # noqa: F403
from .registry import __all__  # noqa: F401
